"""The fused core's named state: its weights in their fused layout, the window's saved tensors, one
chunk's rebuilt factors and buffers, the sweep's carry, and the small pieces that the core
(core.py) and both memory forms (memory_step.py, memory_chunk.py) share.

Shapes: T steps of the window (2 for a work ring: two slots written in turn), B sequences, d the
state, F the FFN, H heads of dk x dv, N_i the width of layer i's fused projection; L the steps of
a chunk. Per-step views (`step_views`) are tuples of the time-major tensor's rows, one per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kernels import Backend
from kernels.memory import ReadFactors


class LayerWeights(NamedTuple):
    W: torch.Tensor  # (d, N): the layer's fused projection, norm weights folded in
    b: torch.Tensor  # (N,)
    W2o: torch.Tensor  # (F [+ H*dv], d): [ffn_w2_k; diag(read_out_norm_w) read_W_o_k]


class Weights(NamedTuple):
    """The loop's weights in their fused layout (`fuse_weights`), passed whole: per layer's, the
    fuse gate's, and the write's A_log (None without memory)."""

    layers: list  # [LayerWeights] per layer
    fg_W: torch.Tensor  # (d, d): the fuse gate, its norm weight folded in
    fg_b: torch.Tensor  # (d,)
    A_log: torch.Tensor | None


class OutputGrads(NamedTuple):
    """The gradients w.r.t. the core's outputs (None where unused): the predictions (T, B, d) and
    the final state."""

    dP: torch.Tensor | None
    dg: torch.Tensor | None
    dg_prev: torch.Tensor | None
    dM: torch.Tensor | None


class Span(NamedTuple):
    """One chunk of the window: its index and its steps c0 .. c1-1."""

    index: int
    c0: int
    c1: int

    @property
    def rows(self) -> slice:
        return slice(self.c0, self.c1)


class Spec(NamedTuple):
    d: int
    F: int
    H: int
    dk: int
    dv: int
    memory: bool
    chunk: int
    bptt: int
    compute_dtype: torch.dtype
    backend: Backend  # the step's memory and elementwise implementation (kernels.backend)
    chunked: bool = False  # the memory's chunk form (kernels/memory_chunk) rather than its step form
    low_reads: bool = False  # the chunk form's per-step products read M_c in compute_dtype (memory_reads: compute)
    keep_projections: bool = False  # the forward keeps every step's projection for the backward (core_projections: keep)


def bounds(spec: Spec, T: int) -> list[tuple[int, int]]:
    """The chunks (c0, c1) of a window: every `chunk` steps, and in the chunk form also at every
    truncated-BPTT cut, where dL/dM stops (it enters and leaves a chunk only at its ends)."""
    starts = set(range(0, T, spec.chunk))
    if spec.chunked and spec.bptt:
        starts |= set(range(0, T, spec.bptt))
    starts = sorted(starts)
    return list(zip(starts, starts[1:] + [T]))


def columns(spec: Spec, first: bool) -> dict[str, slice]:
    """Column blocks of a layer's fused projection.

    Layer 0 of GPN+M leads with the next step's key next to its query, so both are normalised
    (and differentiated) as one block of 2H heads, then the write's v, beta, a.
    """
    hk, hv = spec.H * spec.dk, spec.H * spec.dv
    widths = []
    if spec.memory:
        widths += [("k", hk)] if first else []
        widths += [("q", hk), ("gate", hv)]
        widths += [("v", hv), ("beta", spec.H), ("a", spec.H)] if first else []
    widths += [("ffn", 2 * spec.F), ("pg", spec.d)]
    out, start = {}, 0
    for name, w in widths:
        out[name] = slice(start, start + w)
        start += w
    if spec.memory:  # the block that is l2-normalised per head: [k | q] or [q]
        out["heads"] = slice(out["k" if first else "q"].start, out["q"].stop)
    return out


def io_dtype(spec: Spec, sd: torch.dtype) -> torch.dtype:
    """The dtype of the per-step buffers the step's GEMMs read and write: the compute dtype when
    the step's kernels widen them on load and round into them on store, else the state's (sd)."""
    return spec.compute_dtype if spec.backend.step.narrow_io else sd


def cast(spec: Spec, weights: Weights) -> Weights:
    """The weights the GEMMs read, in the compute dtype (A_log stays as it is)."""
    cd = spec.compute_dtype
    return weights._replace(layers=[LayerWeights(*(w.to(cd) for w in L)) for L in weights.layers], fg_W=weights.fg_W.to(cd),
                            fg_b=weights.fg_b.to(cd))


@dataclass(eq=False)
class Saved:
    """What the forward keeps for the backward (time-major); the work-ring ones hold only the
    current step's, the backward recomputes them per chunk.

    X, R: per layer, the normalised input (T, B, d) and its rms (T, B, 1); layer 0's in the ring
      (the backward forms it again from u, P and the fuse gates).
    Y, Z: per layer, the fused projection's output (2, B, N_i; T rows with core_projections: keep,
      in the GEMMs' dtype) and the second GEMM's input
      (2, B, F [+ H*dv]) = [silu(h1) h2 | read output]. XP, RP, FG: the normalised prediction
      (2, B, d), its rms (2, B, 1), the fuse gate (2, B, d).
    P: the predictions (T, B, d); u: the input projections (T, B, d); g0: the incoming state (B, d).
    GPN+M: NQ, NN: per layer, the normalised [next key | query] heads (2, B, 2 or 1, H, dk) and
      their norms (.., 1); O: per layer, the raw reads (2, B, H*dv); E: the write's error
      (2, B, H, dv); BETA, GAMMA, DECAY: the write's gates (T, B, H); M: M before every chunk
      (B, H, dk, dv) each (the chunk form with memory_reads: compute keeps its bf16 copy only);
      x_prev, r_prev: the incoming previous state normalised (B, d) and its rms (B, 1); k0, k0n:
      the first step's key (B, H, dk) and its norm (B, H, 1). The chunk form keeps O and E for
      every step (T rows), and DELTA (T, B, H, dv), the write's beta e, and M_end, the window's
      last M (its phi = <dL/dM, M> starts the sweep).
    """

    X: list
    R: list
    Y: list
    Z: list
    XP: torch.Tensor
    RP: torch.Tensor
    FG: torch.Tensor
    P: torch.Tensor | None = None
    u: torch.Tensor | None = None
    g0: torch.Tensor | None = None
    NQ: list = field(default_factory=list)
    NN: list = field(default_factory=list)
    O: list = field(default_factory=list)
    E: torch.Tensor | None = None
    BETA: torch.Tensor | None = None
    GAMMA: torch.Tensor | None = None
    DECAY: torch.Tensor | None = None
    M: list = field(default_factory=list)
    x_prev: torch.Tensor | None = None
    r_prev: torch.Tensor | None = None
    k0: torch.Tensor | None = None
    k0n: torch.Tensor | None = None
    DELTA: torch.Tensor | None = None
    M_end: torch.Tensor | None = None


class LayerSteps(NamedTuple):
    """Per-step views of one layer's forward buffers (`Saved`) and of its projection's column
    blocks (`columns`); the memory ones are None without memory, next_key, v, beta, a are layer 0's."""

    x: tuple
    r: tuple
    y: tuple
    z: tuple
    pg: tuple
    h1: tuple
    h2: tuple
    z_ffn: tuple
    z_read: tuple
    heads: tuple | None = None
    gate: tuple | None = None
    nq: tuple | None = None
    nn: tuple | None = None
    q: tuple | None = None
    o: tuple | None = None
    next_key: tuple | None = None
    v: tuple | None = None
    beta: tuple | None = None
    a: tuple | None = None


