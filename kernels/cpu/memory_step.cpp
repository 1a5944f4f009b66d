// The memory step of GPN+M on CPU: the twin of kernels/memory/reference.py in C++.
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
// Row sums over H dv accumulate in double. A block is walked in strips of columns, each
// strip's per-column sums kept in vector registers (for_strips); the sums over dv are per-lane
// partial sums added up at the end, so the summation order differs from torch's in the last
// bits. Outputs not given (None) are allocated.

#include "kernels.h"
#include "layout.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

// ---- SIMD vectors ----------------------------------------------------------------------------

// The vector of T that fills a 256-bit (AVX2) register, as a GCC vector type: arithmetic is
// per lane, a scalar operand is broadcast, and a fixed-size array of them indexed by constants
// stays in registers. Without AVX2 the compiler splits them; the code is the same.
template <typename T>
struct Simd {
  typedef T V __attribute__((vector_size(32)));
};
template <typename T>
using Vec = typename Simd<T>::V;

// Unaligned load and store of a vector, or of a scalar when V is T (a strip's last columns).
template <typename V, typename T>
inline V load(const T* p) {
  V x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename V, typename T>
inline void store(T* p, const V& x) {
  std::memcpy(p, &x, sizeof x);
}

// The sum of a vector's lanes as a tree over halves: three adds, not a chain of seven.
template <typename H, typename V>
inline H half(const V& x, int i) {
  H h;
  std::memcpy(&h, reinterpret_cast<const char*>(&x) + i * sizeof h, sizeof h);
  return h;
}
inline float hsum(Vec<float> x) {
  typedef float V4 __attribute__((vector_size(16)));
  typedef float V2 __attribute__((vector_size(8)));
  const V4 a = half<V4>(x, 0) + half<V4>(x, 1);
  const V2 b = half<V2>(a, 0) + half<V2>(a, 1);
  return b[0] + b[1];
}
inline double hsum(Vec<double> x) {
  typedef double V2 __attribute__((vector_size(16)));
  const V2 a = half<V2>(x, 0) + half<V2>(x, 1);
  return a[0] + a[1];
}
template <typename T>
inline T hsum(T x) {
  return x;
}

// acc += x, where x is a vector or, for a strip's last columns, a scalar (into lane 0).
template <typename T, typename V>
inline void add_lanes(Vec<T>& acc, const V& x) {
  if constexpr (std::is_same_v<V, T>) acc[0] += x;
  else acc += x;
}

// Columns [j, j + cols) of a block, as W vectors V per row (V = T: one column).
template <typename T, typename V_, int W_>
struct Strip {
  using V = V_;
  static constexpr int W = W_;
  static constexpr int64_t cols = W * int64_t(sizeof(V) / sizeof(T));
};

// Calls body(j, Strip) over strips covering a block's dv columns: as many of 8 vectors as fit,
// then one each of 4, 2 and 1 vector, then single columns. The per-column accumulators of a
// strip (e, o, d_delta) live in registers for the whole walk down its dk rows: 8 vectors are
// enough independent sums to hide the FMA latency and leave registers for the operands. With
// the runtime dv of a plain loop they went through memory on every row.
template <typename T, typename Body>
void for_strips(int64_t dv, Body&& body) {
  using V = Vec<T>;
  int64_t j = 0;
  for (; j + Strip<T, V, 8>::cols <= dv; j += Strip<T, V, 8>::cols) body(j, Strip<T, V, 8>{});
  auto one = [&](auto s) {
    if (j + s.cols <= dv) {
      body(j, s);
      j += s.cols;
    }
  };
  one(Strip<T, V, 4>{});
  one(Strip<T, V, 2>{});
  one(Strip<T, V, 1>{});
  for (; j < dv; ++j) body(j, Strip<T, T, 1>{});
}

// ---- per-row math --------------------------------------------------------------------------

// y = silu(gate) o / rms(o) over one row of n.
template <typename T>
void gated_rms_row(const T* __restrict__ o, const T* __restrict__ gate, T* __restrict__ y, int64_t n, double eps) {
  double ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += double(o[i]) * o[i];
  const T inv_rms = T(1.0 / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = gate[i] * sigmoid(gate[i]) * o[i] * inv_rms;  // vectorised (layout.h)
}

// The read's backward through the norm and gate for one sequence's row of n = H dv:
// do = (dhat - o_hat (dhat . o_hat) / n) / rms, dhat = dy silu(gate); dgate = dy to_gate.
template <typename T>
void gated_rms_backward_row(const T* __restrict__ dy, T rms, const T* __restrict__ o_hat,
                            const T* __restrict__ silu_gate, const T* __restrict__ to_gate, T* __restrict__ d_o,
                            T* __restrict__ dgate, int64_t n) {
  double dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < n; ++i) dot += double(dy[i] * silu_gate[i]) * o_hat[i];
  const T mean_dot = T(dot / n);
  for (int64_t i = 0; i < n; ++i) {
    d_o[i] = (dy[i] * silu_gate[i] - o_hat[i] * mean_dot) / rms;
    dgate[i] = dy[i] * to_gate[i];
  }
}

// ---- per-strip math: columns [j, j + cols) of a (dk, dv) block, pointers already at column j ----

// The step: e = v - m^T k, m_out = decay m + k (beta e)^T, o = m_out^T q. Every sum runs down
// a column, so a strip is the whole step for its columns: two walks down its rows (the second
// needs all of e), the strip in L1 in between.
template <typename V, int W, typename T>
void step_strip(const T* __restrict__ m, T* __restrict__ m_out, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ q, T beta, T decay, T* __restrict__ e, T* __restrict__ o, int64_t dk,
                int64_t dv) {
  constexpr int64_t L = sizeof(V) / sizeof(T);
  V acc[W] = {};
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) acc[w] += ki * load<V>(m + i * dv + w * L);
  }
  V delta[W];
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) {
    const V ew = load<V>(v + w * L) - acc[w];
    store(e + w * L, ew);
    delta[w] = beta * ew;
    acc[w] = V{};
  }
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i], qi = q[i];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const V x = decay * load<V>(m + i * dv + w * L) + ki * delta[w];
      store(m_out + i * dv + w * L, x);
      acc[w] += qi * x;
    }
  }
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) store(o + w * L, acc[w]);
}

