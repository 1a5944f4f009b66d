"""Triton kernels, each beside its plain-PyTorch twin (same signature, same outputs).

`memory_ops(kernel)` and `step_ops(kernel)` give the functions the fused core calls: the Triton
kernels (`kernels.memory_step`, `kernels.elementwise`) or their twins
(`gpn_scale.models.memory_step`, `gpn_scale.models.step_ops`). Triton is imported only
when a Triton implementation is asked for, so the model package imports fast and runs where
Triton cannot (CPU without the interpreter).
"""

from __future__ import annotations

import importlib
import os

KERNELS = ("auto", "triton", "torch")


def resolve(kernel: str, device_type: str) -> str:
    """"auto" is triton on CUDA and torch elsewhere; triton off CUDA needs Triton's interpreter."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if kernel == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernel: 'triton' on {device_type} runs only in Triton's interpreter (TRITON_INTERPRET=1); "
                         "use 'torch' or 'auto'")
    return kernel


def memory_ops(kernel: str):
    """The module holding memory_step, memory_read, decay_and_write and their backwards."""
    return importlib.import_module("kernels.memory_step" if kernel == "triton" else "gpn_scale.models.memory_step")


def step_ops(kernel: str):
    """The module holding the step's elementwise groups (post_projection, residual_rms, ground, ...)."""
    return importlib.import_module("kernels.elementwise" if kernel == "triton" else "gpn_scale.models.step_ops")
