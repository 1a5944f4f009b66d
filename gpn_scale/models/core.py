"""The fused recurrent core: the time loop of GPN / GPN+M with a hand-written backward through time.

Autograd's time loop keeps every intermediate of every step (M several times per token) and
spends most of its time on bookkeeping for thousands of tiny ops. This core does only what the
math needs, since the loop itself cannot be parallelised (docs/core.md, "Where the time goes",
points 2-4):

- Fused projections. Every projection of a layer's input c is one GEMM of c / rms(c) against
  the concatenated matrices with the norm weights folded in, `rms(c; w) @ W = (c / rms(c)) @
  (diag(w) W)`. Layer 0's input is the grounded state, so its GEMM also carries the write's
  projections (the *next* step's key, v, beta, a). FFN W2 and the read's W_o (with the read's
  output norm weight folded in the same way) are a second GEMM per layer, the fuse gate a
  third. `fuse_weights` builds the fused matrices from the parameters with ordinary autograd
  ops, so the parameters keep the paper's layout and the norm weights get their gradients from
  the chain rule of one elementwise product.
- Small saved state. Per step the forward saves the normalised layer inputs (and their rms)
  and the write's gates, M at the start of every `chunk` steps, and its output P. Everything
  else lives in two-slot work buffers (M too) and is recomputed per chunk in the backward: the
  projections with one GEMM over the chunk's rows, keys and queries from them, the fuse gates'
  inputs from P, the write's errors and the reads while M is rebuilt.
- Reverse sweep for the input-gradient chain only, chunk by chunk from the end. Step by step,
  back through the fuse gate, the layers and the memory, carrying dL/dg and dL/dM (in two
  buffers written in turn); M is rebuilt inside each chunk from the chunk's saved start, into
  one buffer that every chunk reuses. The gradients w.r.t. each GEMM's output are
  kept for the chunk (dY rows), and the weight gradients are GEMMs over the chunk's B*chunk rows
  (dW += X^T dY), so the backward's working memory is a chunk's, not the window's.

Under autocast the GEMMs run in the autocast dtype; the state, M and all elementwise math stay
float32 (float64 inputs stay float64, for gradient checks). With kernels that read and write
the compute dtype (`StepOps.narrow_io`), the per-step buffers a step GEMM reads or writes are
kept in it (`_io_dtype`): the GEMMs cast nothing inside the loop, and the values are those a
cast would give (a bf16 GEMM's output widened is exact; its input is the float32 value rounded). Truncated BPTT (`bptt`) cuts the
sweep at the same places where the naive core detaches the state. The incoming state receives
gradients, as in the naive core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import Backend
from kernels.common import rms
from kernels.graph import core_graphs, signature
from kernels.memory import ReadFactors
from kernels.memory.reference import read_factors
from kernels.memory_chunk import algebra
from kernels.step.reference import l2n_relu, rms_hat
from kernels.step.reference import mm as _mm  # the chunk's GEMMs, of many rows: BLAS


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


def fuse_weights(model) -> tuple[list[LayerWeights], torch.Tensor, torch.Tensor]:
    """The fused matrices of a `GPN`, built from its parameters with autograd ops.

    Returns (per-layer weights, fuse-gate matrix, fuse-gate bias); the column order is `columns`.
    """
    cfg = model.config
    layers = []
    for i, layer in enumerate(model.layers):
        mats, biases = [], []

        def add(norm_w, weights, bias_list):
            mats.extend(norm_w[:, None] * w for w in weights)
            biases.extend(bias_list)

        zeros = layer.ffn_norm_w.new_zeros
        if cfg.memory and i == 0:
            add(model.write_norm_w, [model.write_W_k_k], [model.write_W_k_b])
        if cfg.memory:
            add(layer.read_norm_w, [layer.read_W_q_k, layer.read_W_gate_k],
                [layer.read_W_q_b, zeros(layer.read_W_gate_k.shape[1])])
        if cfg.memory and i == 0:
            add(model.write_norm_w, [model.write_W_v_k, model.write_W_beta_k, model.write_W_a_k],
                [zeros(model.write_W_v_k.shape[1]), zeros(cfg.n_heads), model.write_dt_bias])
        add(layer.ffn_norm_w, [layer.ffn_w1_k], [zeros(2 * cfg.d_ffn)])
        add(layer.pg_norm_w, [layer.pg_gate_k], [layer.pg_gate_b])
        W2o = layer.ffn_w2_k
        if cfg.memory:
            W2o = torch.cat([W2o, layer.read_out_norm_w[:, None] * layer.read_W_o_k])
        layers.append(LayerWeights(torch.cat(mats, 1), torch.cat(biases), W2o))
    return layers, model.fg_norm_w[:, None] * model.fg_gate_k, model.fg_gate_b


# ---- small pieces ----------------------------------------------------------------------------
# In the time loop every op counts (each costs microseconds of dispatch on tensors this small):
# `out=` writes straight into the saved buffers. The elementwise work between the GEMMs is in
# groups (kernels/step/reference.py, or their kernels), one call each; the step's GEMMs, of
# B rows, are `ew.mm` (its own kernel on CPU), the chunk's, of many rows, `_mm` (BLAS).


def _io_dtype(spec: Spec, sd: torch.dtype) -> torch.dtype:
    """The dtype of the per-step buffers the step's GEMMs read and write: the compute dtype when
    the step's kernels widen them on load and round into them on store, else the state's (sd)."""
    return spec.compute_dtype if spec.backend.step.narrow_io else sd


def _cast(spec: Spec, weights: Weights) -> Weights:
    """The weights the GEMMs read, in the compute dtype (A_log stays as it is)."""
    cd = spec.compute_dtype
    return weights._replace(layers=[LayerWeights(*(w.to(cd) for w in L)) for L in weights.layers], fg_W=weights.fg_W.to(cd),
                            fg_b=weights.fg_b.to(cd))


# ---- named state -----------------------------------------------------------------------------
# Shapes: T steps of the window (2 for a work ring: two slots written in turn), B sequences, d the
# state, F the FFN, H heads of dk x dv, N_i the width of layer i's fused projection; L the steps of
# a chunk. Per-step views (`_steps`) are tuples of the time-major tensor's rows, one per step.


@dataclass(eq=False)
class Saved:
    """What the forward keeps for the backward (time-major); the work-ring ones hold only the
    current step's, the backward recomputes them per chunk.

    X, R: per layer, the normalised input (T, B, d) and its rms (T, B, 1); layer 0's in the ring
      (the backward forms it again from u, P and the fuse gates).
    Y, Z: per layer, the fused projection's output (2, B, N_i) and the second GEMM's input
      (2, B, F [+ H*dv]) = [silu(h1) h2 | read output]. XP, RP, FG: the normalised prediction
      (2, B, d), its rms (2, B, 1), the fuse gate (2, B, d).
    P: the predictions (T, B, d); u: the input projections (T, B, d); g0: the incoming state (B, d).
    GPN+M: NQ, NN: per layer, the normalised [next key | query] heads (2, B, 2 or 1, H, dk) and
      their norms (.., 1); O: per layer, the raw reads (2, B, H*dv); E: the write's error
      (2, B, H, dv); BETA, GAMMA, DECAY: the write's gates (T, B, H); M: M before every chunk
      (B, H, dk, dv) each; x_prev, r_prev: the incoming previous state normalised (B, d) and its
      rms (B, 1); k0, k0n: the first step's key (B, H, dk) and its norm (B, H, 1). The chunk form
      keeps O and E for every step (T rows), and DELTA (T, B, H, dv), the write's beta e, and
      M_end, the window's last M (its phi = <dL/dM, M> starts the sweep).
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

    Y: torch.Tensor  # projection outputs (.., N_i)
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


