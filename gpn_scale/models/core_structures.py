"""The fused core's named structures: its weights in their fused layout, the window's saved tensors,
one chunk's rebuilt factors and buffers, the sweep's carry, the spec, and the small pieces that the
core (core.py), both memory forms (memory_step.py, memory_chunk.py) and the decoder share.

Shapes: T steps of the window (2 for a work ring: two slots written in turn), B sequences, d the
state, F the FFN, H heads of dk x dv, N_i the width of layer i's fused projection; L the steps of
a chunk. Per-step views (`step_views`) are tuples of the time-major tensor's rows, one per step.

One vocabulary throughout (the docs' symbols in brackets):
  x_hat, rms      a layer's normalised input c / rms(c) and rms(c) [X, R]
  proj            the fused projection's output [Y]; its column blocks (`columns`): heads (the raw
                  [next key |] query), gate (the read's), v, beta_pre, a (the write's value and
                  gate pre-activations), h1, h2 (the SwiGLU's), pg (the predict gate's)
  gemm2_in        the second GEMM's input [Z] = [swiglu | read_out]: silu(h1) h2 and the read's
                  output silu(gate) o / rms(o)
  pred_hat, pred_rms   the prediction normalised, and its rms [XP, RP]
  fuse_gate       the fuse-gate GEMM's output, the gate's pre-activation [FG]; in the backward the gate
  preds           the predictions [P]
  heads_hat, head_norms   the normalised [next key |] query heads and their norms [NQ, NN]; q, next_key
                  the normalised query and next key among them
  reads           the raw reads o [O]
  write_err, delta     the write's error e and beta e [E, DELTA]
  beta, gamma, decay   the write's gates [BETA, GAMMA, DECAY]
  d_<name>        dL/d<name>; d_out: dL/d(a layer's output c) [dU]
  <name>_full     a chunk's (L, B, ...) tensor, whose per-step views are <name>
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

    d_preds: torch.Tensor | None
    dg: torch.Tensor | None
    dg_prev: torch.Tensor | None
    dM: torch.Tensor | None


class CoreGrads(NamedTuple):
    """The gradients `run_backward` returns: w.r.t. the input projections du (T, B, d), the incoming
    state (dg, dg_prev, dM; the last two None without memory), A_log (None without memory), and the
    fused weights: per layer [dW, db, dW2o], the fuse gate's."""

    du: torch.Tensor
    dg: torch.Tensor
    dg_prev: torch.Tensor | None
    dM: torch.Tensor | None
    A_log: torch.Tensor | None
    layers: list
    fg_W: torch.Tensor
    fg_b: torch.Tensor


class Span(NamedTuple):
    """One chunk of the window: its index and its steps c0 .. c1-1."""

    index: int
    c0: int
    c1: int

    @property
    def rows(self) -> slice:
        return slice(self.c0, self.c1)


class CoreSpec(NamedTuple):
    """The fused core's sizes and settings for one window (`from_config`): hashable, a graph's key."""

    d_state: int
    d_ffn: int
    n_heads: int
    d_key: int
    d_val: int
    memory: bool
    chunk: int
    bptt: int
    compute_dtype: torch.dtype
    backend: Backend  # the step's memory and elementwise implementation (kernels.backend)
    chunked: bool = False  # the memory's chunk form (kernels/memory_chunk) rather than its step form
    low_reads: bool = False  # the chunk form's per-step products read M_c in compute_dtype (memory_reads: compute)
    keep_projections: bool = False  # the forward keeps every step's projection for the backward (core_projections: keep)

    @classmethod
    def from_config(cls, cfg, backend: Backend, compute_dtype: torch.dtype, device_type: str | None = None,
                    state_dtype: torch.dtype | None = None) -> CoreSpec:
        """The spec of a `GPNConfig`'s core. device_type: where a window runs, which picks the memory's
        form (None: the step form, as a decoder's single steps); state_dtype: the state's, against
        which the compute dtype is narrower or not (the chunk form's low reads)."""
        chunked = device_type is not None and cfg.memory and cfg.memory_form_on(device_type) == "chunk"
        return cls(d_state=cfg.d_state, d_ffn=cfg.d_ffn, n_heads=cfg.n_heads, d_key=cfg.d_key, d_val=cfg.d_val,
                   memory=cfg.memory, chunk=cfg.core_chunk, bptt=cfg.bptt, compute_dtype=compute_dtype, backend=backend,
                   chunked=chunked, low_reads=chunked and cfg.memory_reads == "compute" and compute_dtype != state_dtype,
                   keep_projections=cfg.core_projections == "keep")


