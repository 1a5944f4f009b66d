// The elementwise groups of a fused-core step on CPU: the twins of kernels/step/reference.py.
//
// Between the step's GEMMs sit only elementwise maps and per-row reductions over vectors of a
// few hundred elements. In torch each group is 3 to 10 ops, and on CPU each op costs more in
// dispatch than in arithmetic; here a group is one call that reads its inputs once and writes
// every output (the grouping is the Triton kernels', kernels/elementwise.py). Work is split over
// sequences only when a call is large enough to pay for threads. Arithmetic in the state's dtype
// (float32, or float64 for gradient checks); row sums accumulate in double.

#include "kernels.h"
#include "layout.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace gpn_cpu {
namespace {

// torch's softplus (linear above 20), with log1p keeping the digits of tiny exp(x).
template <typename T>
T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}

// (x / rms(x), rms(x)) of one row: rms = sqrt(mean(x^2) + eps).
template <typename T>
void rms_hat_row(const T* __restrict__ x, T* __restrict__ hat, T* __restrict__ r, int64_t n, double eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const T rms = T(std::sqrt(ss / n + eps)), inv = T(1) / rms;
  for (int64_t i = 0; i < n; ++i) hat[i] = x[i] * inv;
  *r = rms;
}

int64_t rows_of(const at::Tensor& x) { return x.dim() > 0 ? x.size(0) : 1; }

}  // namespace

void post_projection(const at::Tensor& h1_, const at::Tensor& h2_, const at::Tensor& out_ffn, OptTensor heads_,
                     OptTensor out_heads, OptTensor out_norms, OptTensor beta_, OptTensor a_, OptTensor A_,
                     OptTensor out_beta, OptTensor out_gamma, OptTensor out_decay, double l2_eps) {
  check_cpu("post_projection", {{"h1", h1_}, {"h2", h2_}, {"out_ffn", out_ffn}, {"heads", heads_}, {"out_heads", out_heads},
                                {"out_norms", out_norms}, {"beta", beta_}, {"a", a_}, {"A", A_}, {"out_beta", out_beta},
                                {"out_gamma", out_gamma}, {"out_decay", out_decay}});
  const int64_t B = rows_of(h1_), nf = h1_.numel() / B;
  const auto dt = out_ffn.scalar_type();
  const In h1 = in_rows(h1_, B, nf, dt), h2 = in_rows(h2_, B, nf, dt);
  const Out ffn = out_rows(out_ffn, B, nf, out_ffn);
  const bool has_heads = heads_.has_value(), has_gates = beta_.has_value();
  int64_t dk = 1, nh = 0;
  In heads;
  Out qn, norms;
  if (has_heads) {
    dk = heads_->size(-1);
    nh = heads_->numel() / (B * dk);  // heads per row: n_blocks x H
    auto norm_shape = heads_->sizes().vec();
    norm_shape.back() = 1;
    heads = in_rows(*heads_, B, nh * dk, dt);
    qn = out_rows(out_heads, B, nh * dk, out_ffn, heads_->sizes());
    norms = out_rows(out_norms, B, nh, out_ffn, norm_shape);
  }
  int64_t ng = 0;
  In beta, a, A;
  Out beta_o, gamma_o, decay_o;
  if (has_gates) {
    ng = beta_->numel() / B;
    beta = in_rows(*beta_, B, ng, dt);
    a = in_rows(*a_, B, ng, dt);
    A = in_rows(*A_, 1, ng, dt);
    beta_o = out_rows(out_beta, B, ng, out_ffn);
    gamma_o = out_rows(out_gamma, B, ng, out_ffn);
    decay_o = out_rows(out_decay, B, ng, out_ffn);
  }
  AT_DISPATCH_FLOATING_TYPES(dt, "post_projection", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(nf + nh * dk), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T* __restrict__ x1 = h1.at<T>(b);
        const T* __restrict__ x2 = h2.at<T>(b);
        T* __restrict__ y = ffn.at<T>(b);
        for (int64_t i = 0; i < nf; ++i) y[i] = x1[i] * sigmoid(x1[i]) * x2[i];
        if (has_heads) {
          for (int64_t s = 0; s < nh; ++s) {
            const T* __restrict__ z = heads.at<T>(b) + s * dk;
            T* __restrict__ out = qn.at<T>(b) + s * dk;
            double ss = 0;
            for (int64_t j = 0; j < dk; ++j) {
              const T zj = z[j] < T(0) ? T(0) : z[j];  // relu, a NaN kept (as torch.relu)
              ss += double(zj) * zj;
            }
            const T norm = T(std::sqrt(ss + l2_eps)), inv = T(1) / norm;
            for (int64_t j = 0; j < dk; ++j) out[j] = (z[j] < T(0) ? T(0) : z[j]) * inv;
            norms.at<T>(b)[s] = norm;
          }
        }
        if (has_gates) {
          for (int64_t h = 0; h < ng; ++h) {
            beta_o.at<T>(b)[h] = sigmoid(beta.at<T>(b)[h]);
            const T gamma = softplus(a.at<T>(b)[h]) * A.at<T>(0)[h];
            gamma_o.at<T>(b)[h] = gamma;
            decay_o.at<T>(b)[h] = std::exp(gamma);
          }
        }
      }
    });
  });
  ffn.done();
  if (has_heads) {
    qn.done();
    norms.done();
  }
  if (has_gates) {
    beta_o.done();
    gamma_o.done();
    decay_o.done();
  }
}

