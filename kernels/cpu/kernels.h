// The C++ CPU kernels' entry points, bound to Python in module.cpp. Each has a torch twin with
// the same name: kernels/memory/reference.py and kernels/step/reference.py.

#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <vector>

namespace gpn_cpu {

using OptTensor = std::optional<at::Tensor>;

// An entry point's tensor argument, by its Python name; an optional one not given is skipped.
struct Arg {
  const char* name;
  const at::Tensor* t;
  Arg(const char* name, const at::Tensor& t) : name(name), t(&t) {}
  Arg(const char* name, const OptTensor& t) : name(name), t(t.has_value() ? &*t : nullptr) {}
};

// Every entry point first checks that its tensors are on the CPU: the kernels read and write
// through host pointers, so a CUDA tensor's memory would be taken for host memory (and a meta
// tensor has none). A ValueError naming the entry point, the argument and its device.
inline void check_cpu(const char* fn, std::initializer_list<Arg> args) {
  for (const Arg& a : args)
    TORCH_CHECK_VALUE(a.t == nullptr || a.t->device().is_cpu(), fn, ": ", a.name, " is on ", a.t->device(),
                      "; the C++ kernels take CPU tensors");
}

// ---- memory_step.cpp -----------------------------------------------------------------------

std::vector<at::Tensor> memory_step(const at::Tensor& M, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& beta, const at::Tensor& decay, const at::Tensor& q,
                                    const at::Tensor& gate, OptTensor out_e, OptTensor out_o, OptTensor out_y,
                                    OptTensor out_M, double eps);
std::vector<at::Tensor> memory_read(const at::Tensor& M, const at::Tensor& q, const at::Tensor& gate, OptTensor out_o,
                                    OptTensor out_y, double eps);
std::vector<at::Tensor> memory_read_backward(const at::Tensor& M, const at::Tensor& q, const at::Tensor& rms,
                                             const at::Tensor& o_hat, const at::Tensor& silu_gate,
                                             const at::Tensor& to_gate, const at::Tensor& dy, const at::Tensor& dM,
                                             OptTensor out_dq, OptTensor out_dgate, OptTensor out_dM);
std::vector<at::Tensor> memory_step_backward(
    const at::Tensor& M_prev, const at::Tensor& M, const at::Tensor& k, const at::Tensor& beta,
    const at::Tensor& decay, const at::Tensor& e, const at::Tensor& delta, const at::Tensor& q,
    const at::Tensor& rms, const at::Tensor& o_hat, const at::Tensor& silu_gate, const at::Tensor& to_gate,
    const at::Tensor& dM, const at::Tensor& dy, OptTensor out_dk, OptTensor out_dq, OptTensor out_dbeta,
    OptTensor out_ddecay, OptTensor out_dgate, OptTensor out_dM, OptTensor out_dv, OptTensor gate_fac,
    OptTensor out_dgates);

// ---- elementwise.cpp -----------------------------------------------------------------------

void post_projection(const at::Tensor& h1, const at::Tensor& h2, const at::Tensor& out_ffn, OptTensor heads,
                     OptTensor out_heads, OptTensor out_norms, OptTensor beta, OptTensor a, OptTensor A,
                     OptTensor out_beta, OptTensor out_gamma, OptTensor out_decay, double l2_eps);
at::Tensor residual_rms(const at::Tensor& y, const at::Tensor& pg, const at::Tensor& c, OptTensor out,
                        OptTensor out_hat, OptTensor out_rms, double eps);
at::Tensor ground(const at::Tensor& y_fg, const at::Tensor& c, const at::Tensor& u, const at::Tensor& out_fg,
                  OptTensor out_hat, OptTensor out_rms, double eps);
at::Tensor residual_rms_backward(const at::Tensor& x_hat, const at::Tensor& r, const at::Tensor& dx_hat,
                                 const at::Tensor& dc, const at::Tensor& gate, OptTensor extra, OptTensor out);
void gate_grads(const at::Tensor& dz_ffn, const at::Tensor& ffn_fac, const at::Tensor& out_dffn, const at::Tensor& dc,
                const at::Tensor& pg_fac, const at::Tensor& out_dpg);
at::Tensor l2n_relu_backward(const at::Tensor& y, const at::Tensor& mask_over_norm, const at::Tensor& dy, OptTensor out);

// ---- gemm.cpp ------------------------------------------------------------------------------

at::Tensor pack_weights(const at::Tensor& W);
at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& packed, int64_t N, OptTensor bias, OptTensor out);

}  // namespace gpn_cpu