# ---- forward ---------------------------------------------------------------------------------


def _steps(x, *shape):
    """Per-step views of a time-major (T, B, ...) tensor, made in one call: indexing inside the
    loop would cost a dispatched op per step and use."""
    return (x.view(*x.shape[:2], *shape) if shape else x).unbind(0)


def _buffers(spec: Spec, layers, T, B, like, gate_rows):
    """The per-step vectors the backward needs, time-major: (T, B, ...) each; the write's gates
    (gate_rows, B, H)."""
    d, H, dk, dv = spec.d, spec.H, spec.dk, spec.dv
    new = lambda *shape: like.new_empty((T, B) + shape)  # noqa: E731
    ring = lambda *shape: like.new_empty((2, B) + shape)  # noqa: E731
    io = _io_dtype(spec, like.dtype)
    gemm_ring = lambda *shape: like.new_empty((2, B) + shape, dtype=io)  # noqa: E731  (only GEMMs read or write it)
    S = Saved(
        # Normalised layer inputs and their rms. Layer 0's is the grounded state's, which the
        # backward forms again from u, P and the fuse gates: it lives in the work ring, read by
        # the projection GEMM only. Later layers' are saved in the state's dtype for the backward.
        X=[gemm_ring(d)] + [new(d) for _ in layers[1:]],
        R=[ring(1)] + [new(1) for _ in layers[1:]],
        # Everything else is recomputed per chunk in the backward: the projections with one GEMM,
        # keys and queries from them, the fuse gates' inputs from the predictions, the write's
        # errors and the reads while M is rebuilt. The loop keeps only the current step's.
        Y=[gemm_ring(L.W.shape[1]) for L in layers],  # fused projection outputs
        Z=[gemm_ring(L.W2o.shape[0]) for L in layers],  # second GEMM inputs [silu(h1) * h2 | read output]
        XP=gemm_ring(d), RP=ring(1),  # normalised predictions (the fuse-gate GEMM's input), their rms
        FG=gemm_ring(d),  # the fuse-gate GEMM's output
    )
    if spec.memory:
        # Normalised [next key | query] of layer 0, [query] of later layers, and their norms.
        heads = [2] + [1] * (len(layers) - 1)
        S.NQ = [ring(h, H, dk) for h in heads]
        S.NN = [ring(h, H, 1) for h in heads]
        # The chunk form keeps each step's raw reads, error and delta (its backward takes them as
        # they were, instead of forming them again from M_c); the step form only the current step's.
        kept = new if spec.chunked else ring
        S.O = [kept(H * dv) for _ in layers]  # raw reads
        S.E = kept(H, dv)  # the write's error
        S.DELTA = new(H, dv) if spec.chunked else None  # beta e
        S.BETA, S.GAMMA, S.DECAY = (like.new_empty((gate_rows, B, H)) for _ in range(3))  # the write's gates
        S.M = []  # M before every chunk
    return S


def _layer_steps(spec: Spec, S, i, col):
    """Per-step views of layer i's buffers and of the blocks of its projection (in the work ring)."""
    Y, Fd, H, dk = S.Y[i], spec.F, spec.H, spec.dk
    v = dict(x=_steps(S.X[i]), r=_steps(S.R[i]), y=_steps(Y), z=_steps(S.Z[i]), pg=_steps(Y[..., col["pg"]]),
             h1=_steps(Y[..., col["ffn"]][..., :Fd]), h2=_steps(Y[..., col["ffn"]][..., Fd:]),
             z_ffn=_steps(S.Z[i][..., :Fd]), z_read=_steps(S.Z[i][..., Fd:]))
    if spec.memory:
        nh = S.NQ[i].shape[2]
        v.update(heads=_steps(Y[..., col["heads"]], nh, H, dk), gate=_steps(Y[..., col["gate"]]),
                 nq=_steps(S.NQ[i]), nn=_steps(S.NN[i]), q=_steps(S.NQ[i][:, :, -1]), o=_steps(S.O[i]))
        if "k" in col:
            v.update(next_key=_steps(S.NQ[i][:, :, 0]), v=_steps(Y[..., col["v"]], H, spec.dv),
                     beta=_steps(Y[..., col["beta"]]), a=_steps(Y[..., col["a"]]))
    return LayerSteps(**v)


