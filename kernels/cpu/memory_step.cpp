// The memory step of GPN+M on CPU: the twin of gpn_scale/models/memory_step.py in C++.
//
// In torch the step is a dozen ops, and the write, the read and their backward each walk M
// (256 KB per step at batch 8 of the small config) several times. Here one call does a step:
// per (sequence, head) M is a dk x dv block that stays in L1/L2 while it is used, so the
// forward reads M once and writes M_out once, and the backward reads M, M_prev and dM once and
// writes dM_prev once. The output RMS norm and gate reduce over all heads of a sequence, so
// the work is split over sequences (at::parallel_for), heads inside.
//
// Layout: M, M_out, dM, dM_prev contiguous (B, H, dk, dv); every other tensor is B rows of
// packed heads (layout.h). Arithmetic in M's dtype (float32, or float64 for gradient checks).
// Row sums over H dv accumulate in double; the per-block sums over dv are SIMD reductions
// (`omp simd`: the summation order differs from torch's in the last bits). Outputs not given
// (None) are allocated.

#include "kernels.h"
#include "layout.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace gpn_cpu {
namespace {

at::Tensor block(const OptTensor& given, const at::Tensor& like, const char* name) {
  if (!given.has_value()) return at::empty_like(like);
  TORCH_CHECK_VALUE(given->is_contiguous() && given->sizes() == like.sizes() && given->scalar_type() == like.scalar_type(),
                    "memory kernels: ", name, " must be contiguous (B, H, dk, dv) with M's dtype");
  return *given;
}

void check_m(const at::Tensor& M, const char* name) {
  TORCH_CHECK_VALUE(M.dim() == 4 && M.is_contiguous(), "memory kernels: ", name, " must be contiguous (B, H, dk, dv)");
  TORCH_CHECK_VALUE(M.scalar_type() == at::kFloat || M.scalar_type() == at::kDouble,
              "memory kernels (cpp): M must be float32 or float64");
}

// ---- per-row and per-block math ------------------------------------------------------------

// y = silu(gate) o / rms(o) over one row of n.
template <typename T>
void gated_rms_row(const T* __restrict__ o, const T* __restrict__ gate, T* __restrict__ y, int64_t n, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(o[i]) * o[i];
  const T inv_rms = T(1.0 / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] * sigmoid(gate[i]) * o[i] * inv_rms;
}

// The read's backward through the norm and gate for one sequence's row of n = H dv:
// do = (dhat - o_hat (dhat . o_hat) / n) / rms, dhat = dy silu(gate); dgate = dy to_gate.
template <typename T>
void gated_rms_backward_row(const T* __restrict__ dy, T rms, const T* __restrict__ o_hat,
                            const T* __restrict__ silu_gate, const T* __restrict__ to_gate, T* __restrict__ d_o,
                            T* __restrict__ dgate, int64_t n) {
  double dot = 0;
  for (int64_t i = 0; i < n; ++i) dot += double(dy[i] * silu_gate[i]) * o_hat[i];
  const T mean_dot = T(dot / n);
  for (int64_t i = 0; i < n; ++i) {
    d_o[i] = (dy[i] * silu_gate[i] - o_hat[i] * mean_dot) / rms;
    dgate[i] = dy[i] * to_gate[i];
  }
}

// One (dk, dv) block of the step: e = v - m^T k, m_out = decay m + k (beta e)^T, o = m_out^T q.
template <typename T>
void step_block(const T* __restrict__ m, T* __restrict__ m_out, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ q, T beta, T decay, T* __restrict__ e, T* __restrict__ o,
                T* __restrict__ delta, int64_t dk, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) e[j] = v[j];
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i];
    const T* __restrict__ row = m + i * dv;
    for (int64_t j = 0; j < dv; ++j) e[j] -= ki * row[j];
  }
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = beta * e[j];
    o[j] = 0;
  }
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i], qi = q[i];
    const T* __restrict__ row = m + i * dv;
    T* __restrict__ out = m_out + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      const T x = decay * row[j] + ki * delta[j];
      out[j] = x;
      o[j] += qi * x;
    }
  }
}