at::Tensor residual_rms(const at::Tensor& y_, const at::Tensor& pg_, const at::Tensor& c_, OptTensor out_,
                        OptTensor out_hat, OptTensor out_rms, double eps) {
  check_cpu("residual_rms", {{"y", y_}, {"pg", pg_}, {"c", c_}, {"out", out_}, {"out_hat", out_hat}, {"out_rms", out_rms}});
  const int64_t B = rows_of(c_), n = c_.numel() / B;
  const auto dt = c_.scalar_type();
  const In y = in_rows(y_, B, n, dt), pg = in_rows(pg_, B, n, dt), c = in_rows(c_, B, n, dt);
  const Out out = out_rows(out_, B, n, c_, c_.sizes()), hat = out_rows(out_hat, B, n, c_, c_.sizes()),
            r = out_rows(out_rms, B, 1, c_, {B, 1});
  AT_DISPATCH_FLOATING_TYPES(dt, "residual_rms", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(n), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T *yb = y.at<T>(b), *pgb = pg.at<T>(b), *cb = c.at<T>(b);
        T* ob = out.at<T>(b);
        for (int64_t i = 0; i < n; ++i) ob[i] = yb[i] + sigmoid(pgb[i]) * cb[i];
        rms_hat_row(static_cast<const T*>(ob), hat.at<T>(b), r.at<T>(b), n, eps);
      }
    });
  });
  hat.done();
  r.done();
  return out.done();
}

at::Tensor ground(const at::Tensor& y_fg_, const at::Tensor& c_, const at::Tensor& u_, const at::Tensor& out_fg,
                  OptTensor out_hat, OptTensor out_rms, double eps) {
  check_cpu("ground", {{"y_fg", y_fg_}, {"c", c_}, {"u", u_}, {"out_fg", out_fg}, {"out_hat", out_hat}, {"out_rms", out_rms}});
  const int64_t B = rows_of(c_), n = c_.numel() / B;
  const auto dt = c_.scalar_type();
  const In y_fg = in_rows(y_fg_, B, n, dt), c = in_rows(c_, B, n, dt), u = in_rows(u_, B, n, dt);
  const Out fg = out_rows(out_fg, B, n, c_);
  const at::Tensor g = at::empty({B, n}, c_.options());
  const bool has_hat = out_hat.has_value();
  Out hat, r;
  if (has_hat) {
    hat = out_rows(out_hat, B, n, c_);
    r = out_rows(out_rms, B, 1, c_, {B, 1});
  }
  AT_DISPATCH_FLOATING_TYPES(dt, "ground", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(n), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T *yb = y_fg.at<T>(b), *cb = c.at<T>(b), *ub = u.at<T>(b);  // y_fg may be out_fg itself
        T *fgb = fg.at<T>(b), *gb = g.data_ptr<T>() + b * n;
        for (int64_t i = 0; i < n; ++i) {
          const T f = sigmoid(yb[i]);
          fgb[i] = f;
          gb[i] = ub[i] + f * cb[i];
        }
        if (has_hat) rms_hat_row(static_cast<const T*>(gb), hat.at<T>(b), r.at<T>(b), n, eps);
      }
    });
  });
  fg.done();
  if (has_hat) {
    hat.done();
    r.done();
  }
  return g;
}