def run_forward(spec: Spec, u, state, weights: Weights, save: bool):
    """The loop over u (T, B, d), time-major, from state (g, g_prev, M). Returns (P (T, B, d), g,
    g_prev, M, saved or None).

    Without `save` the per-step buffers are two-slot work rings like the rest (the write's gates
    a chunk's rows in the chunk form, whose steps read their chunk's decays).
    """
    T, B, d = u.shape
    g, g_prev, M = state
    H, dk, nl = spec.H, spec.dk, len(weights.layers)
    layers, fg_W, fg_b, A_log = _cast(spec, weights)
    cols = [columns(spec, i == 0) for i in range(nl)]
    chunks = dict(bounds(spec, T))  # chunk start -> end
    gate_rows = T if save else max(c1 - c0 for c0, c1 in chunks.items()) if spec.chunked else 2
    S = _buffers(spec, layers, T if save else 2, B, g, gate_rows)
    V = [_layer_steps(spec, S, i, cols[i]) for i in range(nl)]
    XP, RP, FG = _steps(S.XP), _steps(S.RP), _steps(S.FG)
    P = S.P = g.new_empty((T, B, d))
    Ps, us = _steps(P), _steps(u.to(g.dtype))
    ew = spec.backend.step
    if spec.memory:
        mem = spec.backend.memory
        A = -torch.exp(A_log.to(g.dtype))
        M = M.contiguous()
        # M lives in two work buffers, written in turn (in the chunk form, once per chunk); the one
        # that starts a chunk gets its own when saved.
        Mring = _steps(M.new_empty((2,) + M.shape))
        ends = {c1 - 1 for c1 in chunks.values()}
        E, BETA, GAMMA, DECAY = _steps(S.E), _steps(S.BETA), _steps(S.GAMMA), _steps(S.DECAY)
        if spec.chunked:  # the chunk's keys and deltas, kept as it goes (kernels/memory_chunk)
            chunk, C = spec.backend.chunk, max(c1 - c0 for c0, c1 in chunks.items())
            Kc = M.new_empty((C, B, H, dk))
            Dc = None if save else M.new_empty((C, B, H, spec.dv))  # saved: the chunk's rows of S.DELTA
        S.x_prev, S.r_prev = ew.rms_hat(g_prev)
        k_col = cols[0]["k"]
        kpre = ew.mm(S.x_prev, layers[0].W[:, k_col], bias=layers[0].b[k_col])
        S.k0, S.k0n = ew.l2n_relu(kpre.view(B, H, dk))
        k = S.k0
        v0 = V[0]
    S.u, S.g0 = u, g  # the backward forms layer 0's inputs again from them
    # The step's weights, in the layout its GEMM reads fastest (kernels/cpu/gemm.cpp packs them).
    packed = [L._replace(W=ew.pack(L.W, T, B), W2o=ew.pack(L.W2o, T, B)) for L in layers]
    Y2 = _steps(g.new_empty((2, B, d), dtype=_io_dtype(spec, g.dtype)))  # the second GEMM's output, read by residual_rms
    fg_Wp = ew.pack(fg_W, T, B)
    # Each layer's normalised input is written by the group before it: the previous layer's
    # residual_rms, or (layer 0) the previous step's ground; the first step's here.
    ew.rms_hat(g, V[0].x[0], V[0].r[0])
    for t in range(T):
        s, w = (t if save else t % 2), t % 2  # saved and work-ring slots
        if spec.memory and t in chunks:
            c0, c1, M_c, ci = t, chunks[t], M, (ci + 1 if t else 0)
            if save:
                S.M.append(M)
            if spec.chunked:
                decays = S.DECAY[c0:c1] if save else S.DECAY[: c1 - c0]
                deltas = S.DELTA[c0:c1] if save else Dc
                M_read = M_c.to(spec.compute_dtype) if spec.low_reads else None  # once per chunk
        gs = s if save or not spec.chunked else t - c0  # the slot of the write's gates
        vs = s if spec.chunked else w  # the slot of the reads and the write's error
        c = g
        for i, (L, v) in enumerate(zip(packed, V)):
            ew.mm(v.x[w if i == 0 else s], L.W, v.y[w], L.b)
            if not spec.memory:
                ew.post_projection(v.h1[w], v.h2[w], v.z_ffn[w])
            elif i == 0:
                ew.post_projection(v.h1[w], v.h2[w], v.z_ffn[w], v.heads[w], v.nq[w], v.nn[w], v.beta[w],
                                   v.a[w], A, BETA[gs], GAMMA[gs], DECAY[gs])
                # the chunk form writes M once per chunk: its ring turns per chunk, not per step
                out_M = M.new_empty(M.shape) if save and t in ends else Mring[ci % 2 if spec.chunked else w]
                if not spec.chunked:
                    M, *_ = mem.memory_step(M, k, v.v[w], BETA[gs], DECAY[gs], v.q[w], v.gate[w], out_e=E[w],
                                            out_o=v.o[w], out_y=v.z_read[w], out_M=out_M)
                else:  # M is written at the chunk's last step only, into a buffer other than M_c
                    out_M = out_M if t in ends else None
                    chunk.step(M_c, Kc, deltas, decays, t - c0, k, v.v[w], BETA[gs], v.q[w], v.gate[w], out_e=E[vs],
                               out_o=v.o[vs], out_y=v.z_read[w], out_M=out_M, M_read=M_read)
                    M = M if out_M is None else out_M
                k = v0.next_key[w]
            else:
                ew.post_projection(v.h1[w], v.h2[w], v.z_ffn[w], v.heads[w], v.nq[w], v.nn[w])
                if spec.chunked:
                    chunk.read(M_c, Kc, deltas, decays, t - c0, v.q[w], v.gate[w], out_o=v.o[vs], out_y=v.z_read[w],
                               M_read=M_read)
                else:
                    mem.memory_read(M, v.q[w], v.gate[w], out_o=v.o[w], out_y=v.z_read[w])
            last = i == nl - 1
            x_next, r_next = (XP[w], RP[w]) if last else (V[i + 1].x[s], V[i + 1].r[s])
            c = ew.residual_rms(ew.mm(v.z[w], L.W2o, Y2[w]), v.pg[w], c, Ps[t] if last else None, x_next, r_next)
        ew.mm(XP[w], fg_Wp, FG[w], fg_b)
        x_next, r_next = (V[0].x[1 - w], V[0].r[1 - w]) if t < T - 1 else (None, None)
        # The gates go to Y2's row, which residual_rms has read: over FG itself, the Triton
        # kernel's column blocks could read one another's gates where they need the row's norm.
        g_prev, g = g, ew.ground(FG[w], c, us[t], Y2[w], x_next, r_next)
    if save and spec.chunked:
        S.M_end = M
    return P, g, g_prev, M, (S if save else None)


# ---- backward --------------------------------------------------------------------------------


def _workspace(spec: Spec, layers, L, B, like):
    """Per layer, the chunk's widest buffers (projections, second GEMM inputs, their gradients,
    the SwiGLU factors), made once for the sweep and reused by every chunk: fresh ones per chunk
    leave the heap fragmented, and the process's resident memory creeping up chunk by chunk."""
    new = lambda *shape, dtype=like.dtype: like.new_empty((L, B) + shape, dtype=dtype)  # noqa: E731
    io = _io_dtype(spec, like.dtype)  # the sweep's GEMM outputs and inputs (the weight gradients' too)
    # Z is read by one GEMM only (W2o's weight gradient): written rounded, it is not cast there.
    # Y is the recomputed projection as its GEMM writes it: `gate_factors` and the memory kernels
    # widen it on load, torch's ops take widened copies of the blocks they read.
    return [Workspace(Y=new(W.W.shape[1], dtype=io), dY=new(W.W.shape[1], dtype=io), Z=new(W.W2o.shape[0], dtype=io),
                      dZ=new(W.W2o.shape[0], dtype=io), ffn_fac=new(2, spec.F)) for W in layers]