// o = m^T q for one block.
template <typename T>
void read_block(const T* __restrict__ m, const T* __restrict__ q, T* __restrict__ o, int64_t dk, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) o[j] = 0;
  for (int64_t i = 0; i < dk; ++i) {
    const T qi = q[i];
    const T* __restrict__ row = m + i * dv;
    for (int64_t j = 0; j < dv; ++j) o[j] += qi * row[j];
  }
}

// dq = m d_o, g_out = g_in + q d_o^T, for one block of a read.
template <typename T>
void read_backward_block(const T* __restrict__ m, const T* __restrict__ q, const T* __restrict__ d_o,
                         const T* __restrict__ g_in, T* __restrict__ g_out, T* __restrict__ dq, int64_t dk, int64_t dv) {
  for (int64_t i = 0; i < dk; ++i) {
    const T qi = q[i];
    const T* __restrict__ row = m + i * dv;
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < dv; ++j) {
      acc += row[j] * d_o[j];
      g_out[i * dv + j] = g_in[i * dv + j] + qi * d_o[j];
    }
    dq[i] = acc;
  }
}

// One block of the step's backward. With G = dM + q do^T the gradient w.r.t. M_t and
// M_t = decay M_prev + k delta^T, delta = beta (v - M_prev^T k):
// d_delta = G^T k, dbeta = d_delta . e, dv = beta d_delta, dk = G delta - M_prev dv,
// ddecay = <G, M_prev>, dM_prev = decay G - k dv^T. Two passes: the first forms G (into
// dM_prev's block) and every sum over it, the second needs dv.
template <typename T>
void step_backward_block(const T* __restrict__ mp, const T* __restrict__ m, const T* __restrict__ k,
                         const T* __restrict__ q, T beta, T decay, const T* __restrict__ e, const T* __restrict__ delta,
                         const T* __restrict__ d_o, const T* __restrict__ g_in, T* __restrict__ g,
                         T* __restrict__ dk_out, T* __restrict__ dv_out, T* __restrict__ dbeta, T* __restrict__ ddecay,
                         T* __restrict__ dq, T* __restrict__ d_delta, int64_t dk, int64_t dv) {
  read_backward_block(m, q, d_o, g_in, g, dq, dk, dv);
  for (int64_t j = 0; j < dv; ++j) d_delta[j] = 0;
  T dec = 0;
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i];
    const T* __restrict__ gi = g + i * dv;
    const T* __restrict__ mpi = mp + i * dv;
    T acc = 0;
#pragma omp simd reduction(+ : acc, dec)
    for (int64_t j = 0; j < dv; ++j) {
      d_delta[j] += ki * gi[j];
      acc += gi[j] * delta[j];
      dec += gi[j] * mpi[j];
    }
    dk_out[i] = acc;
  }
  T db = 0;
#pragma omp simd reduction(+ : db)
  for (int64_t j = 0; j < dv; ++j) {
    db += d_delta[j] * e[j];
    dv_out[j] = beta * d_delta[j];
  }
  *dbeta = db;
  *ddecay = dec;
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i];
    const T* __restrict__ mpi = mp + i * dv;
    T* __restrict__ gi = g + i * dv;
    T acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < dv; ++j) {
      acc += mpi[j] * dv_out[j];
      gi[j] = decay * gi[j] - ki * dv_out[j];
    }
    dk_out[i] -= acc;
  }
}

struct Factors {
  In rms, o_hat, silu_gate, to_gate;
};

Factors factor_rows(const at::Tensor& rms, const at::Tensor& o_hat, const at::Tensor& silu_gate,
                    const at::Tensor& to_gate, int64_t B, int64_t n, at::ScalarType dt) {
  return {in_rows(rms, B, 1, dt), in_rows(o_hat, B, n, dt), in_rows(silu_gate, B, n, dt), in_rows(to_gate, B, n, dt)};
}

}  // namespace