class Workspace(NamedTuple):
    """One layer's widest chunk buffers, (L, B, ...): reused by every chunk of the sweep."""

    Y: torch.Tensor | None  # projection outputs (.., N_i); None when the forward kept its own
    dY: torch.Tensor  # their gradients
    Z: torch.Tensor  # second GEMM inputs (.., F [+ H*dv])
    dZ: torch.Tensor  # their gradients
    ffn_fac: torch.Tensor  # (.., 2, F): the SwiGLU's (dL/dh1, dL/dh2) per dL/d(silu(h1) h2)


@dataclass(eq=False, slots=True)
class ChunkLayer:
    """One layer's buffers for one chunk of the reverse sweep: `*_full` tensors (L, B, ...), the
    rest per-step views of them. x, r: the normalised input and its rms; Y, Z: the recomputed
    projection and second GEMM input; dY, dZ, dU: the gradients w.r.t. the projection output, the
    second GEMM input and the layer's output c; pg_gate, pg_fac: the predict gate and its
    derivative factor; ffn_fac, dffn, dpg, dz_ffn, dz_read: the SwiGLU's factors and the
    gradient blocks. GPN+M: nq, q (q_full), nq_mask: the normalised heads, the query, relu's mask
    over the norm; gate, o, z_read: the read's gate, raw output and output; dgate, dheads: their gradient
    blocks; rf: the reads' `ReadFactors`; keys, v: layer 0's write keys and values."""

    X_full: torch.Tensor
    x: tuple
    r: tuple
    Y: torch.Tensor
    Z_full: torch.Tensor
    dY_full: torch.Tensor
    dZ_full: torch.Tensor
    dU_full: torch.Tensor
    dU: tuple
    pg_gate: tuple
    pg_fac: tuple
    ffn_fac: tuple
    dY: tuple
    dZ: tuple
    dffn: tuple
    dpg: tuple
    dz_ffn: tuple
    dz_read: tuple
    nq: tuple | None = None
    q_full: torch.Tensor | None = None
    q: tuple | None = None
    nq_mask: tuple | None = None
    gate_full: torch.Tensor | None = None
    gate: tuple | None = None
    O_full: torch.Tensor | None = None
    o: tuple | None = None
    z_read: tuple | None = None
    dgate: tuple | None = None
    dheads: tuple | None = None
    keys: list | None = None
    v: tuple | None = None
    rf: list | None = None


