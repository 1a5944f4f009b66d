// The step's GEMMs on CPU: y = [bias +] x @ W for x of a few rows (the batch), float32.
//
// In the fused core's time loop every GEMM has as many rows as sequences in the batch (8 in
// the small config) against a weight matrix of a few MB, once per step and layer. BLAS
// libraries tune for large operands; at 8 rows MKL reaches about half of what this simple
// register-blocked loop does (bench: ~40 vs ~62 GFLOP/s on one AVX2 core). Two forms:
//
// - W row-major (K, N), as the forward has it: a tile of 4 rows x 24 columns of y stays in 12
//   vector registers while k runs over K; each step broadcasts one x per row and loads 3
//   vectors of W. The tile's 24 columns of W (K x 96 bytes) stay in L1 for the next 4 rows.
// - W a transposed view of a row-major (N, K), as the backward has it (dx = dy @ W^T): each
//   y[r, n] is a dot product along contiguous rows; 4 rows x 3 columns accumulate in
//   registers, then are summed across lanes.
//
// GCC/Clang vector types, not intrinsics: with -mavx2 -mfma a vector of 8 floats is one
// register and `acc += a * b` one FMA; without them it still compiles. The summation order
// differs from a BLAS's in the last bits.

#include "kernels.h"
#include "layout.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace gpn_cpu {
namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float sum8(v8 v) {
  float s = 0;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

constexpr int kRows = 4;  // rows of x per tile in both forms

// y[r, :8*NV] = (y[r, :8*NV] if more else b) + x[r, :K] @ W[:K, :8*NV] for r < nr (<= kRows).
template <int NV>
void tile_nn(const float* x, int64_t ldx, int nr, const float* W, int64_t ldw, const float* b, float* y,
             int64_t ldy, int64_t K, bool more) {
  v8 acc[kRows][NV];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < NV; ++j)
      acc[r][j] = more && r < nr ? load8(y + r * ldy + 8 * j) : b ? load8(b + 8 * j) : splat8(0.f);
  // Rows past nr read row 0 again (kept out of the loop's branches) and are not stored.
  const float* xr[kRows];
  for (int r = 0; r < kRows; ++r) xr[r] = x + (r < nr ? r : 0) * ldx;
  for (int64_t k = 0; k < K; ++k) {
    v8 w[NV];
    for (int j = 0; j < NV; ++j) w[j] = load8(W + k * ldw + 8 * j);
    for (int r = 0; r < kRows; ++r) {
      const v8 xb = splat8(xr[r][k]);
      for (int j = 0; j < NV; ++j) acc[r][j] += xb * w[j];
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < NV; ++j) store8(y + r * ldy + 8 * j, acc[r][j]);
}

// The last N % 8 columns, one at a time.
void columns_nn(const float* x, int64_t ldx, int64_t R, const float* W, int64_t ldw, const float* b, float* y,
                int64_t ldy, int64_t K, bool more, int64_t n0, int64_t n1) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = n0; n < n1; ++n) {
      float acc = more ? y[r * ldy + n] : b ? b[n] : 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[r * ldx + k] * W[k * ldw + n];
      y[r * ldy + n] = acc;
    }
}

// y[r, n] = b + sum_k x[r, k] Wt[n, k] for r < nr, n < nn (<= 3).
void tile_nt(const float* x, int64_t ldx, int nr, const float* Wt, int64_t ldw, int nn, const float* b, float* y,
             int64_t ldy, int64_t K) {
  constexpr int kCols = 3;
  v8 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kCols; ++j) acc[r][j] = splat8(0.f);
  const float *xr[kRows], *wr[kCols];
  for (int r = 0; r < kRows; ++r) xr[r] = x + (r < nr ? r : 0) * ldx;
  for (int j = 0; j < kCols; ++j) wr[j] = Wt + (j < nn ? j : 0) * ldw;
  const int64_t K8 = K - K % 8;
  for (int64_t k = 0; k < K8; k += 8) {
    v8 w[kCols];
    for (int j = 0; j < kCols; ++j) w[j] = load8(wr[j] + k);
    for (int r = 0; r < kRows; ++r) {
      const v8 xv = load8(xr[r] + k);
      for (int j = 0; j < kCols; ++j) acc[r][j] += xv * w[j];
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < nn; ++j) {
      float s = sum8(acc[r][j]);
      for (int64_t k = K8; k < K; ++k) s += xr[r][k] * wr[j][k];
      y[r * ldy + j] = b ? b[j] + s : s;
    }
}