def _chunk_buffers(spec: Spec, S, span: Span, layers, A, rows: ChunkRows, work):
    """Per-step views of one chunk's gradient buffers and of its derivative factors.

    The factors are the parts of the elementwise derivatives that do not depend on the incoming
    gradient, computed for the chunk's steps at once: the sweep is left with products, dots and
    GEMMs. Buffers live for one chunk, so the backward's working memory is a chunk's, not T's.
    GPN+M: the keys and queries are normalised again from the recomputed projections (k_first:
    the key of the chunk's first step, which the step before projected); the reads and the
    write's errors are left to the rebuild of M (`_rebuild`; the chunk form kept them). rows: the
    chunk's layer-0 inputs, normalised predictions and fuse gates (`ChunkRows`). work: the
    per-layer buffers of `_workspace`, of which the chunk uses its first L rows.
    """
    X0, R0, XP, RP, fg, k_first = rows
    sl, cols = span.rows, [columns(spec, i == 0) for i in range(len(layers))]
    L, B, d = XP.shape
    H, dk, Fd, sd, ew = spec.H, spec.dk, spec.F, XP.dtype, spec.backend.step
    empty = lambda *shape: XP.new_empty(shape)  # noqa: E731
    io = _io_dtype(spec, sd)
    C = []
    for i, (W, col, ws) in enumerate(zip(layers, cols, work)):
        x_hat, r = (X0, R0) if i == 0 else (S.X[i][sl], S.R[i][sl])
        Y, Z, dY, dZ, ffn_fac = (x[:L] for x in (ws.Y, ws.Z, ws.dY, ws.dZ, ws.ffn_fac))  # every row is written
        rows = Y.view(L * B, -1)
        _mm(x_hat.reshape(L * B, d), W.W, rows, W.b)  # as the forward's, one GEMM, in the GEMMs' dtype (io)
        # (dL/dh1, dL/dh2) = dL/d(silu(h1) h2) * ffn_fac, dL/d(pg pre-activation) = dL/dc * pg_fac
        pg, pg_fac = empty(L, B, d), empty(L, B, d)
        ffn = rows[:, col["ffn"]]
        ew.gate_factors(ffn[:, :Fd], ffn[:, Fd:], rows[:, col["pg"]], x_hat.reshape(L * B, d), r.reshape(L * B, 1),
                        ffn_fac.view(L * B, 2, Fd), Z.view(L * B, -1)[:, :Fd], pg.view(L * B, d), pg_fac.view(L * B, d))
        dU = XP.new_empty((L, B, d), dtype=io)  # the second GEMM's input (rounded), as the weight gradient's
        c = dict(X_full=x_hat, x=_steps(x_hat), r=_steps(r), Y=Y, Z_full=Z, dY_full=dY, dZ_full=dZ, dU_full=dU, dU=_steps(dU),
                 pg_gate=_steps(pg), pg_fac=_steps(pg_fac),
                 ffn_fac=_steps(ffn_fac), dY=_steps(dY), dZ=_steps(dZ), dffn=_steps(dY[..., col["ffn"]], 2, Fd),
                 dpg=_steps(dY[..., col["pg"]]), dz_ffn=_steps(dZ[..., None, :Fd]), dz_read=_steps(dZ[..., Fd:]))
        if spec.memory:
            nh = S.NQ[i].shape[2]
            # The heads and the read's gate feed torch's elementwise ops: widened to the state's dtype.
            nq, norms = l2n_relu(Y[..., col["heads"]].to(sd).view(L, B, nh, H, dk))
            gate = Y[..., col["gate"]].to(sd)
            O = S.O[i][sl] if spec.chunked else empty(L, B, H * spec.dv)  # the chunk form kept its reads
            c.update(nq=_steps(nq), q_full=nq[:, :, -1], q=_steps(nq[:, :, -1]), nq_mask=_steps((nq > 0) / norms), gate_full=gate,
                     gate=_steps(gate), O_full=O, o=_steps(O), z_read=_steps(Z[..., Fd:]),
                     dgate=_steps(dY[..., col["gate"]]), dheads=_steps(dY[..., col["heads"]], nh, H, dk))
            if i == 0:
                c.update(keys=[k_first] + list(_steps(nq[:-1, :, 0])), v=_steps(Y[..., col["v"]], H, spec.dv))
        C.append(ChunkLayer(**c))
    dYfg = XP.new_empty((L, B, d), dtype=io)
    G = dict(dYfg_full=dYfg, dYfg=_steps(dYfg), fg=_steps(fg), fg_fac=_steps((XP * RP).mul_(fg).mul_(1 - fg)),
             XP=XP, xp=_steps(XP), rp=_steps(RP))
    if spec.memory:
        col0, dY0 = cols[0], C[0].dY_full
        # dL/d(beta, a pre-activations) = (dL/dbeta, dL/ddecay) * gate_fac
        # (the chunk form's backward gives dL/dgamma = dL/ddecay * decay: its factor has no decay)
        da_fac = A * torch.sigmoid(C[0].Y[..., col0["a"]].to(sd))
        if not spec.chunked:
            da_fac = da_fac * S.DECAY[sl]
        dBD = empty(L, 2, B, H)  # (dL/dbeta, dL/ddecay)
        dKQ = empty(L, 2, B, H, dk)  # dL/d(normalised [next key | query]) of layer 0
        E = S.E[sl] if spec.chunked else empty(L, B, H, spec.dv)  # the write's errors: kept, or from the rebuild
        G.update(E_full=E, e=_steps(E), gate_fac=_steps(torch.stack([S.BETA[sl] * (1 - S.BETA[sl]), da_fac], 2)),
                 dBD_full=dBD, dBD=_steps(dBD.transpose(1, 2)),
                 dbeta=_steps(dBD[:, 0]), ddecay=_steps(dBD[:, 1]), dgates=_steps(dY0[..., col0["beta"].start : col0["a"].stop], 2, H),
                 dv=_steps(dY0[..., col0["v"]], H, spec.dv), dkn=_steps(dY0[..., col0["k"]]), dKQ_full=dKQ,
                 dKQ=_steps(dKQ.transpose(1, 2)), dk_out=_steps(dKQ[:, 0]), dq_out=_steps(dKQ[:, 1]))
    return C, ChunkShared(**G)


def _grounded_rows(S, lo: int, hi: int, fg_W, fg_b):
    """The forward's per-step vectors around the grounded state, formed again from the
    predictions P and the inputs u, time-major: for steps lo..hi-1 the normalised predictions,
    their rms and the fuse gates fg = sigmoid(xp W_fg + b) (one GEMM); layer 0's normalised
    input and its rms, from g_t = u_{t-1} + fg_{t-1} P_{t-1}, for steps lo+1..hi-1 (0..hi-1
    when lo is 0: step 0's is the incoming state's). Returns (XP, RP, fg, X0, R0), whole: the
    caller cuts the chunk's `ChunkRows` from them."""
    XP, RP = rms_hat(S.P[lo:hi])
    L, B, d = XP.shape
    fg = torch.sigmoid(_mm(XP.reshape(L * B, d), fg_W, bias=fg_b)).view(L, B, d)
    g = torch.addcmul(S.u[lo : hi - 1].to(XP.dtype), fg[:-1], S.P[lo : hi - 1])
    if lo == 0:
        g = torch.cat([S.g0[None], g])
    X0, R0 = rms_hat(g)
    return XP, RP, fg, X0, R0