def bounds(spec: CoreSpec, T: int) -> list[tuple[int, int]]:
    """The chunks (c0, c1) of a window: every `chunk` steps, and in the chunk form also at every
    truncated-BPTT cut, where dL/dM stops (it enters and leaves a chunk only at its ends)."""
    starts = set(range(0, T, spec.chunk))
    if spec.chunked and spec.bptt:
        starts |= set(range(0, T, spec.bptt))
    starts = sorted(starts)
    return list(zip(starts, starts[1:] + [T]))


def columns(spec: CoreSpec, first: bool) -> dict[str, slice]:
    """Column blocks of a layer's fused projection.

    Layer 0 of GPN+M leads with the next step's key next to its query, so both are normalised
    (and differentiated) as one block of 2H heads, then the write's v, beta, a.
    """
    hk, hv = spec.n_heads * spec.d_key, spec.n_heads * spec.d_val
    widths = []
    if spec.memory:
        widths += [("k", hk)] if first else []
        widths += [("q", hk), ("gate", hv)]
        widths += [("v", hv), ("beta_pre", spec.n_heads), ("a", spec.n_heads)] if first else []
    widths += [("ffn", 2 * spec.d_ffn), ("pg", spec.d_state)]
    out, start = {}, 0
    for name, w in widths:
        out[name] = slice(start, start + w)
        start += w
    if spec.memory:  # the block that is l2-normalised per head: [k | q] or [q]
        out["heads"] = slice(out["k" if first else "q"].start, out["q"].stop)
    return out


def io_dtype(spec: CoreSpec, sd: torch.dtype) -> torch.dtype:
    """The dtype of the per-step buffers the step's GEMMs read and write: the compute dtype when
    the step's kernels widen them on load and round into them on store, else the state's (sd)."""
    return spec.compute_dtype if spec.backend.step.narrow_io else sd


def cast(spec: CoreSpec, weights: Weights) -> Weights:
    """The weights the GEMMs read, in the compute dtype (A_log stays as it is)."""
    cd = spec.compute_dtype
    return weights._replace(layers=[LayerWeights(*(w.to(cd) for w in L)) for L in weights.layers], fg_W=weights.fg_W.to(cd),
                            fg_b=weights.fg_b.to(cd))


@dataclass(eq=False)
class Saved:
    """What the forward keeps for the backward (time-major; names as in the module docstring); the
    work-ring ones hold only the current step's, the backward recomputes them per chunk.

    x_hat, rms: per layer, the normalised input (T, B, d) and its rms (T, B, 1); layer 0's in the
      ring (the backward forms it again from u, preds and the fuse gates).
    proj, gemm2_in: per layer, the fused projection's output (2, B, N_i; T rows with
      core_projections: keep, in the GEMMs' dtype) and the second GEMM's input (2, B, F [+ H*dv]).
    pred_hat, pred_rms, fuse_gate: the normalised prediction (2, B, d), its rms (2, B, 1), the
      fuse-gate GEMM's output (2, B, d).
    preds: the predictions (T, B, d); u: the input projections (T, B, d); g0: the incoming state (B, d).
    GPN+M: heads_hat, head_norms: per layer, the normalised [next key | query] heads (2, B, 2 or 1,
      H, dk) and their norms (.., 1); reads: per layer, the raw reads (2, B, H*dv); write_err: the
      write's error (2, B, H, dv); beta, gamma, decay: the write's gates (T, B, H); M: M before every
      chunk (B, H, dk, dv) each (the chunk form with memory_reads: compute keeps its bf16 copy only);
      x_prev, r_prev: the incoming previous state normalised (B, d) and its rms (B, 1); k0, k0_norm:
      the first step's key (B, H, dk) and its norm (B, H, 1). The chunk form keeps reads and write_err
      for every step (T rows), and delta (T, B, H, dv), and M_end, the window's last M (its
      phi = <dL/dM, M> starts the sweep).
    """

    x_hat: list
    rms: list
    proj: list
    gemm2_in: list
    pred_hat: torch.Tensor
    pred_rms: torch.Tensor
    fuse_gate: torch.Tensor
    preds: torch.Tensor | None = None
    u: torch.Tensor | None = None
    g0: torch.Tensor | None = None
    heads_hat: list = field(default_factory=list)
    head_norms: list = field(default_factory=list)
    reads: list = field(default_factory=list)
    write_err: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    gamma: torch.Tensor | None = None
    decay: torch.Tensor | None = None
    M: list = field(default_factory=list)
    x_prev: torch.Tensor | None = None
    r_prev: torch.Tensor | None = None
    k0: torch.Tensor | None = None
    k0_norm: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    M_end: torch.Tensor | None = None


