"""Kernels, each beside its plain-PyTorch twin (same signature, same outputs).

`memory_ops(kernel)` and `step_ops(kernel)` give the functions the fused core calls: the Triton
kernels (`kernels.memory_step`, `kernels.elementwise`), the C++ CPU kernels
(`kernels.memory_step_cpu`, `kernels.elementwise_cpu`), or the twins
(`gpn_scale.models.memory_step`, `gpn_scale.models.step_ops`). Triton is imported only
when a Triton implementation is asked for, and the C++ one is built only when asked for, so the
model package imports fast and runs anywhere.
"""

from __future__ import annotations

import importlib
import os
import warnings

KERNELS = ("auto", "triton", "cpp", "torch")


def resolve(kernel: str, device_type: str) -> str:
    """"auto" is triton on CUDA, cpp on CPU (torch, with a warning, where the C++ kernels cannot
    be built) and torch elsewhere; triton off CUDA needs Triton's interpreter."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        if device_type == "cuda":
            return "triton"
        if device_type != "cpu":
            return "torch"
        from kernels import cpu_build

        built, why = cpu_build.available()
        if not built:
            warnings.warn(f"kernel auto: the C++ CPU kernels could not be built ({why}); using the slower torch twins",
                          stacklevel=2)
        return "cpp" if built else "torch"
    if kernel == "cpp" and device_type != "cpu":
        raise ValueError(f"kernel: 'cpp' runs on CPU tensors, not {device_type}; use 'auto'")
    if kernel == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernel: 'triton' on {device_type} runs only in Triton's interpreter (TRITON_INTERPRET=1); "
                         "use 'torch' or 'auto'")
    return kernel


def memory_ops(kernel: str):
    """The module holding memory_step, memory_read, decay_and_write and their backwards."""
    modules = {"triton": "kernels.memory_step", "cpp": "kernels.memory_step_cpu"}
    return importlib.import_module(modules.get(kernel, "gpn_scale.models.memory_step"))


def step_ops(kernel: str):
    """The module holding the step's elementwise groups (post_projection, residual_rms, ground, ...)."""
    modules = {"triton": "kernels.elementwise", "cpp": "kernels.elementwise_cpu"}
    return importlib.import_module(modules.get(kernel, "gpn_scale.models.step_ops"))