@dataclass(eq=False, slots=True)
class ChunkShared:
    """The chunk's buffers outside the layers, (L, B, ...) and per-step views. XP, xp, rp: the
    normalised predictions and their rms; fg, fg_fac: the fuse gates and their derivative factor;
    dYfg: the fuse-gate GEMM's output gradient. GPN+M: e (E_full), delta: the write's errors and
    beta e; gate_fac: (beta, a) derivative factors; dBD (dbeta, ddecay), dgates: the gates'
    gradients; dv, dkn: layer 0's v and next-key gradient blocks; dKQ (dk_out, dq_out): dL/d the
    normalised [next key | query] of layer 0."""

    dYfg_full: torch.Tensor
    dYfg: tuple
    fg: tuple
    fg_fac: tuple
    XP: torch.Tensor
    xp: tuple
    rp: tuple
    E_full: torch.Tensor | None = None
    e: tuple | None = None
    gate_fac: tuple | None = None
    dBD_full: torch.Tensor | None = None
    dBD: tuple | None = None
    dbeta: tuple | None = None
    ddecay: tuple | None = None
    dgates: tuple | None = None
    dv: tuple | None = None
    dkn: tuple | None = None
    dKQ_full: torch.Tensor | None = None
    dKQ: tuple | None = None
    dk_out: tuple | None = None
    dq_out: tuple | None = None
    delta: tuple | None = None


def step_views(x, *shape):
    """Per-step views of a time-major (T, B, ...) tensor, made in one call: indexing inside the
    loop would cost a dispatched op per step and use."""
    return (x.view(*x.shape[:2], *shape) if shape else x).unbind(0)


class ChunkRows(NamedTuple):
    """The forward's per-step vectors around the grounded state, formed again for one chunk's steps
    (`_grounded_rows`), (L, B, ...) each: layer 0's normalised input and its rms, the normalised
    predictions and their rms, the fuse gates and their derivative factor; and GPN+M's key of the
    chunk's first step, which the step before projected (None without memory)."""

    X0: torch.Tensor
    R0: torch.Tensor
    XP: torch.Tensor
    RP: torch.Tensor
    fg: torch.Tensor
    fg_fac: torch.Tensor
    k_first: torch.Tensor | None


class WeightGrads(NamedTuple):
    """The weights' gradients as the chunks accumulate them, in the state's dtype: per layer
    [dW, db, dW2o], the fuse gate's, and A_log's (None without memory)."""

    layers: list
    fg_W: torch.Tensor
    fg_b: torch.Tensor
    A_log: torch.Tensor | None


class Sweep(NamedTuple):
    """What the reverse sweep reads at every chunk: the step functions, the memory form's backward,
    the transposed weights of its GEMMs (packed as they are read fastest), du's and dP's per-step
    views, the key projection's transpose and dL/dg_prev."""

    ew: object  # StepOps
    form: object  # the memory form's backward (memory_step.Backward, memory_chunk.Backward), or None without memory
    WT: list
    W2oT: list
    fg_WT: object
    dus: tuple
    dPs: tuple | None
    W_kT: torch.Tensor | None
    dg_prev: torch.Tensor | None
    dX: torch.Tensor  # (B, d): the input-gradient GEMMs' output, read by the next group


class Carry(NamedTuple):
    """What the sweep carries from step to step, backwards: dL/dg, dL/dM, and whether the next
    key's gradient flows into the state (not across a truncated-BPTT cut)."""

    dg: torch.Tensor
    dM: torch.Tensor | None
    kn_flows: bool


def read_outputs(spec: Spec, outputs: list, C: list) -> None:
    """The chunk's read outputs y = silu(gate) o / rms(o) into the second GEMM's input rows of the
    layers `outputs` (whose reads were not made by a memory function that writes them), then the
    read factors of every layer (`ChunkLayer.rf`)."""
    factors = spec.backend.memory.read_factors
    for c in C:
        y = c.Z_full[..., spec.F :] if any(c is o for o in outputs) else None
        L, B, n = c.O_full.shape
        f = factors(c.O_full.view(L * B, n), c.gate_full.reshape(L * B, n), out_y=None if y is None else y.view(L * B, n))
        c.rf = [ReadFactors(*v) for v in zip(*(step_views(x.view(L, B, -1)) for x in f))]

