"""Triton kernels, each beside its plain-PyTorch twin (same signature, same outputs).

`memory_ops(kernel)` gives the memory-step functions the fused core calls: the Triton kernels
(`kernels.memory_step`) or their twin (`gpn_scale.models.memory_step`). Triton is imported only
when a Triton implementation is asked for, so the model package imports fast and runs where
Triton cannot (CPU without the interpreter).
"""

from __future__ import annotations

import importlib

KERNELS = ("auto", "triton", "torch")


def resolve(kernel: str, device_type: str) -> str:
    """"auto" is triton on CUDA and torch elsewhere."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return kernel


def memory_ops(kernel: str):
    """The module holding memory_step, memory_read, decay_and_write and their backwards."""
    name = "kernels.memory_step" if kernel == "triton" else "gpn_scale.models.memory_step"
    return importlib.import_module(name)