// The read: o = m^T q.
template <typename V, int W, typename T>
void read_strip(const T* __restrict__ m, const T* __restrict__ q, T* __restrict__ o, int64_t dk, int64_t dv) {
  constexpr int64_t L = sizeof(V) / sizeof(T);
  V acc[W] = {};
  for (int64_t i = 0; i < dk; ++i) {
    const T qi = q[i];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) acc[w] += qi * load<V>(m + i * dv + w * L);
  }
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) store(o + w * L, acc[w]);
}

// The read's backward: g_out = g_in + q d_o^T, and the strip's share of dq = m d_o, per row
// into dq_part (a vector per row, summed over its lanes once the block is done).
template <typename V, int W, typename T>
void read_backward_strip(const T* __restrict__ m, const T* __restrict__ q, const T* __restrict__ d_o,
                         const T* __restrict__ g_in, T* __restrict__ g_out, Vec<T>* __restrict__ dq_part, int64_t dk,
                         int64_t dv) {
  constexpr int64_t L = sizeof(V) / sizeof(T);
  for (int64_t i = 0; i < dk; ++i) {
    const T qi = q[i];
    V a_dq = {};
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const int64_t x = i * dv + w * L;
      const V dow = load<V>(d_o + w * L);
      store(g_out + x, load<V>(g_in + x) + qi * dow);
      a_dq += load<V>(m + x) * dow;
    }
    add_lanes<T>(dq_part[i], a_dq);
  }
}