constexpr int64_t kPanel = 24;  // columns of y per task: the nn tile's width
constexpr int64_t kDepth = 256;  // rows of W per pass of the nn form: a 24-column panel of them is 24 KB, in L1

}  // namespace

at::Tensor small_mm(const at::Tensor& x_, const at::Tensor& W, OptTensor bias_, OptTensor out_) {
  TORCH_CHECK_VALUE(x_.dim() == 2 && W.dim() == 2 && x_.size(1) == W.size(0), "small_mm: expected x (R, K) and W (K, N), got ",
                    x_.sizes(), " and ", W.sizes());
  const int64_t R = x_.size(0), K = x_.size(1), N = W.size(1);
  TORCH_CHECK_VALUE(x_.scalar_type() == at::kFloat && W.scalar_type() == at::kFloat, "small_mm: expected float32 x and W, got ",
                    x_.scalar_type(), " and ", W.scalar_type());
  // W as given (row-major, or the transposed view of a row-major matrix), else a row-major copy.
  const at::Tensor Wc = W.stride(1) == 1 || W.stride(0) == 1 ? W : W.contiguous();
  const bool row_major = Wc.stride(1) == 1;
  const In x = in_rows(x_, R, K, at::kFloat);
  const at::Tensor bias = bias_.has_value() ? bias_->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK_VALUE(!bias.defined() || bias.numel() == N, "small_mm: bias must have ", N, " elements, got ", bias.numel());
  const Out y = out_rows(out_, R, N, x_, {R, N});
  const float* xp = x.at<float>(0);
  const float* Wp = Wc.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.at<float>(0);
  const int64_t ldx = x.s_row, ldy = y.s_row, ldw = row_major ? Wc.stride(0) : Wc.stride(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // Threads only for calls worth starting them for (~2 * 2^18 FLOPs a task).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(R * K * kPanel, 1));
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    const int64_t n0 = p0 * kPanel, n1 = std::min(N, p1 * kPanel);
    for (int64_t r = 0; r < R; r += kRows) {
      const int nr = int(std::min<int64_t>(kRows, R - r));
      const float* xr = xp + r * ldx;
      float* yr = yp + r * ldy;
      if (row_major) {
        for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
          const int64_t kn = std::min(kDepth, K - k0);
          const float *xk = xr + k0, *Wk = Wp + k0 * ldw;
          const bool more = k0 > 0;
          int64_t n = n0;
          for (; n + 24 <= n1; n += 24) tile_nn<3>(xk, ldx, nr, Wk + n, ldw, bp ? bp + n : nullptr, yr + n, ldy, kn, more);
          for (; n + 8 <= n1; n += 8) tile_nn<1>(xk, ldx, nr, Wk + n, ldw, bp ? bp + n : nullptr, yr + n, ldy, kn, more);
          if (n < n1) columns_nn(xk, ldx, nr, Wk, ldw, bp, yr, ldy, kn, more, n, n1);
        }
      } else {
        for (int64_t n = n0; n < n1; n += 3)
          tile_nt(xr, ldx, nr, Wp + n * ldw, ldw, int(std::min<int64_t>(3, n1 - n)), bp ? bp + n : nullptr, yr + n, ldy, K);
      }
    }
  });
  return y.done();
}

}  // namespace gpn_cpu