class ChunkRows(NamedTuple):
    """The forward's per-step vectors around the grounded state, formed again for one chunk's steps
    (`_grounded_rows`), (L, B, ...) each: layer 0's normalised input and its rms, the normalised
    predictions and their rms, the fuse gates; and GPN+M's key of the chunk's first step, which
    the step before projected (None without memory)."""

    X0: torch.Tensor
    R0: torch.Tensor
    XP: torch.Tensor
    RP: torch.Tensor
    fg: torch.Tensor
    k_first: torch.Tensor | None


class WeightGrads(NamedTuple):
    """The weights' gradients as the chunks accumulate them, in the state's dtype: per layer
    [dW, db, dW2o], the fuse gate's, and A_log's (None without memory)."""

    layers: list
    fg_W: torch.Tensor
    fg_b: torch.Tensor
    A_log: torch.Tensor | None


class Sweep(NamedTuple):
    """What the reverse sweep reads at every chunk: the step functions, the transposed weights of
    its GEMMs (packed as they are read fastest), du's and dP's per-step views, the write's gates,
    the two dL/dM buffers written in turn, the key projection's transpose and dL/dg_prev."""

    ew: object  # StepOps
    mem: object  # MemoryOps, or None without memory
    WT: list
    W2oT: list
    fg_WT: object
    dus: tuple
    dPs: tuple | None
    BETA: tuple | None
    DECAY: tuple | None
    dMring: tuple | None
    W_kT: torch.Tensor | None
    dg_prev: torch.Tensor | None
    dX: torch.Tensor  # (B, d): the input-gradient GEMMs' output, read by the next group


class Carry(NamedTuple):
    """What the sweep carries from step to step, backwards: dL/dg, dL/dM, and whether the next
    key's gradient flows into the state (not across a truncated-BPTT cut)."""

    dg: torch.Tensor
    dM: torch.Tensor | None
    kn_flows: bool


def _rebuild(spec: Spec, S, span: Span, C: list[ChunkLayer], G: ChunkShared, Mbuf, sw: Sweep) -> list:
    """M after each step of the chunk, rebuilt from its saved start into Mbuf by replaying the
    write (with layer 0's reads and the write's errors), then the later layers' reads, the read
    factors and the deltas. Returns Ms: Ms[j] is M before step c0 + j."""
    ci, c0, c1 = span
    mem, BETA, DECAY = sw.mem, sw.BETA, sw.DECAY
    Ms, c = [S.M[ci]] + list(_steps(Mbuf[: c1 - c0])), C[0]
    for j, t in enumerate(range(c0, c1)):
        mem.memory_step(Ms[j], c.keys[j], c.v[j], BETA[t], DECAY[t], c.q[j], c.gate[j], out_e=G.e[j],
                        out_o=c.o[j], out_y=c.z_read[j], out_M=Ms[j + 1])
    L, B = c1 - c0, S.P.shape[1]
    for c in C[1:]:  # the later layers' reads: one batched product each over the rebuilt M's
        torch.matmul(torch.stack(c.q).unsqueeze(-2), Mbuf[:L], out=c.O_full.view(L, B, spec.H, 1, spec.dv))
    _read_outputs(spec, C[1:], C)
    G.delta = _steps(S.BETA[c0:c1].unsqueeze(-1) * G.E_full)
    return Ms


def _read_outputs(spec: Spec, outputs: list, C: list) -> None:
    """The chunk's read outputs y = silu(gate) o / rms(o) into the second GEMM's input rows of the
    layers `outputs` (whose reads were not made by a memory function that writes them), then the
    read factors of every layer (`ChunkLayer.rf`)."""
    for c in outputs:
        torch.mul(F.silu(c.gate_full), c.O_full / rms(c.O_full), out=c.Z_full[..., spec.F :])
    for c in C:
        c.rf = [ReadFactors(*f) for f in zip(*map(_steps, read_factors(c.O_full, c.gate_full)))]


class ChunkSweep(NamedTuple):
    """The chunk form's state for one chunk of the reverse sweep (kernels/memory_chunk): its ops,
    M_c (in the compute dtype with `low_reads`), the chunk's keys (L, B, H, dk) and queries
    (layers, L, B, H, dk), its forward values and C x C algebra (`algebra.Rebuilt`), dL/dM's
    products at the chunk's end (`Coefficients`), the read gradients (layers, >= L, B, H, dv) the
    sweep fills, and phi (B, H)."""

    ops: object
    M_c: torch.Tensor
    keys: torch.Tensor
    queries: torch.Tensor
    r: algebra.Rebuilt
    co: algebra.Coefficients
    read_grads: torch.Tensor
    phi: torch.Tensor


def _chunk_algebra(spec: Spec, S, span: Span, C: list[ChunkLayer], G: ChunkShared, dM_end, read_grads, phi) -> ChunkSweep:
    """The chunk form's once-per-chunk work before the sweep: the C x C algebra of the chunk's
    keys (its deltas, errors and reads are the forward's), the read outputs and factors, and
    dM_end's products the sweep reads."""
    ci, sl = span.index, span.rows
    keys = torch.stack(C[0].keys)
    queries = torch.stack([c.q_full for c in C])
    beta = S.BETA[sl]
    r = algebra.from_forward(keys, beta, S.DECAY[sl], S.DELTA[sl], G.E_full, [c.O_full for c in C])
    G.delta = _steps(r.delta)
    _read_outputs(spec, C, C)
    co = algebra.coefficients(*spec.backend.chunk.dm_products(dM_end, keys, r.delta), keys, r, beta, queries)
    M_c = S.M[ci].to(spec.compute_dtype) if spec.low_reads else S.M[ci]  # what the step's products read
    return ChunkSweep(spec.backend.chunk, M_c, keys, queries, r, co, read_grads, phi)


