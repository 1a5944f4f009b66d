// How the C++ CPU kernels read and write tensors (the Triton launchers' kernels/layout.py, here).
//
// A kernel sees a tensor as B rows of nb blocks of m contiguous elements: rows at any stride,
// blocks at one uniform stride. The fused core's per-step vectors are views into wider
// buffers (a column slice of a GEMM output, one step of a time-major buffer, [key | query]
// heads), and all of them have this shape, so they are read and written in place. Anything
// else is copied in, or written to a fresh buffer and copied out. Arithmetic is in one dtype,
// the state's: inputs in another dtype are converted, outputs must have it.

#pragma once

#include "kernels.h"

// Per-operator headers, not ATen.h: a build of these files takes half the time.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace gpn_cpu {



// Whether x is (B, nb, m) in that sense; sets the row and block strides.
inline bool as_blocks(const at::Tensor& x, int64_t nb, int64_t m, int64_t& s_row, int64_t& s_blk) {
  if (x.dim() <= 1) {  // one row (a per-head parameter)
    s_row = 0;
    s_blk = m;
    return nb == 1 && x.numel() == m && (m == 1 || x.stride(-1) == 1);
  }
  int64_t d = x.dim() - 1, extent = 1;
  while (d >= 1 && extent < m) {  // the block: contiguous
    if (x.size(d) != 1) {
      if (x.stride(d) != extent) return false;
      extent *= x.size(d);
    }
    --d;
  }
  if (extent != m) return false;
  int64_t count = 1;
  s_blk = m;
  while (d >= 1) {  // the blocks: one stride
    if (x.size(d) != 1) {
      if (count == 1) s_blk = x.stride(d);
      else if (x.stride(d) != s_blk * count) return false;
      count *= x.size(d);
    }
    --d;
  }
  s_row = x.stride(0);
  return count == nb;
}

struct In {
  at::Tensor t;
  int64_t s_row, s_blk;
  template <typename T>
  const T* at(int64_t b, int64_t blk = 0) const { return t.data_ptr<T>() + b * s_row + blk * s_blk; }
};

inline In in_blocks(const at::Tensor& x, int64_t B, int64_t nb, int64_t m, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(x.numel() == B * nb * m, "cpu kernels: expected ", B, " x ", nb * m, " elements, got shape ", x.sizes());
  In in{x.scalar_type() == dtype ? x : x.to(dtype), 0, 0};
  if (!as_blocks(in.t, nb, m, in.s_row, in.s_blk)) {
    in.t = in.t.reshape({B, nb, m}).contiguous();
    in.s_row = nb * m;
    in.s_blk = m;
  }
  return in;
}

inline In in_rows(const at::Tensor& x, int64_t B, int64_t n, at::ScalarType dtype) { return in_blocks(x, B, 1, n, dtype); }

// An output: the given buffer when the kernel can write it in place, else a fresh one that
// `done` copies into it. Not given: a fresh (B, nb * m) one, or of `shape`.
struct Out {
  at::Tensor buf, w;
  int64_t s_row, s_blk;
  template <typename T>
  T* at(int64_t b, int64_t blk = 0) const { return w.data_ptr<T>() + b * s_row + blk * s_blk; }
  at::Tensor done() const {
    if (!w.is_same(buf)) buf.copy_(w.view(buf.sizes()));
    return buf;
  }
};

inline Out out_blocks(const OptTensor& given, int64_t B, int64_t nb, int64_t m, const at::Tensor& like,
                      at::IntArrayRef shape = {}) {
  at::Tensor buf = given.has_value() ? *given
                                     : at::empty(shape.empty() ? at::IntArrayRef{B, nb * m} : shape, like.options());
  TORCH_CHECK_VALUE(buf.scalar_type() == like.scalar_type(), "cpu kernels: outputs must have the state's dtype (",
                    like.scalar_type(), "), got ", buf.scalar_type());
  TORCH_CHECK_VALUE(buf.numel() == B * nb * m, "cpu kernels: an output of shape ", buf.sizes(), " cannot hold ", B,
                    " x ", nb * m, " elements");
  Out out{buf, buf, 0, 0};
  if (!as_blocks(buf, nb, m, out.s_row, out.s_blk)) {
    out.w = at::empty({B, nb, m}, like.options());
    out.s_row = nb * m;
    out.s_blk = m;
  }
  return out;
}

inline Out out_rows(const OptTensor& given, int64_t B, int64_t n, const at::Tensor& like, at::IntArrayRef shape = {}) {
  return out_blocks(given, B, 1, n, like, shape);
}

// Sequences per thread for rows of `per_row` elements: as ATen's loops, a call of fewer than
// 32768 elements stays on one thread (thread start-up would cost more than the work).
inline int64_t grain(int64_t per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(per_row, 1)); }

// exp of a float in a form the compiler vectorises: std::exp is a libm call per element, which
// made the sigmoids most of the elementwise groups' time. Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (within 2 ulp), 2^n written into the exponent
// bits. Saturates beyond [-87.3, 88.3] (exp there is below float's normal range or near its
// largest); NaN stays NaN (no comparison is true for it).
inline float exp_vec(float x) {
  x = x > 88.3762626647949f ? 88.3762626647949f : x;
  x = x < -87.3365447504f ? -87.3365447504f : x;
  // n = round(x / ln2): adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits.
  const float shifter = 12582912.0f, t = x * 1.44269504088896341f + shifter, n = t - shifter;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  const int32_t scale_bits = (bits - 0x4B400000 + 127) << 23;  // 0x4B400000: the bits of the shifter
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;  // ln2 in two parts: r keeps its digits
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * r * r + r + 1.0f) * scale;
}

template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <>
inline float sigmoid(float x) {
  return 1.0f / (1.0f + exp_vec(-x));
}

}  // namespace gpn_cpu
