// The Python module of the C++ CPU kernels (built by kernels/cpu_build.py).

// torch's pybind11 type casters for tensors, not the whole C++ API of torch/extension.h: the
// build takes a fraction of the time.
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace gpn_cpu;
  m.def("memory_step", &memory_step);
  m.def("memory_read", &memory_read);
  m.def("memory_read_backward", &memory_read_backward);
  m.def("memory_step_backward", &memory_step_backward);
  m.def("post_projection", &post_projection);
  m.def("residual_rms", &residual_rms);
  m.def("ground", &ground);
  m.def("residual_rms_backward", &residual_rms_backward);
  m.def("gate_grads", &gate_grads);
  m.def("l2n_relu_backward", &l2n_relu_backward);
  m.def("pack_weights", &pack_weights);
  m.def("packed_mm", &packed_mm);
}