def _sweep(spec: Spec, sw: Sweep, C: list[ChunkLayer], G: ChunkShared, Ms, span: Span, carry: Carry, dk_next) -> Carry:
    """Steps c1-1 .. c0, backwards: through the fuse gate, the layers and the memory, writing the
    chunk's GEMM-output gradients (dY, dZ, dU rows), du, and dL/d(first key) into dk_next."""
    ew, mem, WT, W2oT, fg_WT, dus, dPs, BETA, DECAY, dMring, W_kT, dg_prev, dX = sw
    dg, dM, kn_flows = carry
    _, c0, c1 = span
    T = len(dus)
    nl = len(C)
    # dL/d(a layer's output) goes on in the state's dtype (the carry); its copy in the GEMMs'
    # dtype, the layer's dU row, is the second GEMM's input and the weight gradient's.
    narrow = C[0].dU_full.dtype != dg.dtype
    folded = False  # whether the step after wrote this step's fuse-gate GEMM input (dg times the gate's factor)
    for t in reversed(range(c0, c1)):
        j = t - c0
        cut = spec.bptt and t > 0 and t % spec.bptt == 0  # where the naive core detaches the state
        if t == T - 1:  # later steps' dL/dg (= dL/du_t) is their last group's output, written into du
            dus[t].copy_(dg)
        if not folded:  # the chunk's last step, or after a truncated-BPTT cut
            torch.mul(dg, G.fg_fac[j], out=G.dYfg[j])
        dxp = ew.mm(G.dYfg[j], fg_WT, dX)
        dc = ew.residual_rms_backward(G.xp[j], G.rp[j], dxp, dg, G.fg[j], None if dPs is None else dPs[t],
                                      **_dc_out(C[-1].dU[j], narrow))
        for i in reversed(range(nl)):
            c = C[i]
            ew.mm(c.dU[j], W2oT[i], c.dZ[j])  # into the dZ rows of the chunk
            ew.gate_grads(c.dz_ffn[j], c.ffn_fac[j], c.dffn[j], dc, c.pg_fac[j], c.dpg[j])
            if spec.chunked:  # Ms is the chunk's ChunkSweep; dL/dM is not carried step by step
                if i == 0:
                    Ms.ops.step_backward(
                        Ms.M_c, Ms.keys, Ms.r.delta, Ms.r, Ms.co, j, BETA[t], G.e[j], c.v[j], Ms.queries, c.o[j], c.rf[j],
                        c.dz_read[j], Ms.read_grads, Ms.phi, out_dk=G.dk_out[j - 1] if j > 0 else dk_next,
                        out_dq=G.dq_out[j], out_dbeta=G.dbeta[j], out_dgamma=G.ddecay[j], out_dgate=c.dgate[j],
                        out_dv=G.dv[j], gate_fac=G.gate_fac[j], out_dgates=G.dgates[j])
                    dq = G.dKQ[j]
                else:
                    dq, _ = Ms.ops.read_backward(Ms.M_c, Ms.keys, Ms.r.delta, Ms.r, j, c.o[j], c.rf[j], c.dz_read[j],
                                                 Ms.read_grads[i], Ms.phi, out_dgate=c.dgate[j])
                    dq = dq.unsqueeze(1)
                ew.l2n_relu_backward(c.nq[j], c.nq_mask[j], dq, out=c.dheads[j])
            elif spec.memory:
                if i == 0:
                    # dv and the gates' pre-activation gradients go straight into the projection's
                    # gradient row, which the GEMM below reads.
                    dM, *_ = mem.memory_step_backward(
                        Ms[j], Ms[j + 1], c.keys[j], BETA[t], DECAY[t], G.e[j], G.delta[j], c.q[j], c.rf[j], dM,
                        c.dz_read[j], out_dk=G.dk_out[j - 1] if j > 0 else dk_next, out_dq=G.dq_out[j],
                        out_dbeta=G.dbeta[j], out_ddecay=G.ddecay[j], out_dgate=c.dgate[j],
                        out_dM=dMring[1] if dM is dMring[0] else dMring[0], out_dv=G.dv[j], gate_fac=G.gate_fac[j],
                        out_dgates=G.dgates[j])
                    dq = G.dKQ[j]
                else:
                    dq, _, dM = mem.memory_read_backward(Ms[j + 1], c.q[j], c.rf[j], c.dz_read[j], dM,
                                                         out_dgate=c.dgate[j],
                                                         out_dM=dMring[1] if dM is dMring[0] else dMring[0])
                    dq = dq.unsqueeze(1)
                ew.l2n_relu_backward(c.nq[j], c.nq_mask[j], dq, out=c.dheads[j])
            dx = ew.mm(c.dY[j], WT[i], dX)
            if i == 0 and spec.memory and not kn_flows:  # the next key's gradient reaches the weights only
                dx = dx.to(dg.dtype) - ew.mm(G.dkn[j], W_kT)
            if i > 0:
                out = _dc_out(C[i - 1].dU[j], narrow)
            else:
                # dL/dg_t (layer 0's) is dL/du_{t-1}: written into du's row, the next step reads it
                # there; dL/dg_prev, the last step's input, adds in; and the next step's fuse-gate
                # GEMM input, dL/dg_t times the gate's factor, is written here too (within the chunk).
                folded = j > 0 and not cut
                out = dict(out=dus[t - 1] if t > 0 else None, extra=dg_prev if t == T - 1 else None,
                           out_low=G.dYfg[j - 1] if folded else None, low_fac=G.fg_fac[j - 1] if folded else None)
            dc = ew.residual_rms_backward(c.x[j], c.r[j], dx, dc, c.pg_gate[j], **out)
        dg = dc
        if cut:
            dg.zero_()
            if spec.memory:
                if not spec.chunked:  # the chunk form cuts dL/dM where its chunk starts (run_backward)
                    dM = torch.zeros_like(dM)
                kn_flows = False
        elif spec.memory:
            kn_flows = True
    return Carry(dg, dM, kn_flows)


def _dc_out(dU, narrow: bool) -> dict:
    """Where residual_rms_backward writes dL/dc: the dU row itself, or (narrow) a new carry in the
    state's dtype and the dU row rounded."""
    return dict(out=None, out_low=dU) if narrow else dict(out=dU)


def _weight_grad_workspace(spec: Spec, layers, fg_W, sd: torch.dtype) -> torch.Tensor | None:
    """Where a weight gradient's GEMM writes its (in x out) product when it runs in a compute
    dtype narrower than the float32 gradients (BLAS cannot write another dtype than it reads):
    one buffer of the largest weight, made once for the backward and reused by every GEMM of
    every chunk, so a chunk allocates nothing weight-sized. None when the dtypes agree."""
    cd = spec.compute_dtype
    if cd == sd:
        return None
    return fg_W.new_empty(max(w.numel() for L in layers for w in (L.W, L.W2o, fg_W)), dtype=cd)


def _gemm(acc, X, G, cd, work):
    """acc += X^T G over all rows, the GEMM in the compute dtype cd. Without `work` (cd is acc's
    dtype) it accumulates in place; with it, the product goes into `work` and is added from there,
    widened on load: the same numbers as rounding a fresh product, without one."""
    X, G = X.reshape(-1, X.shape[-1]).to(cd), G.reshape(-1, G.shape[-1]).to(cd)
    if work is None:
        acc.addmm_(X.T, G)
    else:
        acc.add_(torch.mm(X.T, G, out=work[: acc.numel()].view(acc.shape)))