class LayerSteps(NamedTuple):
    """Per-step views of one layer's forward buffers (`Saved`) and of its projection's column
    blocks (`columns`); the memory ones are None without memory; next_key, v, beta_pre, a and the
    write's gates beta, gamma, decay are layer 0's."""

    x_hat: tuple
    rms: tuple
    proj: tuple
    gemm2_in: tuple
    pg: tuple
    h1: tuple
    h2: tuple
    swiglu: tuple
    read_out: tuple
    heads: tuple | None = None
    gate: tuple | None = None
    heads_hat: tuple | None = None
    head_norms: tuple | None = None
    q: tuple | None = None
    reads: tuple | None = None
    next_key: tuple | None = None
    v: tuple | None = None
    beta_pre: tuple | None = None
    a: tuple | None = None
    beta: tuple | None = None
    gamma: tuple | None = None
    decay: tuple | None = None


class StepLayers(NamedTuple):
    """What one step's predict layers (core.predict_step) read and write, fixed for a window (or a
    decoder's batch size): the step's kernels (`StepOps`), each layer's weights as its GEMMs read
    them, each layer's `LayerSteps`, the rows the second GEMM writes (2, B, d), and the write's
    A = -exp(A_log) (None without memory)."""

    ops: object
    weights: list
    views: list
    gemm2_out: tuple
    A: torch.Tensor | None


class Workspace(NamedTuple):
    """One layer's widest chunk buffers, (L, B, ...): reused by every chunk of the sweep."""

    proj: torch.Tensor | None  # projection outputs (.., N_i); None when the forward kept its own
    d_proj: torch.Tensor  # their gradients
    gemm2_in: torch.Tensor  # second GEMM inputs (.., F [+ H*dv])
    d_gemm2_in: torch.Tensor  # their gradients
    ffn_fac: torch.Tensor  # (.., 2, F): the SwiGLU's (dL/dh1, dL/dh2) per dL/d(silu(h1) h2)


@dataclass(eq=False, slots=True)
class ChunkLayer:
    """One layer's buffers for one chunk of the reverse sweep (names as in the module docstring):
    `*_full` tensors (L, B, ...), the rest per-step views of them. x_hat, rms: the normalised input
    and its rms; proj_full, gemm2_in_full: the recomputed projection and second GEMM input; d_proj,
    d_gemm2_in, d_out: the gradients w.r.t. the projection output, the second GEMM input and the
    layer's output c; pg_gate, pg_fac: the predict gate and its derivative factor; ffn_fac, d_ffn,
    d_pg, d_swiglu, d_read_out: the SwiGLU's factors and the gradient blocks. GPN+M: heads_hat, q
    (q_full), heads_mask: the normalised heads, the query, relu's mask over the norm; gate, reads,
    read_out: the read's gate, raw output and output; d_gate, d_heads: their gradient blocks;
    read_factors: the reads' `ReadFactors`; keys, v: layer 0's write keys and values."""

    x_hat_full: torch.Tensor
    x_hat: tuple
    rms: tuple
    proj_full: torch.Tensor
    gemm2_in_full: torch.Tensor
    d_proj_full: torch.Tensor
    d_gemm2_in_full: torch.Tensor
    d_out_full: torch.Tensor
    d_out: tuple
    pg_gate: tuple
    pg_fac: tuple
    ffn_fac: tuple
    d_proj: tuple
    d_gemm2_in: tuple
    d_ffn: tuple
    d_pg: tuple
    d_swiglu: tuple
    d_read_out: tuple
    heads_hat: tuple | None = None
    q_full: torch.Tensor | None = None
    q: tuple | None = None
    heads_mask: tuple | None = None
    gate_full: torch.Tensor | None = None
    gate: tuple | None = None
    reads_full: torch.Tensor | None = None
    reads: tuple | None = None
    read_out: tuple | None = None
    d_gate: tuple | None = None
    d_heads: tuple | None = None
    keys: list | None = None
    v: tuple | None = None
    read_factors: list | None = None


