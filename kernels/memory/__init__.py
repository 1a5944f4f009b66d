"""The memory step of GPN+M: the gated delta write and the gated, RMS-normalised reads.

Three implementations of one contract, side by side: `reference` (plain PyTorch, the twin every
kernel is tested against), `triton` (GPUs) and `cpu` (C++). Each exports `OPS`, a `MemoryOps`;
importing this package imports neither Triton nor the C++ build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


class ReadFactors(NamedTuple):
    """The parts of a read's derivative that do not depend on the incoming gradient.

    They are elementwise in (o, gate), so the core computes them for all steps at once.
    """

    rms: torch.Tensor  # rms(o), (..., 1)
    o_hat: torch.Tensor  # o / rms(o)
    silu_gate: torch.Tensor  # dL/d(o_hat) = dy * silu(gate)
    to_gate: torch.Tensor  # dL/d(gate) = dy * o_hat * silu'(gate)


@dataclass(frozen=True)
class MemoryOps:
    """The memory functions the fused core calls (signatures: `reference`)."""

    memory_step: Callable
    memory_read: Callable
    decay_and_write: Callable
    memory_read_backward: Callable
    memory_step_backward: Callable
    read_factors: Callable  # once per chunk of the reverse sweep: the reads' factors (and outputs) for its rows