def _weight_grads(spec: Spec, S, span: Span, C: list[ChunkLayer], G: ChunkShared, grads: WeightGrads, work) -> None:
    """The chunk's weight gradients, accumulated in place: dW += X^T dY as GEMMs over its B*L rows."""
    cd, sl = spec.compute_dtype, span.rows
    for i, c in enumerate(C):
        dW, db, dW2o = grads.layers[i]
        _gemm(dW, c.X_full, c.dY_full, cd, work)
        db += c.dY_full.sum((0, 1), dtype=db.dtype)
        _gemm(dW2o, c.Z_full, c.dU_full, cd, work)
    _gemm(grads.fg_W, G.XP, G.dYfg_full, cd, work)
    grads.fg_b.add_(G.dYfg_full.sum((0, 1), dtype=grads.fg_b.dtype))
    if spec.memory:  # the chunk form's dBD holds dL/dgamma, the step form's dL/ddecay
        dgamma = G.dBD_full[:, 1] if spec.chunked else G.dBD_full[:, 1] * S.DECAY[sl]
        grads.A_log.add_((dgamma * S.GAMMA[sl]).sum((0, 1)))


def run_backward(spec: Spec, S, weights: Weights, out: OutputGrads):
    """The reverse sweep, chunk by chunk from the end: per chunk, its buffers and derivative
    factors (`_chunk_buffers`), M rebuilt (`_rebuild`), the steps backwards (`_sweep`), and its
    weight gradients as GEMMs over its rows (`_weight_grads`).

    out: the gradients w.r.t. the outputs (`OutputGrads`). Returns (du (T, B, d), dg0, dg_prev0,
    dM0, dA_log, [per layer (dW, db, dW2o)], dfg_W, dfg_b).
    """
    T, B, d = S.P.shape
    dP, dg, dg_prev, dM = out
    H, dk, nl, sd = spec.H, spec.dk, len(weights.layers), S.P.dtype
    layers, fg_W, fg_b, A_log = _cast(spec, weights)
    cols = [columns(spec, i == 0) for i in range(nl)]
    ew = spec.backend.step
    du = S.P.new_empty((T, B, d))
    dg = S.P.new_zeros((B, d)) if dg is None else dg
    grads = [[torch.zeros_like(L.W, dtype=sd), torch.zeros_like(L.b, dtype=sd), torch.zeros_like(L.W2o, dtype=sd)] for L in layers]
    dfg_W, dfg_b = torch.zeros_like(fg_W, dtype=sd), torch.zeros_like(fg_b, dtype=sd)
    lanes = spec.backend.lanes
    # With a side stream, chunk k's weight gradients run beside chunk k+1's sweep: the two use
    # workspaces in turn, so the next chunk's buffers never overwrite rows the GEMMs still read.
    n_chunks = len(bounds(spec, T))
    works = [_workspace(spec, layers, min(spec.chunk, T), B, S.P) for _ in range(2 if lanes.concurrent and n_chunks > 1
                                                                                  else 1)]
    gemm_work = _weight_grad_workspace(spec, layers, fg_W, sd)
    A = mem = BETA = DECAY = dMring = W_kT = dA_log = dk_next = None
    if spec.memory:
        mem = spec.backend.memory
        col0 = cols[0]
        A = -torch.exp(A_log.to(sd))
        BETA, DECAY = _steps(S.BETA), _steps(S.DECAY)
        no_dM = dM is None  # the window's last M sends no gradient back (a training window's)
        dM = S.P.new_zeros((B, H, dk, spec.dv)) if no_dM else dM
        dMring = _steps(dM.new_empty((2,) + dM.shape))  # dL/dM, written into these in turn
        # The step form's memory after each step of a chunk, rebuilt into one buffer that every chunk reuses.
        Mbuf = None if spec.chunked else dM.new_empty((min(spec.chunk, T),) + dM.shape)
        dk_next = S.P.new_zeros((B, H, dk))  # dL/d(normalised key) of the step after the chunk
        W_k, b_k = layers[0].W[:, col0["k"]], layers[0].b[col0["k"]]
        W_kT = W_k.T
        dA_log = torch.zeros_like(A)
        if spec.chunked:  # dL/d(each read) of a chunk's steps, and phi = <dL/dM, M> (kernels/memory_chunk)
            read_grads = dM.new_empty((nl, min(spec.chunk, T), B, H, spec.dv))
            phi = S.P.new_zeros((B, H)) if no_dM else torch.linalg.vecdot(dM.flatten(2), S.M_end.flatten(2))
    # The transposed weights of the sweep's GEMMs, in the layout they are read fastest.
    sw = Sweep(ew, mem, [ew.pack(L.W.T, T, B) for L in layers], [ew.pack(L.W2o.T, T, B) for L in layers],
               ew.pack(fg_W.T, T, B), _steps(du), (_steps(dP) if dP is not None else None), BETA, DECAY, dMring, W_kT,
               dg_prev, S.P.new_empty((B, d), dtype=_io_dtype(spec, sd)))
    carry = Carry(dg, dM, True)
    wgrads = WeightGrads(grads, dfg_W, dfg_b, dA_log)

    lanes.fork()
    try:
        pending = None  # the chunk before's buffers and the event after its weight gradients
        for k, (ci, (c0, c1)) in enumerate(reversed(list(enumerate(bounds(spec, T))))):
            # From two steps back: the gate of step c0 - 2 forms the input of step c0 - 1, whose
            # projection holds the key of step c0.
            span = Span(ci, c0, c1)
            sl, lo = span.rows, max(c0 - 2, 0)
            XP, RP, fg, X0, R0 = _grounded_rows(S, lo, c1, fg_W, fg_b)
            first = 0 if lo == 0 else lo + 1  # the step of X0[0]
            k_first = None
            if spec.memory:
                k_first = S.k0 if c0 == 0 else l2n_relu(ew.mm(X0[c0 - 1 - first], W_k, bias=b_k).view(B, H, dk))[0]
            rows = ChunkRows(X0[c0 - first :], R0[c0 - first :], XP[c0 - lo :], RP[c0 - lo :], fg[c0 - lo :], k_first)
            C, G = _chunk_buffers(spec, S, span, layers, A, rows, works[k % len(works)])
            Ms = None
            if spec.chunked:
                Ms = _chunk_algebra(spec, S, span, C, G, carry.dM, read_grads, phi)
            elif spec.memory:
                Ms = _rebuild(spec, S, span, C, G, Mbuf, sw)
            if spec.memory:
                G.dKQ_full[-1, 0] = dk_next
                dk_next = torch.empty_like(dk_next)
            carry = _sweep(spec, sw, C, G, Ms, span, carry, dk_next)
            if spec.chunked:  # dL/dM leaves the chunk once, at its start (none across a truncated-BPTT cut)
                terms = algebra.finish(Ms.keys, Ms.r, Ms.co, S.BETA[sl], Ms.queries, read_grads[:, : c1 - c0])
                dM = Ms.ops.carry_back(carry.dM, terms, out=dMring[ci % 2])  # never carry.dM's buffer
                if spec.bptt and c0 % spec.bptt == 0 and c0 > 0:
                    dM.zero_()
                    phi.zero_()
                carry = carry._replace(dM=dM)
            # The weight gradients read the chunk's rows and nothing the sweep goes on to write: on the
            # side stream, after the sweep. The main stream waits for the chunk before's before it
            # rewrites that chunk's workspace or frees its buffers (kept alive in `pending` until then).
            swept = lanes.record()
            with lanes.side():
                lanes.wait(swept)
                _weight_grads(spec, S, span, C, G, wgrads, gemm_work)
                done = lanes.record()
            if pending is not None:
                lanes.wait(pending[2])
            pending = (C, G, done)
            del C, G, Ms  # before the next chunk's buffers exist, not after
        lanes.wait(pending[2])
    finally:  # also when the sweep raises: the streams joined, the stand-in's checks ended
        lanes.join()  # the gradients, and gemm_work, are the main stream's again
    del pending

    dg, dM = carry.dg, carry.dM
    if not spec.memory:
        return du, dg, None, None, None, grads, dfg_W, dfg_b
    # The first key comes from the incoming previous state.
    dk0 = ew.l2n_relu_backward(S.k0, (S.k0 > 0) / S.k0n, dk_next).flatten(1)
    _gemm(grads[0][0][:, col0["k"]], S.x_prev, dk0, spec.compute_dtype, gemm_work)
    grads[0][1][col0["k"]] += dk0.sum(0)
    dg_prev0 = ew.rms_hat_backward(S.x_prev, S.r_prev, ew.mm(dk0, W_kT))
    return du, dg, dg_prev0, dM, dA_log, grads, dfg_W, dfg_b