@dataclass(eq=False, slots=True)
class ChunkShared:
    """The chunk's buffers outside the layers, (L, B, ...) and per-step views (names as in the module
    docstring). pred_hat (pred_hat_full), pred_rms: the normalised predictions and their rms;
    fuse_gate, fuse_gate_fac: the fuse gates and their derivative factor; d_fuse_gate: the fuse-gate
    GEMM's output gradient. GPN+M: write_err, delta: the write's errors and beta e; gate_fac: (beta,
    a) derivative factors; d_beta_decay (d_beta, d_decay): dL/d(beta, decay); d_beta_a: their
    pre-activations' gradient block; d_v, d_key_proj: layer 0's v and next-key gradient blocks;
    d_heads_hat (d_next_key, d_q): dL/d the normalised [next key | query] of layer 0."""

    d_fuse_gate_full: torch.Tensor
    d_fuse_gate: tuple
    fuse_gate: tuple
    fuse_gate_fac: tuple
    pred_hat_full: torch.Tensor
    pred_hat: tuple
    pred_rms: tuple
    write_err_full: torch.Tensor | None = None
    write_err: tuple | None = None
    gate_fac: tuple | None = None
    d_beta_decay_full: torch.Tensor | None = None
    d_beta_decay: tuple | None = None
    d_beta: tuple | None = None
    d_decay: tuple | None = None
    d_beta_a: tuple | None = None
    d_v: tuple | None = None
    d_key_proj: tuple | None = None
    d_heads_hat_full: torch.Tensor | None = None
    d_heads_hat: tuple | None = None
    d_next_key: tuple | None = None
    d_q: tuple | None = None
    delta: tuple | None = None


def step_views(x, *shape):
    """Per-step views of a time-major (T, B, ...) tensor, made in one call: indexing inside the
    loop would cost a dispatched op per step and use."""
    return (x.view(*x.shape[:2], *shape) if shape else x).unbind(0)


class ChunkRows(NamedTuple):
    """The forward's per-step vectors around the grounded state, formed again (`_grounded_rows`),
    (L, B, ...) each: layer 0's normalised input and its rms, the normalised predictions and their
    rms, the fuse gates and their derivative factor; and GPN+M's key of the chunk's first step,
    which the step before projected (None without memory, and in the window's rows)."""

    x_hat: torch.Tensor
    rms: torch.Tensor
    pred_hat: torch.Tensor
    pred_rms: torch.Tensor
    fuse_gate: torch.Tensor
    fuse_gate_fac: torch.Tensor
    first_key: torch.Tensor | None = None


class WeightGrads(NamedTuple):
    """The weights' gradients as the chunks accumulate them, in the state's dtype: per layer
    [dW, db, dW2o], the fuse gate's, and A_log's (None without memory)."""

    layers: list
    fg_W: torch.Tensor
    fg_b: torch.Tensor
    A_log: torch.Tensor | None


class Sweep(NamedTuple):
    """What the reverse sweep reads at every chunk: the step functions, the memory form's backward,
    the transposed weights of its GEMMs (packed as they are read fastest), du's and d_preds' per-step
    views, the key projection's transpose and dL/dg_prev."""

    ops: object  # StepOps
    form: object  # the memory form's backward (memory_step.Backward, memory_chunk.Backward), or None without memory
    W_T: list  # per layer
    W2o_T: list  # per layer
    fg_W_T: object
    du: tuple
    d_preds: tuple | None
    W_k_T: torch.Tensor | None
    dg_prev: torch.Tensor | None
    dx: torch.Tensor  # (B, d): the input-gradient GEMMs' output, read by the next group


class Carry(NamedTuple):
    """What the sweep carries from step to step, backwards: dL/dg, dL/dM, and whether the next
    key's gradient flows into the state (not across a truncated-BPTT cut)."""

    dg: torch.Tensor
    dM: torch.Tensor | None
    kn_flows: bool


def read_outputs(spec: CoreSpec, outputs: list, C: list) -> None:
    """The chunk's read outputs y = silu(gate) o / rms(o) into the second GEMM's input rows of the
    layers `outputs` (whose reads were not made by a memory function that writes them), then the
    read factors of every layer (`ChunkLayer.read_factors`)."""
    factors = spec.backend.memory.read_factors
    for c in C:
        y = c.gemm2_in_full[..., spec.d_ffn :] if any(c is o for o in outputs) else None
        L, B, n = c.reads_full.shape
        f = factors(c.reads_full.view(L * B, n), c.gate_full.reshape(L * B, n), out_y=None if y is None else y.view(L * B, n))
        c.read_factors = [ReadFactors(*v) for v in zip(*(step_views(x.view(L, B, -1)) for x in f))]