// The step's backward. With G = dM + q do^T the gradient w.r.t. M_t and M_t = decay M_prev +
// k delta^T, delta = beta (v - M_prev^T k): d_delta = G^T k, dbeta = d_delta . e,
// dv = beta d_delta, dk = G delta - M_prev dv, ddecay = <G, M_prev>, dM_prev = decay G - k dv^T.
// The first walk down the strip forms G (into dM_prev's block) and every sum over it, the
// second needs dv, so all of d_delta. The row sums (dq, dk) go to per-row vectors, dbeta and
// ddecay to scalars.
template <typename V, int W, typename T>
void step_backward_strip(const T* __restrict__ mp, const T* __restrict__ m, const T* __restrict__ k,
                         const T* __restrict__ q, T beta, T decay, const T* __restrict__ e,
                         const T* __restrict__ delta, const T* __restrict__ d_o, const T* __restrict__ g_in,
                         T* __restrict__ g, T* __restrict__ dv_out, Vec<T>* __restrict__ dq_part,
                         Vec<T>* __restrict__ dk_part, T& dbeta, T& ddecay, int64_t dk, int64_t dv) {
  constexpr int64_t L = sizeof(V) / sizeof(T);
  V d_delta[W] = {}, a_dec = {};
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i], qi = q[i];
    V a_dq = {}, a_dk = {}, a_deci = {};  // per row: short sums, several rows in flight
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const int64_t x = i * dv + w * L;
      const V dow = load<V>(d_o + w * L);
      const V gw = load<V>(g_in + x) + qi * dow;
      store(g + x, gw);
      a_dq += load<V>(m + x) * dow;
      a_dk += gw * load<V>(delta + w * L);
      a_deci += gw * load<V>(mp + x);
      d_delta[w] += ki * gw;
    }
    add_lanes<T>(dq_part[i], a_dq);
    add_lanes<T>(dk_part[i], a_dk);
    a_dec += a_deci;
  }
  V dvw[W], a_db = {};
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) {
    a_db += d_delta[w] * load<V>(e + w * L);
    dvw[w] = beta * d_delta[w];
    store(dv_out + w * L, dvw[w]);
  }
  dbeta += hsum(a_db);
  ddecay += hsum(a_dec);
  for (int64_t i = 0; i < dk; ++i) {
    const T ki = k[i];
    V a_dk = {};
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const int64_t x = i * dv + w * L;
      a_dk += load<V>(mp + x) * dvw[w];
      store(g + x, decay * load<V>(g + x) - ki * dvw[w]);
    }
    add_lanes<T>(dk_part[i], -a_dk);
  }
}

// ---- per-block math: a block's strips --------------------------------------------------------

template <typename T>
void step_block(const T* m, T* m_out, const T* k, const T* v, const T* q, T beta, T decay, T* e, T* o, int64_t dk,
                int64_t dv) {
  for_strips<T>(dv, [&](int64_t j, auto s) {
    using S = decltype(s);
    step_strip<typename S::V, S::W>(m + j, m_out + j, k, v + j, q, beta, decay, e + j, o + j, dk, dv);
  });
}

template <typename T>
void read_block(const T* m, const T* q, T* o, int64_t dk, int64_t dv) {
  for_strips<T>(dv, [&](int64_t j, auto s) {
    using S = decltype(s);
    read_strip<typename S::V, S::W>(m + j, q, o + j, dk, dv);
  });
}

// part: dk vectors of scratch.
template <typename T>
void read_backward_block(const T* m, const T* q, const T* d_o, const T* g_in, T* g_out, T* dq, Vec<T>* part,
                         int64_t dk, int64_t dv) {
  std::fill(part, part + dk, Vec<T>{});
  for_strips<T>(dv, [&](int64_t j, auto s) {
    using S = decltype(s);
    read_backward_strip<typename S::V, S::W>(m + j, q, d_o + j, g_in + j, g_out + j, part, dk, dv);
  });
  for (int64_t i = 0; i < dk; ++i) dq[i] = hsum(part[i]);
}

// part: 2 dk vectors of scratch.
template <typename T>
void step_backward_block(const T* mp, const T* m, const T* k, const T* q, T beta, T decay, const T* e,
                         const T* delta, const T* d_o, const T* g_in, T* g, T* dk_out, T* dv_out, T* dbeta,
                         T* ddecay, T* dq, Vec<T>* part, int64_t dk, int64_t dv) {
  Vec<T>*const dq_part = part, *const dk_part = part + dk;
  std::fill(part, part + 2 * dk, Vec<T>{});
  T db = 0, dec = 0;
  for_strips<T>(dv, [&](int64_t j, auto s) {
    using S = decltype(s);
    step_backward_strip<typename S::V, S::W>(mp + j, m + j, k, q, beta, decay, e + j, delta + j, d_o + j, g_in + j,
                                             g + j, dv_out + j, dq_part, dk_part, db, dec, dk, dv);
  });
  for (int64_t i = 0; i < dk; ++i) {
    dq[i] = hsum(dq_part[i]);
    dk_out[i] = hsum(dk_part[i]);
  }
  *dbeta = db;
  *ddecay = dec;
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
  check_cpu("memory_step", {{"M", M}, {"k", k_}, {"v", v_}, {"beta", beta_}, {"decay", decay_}, {"q", q_}, {"gate", gate_},
                            {"out_e", out_e}, {"out_o", out_o}, {"out_y", out_y}, {"out_M", out_M}});
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
    // Pointers are taken once per sequence: data_ptr checks the tensor on every call.
    const T* const m0 = M.data_ptr<T>();
    T* const m_out0 = M_out.data_ptr<T>();
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T *kb = k.at<T>(b), *vb = v.at<T>(b), *qb = q.at<T>(b), *betab = beta.at<T>(b), *decayb = decay.at<T>(b);
        T *eb = e.at<T>(b), *ob = o.at<T>(b);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t blk = (b * H + h) * dk * dv;
          step_block(m0 + blk, m_out0 + blk, kb + h * dk, vb + h * dv, qb + h * dk, betab[h], decayb[h], eb + h * dv,
                     ob + h * dv, dk, dv);
        }
        gated_rms_row(ob, gate.at<T>(b), y.at<T>(b), H * dv, eps);
      }
    });
  });
  return {M_out, e.done(), o.done(), y.done()};
}

