"""The chunk form of GPN+M's memory: M read once per step and written once per chunk.

The step form (`kernels.memory`) moves all of M through memory at every step: the write reads
and writes it, the backward rebuilds it and reads it and dL/dM again. Within a chunk of C steps
that starts from M_c, every M_j is M_c decayed plus the chunk's own low-rank writes,

    M_j = G(-1, j) M_c + sum_{i <= j} G(i, j) k_i delta_i^T,   G(a, b) = decay_{a+1} ... decay_b,

so the write's error e_j = v_j - M_{j-1}^T k_j and every read M_j^T q_j are M_c^T applied to
the step's vectors (one pass over M_c, which the write and layer 0's read share) plus terms in
the chunk's keys and deltas; M is written once, at the chunk's end. The backward runs on the
same split: per step one pass over M_c (M_j do, M_{j-1} d_delta) and terms in the chunk's
vectors; dL/dM enters a chunk once, through a few chunk-wide products that are computed
before its sweep (`algebra.coefficients`), and leaves it once (`algebra.finish`). docs/core.md,
"The memory's chunk form", derives it.

This package holds the per-step and once-per-chunk functions as a contract (`ChunkOps`) with a
torch twin (`reference`) and Triton kernels (`triton`); `algebra` holds the once-per-chunk work in
plain torch (batched GEMMs and C x C triangular algebra): the twin's, which the Triton kernels
reproduce, and `rebuild` (a chunk's deltas, errors and reads formed again from M_c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ChunkOps:
    """The per-step functions of the chunk form the fused core calls (signatures: `reference`)."""

    step: Callable  # the write's error and layer 0's read; at the chunk's last step, M at its end
    read: Callable  # a later layer's read
    step_backward: Callable  # the write's and layer 0's read's gradients, one step back
    read_backward: Callable  # a later layer's read's gradients
    dm_products: Callable  # once per chunk, before its sweep: dM_end's products with its keys and deltas
    algebra: Callable  # once per chunk, before its sweep: its C x C algebra and the coefficients (dm_products' included)
    finish: Callable  # once per chunk, after its sweep: the rows and weights dL/dM_c is made of
    carry_back: Callable  # once per chunk, after its sweep: dL/dM_c from dM_end
