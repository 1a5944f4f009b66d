"""The elementwise groups between a fused-core step's GEMMs, and the step's GEMMs.

Three implementations of one contract, side by side: `reference` (plain PyTorch, the twin every
kernel is tested against), `triton` (GPUs) and `cpu` (C++). Each exports `OPS`, a `StepOps`;
importing this package imports neither Triton nor the C++ build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StepOps:
    """The step functions the fused core calls (signatures: `reference`)."""

    pack: Callable
    mm: Callable
    rms_hat: Callable
    rms_hat_backward: Callable
    l2n_relu: Callable
    l2n_relu_backward: Callable
    post_projection: Callable
    residual_rms: Callable
    ground: Callable
    residual_rms_backward: Callable
    gate_grads: Callable
    gate_factors: Callable  # once per chunk of the reverse sweep: the factors gate_grads multiplies by
    ce_lse: Callable  # the decoder's cross-entropy, once per window (chunks of rows)
    ce_grad: Callable
    # True: the groups read the step GEMMs' outputs and write their inputs in the GEMMs' compute
    # dtype (widening on load, rounding on store), so the core keeps those per-step buffers in it
    # and the GEMMs cast nothing. False (the twins, which compute in their inputs' dtype, and the
    # C++ kernels): the buffers stay in the state's dtype.
    narrow_io: bool = False