// Returns (M_t, e, o, y).
std::vector<at::Tensor> memory_step(const at::Tensor& M, const at::Tensor& k_, const at::Tensor& v_,
                                    const at::Tensor& beta_, const at::Tensor& decay_, const at::Tensor& q_,
                                    const at::Tensor& gate_, OptTensor out_e, OptTensor out_o, OptTensor out_y,
                                    OptTensor out_M, double eps) {
  check_m(M, "M");
  const int64_t B = M.size(0), H = M.size(1), dk = M.size(2), dv = M.size(3);
  const auto dt = M.scalar_type();
  const In k = in_rows(k_, B, H * dk, dt), q = in_rows(q_, B, H * dk, dt), v = in_rows(v_, B, H * dv, dt);
  const In beta = in_rows(beta_, B, H, dt), decay = in_rows(decay_, B, H, dt), gate = in_rows(gate_, B, H * dv, dt);
  const at::Tensor M_out = block(out_M, M, "out_M");
  TORCH_CHECK_VALUE(!M_out.is_same(M), "memory kernels: out_M must be a buffer other than M");
  const Out e = out_rows(out_e, B, H * dv, M, {B, H, dv}), o = out_rows(out_o, B, H * dv, M, {B, H * dv}),
            y = out_rows(out_y, B, H * dv, M, {B, H * dv});
  AT_DISPATCH_FLOATING_TYPES(dt, "memory_step", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      std::vector<T> delta(dv);
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t blk = (b * H + h) * dk * dv;
          step_block(M.data_ptr<T>() + blk, M_out.data_ptr<T>() + blk, k.at<T>(b) + h * dk, v.at<T>(b) + h * dv,
                     q.at<T>(b) + h * dk, beta.at<T>(b)[h], decay.at<T>(b)[h], e.at<T>(b) + h * dv,
                     o.at<T>(b) + h * dv, delta.data(), dk, dv);
        }
        gated_rms_row(o.at<T>(b), gate.at<T>(b), y.at<T>(b), H * dv, eps);
      }
    });
  });
  return {M_out, e.done(), o.done(), y.done()};
}

// Returns (o, y).
std::vector<at::Tensor> memory_read(const at::Tensor& M, const at::Tensor& q_, const at::Tensor& gate_,
                                    OptTensor out_o, OptTensor out_y, double eps) {
  check_m(M, "M");
  const int64_t B = M.size(0), H = M.size(1), dk = M.size(2), dv = M.size(3);
  const auto dt = M.scalar_type();
  const In q = in_rows(q_, B, H * dk, dt), gate = in_rows(gate_, B, H * dv, dt);
  const Out o = out_rows(out_o, B, H * dv, M, {B, H * dv}), y = out_rows(out_y, B, H * dv, M, {B, H * dv});
  AT_DISPATCH_FLOATING_TYPES(dt, "memory_read", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t h = 0; h < H; ++h)
          read_block(M.data_ptr<T>() + (b * H + h) * dk * dv, q.at<T>(b) + h * dk, o.at<T>(b) + h * dv, dk, dv);
        gated_rms_row(o.at<T>(b), gate.at<T>(b), y.at<T>(b), H * dv, eps);
      }
    });
  });
  return {o.done(), y.done()};
}

// Returns (dq, dgate, dM + q do^T).
std::vector<at::Tensor> memory_read_backward(const at::Tensor& M, const at::Tensor& q_, const at::Tensor& rms_,
                                             const at::Tensor& o_hat_, const at::Tensor& silu_gate_,
                                             const at::Tensor& to_gate_, const at::Tensor& dy_, const at::Tensor& dM_,
                                             OptTensor out_dq, OptTensor out_dgate, OptTensor out_dM) {
  check_m(M, "M");
  const int64_t B = M.size(0), H = M.size(1), dk = M.size(2), dv = M.size(3), n = H * dv;
  const auto dt = M.scalar_type();
  const In q = in_rows(q_, B, H * dk, dt), dy = in_rows(dy_, B, n, dt);
  const Factors f = factor_rows(rms_, o_hat_, silu_gate_, to_gate_, B, n, dt);
  const at::Tensor dM = dM_.to(dt).contiguous(), dM_out = block(out_dM, M, "out_dM");
  TORCH_CHECK_VALUE(!dM_out.is_same(dM), "memory kernels: out_dM must be a buffer other than dM");
  const Out dq = out_rows(out_dq, B, H * dk, M, {B, H, dk}), dgate = out_rows(out_dgate, B, n, M, {B, n});
  AT_DISPATCH_FLOATING_TYPES(dt, "memory_read_backward", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      std::vector<T> d_o(n);
      for (int64_t b = b0; b < b1; ++b) {
        gated_rms_backward_row(dy.at<T>(b), f.rms.at<T>(b)[0], f.o_hat.at<T>(b), f.silu_gate.at<T>(b),
                               f.to_gate.at<T>(b), d_o.data(), dgate.at<T>(b), n);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t blk = (b * H + h) * dk * dv;
          read_backward_block(M.data_ptr<T>() + blk, q.at<T>(b) + h * dk, d_o.data() + h * dv,
                              dM.data_ptr<T>() + blk, dM_out.data_ptr<T>() + blk, dq.at<T>(b) + h * dk, dk, dv);
        }
      }
    });
  });
  return {dq.done(), dgate.done(), dM_out};
}