// Returns (o, y).
std::vector<at::Tensor> memory_read(const at::Tensor& M, const at::Tensor& q_, const at::Tensor& gate_,
                                    OptTensor out_o, OptTensor out_y, double eps) {
  check_cpu("memory_read", {{"M", M}, {"q", q_}, {"gate", gate_}, {"out_o", out_o}, {"out_y", out_y}});
  check_m(M, "M");
  const int64_t B = M.size(0), H = M.size(1), dk = M.size(2), dv = M.size(3);
  const auto dt = M.scalar_type();
  const In q = in_rows(q_, B, H * dk, dt), gate = in_rows(gate_, B, H * dv, dt);
  const Out o = out_rows(out_o, B, H * dv, M, {B, H * dv}), y = out_rows(out_y, B, H * dv, M, {B, H * dv});
  AT_DISPATCH_FLOATING_TYPES(dt, "memory_read", [&] {
    using T = scalar_t;
    const T* const m0 = M.data_ptr<T>();
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T* qb = q.at<T>(b);
        T* ob = o.at<T>(b);
        for (int64_t h = 0; h < H; ++h) read_block(m0 + (b * H + h) * dk * dv, qb + h * dk, ob + h * dv, dk, dv);
        gated_rms_row(ob, gate.at<T>(b), y.at<T>(b), H * dv, eps);
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
  check_cpu("memory_read_backward", {{"M", M}, {"q", q_}, {"rms", rms_}, {"o_hat", o_hat_}, {"silu_gate", silu_gate_},
                                     {"to_gate", to_gate_}, {"dy", dy_}, {"dM", dM_}, {"out_dq", out_dq},
                                     {"out_dgate", out_dgate}, {"out_dM", out_dM}});
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
    const T *const m0 = M.data_ptr<T>(), *const dm0 = dM.data_ptr<T>();
    T* const dm_out0 = dM_out.data_ptr<T>();
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      std::vector<T> d_o(n);
      std::vector<Vec<T>> part(dk);
      for (int64_t b = b0; b < b1; ++b) {
        gated_rms_backward_row(dy.at<T>(b), f.rms.at<T>(b)[0], f.o_hat.at<T>(b), f.silu_gate.at<T>(b),
                               f.to_gate.at<T>(b), d_o.data(), dgate.at<T>(b), n);
        const T* qb = q.at<T>(b);
        T* dqb = dq.at<T>(b);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t blk = (b * H + h) * dk * dv;
          read_backward_block(m0 + blk, qb + h * dk, d_o.data() + h * dv, dm0 + blk, dm_out0 + blk, dqb + h * dk,
                              part.data(), dk, dv);
        }
      }
    });
  });
  return {dq.done(), dgate.done(), dM_out};
}

