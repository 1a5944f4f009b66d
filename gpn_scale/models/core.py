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
  projections with one GEMM over the chunk's rows (unless `core_projections: keep` saves every
  step's), keys and queries from them, the fuse gates' inputs from P, the write's errors and the
  reads while M is rebuilt.
- Reverse sweep for the input-gradient chain only, chunk by chunk from the end. Step by step,
  back through the fuse gate, the layers and the memory, carrying dL/dg, and dL/dM the way the
  memory's form does (memory_step.py: M rebuilt inside each chunk from its saved start, dL/dM
  carried step by step; memory_chunk.py: the chunk's algebra, dL/dM carried once per chunk).
  The named structures the core passes around are in core_structures.py. The gradients w.r.t. each GEMM's output are
  kept for the chunk (dY rows), and the weight gradients are GEMMs over the chunk's B*chunk rows
  (dW += X^T dY), so the backward's working memory is a chunk's, not the window's.

Under autocast the GEMMs run in the autocast dtype; the state, M and all elementwise math stay
float32 (float64 inputs stay float64, for gradient checks). With kernels that read and write
the compute dtype (`StepOps.narrow_io`), the per-step buffers a step GEMM reads or writes are
kept in it (`io_dtype`): the GEMMs cast nothing inside the loop, and the values are those a
cast would give (a bf16 GEMM's output widened is exact; its input is the float32 value rounded). Truncated BPTT (`bptt`) cuts the
sweep at the same places where the naive core detaches the state. The incoming state receives
gradients, as in the naive core.
"""

from __future__ import annotations

import torch

from gpn_scale.models import memory_chunk, memory_step
from gpn_scale.models.core_structures import (Carry, ChunkLayer, ChunkRows, ChunkShared, CoreGrads, CoreSpec, LayerSteps,
                                              LayerWeights, OutputGrads, Saved, Span, StepLayers, Sweep, WeightGrads, Weights,
                                              Workspace, bounds, cast, columns, io_dtype)
from gpn_scale.models.core_structures import step_views as _steps  # short: the loop's lines are full of them
from kernels.graph import core_graphs, signature
from kernels.step.reference import l2n_relu
from kernels.step.reference import mm as _mm  # the chunk's GEMMs, of many rows: BLAS


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


def memory_form(spec: CoreSpec):
    """The module of the memory's form the core runs (memory_step, memory_chunk): its `Forward` and
    `Backward` do what the two forms do differently."""
    return memory_chunk if spec.chunked else memory_step


# ---- forward ---------------------------------------------------------------------------------


def window_buffers(spec: CoreSpec, n_layers: int, T: int, B: int, like, gate_rows: int) -> Saved:
    """The per-step vectors the backward needs, time-major: (T, B, ...) each; the write's gates
    (gate_rows, B, H). A decoder's step uses them as a one-step window's (T = 1)."""
    d, H, dk, dv = spec.d_state, spec.n_heads, spec.d_key, spec.d_val
    widths = [columns(spec, i == 0)["pg"].stop for i in range(n_layers)]  # the projections' (pg is the last block)
    gemm2_width = spec.d_ffn + (H * dv if spec.memory else 0)
    new = lambda *shape: like.new_empty((T, B) + shape)  # noqa: E731
    ring = lambda *shape: like.new_empty((2, B) + shape)  # noqa: E731
    io = io_dtype(spec, like.dtype)
    gemm_ring = lambda *shape: like.new_empty((2, B) + shape, dtype=io)  # noqa: E731  (only GEMMs read or write it)
    gemm_kept = lambda *shape: like.new_empty((T, B) + shape, dtype=io)  # noqa: E731
    S = Saved(
        # Normalised layer inputs and their rms. Layer 0's is the grounded state's, which the
        # backward forms again from u, the predictions and the fuse gates: it lives in the work
        # ring, read by the projection GEMM only. Later layers' are saved in the state's dtype.
        x_hat=[gemm_ring(d)] + [new(d) for _ in widths[1:]],
        rms=[ring(1)] + [new(1) for _ in widths[1:]],
        # Everything else is recomputed per chunk in the backward: the projections with one GEMM
        # (unless kept: core_projections), keys and queries from them, the fuse gates' inputs from
        # the predictions, the write's errors and the reads while M is rebuilt. The loop keeps only
        # the current step's.
        proj=[(gemm_kept if spec.keep_projections else gemm_ring)(n) for n in widths],
        gemm2_in=[gemm_ring(gemm2_width) for _ in widths],
        pred_hat=gemm_ring(d),  # the fuse-gate GEMM's input
        pred_rms=ring(1),
        fuse_gate=gemm_ring(d),
    )
    if spec.memory:
        # Normalised [next key | query] of layer 0, [query] of later layers, and their norms.
        heads = [2] + [1] * (n_layers - 1)
        S.heads_hat = [ring(h, H, dk) for h in heads]
        S.head_norms = [ring(h, H, 1) for h in heads]
        # The chunk form keeps each step's raw reads, error and delta (its backward takes them as
        # they were, instead of forming them again from M_c); the step form only the current step's.
        keeps = memory_form(spec).KEEPS_READS
        kept = new if keeps else ring
        S.reads = [kept(H * dv) for _ in widths]
        S.write_err = kept(H, dv)
        S.delta = new(H, dv) if keeps else None
        S.beta, S.gamma, S.decay = (like.new_empty((gate_rows, B, H)) for _ in range(3))
        S.M = []  # M before every chunk (the chunk form with memory_reads: compute keeps its reads' copy)
    return S


def layer_steps(spec: CoreSpec, S: Saved, i: int, col) -> LayerSteps:
    """Per-step views of layer i's buffers and of the blocks of its projection (in the work ring)."""
    proj, z, Fd, H, dk = S.proj[i], S.gemm2_in[i], spec.d_ffn, spec.n_heads, spec.d_key
    ffn = proj[..., col["ffn"]]
    v = LayerSteps(x_hat=_steps(S.x_hat[i]), rms=_steps(S.rms[i]), proj=_steps(proj), gemm2_in=_steps(z),
                   pg=_steps(proj[..., col["pg"]]), h1=_steps(ffn[..., :Fd]), h2=_steps(ffn[..., Fd:]), swiglu=_steps(z[..., :Fd]),
                   read_out=_steps(z[..., Fd:]))
    if not spec.memory:
        return v
    heads_hat = S.heads_hat[i]
    v = v._replace(heads=_steps(proj[..., col["heads"]], heads_hat.shape[2], H, dk), gate=_steps(proj[..., col["gate"]]),
                   heads_hat=_steps(heads_hat), head_norms=_steps(S.head_norms[i]), q=_steps(heads_hat[:, :, -1]),
                   reads=_steps(S.reads[i]))
    if "k" not in col:
        return v
    return v._replace(next_key=_steps(heads_hat[:, :, 0]), v=_steps(proj[..., col["v"]], H, spec.d_val),
                      beta_pre=_steps(proj[..., col["beta_pre"]]), a=_steps(proj[..., col["a"]]), beta=_steps(S.beta),
                      gamma=_steps(S.gamma), decay=_steps(S.decay))


def predict_step(layers: StepLayers, c, memory, slots: tuple, last: tuple):
    """One step's predict layers from the grounded state c, whose normalised form is in layer 0's
    x_hat row, as the forward's loop and a decoder's step both run them: per layer the fused
    projection, its elementwise group (with memory: layer 0's [next key | query] and the write's
    gates, then the write and layer 0's read; a later layer's query, then its read), the second
    GEMM, and the residual with the next layer's norm. Returns the prediction.

    memory: M's reads and writes for the caller (None without memory): `write(v, w, s, y)` (the
    write from the key it carries, and layer 0's read; v: the layer's `LayerSteps`) and
    `read(v, w, s, y)`. slots: (w, s, y, gs), the rows of the work ring, of the saved buffers, of
    the projection and of the write's gates. last: (out, x_hat, rms), where the last layer writes the
    prediction, and its normalised form and rms (the fuse gate's input).
    """
    ops, views, gemm2_out, A = layers.ops, layers.views, layers.gemm2_out, layers.A
    w, s, y, gs = slots
    n = len(views) - 1
    for i, (L, v) in enumerate(zip(layers.weights, views)):
        ops.mm(v.x_hat[w if i == 0 else s], L.W, v.proj[y], L.b)
        if memory is None:
            ops.post_projection(v.h1[y], v.h2[y], v.swiglu[w])
        elif i == 0:
            ops.post_projection(v.h1[y], v.h2[y], v.swiglu[w], v.heads[y], v.heads_hat[w], v.head_norms[w], v.beta_pre[y],
                                v.a[y], A, v.beta[gs], v.gamma[gs], v.decay[gs])
            memory.write(v, w, s, y)
        else:
            ops.post_projection(v.h1[y], v.h2[y], v.swiglu[w], v.heads[y], v.heads_hat[w], v.head_norms[w])
            memory.read(v, w, s, y)
        out, x_next, r_next = last if i == n else (None, views[i + 1].x_hat[s], views[i + 1].rms[s])
        c = ops.residual_rms(ops.mm(v.gemm2_in[w], L.W2o, gemm2_out[w]), v.pg[y], c, out, x_next, r_next)
    return c


def run_forward(spec: CoreSpec, u, state, weights: Weights, save: bool):
    """The loop over u (T, B, d), time-major, from state (g, g_prev, M). Returns (preds (T, B, d), g,
    g_prev, M, saved or None).

    Without `save` the per-step buffers are two-slot work rings like the rest (the write's gates
    a chunk's rows in the chunk form, whose steps read their chunk's decays).
    """
    T, B, d = u.shape
    g, g_prev, M = state
    H, dk, nl = spec.n_heads, spec.d_key, len(weights.layers)
    fused = cast(spec, weights)
    cols = [columns(spec, i == 0) for i in range(nl)]
    chunks = dict(bounds(spec, T))  # chunk start -> end
    S = window_buffers(spec, nl, T if save else 2, B, g, memory_form(spec).gate_rows(T, chunks, save))
    V = [layer_steps(spec, S, i, cols[i]) for i in range(nl)]
    pred_hat, pred_rms, fuse_gate = _steps(S.pred_hat), _steps(S.pred_rms), _steps(S.fuse_gate)
    preds = S.preds = g.new_empty((T, B, d))
    u = u.contiguous()  # time-major in memory (as fused_recurrence gives it): a chunk's rows are one block
    us = _steps(u.to(g.dtype))
    ew = spec.backend.step
    A = form = None
    if spec.memory:
        A = -torch.exp(fused.A_log.to(g.dtype))
        S.x_prev, S.r_prev = ew.rms_hat(g_prev)
        k_col = cols[0]["k"]
        kpre = ew.mm(S.x_prev, fused.layers[0].W[:, k_col], bias=fused.layers[0].b[k_col])
        S.k0, S.k0_norm = ew.l2n_relu(kpre.view(B, H, dk))
        # M's reads and writes, in the memory's form (memory_step.py, memory_chunk.py), from the first key
        form = memory_form(spec).Forward(spec, S, M.contiguous(), save, chunks, S.k0)
    S.u, S.g0 = u, g  # the backward forms layer 0's inputs again from them
    # The step's weights, in the layout its GEMM reads fastest (kernels/cpu/gemm.cpp packs them).
    packed = [L._replace(W=ew.pack(L.W, T, B), W2o=ew.pack(L.W2o, T, B)) for L in fused.layers]
    gemm2_out = _steps(g.new_empty((2, B, d), dtype=io_dtype(spec, g.dtype)))  # read by residual_rms
    step = StepLayers(ops=ew, weights=packed, views=V, gemm2_out=gemm2_out, A=A)
    fg_Wp, fg_b = ew.pack(fused.fg_W, T, B), fused.fg_b
    # Where the last layer writes: the prediction, its normalised form and rms (the fuse gate's input).
    lasts = [(p, pred_hat[t % 2], pred_rms[t % 2]) for t, p in enumerate(_steps(preds))]
    # Each layer's normalised input is written by the group before it: the previous layer's
    # residual_rms, or (layer 0) the previous step's ground; the first step's here.
    x0, r0 = V[0].x_hat, V[0].rms
    ew.rms_hat(g, x0[0], r0[0])
    for t in range(T):
        s, w = (t if save else t % 2), t % 2  # saved and work-ring slots
        y = s if spec.keep_projections else w  # the projection's slot
        gs = 0
        if form is not None:
            if t in chunks:
                form.begin_chunk(t, chunks[t])
            gs = form.begin_step(t, s)  # the row of the write's gates
        c = predict_step(step, g, form, (w, s, y, gs), lasts[t])
        ew.mm(pred_hat[w], fg_Wp, fuse_gate[w], fg_b)
        x_next, r_next = (x0[1 - w], r0[1 - w]) if t < T - 1 else (None, None)
        # The gates go to gemm2_out's row, which residual_rms has read: over fuse_gate itself, the
        # Triton kernel's column blocks could read one another's gates where they need the row's norm.
        g_prev, g = g, ew.ground(fuse_gate[w], c, us[t], gemm2_out[w], x_next, r_next)
    if form is not None:
        M = form.finish()
    return preds, g, g_prev, M, (S if save else None)


# ---- backward --------------------------------------------------------------------------------


def _workspace(spec: CoreSpec, layers, L, B, like):
    """Per layer, the chunk's widest buffers (projections, second GEMM inputs, their gradients,
    the SwiGLU factors), made once for the sweep and reused by every chunk: fresh ones per chunk
    leave the heap fragmented, and the process's resident memory creeping up chunk by chunk."""
    new = lambda *shape, dtype=like.dtype: like.new_empty((L, B) + shape, dtype=dtype)  # noqa: E731
    io = io_dtype(spec, like.dtype)  # the sweep's GEMM outputs and inputs (the weight gradients' too)
    # gemm2_in is read by one GEMM only (W2o's weight gradient): written rounded, it is not cast there.
    # proj is the recomputed projection as its GEMM writes it (none with core_projections: keep, the
    # forward's are read): `gate_factors` and the memory kernels widen it on load, torch's ops take
    # widened copies of the blocks they read.
    return [Workspace(proj=None if spec.keep_projections else new(W.W.shape[1], dtype=io), d_proj=new(W.W.shape[1], dtype=io),
                      gemm2_in=new(W.W2o.shape[0], dtype=io), d_gemm2_in=new(W.W2o.shape[0], dtype=io),
                      ffn_fac=new(2, spec.d_ffn))
            for W in layers]


def _chunk_layer(spec: CoreSpec, S: Saved, span: Span, i: int, W: LayerWeights, ws: Workspace, rows: ChunkRows) -> ChunkLayer:
    """Layer i's buffers for the chunk (`_chunk_buffers`), its projection recomputed into the
    workspace ws unless the forward kept it."""
    like, sl, col = rows.pred_hat, span.rows, columns(spec, i == 0)
    L, B, d = like.shape
    H, dk, Fd, sd, ew, form = spec.n_heads, spec.d_key, spec.d_ffn, like.dtype, spec.backend.step, memory_form(spec)
    x_hat, rms = (rows.x_hat, rows.rms) if i == 0 else (S.x_hat[i][sl], S.rms[i][sl])
    # the workspace's first L rows: every row is written
    gemm2_in, d_proj, d_gemm2_in, ffn_fac = (x[:L] for x in (ws.gemm2_in, ws.d_proj, ws.d_gemm2_in, ws.ffn_fac))
    if spec.keep_projections:  # the forward's own rows
        proj = S.proj[i][sl]
    else:  # as the forward's, one GEMM, in the GEMMs' dtype (io)
        proj = ws.proj[:L]
        _mm(x_hat.reshape(L * B, d), W.W, proj.view(L * B, -1), W.b)
    flat = proj.view(L * B, -1)
    # (dL/dh1, dL/dh2) = dL/d(silu(h1) h2) * ffn_fac, dL/d(pg pre-activation) = dL/dc * pg_fac
    pg, pg_fac = like.new_empty((L, B, d)), like.new_empty((L, B, d))
    ffn = flat[:, col["ffn"]]
    ew.gate_factors(ffn[:, :Fd], ffn[:, Fd:], flat[:, col["pg"]], x_hat.reshape(L * B, d), rms.reshape(L * B, 1),
                    ffn_fac.view(L * B, 2, Fd), gemm2_in.view(L * B, -1)[:, :Fd], pg.view(L * B, d), pg_fac.view(L * B, d))
    d_out = like.new_empty((L, B, d), dtype=io_dtype(spec, sd))  # the second GEMM's input (rounded), as the weight gradient's
    c = ChunkLayer(x_hat_full=x_hat, x_hat=_steps(x_hat), rms=_steps(rms), proj_full=proj, gemm2_in_full=gemm2_in,
                   d_proj_full=d_proj, d_gemm2_in_full=d_gemm2_in, d_out_full=d_out, d_out=_steps(d_out), pg_gate=_steps(pg),
                   pg_fac=_steps(pg_fac), ffn_fac=_steps(ffn_fac), d_proj=_steps(d_proj), d_gemm2_in=_steps(d_gemm2_in),
                   d_ffn=_steps(d_proj[..., col["ffn"]], 2, Fd), d_pg=_steps(d_proj[..., col["pg"]]),
                   d_swiglu=_steps(d_gemm2_in[..., None, :Fd]), d_read_out=_steps(d_gemm2_in[..., Fd:]))
    if not spec.memory:
        return c
    nh = S.heads_hat[i].shape[2]
    # The heads feed torch's elementwise ops: widened to the state's dtype. The read's factors
    # widen the gate on load; the step form's rebuild, which replays the reads, takes it widened.
    heads_hat, norms = l2n_relu(proj[..., col["heads"]].to(sd).view(L, B, nh, H, dk))
    gate = proj[..., col["gate"]]
    reads = S.reads[i][sl] if form.KEEPS_READS else like.new_empty((L, B, H * spec.d_val))  # kept, or from the rebuild
    c.heads_hat, c.q_full, c.q = _steps(heads_hat), heads_hat[:, :, -1], _steps(heads_hat[:, :, -1])
    c.heads_mask = _steps((heads_hat > 0) / norms)
    c.gate_full, c.gate = gate, None if form.KEEPS_READS else _steps(gate.to(sd))
    c.reads_full, c.reads, c.read_out = reads, _steps(reads), _steps(gemm2_in[..., Fd:])
    c.d_gate, c.d_heads = _steps(d_proj[..., col["gate"]]), _steps(d_proj[..., col["heads"]], nh, H, dk)
    if i == 0:
        c.keys, c.v = [rows.first_key] + list(_steps(heads_hat[:-1, :, 0])), _steps(proj[..., col["v"]], H, spec.d_val)
    return c


def _chunk_buffers(spec: CoreSpec, S: Saved, span: Span, layers, A, rows: ChunkRows, work):
    """Per-step views of one chunk's gradient buffers and of its derivative factors.

    The factors are the parts of the elementwise derivatives that do not depend on the incoming
    gradient, computed for the chunk's steps at once: the sweep is left with products, dots and
    GEMMs. Buffers live for one chunk, so the backward's working memory is a chunk's, not T's.
    GPN+M: the keys and queries are normalised again from the recomputed projections
    (rows.first_key: the key of the chunk's first step, which the step before projected); the
    reads and the write's errors are left to the memory form's `Backward.chunk` (the chunk form
    kept them). rows: the chunk's layer-0 inputs, normalised predictions and fuse gates
    (`ChunkRows`). work: the per-layer buffers of `_workspace`, of which the chunk uses its first L rows.
    """
    C = [_chunk_layer(spec, S, span, i, W, ws, rows) for i, (W, ws) in enumerate(zip(layers, work))]
    pred_hat = rows.pred_hat
    L, B, d = pred_hat.shape
    d_fuse_gate = pred_hat.new_empty((L, B, d), dtype=io_dtype(spec, pred_hat.dtype))
    G = ChunkShared(d_fuse_gate_full=d_fuse_gate, d_fuse_gate=_steps(d_fuse_gate), fuse_gate=_steps(rows.fuse_gate),
                    fuse_gate_fac=_steps(rows.fuse_gate_fac), pred_hat_full=pred_hat, pred_hat=_steps(pred_hat),
                    pred_rms=_steps(rows.pred_rms))
    if not spec.memory:
        return C, G
    H, dk, sl, form = spec.n_heads, spec.d_key, span.rows, memory_form(spec)
    col0, d_proj0 = columns(spec, True), C[0].d_proj_full
    # dL/d(beta, a pre-activations) = (dL/dbeta, dL/ddecay) * gate_fac
    # (a form whose backward gives dL/dgamma = dL/ddecay * decay has no decay in the factor)
    da_fac = A * torch.sigmoid(C[0].proj_full[..., col0["a"]].to(pred_hat.dtype))
    if not form.GATE_GRAD_IS_GAMMA:
        da_fac = da_fac * S.decay[sl]
    d_beta_decay = pred_hat.new_empty((L, 2, B, H))  # (dL/dbeta, dL/ddecay)
    d_heads_hat = pred_hat.new_empty((L, 2, B, H, dk))  # dL/d(normalised [next key | query]) of layer 0
    # the write's errors: kept, or from the rebuild
    write_err = S.write_err[sl] if form.KEEPS_READS else pred_hat.new_empty((L, B, H, spec.d_val))
    G.write_err_full, G.write_err = write_err, _steps(write_err)
    G.gate_fac = _steps(torch.stack([S.beta[sl] * (1 - S.beta[sl]), da_fac], 2))
    G.d_beta_decay_full, G.d_beta_decay = d_beta_decay, _steps(d_beta_decay.transpose(1, 2))
    G.d_beta, G.d_decay = _steps(d_beta_decay[:, 0]), _steps(d_beta_decay[:, 1])
    G.d_beta_a = _steps(d_proj0[..., col0["beta_pre"].start : col0["a"].stop], 2, H)
    G.d_v, G.d_key_proj = _steps(d_proj0[..., col0["v"]], H, spec.d_val), _steps(d_proj0[..., col0["k"]])
    G.d_heads_hat_full, G.d_heads_hat = d_heads_hat, _steps(d_heads_hat.transpose(1, 2))
    G.d_next_key, G.d_q = _steps(d_heads_hat[:, 0]), _steps(d_heads_hat[:, 1])
    return C, G


def _grounded_rows(spec: CoreSpec, S: Saved, lo: int, hi: int, fg_W, fg_b) -> ChunkRows:
    """The forward's per-step vectors around the grounded state, formed again from the
    predictions and the inputs u, time-major, with the step's groups over all the rows at once:
    for steps lo..hi-1 the normalised predictions, their rms, the fuse gates fg = sigmoid(xp W_fg
    + b) (one GEMM, into the GEMMs' dtype as the forward's) and their derivative factor xp rp fg
    (1 - fg) (`gate_factors`, the predict gate's form); layer 0's normalised input and its rms,
    from g_t = u_{t-1} + fg_{t-1} P_{t-1} (`residual_rms`, the same form), for steps lo+1..hi-1
    (0..hi-1 when lo is 0: step 0's is the incoming state's). Returns them whole, as `ChunkRows`
    without a first key: the caller cuts the chunk's from them."""
    ew = spec.backend.step
    P = S.preds[lo:hi]
    L, B, d = P.shape
    pred_hat, pred_rms = ew.rms_hat(P.reshape(L * B, d))
    pre = _mm(pred_hat, fg_W, out=pred_hat.new_empty((L * B, d), dtype=io_dtype(spec, pred_hat.dtype)), bias=fg_b)
    fg, fg_fac = pred_hat.new_empty((L * B, d)), pred_hat.new_empty((L * B, d))
    ew.gate_factors(None, None, pre, pred_hat, pred_rms, None, None, fg, fg_fac)
    head, n = (B if lo == 0 else 0), (L - 1) * B
    x_hat, rms = pred_hat.new_empty((head + n, d)), pred_hat.new_empty((head + n, 1))
    if lo == 0:
        ew.rms_hat(S.g0, x_hat[:B], rms[:B])
    if n:
        ew.residual_rms(S.u[lo : hi - 1].reshape(n, d), pre[:n], P[:-1].reshape(n, d), out_hat=x_hat[head:], out_rms=rms[head:])
    rows = lambda x: x.view(-1, B, x.shape[-1])  # noqa: E731
    return ChunkRows(x_hat=rows(x_hat), rms=rows(rms), pred_hat=rows(pred_hat), pred_rms=rows(pred_rms), fuse_gate=rows(fg),
                     fuse_gate_fac=rows(fg_fac))


def _sweep(spec: CoreSpec, sw: Sweep, C: list[ChunkLayer], G: ChunkShared, Ms, span: Span, carry: Carry, dk_next) -> Carry:
    """Steps c1-1 .. c0, backwards: through the fuse gate, the layers and the memory, writing the
    chunk's GEMM-output gradients (d_proj, d_gemm2_in, d_out rows), du, and dL/d(first key) into
    dk_next. Ms: the memory form's chunk (`Backward.chunk`)."""
    ew, form, W_T, W2o_T, fg_W_T, dus, d_preds = sw.ops, sw.form, sw.W_T, sw.W2o_T, sw.fg_W_T, sw.du, sw.d_preds
    W_k_T, dg_prev, dX = sw.W_k_T, sw.dg_prev, sw.dx
    dg, dM, kn_flows = carry.dg, carry.dM, carry.kn_flows
    c0, c1 = span.c0, span.c1
    T = len(dus)
    nl = len(C)
    # dL/d(a layer's output) goes on in the state's dtype (the carry); its copy in the GEMMs'
    # dtype, the layer's d_out row, is the second GEMM's input and the weight gradient's.
    narrow = C[0].d_out_full.dtype != dg.dtype
    folded = False  # whether the step after wrote this step's fuse-gate GEMM input (dg times the gate's factor)
    for t in reversed(range(c0, c1)):
        j = t - c0
        cut = spec.bptt and t > 0 and t % spec.bptt == 0  # where the naive core detaches the state
        if t == T - 1:  # later steps' dL/dg (= dL/du_t) is their last group's output, written into du
            dus[t].copy_(dg)
        if not folded:  # the chunk's last step, or after a truncated-BPTT cut
            torch.mul(dg, G.fuse_gate_fac[j], out=G.d_fuse_gate[j])
        dxp = ew.mm(G.d_fuse_gate[j], fg_W_T, dX)
        dc = ew.residual_rms_backward(G.pred_hat[j], G.pred_rms[j], dxp, dg, G.fuse_gate[j],
                                      None if d_preds is None else d_preds[t], **_dc_out(C[-1].d_out[j], narrow))
        for i in reversed(range(nl)):
            c = C[i]
            ew.mm(c.d_out[j], W2o_T[i], c.d_gemm2_in[j])  # into the d_gemm2_in rows of the chunk
            ew.gate_grads(c.d_swiglu[j], c.ffn_fac[j], c.d_ffn[j], dc, c.pg_fac[j], c.d_pg[j])
            if form is not None:
                if i == 0:
                    dq, dM = form.write(j, t, c, G, Ms, dM, G.d_next_key[j - 1] if j > 0 else dk_next)
                else:
                    dq, dM = form.read(i, j, c, Ms, dM)
                ew.l2n_relu_backward(c.heads_hat[j], c.heads_mask[j], dq, out=c.d_heads[j])
            dx = ew.mm(c.d_proj[j], W_T[i], dX)
            if i == 0 and spec.memory and not kn_flows:  # the next key's gradient reaches the weights only
                dx = dx.to(dg.dtype) - ew.mm(G.d_key_proj[j], W_k_T)
            if i > 0:
                out = _dc_out(C[i - 1].d_out[j], narrow)
            else:
                # dL/dg_t (layer 0's) is dL/du_{t-1}: written into du's row, the next step reads it
                # there; dL/dg_prev, the last step's input, adds in; and the next step's fuse-gate
                # GEMM input, dL/dg_t times the gate's factor, is written here too (within the chunk).
                folded = j > 0 and not cut
                out = dict(out=dus[t - 1] if t > 0 else None, extra=dg_prev if t == T - 1 else None,
                           out_low=G.d_fuse_gate[j - 1] if folded else None, low_fac=G.fuse_gate_fac[j - 1] if folded else None)
            dc = ew.residual_rms_backward(c.x_hat[j], c.rms[j], dx, dc, c.pg_gate[j], **out)
        dg = dc
        if cut:
            dg.zero_()
            if spec.memory:
                dM = form.cut(dM)
                kn_flows = False
        elif spec.memory:
            kn_flows = True
    return Carry(dg=dg, dM=dM, kn_flows=kn_flows)


def _dc_out(d_out, narrow: bool) -> dict:
    """Where residual_rms_backward writes dL/dc: the d_out row itself, or (narrow) a new carry in the
    state's dtype and the d_out row rounded."""
    return dict(out=None, out_low=d_out) if narrow else dict(out=d_out)


def _weight_grad_workspace(spec: CoreSpec, layers, fg_W, sd: torch.dtype) -> torch.Tensor | None:
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


def _weight_grads(spec: CoreSpec, S: Saved, span: Span, C: list[ChunkLayer], G: ChunkShared, grads: WeightGrads, work) -> None:
    """The chunk's weight gradients, accumulated in place: dW += X^T dY as GEMMs over its B*L rows."""
    cd, sl = spec.compute_dtype, span.rows
    for i, c in enumerate(C):
        dW, db, dW2o = grads.layers[i]
        _gemm(dW, c.x_hat_full, c.d_proj_full, cd, work)
        db += c.d_proj_full.sum((0, 1), dtype=db.dtype)
        _gemm(dW2o, c.gemm2_in_full, c.d_out_full, cd, work)
    _gemm(grads.fg_W, G.pred_hat_full, G.d_fuse_gate_full, cd, work)
    grads.fg_b.add_(G.d_fuse_gate_full.sum((0, 1), dtype=grads.fg_b.dtype))
    if spec.memory:  # d_beta_decay holds dL/dgamma, or dL/ddecay (memory_form: GATE_GRAD_IS_GAMMA)
        d_decay = G.d_beta_decay_full[:, 1]
        dgamma = d_decay if memory_form(spec).GATE_GRAD_IS_GAMMA else d_decay * S.decay[sl]
        grads.A_log.add_((dgamma * S.gamma[sl]).sum((0, 1)))


def run_backward(spec: CoreSpec, S: Saved, weights: Weights, out: OutputGrads) -> CoreGrads:
    """The reverse sweep, chunk by chunk from the end: per chunk, its buffers and derivative
    factors (`_chunk_buffers`), the memory form's chunk (`Backward.chunk`: M rebuilt, or the
    chunk's algebra), the steps backwards (`_sweep`), and its weight gradients as GEMMs over its
    rows (`_weight_grads`).

    out: the gradients w.r.t. the outputs (`OutputGrads`). Returns the gradients w.r.t. the inputs
    (`CoreGrads`).
    """
    T, B, d = S.preds.shape
    dg, dM = out.dg, out.dM
    H, dk, nl, sd = spec.n_heads, spec.d_key, len(weights.layers), S.preds.dtype
    fused = cast(spec, weights)
    layers, fg_W = fused.layers, fused.fg_W
    ew = spec.backend.step
    du = S.preds.new_empty((T, B, d))
    dg = S.preds.new_zeros((B, d)) if dg is None else dg
    layer_grads = [[torch.zeros_like(L.W, dtype=sd), torch.zeros_like(L.b, dtype=sd), torch.zeros_like(L.W2o, dtype=sd)]
                   for L in layers]
    dfg_W, dfg_b = torch.zeros_like(fg_W, dtype=sd), torch.zeros_like(fused.fg_b, dtype=sd)
    lanes = spec.backend.lanes
    # With a side stream, chunk k's weight gradients run beside chunk k+1's sweep: the two use
    # workspaces in turn, so the next chunk's buffers never overwrite rows the GEMMs still read.
    n_chunks = len(bounds(spec, T))
    works = [_workspace(spec, layers, min(spec.chunk, T), B, S.preds) for _ in range(2 if lanes.concurrent and n_chunks > 1
                                                                                       else 1)]
    gemm_work = _weight_grad_workspace(spec, layers, fg_W, sd)
    A = form = W_k_T = dA_log = dk_next = None
    if spec.memory:
        k_col = columns(spec, True)["k"]
        A = -torch.exp(fused.A_log.to(sd))
        no_dM = dM is None  # the window's last M sends no gradient back (a training window's)
        dM = S.preds.new_zeros((B, H, dk, spec.d_val)) if no_dM else dM
        dk_next = S.preds.new_zeros((B, H, dk))  # dL/d(normalised key) of the step after the chunk
        W_k, b_k = layers[0].W[:, k_col], layers[0].b[k_col]
        W_k_T = W_k.T
        dA_log = torch.zeros_like(A)
        form = memory_form(spec).Backward(spec, S, dM, T, no_dM)  # dL/dM's way back, in the memory's form
    # The transposed weights of the sweep's GEMMs, in the layout they are read fastest.
    sw = Sweep(ops=ew, form=form, W_T=[ew.pack(L.W.T, T, B) for L in layers], W2o_T=[ew.pack(L.W2o.T, T, B) for L in layers],
               fg_W_T=ew.pack(fg_W.T, T, B), du=_steps(du), d_preds=None if out.d_preds is None else _steps(out.d_preds),
               W_k_T=W_k_T, dg_prev=out.dg_prev, dx=S.preds.new_empty((B, d), dtype=io_dtype(spec, sd)))
    carry = Carry(dg=dg, dM=dM, kn_flows=True)
    grads = WeightGrads(layers=layer_grads, fg_W=dfg_W, fg_b=dfg_b, A_log=dA_log)

    lanes.fork()
    try:
        pending = None  # the chunk before's buffers and the event after its weight gradients
        for k, (ci, (c0, c1)) in enumerate(reversed(list(enumerate(bounds(spec, T))))):
            # From two steps back: the gate of step c0 - 2 forms the input of step c0 - 1, whose
            # projection holds the key of step c0.
            span = Span(index=ci, c0=c0, c1=c1)
            lo = max(c0 - 2, 0)
            whole = _grounded_rows(spec, S, lo, c1, fg_W, fused.fg_b)
            first = 0 if lo == 0 else lo + 1  # the step of whole.x_hat[0]
            first_key = None
            if spec.memory:
                first_key = S.k0 if c0 == 0 else l2n_relu(ew.mm(whole.x_hat[c0 - 1 - first], W_k, bias=b_k).view(B, H, dk))[0]
            rows = ChunkRows(x_hat=whole.x_hat[c0 - first :], rms=whole.rms[c0 - first :], pred_hat=whole.pred_hat[c0 - lo :],
                             pred_rms=whole.pred_rms[c0 - lo :], fuse_gate=whole.fuse_gate[c0 - lo :],
                             fuse_gate_fac=whole.fuse_gate_fac[c0 - lo :], first_key=first_key)
            C, G = _chunk_buffers(spec, S, span, layers, A, rows, works[k % len(works)])
            Ms = None
            if spec.memory:
                Ms = form.chunk(span, C, G, carry.dM)
                G.d_heads_hat_full[-1, 0] = dk_next
                dk_next = torch.empty_like(dk_next)
            carry = _sweep(spec, sw, C, G, Ms, span, carry, dk_next)
            if spec.memory:
                carry = carry._replace(dM=form.end_chunk(span, Ms, carry.dM))
            # The weight gradients read the chunk's rows and nothing the sweep goes on to write: on the
            # side stream, after the sweep. The main stream waits for the chunk before's before it
            # rewrites that chunk's workspace or frees its buffers (kept alive in `pending` until then).
            swept = lanes.record()
            with lanes.side():
                lanes.wait(swept)
                _weight_grads(spec, S, span, C, G, grads, gemm_work)
                done = lanes.record()
            if pending is not None:
                lanes.wait(pending[2])
            pending = (C, G, done)
            del C, G, Ms  # before the next chunk's buffers exist, not after
        lanes.wait(pending[2])
    finally:  # also when the sweep raises: the streams joined, the stand-in's checks ended
        lanes.join()  # the gradients, and gemm_work, are the main stream's again
    del pending

    if not spec.memory:
        return CoreGrads(du=du, dg=carry.dg, dg_prev=None, dM=None, A_log=None, layers=grads.layers, fg_W=grads.fg_W,
                         fg_b=grads.fg_b)
    # The first key comes from the incoming previous state.
    dk0 = ew.l2n_relu_backward(S.k0, (S.k0 > 0) / S.k0_norm, dk_next).flatten(1)
    _gemm(grads.layers[0][0][:, k_col], S.x_prev, dk0, spec.compute_dtype, gemm_work)
    grads.layers[0][1][k_col] += dk0.sum(0)
    dg_prev0 = ew.rms_hat_backward(S.x_prev, S.r_prev, ew.mm(dk0, W_k_T))
    return CoreGrads(du=du, dg=carry.dg, dg_prev=dg_prev0, dM=carry.dM, A_log=grads.A_log, layers=grads.layers,
                     fg_W=grads.fg_W, fg_b=grads.fg_b)


class FusedCore(torch.autograd.Function):
    """(u, state, fused weights) -> (preds, g, g_prev, M) with `run_forward` / `run_backward`.

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
                grads = _backward_flat(ctx.spec, ctx.S, *inputs)
            else:
                graphs, key, replay = ctx.graph
                if graphs.forward.replays[key] != replay:
                    raise RuntimeError("fused core: the forward's CUDA graph ran again before this backward, so its saved "
                                       "buffers are gone; run one backward per forward, or set cuda_graphs: false")
                grads = graphs.backward((key, signature(*inputs)), (ctx.spec, ctx.S), inputs)
        du = grads.du.to(ctx.u_dtype, copy=ctx.graph is not None)
        if ctx.graph is not None:
            # Out of the graph's memory, which its next replay rewrites: autograd keeps gradients
            # (a parameter's .grad is the returned tensor itself when it had none). du is copied above.
            grads = CoreGrads(*_copied(list(grads._replace(du=None))))
        return (None, None, du, grads.dg, grads.dg_prev, grads.dM, grads.A_log, grads.fg_W, grads.fg_b,
                *(x for L in grads.layers for x in L))


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
    return run_forward(spec, u, (g, g_prev, M), Weights(layers=_layers(flat), fg_W=fg_W, fg_b=fg_b, A_log=A_log), save=True)


def _backward_flat(spec, S, *inputs):
    """`run_backward` on flat inputs: A_log, fg_W, fg_b, the output gradients, each layer's weights."""
    A_log, fg_W, fg_b, dP, dg, dg_prev, dM, *flat = inputs
    return run_backward(spec, S, Weights(layers=_layers(flat), fg_W=fg_W, fg_b=fg_b, A_log=A_log),
                        OutputGrads(d_preds=dP, dg=dg, dg_prev=dg_prev, dM=dM))


def fused_recurrence(model, u: torch.Tensor, state, graphs: bool = True, fused=None):
    """The fused core for a `GPN`: u (B, T, d) input projections, state a `GPNState`; `graphs`:
    False runs the loops eagerly whatever the backend says (callers that run several forwards
    before their backwards, which a graph's next replay would overwrite); `fused`: the model's
    `fuse_weights`, made once by a caller that runs the core on several pieces of a window.

    Returns (predictions (B, T, d), (g, g_prev, M)).
    """
    cfg = model.config
    g, g_prev, M = state
    device = u.device.type
    cd = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else g.dtype
    backend = model.backend(device)
    spec = CoreSpec.from_config(cfg, backend, cd, device, g.dtype)
    graphs = None if backend.graphs is None or not graphs else core_graphs(model, _forward_flat, _backward_flat,
                                                                            backend.graphs)
    A_log = model.write_A_log if cfg.memory else None
    # Time-major in memory: the backward reads a chunk's rows of u as one block, and a graph's static
    # copy of it is then the one copy (run_forward's `contiguous` finds nothing to do)
    u = u.transpose(0, 1).contiguous()
    with torch.autocast(device, enabled=False):
        layers, fg_W, fg_b = fuse_weights(model) if fused is None else fused
        if torch.is_grad_enabled():
            flat = [x for L in layers for x in L]
            P, g, g_prev, M = FusedCore.apply(spec, graphs, u, g, g_prev, M, A_log, fg_W, fg_b, *flat)
        else:
            P, g, g_prev, M, _ = run_forward(spec, u, (g, g_prev, M), Weights(layers=layers, fg_W=fg_W, fg_b=fg_b, A_log=A_log),
                                             save=False)
    return P.transpose(0, 1), (g, g_prev, M)