// Returns (dM_prev, dk, dv, dbeta, ddecay, dq, dgate).
std::vector<at::Tensor> memory_step_backward(
    const at::Tensor& M_prev, const at::Tensor& M, const at::Tensor& k_, const at::Tensor& beta_,
    const at::Tensor& decay_, const at::Tensor& e_, const at::Tensor& delta_, const at::Tensor& q_,
    const at::Tensor& rms_, const at::Tensor& o_hat_, const at::Tensor& silu_gate_, const at::Tensor& to_gate_,
    const at::Tensor& dM_, const at::Tensor& dy_, OptTensor out_dk, OptTensor out_dq, OptTensor out_dbeta,
    OptTensor out_ddecay, OptTensor out_dgate, OptTensor out_dM) {
  check_m(M_prev, "M_prev");
  check_m(M, "M");
  const int64_t B = M_prev.size(0), H = M_prev.size(1), dk = M_prev.size(2), dv = M_prev.size(3), n = H * dv;
  const auto dt = M_prev.scalar_type();
  const In k = in_rows(k_, B, H * dk, dt), q = in_rows(q_, B, H * dk, dt), beta = in_rows(beta_, B, H, dt),
           decay = in_rows(decay_, B, H, dt), e = in_rows(e_, B, n, dt), delta = in_rows(delta_, B, n, dt),
           dy = in_rows(dy_, B, n, dt);
  const Factors f = factor_rows(rms_, o_hat_, silu_gate_, to_gate_, B, n, dt);
  const at::Tensor dM = dM_.to(dt).contiguous(), dM_prev = block(out_dM, M_prev, "out_dM");
  TORCH_CHECK_VALUE(!dM_prev.is_same(dM), "memory kernels: out_dM must be a buffer other than dM");
  const at::Tensor dv_t = at::empty({B, H, dv}, M_prev.options());
  const Out dk_o = out_rows(out_dk, B, H * dk, M_prev, {B, H, dk}), dq = out_rows(out_dq, B, H * dk, M_prev, {B, H, dk}),
            dbeta = out_rows(out_dbeta, B, H, M_prev, {B, H}), ddecay = out_rows(out_ddecay, B, H, M_prev, {B, H}),
            dgate = out_rows(out_dgate, B, n, M_prev, {B, n});
  AT_DISPATCH_FLOATING_TYPES(dt, "memory_step_backward", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      std::vector<T> d_o(n), d_delta(dv);
      for (int64_t b = b0; b < b1; ++b) {
        gated_rms_backward_row(dy.at<T>(b), f.rms.at<T>(b)[0], f.o_hat.at<T>(b), f.silu_gate.at<T>(b),
                               f.to_gate.at<T>(b), d_o.data(), dgate.at<T>(b), n);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t blk = (b * H + h) * dk * dv;
          step_backward_block(M_prev.data_ptr<T>() + blk, M.data_ptr<T>() + blk, k.at<T>(b) + h * dk,
                              q.at<T>(b) + h * dk, beta.at<T>(b)[h], decay.at<T>(b)[h], e.at<T>(b) + h * dv,
                              delta.at<T>(b) + h * dv, d_o.data() + h * dv, dM.data_ptr<T>() + blk,
                              dM_prev.data_ptr<T>() + blk, dk_o.at<T>(b) + h * dk,
                              dv_t.data_ptr<T>() + (b * H + h) * dv, dbeta.at<T>(b) + h, ddecay.at<T>(b) + h,
                              dq.at<T>(b) + h * dk, d_delta.data(), dk, dv);
        }
      }
    });
  });
  return {dM_prev, dk_o.done(), dv_t, dbeta.done(), ddecay.done(), dq.done(), dgate.done()};
}

}  // namespace gpn_cpu