// Returns (dM_prev, dk, dv, dbeta, ddecay, dq, dgate) and, with gate_fac (B, 2, H), dgates =
// (dbeta, ddecay) * gate_fac (into out_dgates when given).
std::vector<at::Tensor> memory_step_backward(
    const at::Tensor& M_prev, const at::Tensor& M, const at::Tensor& k_, const at::Tensor& beta_,
    const at::Tensor& decay_, const at::Tensor& e_, const at::Tensor& delta_, const at::Tensor& q_,
    const at::Tensor& rms_, const at::Tensor& o_hat_, const at::Tensor& silu_gate_, const at::Tensor& to_gate_,
    const at::Tensor& dM_, const at::Tensor& dy_, OptTensor out_dk, OptTensor out_dq, OptTensor out_dbeta,
    OptTensor out_ddecay, OptTensor out_dgate, OptTensor out_dM, OptTensor out_dv, OptTensor gate_fac_,
    OptTensor out_dgates) {
  check_cpu("memory_step_backward",
            {{"M_prev", M_prev}, {"M", M}, {"k", k_}, {"beta", beta_}, {"decay", decay_}, {"e", e_}, {"delta", delta_},
             {"q", q_}, {"rms", rms_}, {"o_hat", o_hat_}, {"silu_gate", silu_gate_}, {"to_gate", to_gate_}, {"dM", dM_},
             {"dy", dy_}, {"out_dk", out_dk}, {"out_dq", out_dq}, {"out_dbeta", out_dbeta}, {"out_ddecay", out_ddecay},
             {"out_dgate", out_dgate}, {"out_dM", out_dM}, {"out_dv", out_dv}, {"gate_fac", gate_fac_},
             {"out_dgates", out_dgates}});
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
  const Out dk_o = out_rows(out_dk, B, H * dk, M_prev, {B, H, dk}), dq = out_rows(out_dq, B, H * dk, M_prev, {B, H, dk}),
            dbeta = out_rows(out_dbeta, B, H, M_prev, {B, H}), ddecay = out_rows(out_ddecay, B, H, M_prev, {B, H}),
            dgate = out_rows(out_dgate, B, n, M_prev, {B, n}), dv_o = out_rows(out_dv, B, n, M_prev, {B, H, dv});
  const bool gates = gate_fac_.has_value();
  TORCH_CHECK_VALUE(gates || !out_dgates.has_value(), "memory_step_backward: out_dgates needs gate_fac");
  // Empty without gate_fac, and then never read.
  const In gate_fac = gates ? in_rows(*gate_fac_, B, 2 * H, dt) : In{};
  const Out dgates = gates ? out_rows(out_dgates, B, 2 * H, M_prev, {B, 2, H}) : Out{};
  AT_DISPATCH_FLOATING_TYPES(dt, "memory_step_backward", [&] {
    using T = scalar_t;
    const T *const mp0 = M_prev.data_ptr<T>(), *const m0 = M.data_ptr<T>(), *const dm0 = dM.data_ptr<T>();
    T* const dm_prev0 = dM_prev.data_ptr<T>();
    at::parallel_for(0, B, grain(H * dk * dv), [&](int64_t b0, int64_t b1) {
      std::vector<T> d_o(n);
      std::vector<Vec<T>> part(2 * dk);
      for (int64_t b = b0; b < b1; ++b) {
        gated_rms_backward_row(dy.at<T>(b), f.rms.at<T>(b)[0], f.o_hat.at<T>(b), f.silu_gate.at<T>(b),
                               f.to_gate.at<T>(b), d_o.data(), dgate.at<T>(b), n);
        const T *kb = k.at<T>(b), *qb = q.at<T>(b), *betab = beta.at<T>(b), *decayb = decay.at<T>(b),
                *eb = e.at<T>(b), *deltab = delta.at<T>(b);
        T *dkb = dk_o.at<T>(b), *dqb = dq.at<T>(b), *dbetab = dbeta.at<T>(b), *ddecayb = ddecay.at<T>(b),
          *dvb = dv_o.at<T>(b);
        for (int64_t h = 0; h < H; ++h) {
          const int64_t blk = (b * H + h) * dk * dv;
          step_backward_block(mp0 + blk, m0 + blk, kb + h * dk, qb + h * dk, betab[h], decayb[h], eb + h * dv,
                              deltab + h * dv, d_o.data() + h * dv, dm0 + blk, dm_prev0 + blk, dkb + h * dk,
                              dvb + h * dv, dbetab + h, ddecayb + h, dqb + h * dk, part.data(), dk, dv);
        }
        if (gates) {  // [beta's | decay's] factors, H each
          const T* gf = gate_fac.at<T>(b);
          T* dg = dgates.at<T>(b);
          for (int64_t h = 0; h < H; ++h) {
            dg[h] = dbetab[h] * gf[h];
            dg[H + h] = ddecayb[h] * gf[H + h];
          }
        }
      }
    });
  });
  std::vector<at::Tensor> out{dM_prev, dk_o.done(), dv_o.done(), dbeta.done(), ddecay.done(), dq.done(), dgate.done()};
  if (gates) out.push_back(dgates.done());
  return out;
}

}  // namespace gpn_cpu