at::Tensor residual_rms_backward(const at::Tensor& x_hat_, const at::Tensor& r_, const at::Tensor& dx_hat_,
                                 const at::Tensor& dc_, const at::Tensor& gate_, OptTensor extra_, OptTensor out_) {
  check_cpu("residual_rms_backward", {{"x_hat", x_hat_}, {"r", r_}, {"dx_hat", dx_hat_}, {"dc", dc_}, {"gate", gate_},
                                      {"extra", extra_}, {"out", out_}});
  const int64_t B = rows_of(x_hat_), n = x_hat_.numel() / B;
  const auto dt = x_hat_.scalar_type();
  const In x_hat = in_rows(x_hat_, B, n, dt), r = in_rows(r_, B, 1, dt), dx_hat = in_rows(dx_hat_, B, n, dt),
           dc = in_rows(dc_, B, n, dt), gate = in_rows(gate_, B, n, dt);
  const bool has_extra = extra_.has_value();
  const In extra = has_extra ? in_rows(*extra_, B, n, dt) : In{};
  const Out out = out_rows(out_, B, n, x_hat_, x_hat_.sizes());
  AT_DISPATCH_FLOATING_TYPES(dt, "residual_rms_backward", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(n), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T *xh = x_hat.at<T>(b), *dxh = dx_hat.at<T>(b), *dcb = dc.at<T>(b), *gb = gate.at<T>(b);
        const T* ex = has_extra ? extra.at<T>(b) : nullptr;
        T* ob = out.at<T>(b);
        double dot = 0;
        for (int64_t i = 0; i < n; ++i) dot += double(dxh[i]) * xh[i];
        const T mean_dot = T(dot / n), inv_r = T(1) / r.at<T>(b)[0];
        for (int64_t i = 0; i < n; ++i) {
          T v = (dxh[i] - xh[i] * mean_dot) * inv_r;
          if (has_extra) v += ex[i];
          ob[i] = v + dcb[i] * gb[i];
        }
      }
    });
  });
  return out.done();
}

void gate_grads(const at::Tensor& dz_ffn_, const at::Tensor& ffn_fac_, const at::Tensor& out_dffn, const at::Tensor& dc_,
                const at::Tensor& pg_fac_, const at::Tensor& out_dpg) {
  check_cpu("gate_grads", {{"dz_ffn", dz_ffn_}, {"ffn_fac", ffn_fac_}, {"out_dffn", out_dffn}, {"dc", dc_}, {"pg_fac", pg_fac_},
                           {"out_dpg", out_dpg}});
  const int64_t B = rows_of(ffn_fac_), nf = ffn_fac_.size(-1), n = dc_.numel() / B;
  const auto dt = out_dffn.scalar_type();
  const In dz = in_blocks(dz_ffn_, B, 1, nf, dt), fac = in_blocks(ffn_fac_, B, 2, nf, dt), dc = in_rows(dc_, B, n, dt),
           pg_fac = in_rows(pg_fac_, B, n, dt);
  const Out dffn = out_blocks(out_dffn, B, 2, nf, out_dffn), dpg = out_rows(out_dpg, B, n, out_dffn);
  AT_DISPATCH_FLOATING_TYPES(dt, "gate_grads", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(2 * nf + n), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T* dzb = dz.at<T>(b);
        for (int64_t k = 0; k < 2; ++k) {
          const T* f = fac.at<T>(b, k);
          T* o = dffn.at<T>(b, k);
          for (int64_t i = 0; i < nf; ++i) o[i] = dzb[i] * f[i];
        }
        const T *dcb = dc.at<T>(b), *pf = pg_fac.at<T>(b);
        T* o = dpg.at<T>(b);
        for (int64_t i = 0; i < n; ++i) o[i] = dcb[i] * pf[i];
      }
    });
  });
  dffn.done();
  dpg.done();
}

at::Tensor l2n_relu_backward(const at::Tensor& y_, const at::Tensor& mask_, const at::Tensor& dy_, OptTensor out_) {
  check_cpu("l2n_relu_backward", {{"y", y_}, {"mask_over_norm", mask_}, {"dy", dy_}, {"out", out_}});
  // (B, n_blocks, H, dk) or (B, H, dk): per head, (dy - y (dy . y)) * mask_over_norm.
  const int64_t B = rows_of(y_), dk = y_.size(-1), nb = y_.dim() == 4 ? y_.size(1) : 1;
  const int64_t m = y_.numel() / (B * nb), heads = m / dk;
  const auto dt = y_.scalar_type();
  const In y = in_blocks(y_, B, nb, m, dt), mask = in_blocks(mask_, B, nb, m, dt), dy = in_blocks(dy_, B, nb, m, dt);
  const Out out = out_blocks(out_, B, nb, m, y_, y_.sizes());
  AT_DISPATCH_FLOATING_TYPES(dt, "l2n_relu_backward", [&] {
    using T = scalar_t;
    at::parallel_for(0, B, grain(nb * m), [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t k = 0; k < nb; ++k) {
          for (int64_t h = 0; h < heads; ++h) {
            const T *yh = y.at<T>(b, k) + h * dk, *mh = mask.at<T>(b, k) + h * dk, *dyh = dy.at<T>(b, k) + h * dk;
            T* oh = out.at<T>(b, k) + h * dk;
            T dot = 0;
            for (int64_t j = 0; j < dk; ++j) dot += dyh[j] * yh[j];
            for (int64_t j = 0; j < dk; ++j) oh[j] = (dyh[j] - yh[j] * dot) * mh[j];
          }
        }
      }
    });
  });
  return out.done();
}

}  // namespace gpn_cpu