class FusedCore(torch.autograd.Function):
    """(u, state, fused weights) -> (P, g, g_prev, M) with `run_forward` / `run_backward`.

    With `graphs` (kernels.graph.CoreGraphs) both loops run as captured graphs.
    """

    @staticmethod
    def forward(ctx, spec, graphs, *inputs):
        """inputs: u, g, g_prev, M, A_log, fg_W, fg_b, then each layer's W, b, W2o: flat, as autograd
        and the graphs take tensors."""
        u, A_log, fg_W, fg_b, flat = inputs[0], *inputs[4:7], inputs[7:]
        ctx.graph = None
        if graphs is None:
            P, g, g_prev, M, S = _forward_flat(spec, *inputs)
        else:
            key = (spec, signature(*inputs))
            P, g, g_prev, M, S = graphs.forward(key, (spec,), inputs)
            if graphs.forward.replays.get(key):  # S is the graph's: the backward may replay too
                ctx.graph = (graphs, key, graphs.forward.replays[key])
            # The state outlives the graph's next replay, so it is copied; P is consumed before
            # it. detach: autograd gives the returned tensor a history, not the graph's own.
            P, g, M = P.detach(), g.clone(), None if M is None else M.clone()
        ctx.spec, ctx.S, ctx.u_dtype = spec, S, u.dtype
        ctx.save_for_backward(A_log, fg_W, fg_b, *flat)
        ctx.set_materialize_grads(False)
        return P, g, g_prev.clone(), M

    @staticmethod
    def backward(ctx, dP, dg, dg_prev, dM):
        A_log, fg_W, fg_b, *flat = ctx.saved_tensors
        inputs = (A_log, fg_W, fg_b, dP, dg, dg_prev, dM, *flat)
        with torch.autocast(fg_W.device.type, enabled=False):  # the compute dtype is the spec's
            if ctx.graph is None:
                out = _backward_flat(ctx.spec, ctx.S, *inputs)
            else:
                graphs, key, replay = ctx.graph
                if graphs.forward.replays[key] != replay:
                    raise RuntimeError("fused core: the forward's CUDA graph ran again before this backward, so its saved "
                                       "buffers are gone; run one backward per forward, or set cuda_graphs: false")
                out = graphs.backward((key, signature(*inputs)), (ctx.spec, ctx.S), inputs)
        du, *rest = out
        if ctx.graph is not None:
            # Out of the graph's memory, which its next replay rewrites: autograd keeps gradients
            # (a parameter's .grad is the returned tensor itself when it had none).
            rest = _copied(rest)
        dg0, dg_prev0, dM0, dA_log, grads, dfg_W, dfg_b = rest
        du = du.to(ctx.u_dtype, copy=ctx.graph is not None)
        return (None, None, du, dg0, dg_prev0, dM0, dA_log, dfg_W, dfg_b, *(x for l in grads for x in l))


def _copied(x):
    """x's tensors copied, in the same nest of lists."""
    if isinstance(x, (list, tuple)):
        return [_copied(y) for y in x]
    return None if x is None else x.clone()


def _layers(flat):
    return [LayerWeights(*flat[j : j + 3]) for j in range(0, len(flat), 3)]


def _forward_flat(spec, *inputs):
    """`run_forward` on `FusedCore.forward`'s flat inputs."""
    u, g, g_prev, M, A_log, fg_W, fg_b, *flat = inputs
    return run_forward(spec, u, (g, g_prev, M), Weights(_layers(flat), fg_W, fg_b, A_log), save=True)


def _backward_flat(spec, S, *inputs):
    """`run_backward` on flat inputs: A_log, fg_W, fg_b, the output gradients, each layer's weights."""
    A_log, fg_W, fg_b, dP, dg, dg_prev, dM, *flat = inputs
    return run_backward(spec, S, Weights(_layers(flat), fg_W, fg_b, A_log), OutputGrads(dP, dg, dg_prev, dM))


def fused_recurrence(model, u: torch.Tensor, state, graphs: bool = True):
    """The fused core for a `GPN`: u (B, T, d) input projections, state a `GPNState`; `graphs`:
    False runs the loops eagerly whatever the backend says (callers that run several forwards
    before their backwards, which a graph's next replay would overwrite).

    Returns (predictions (B, T, d), (g, g_prev, M)).
    """
    cfg = model.config
    g, g_prev, M = state
    device = u.device.type
    cd = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else g.dtype
    backend = model.backend(device)
    chunked = cfg.memory and cfg.memory_form_on(device) == "chunk"
    spec = Spec(cfg.d_state, cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.d_val, cfg.memory, cfg.core_chunk, cfg.bptt, cd, backend,
                chunked, chunked and cfg.memory_reads == "compute" and cd != g.dtype)
    graphs = None if backend.graphs is None or not graphs else core_graphs(model, _forward_flat, _backward_flat,
                                                                            backend.graphs)
    A_log = model.write_A_log if cfg.memory else None
    u = u.transpose(0, 1)
    with torch.autocast(device, enabled=False):
        layers, fg_W, fg_b = fuse_weights(model)
        if torch.is_grad_enabled():
            flat = [x for L in layers for x in L]
            P, g, g_prev, M = FusedCore.apply(spec, graphs, u, g, g_prev, M, A_log, fg_W, fg_b, *flat)
        else:
            P, g, g_prev, M, _ = run_forward(spec, u, (g, g_prev, M), Weights(layers, fg_W, fg_b, A_log), save=False)
    return P.transpose(0, 1), (g, g_prev, M)
