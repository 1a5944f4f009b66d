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
from gpn_scale.models.core_structures import (Carry, ChunkLayer, ChunkRows, ChunkShared, LayerSteps, LayerWeights, OutputGrads,
                                         Saved, Span, Spec, Sweep, WeightGrads, Weights, Workspace, bounds, cast, columns,
                                         io_dtype)
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


def memory_form(spec: Spec):
    """The module of the memory's form the core runs (memory_step, memory_chunk): its `Forward` and
    `Backward` do what the two forms do differently."""
    return memory_chunk if spec.chunked else memory_step


# ---- forward ---------------------------------------------------------------------------------


def _buffers(spec: Spec, layers, T, B, like, gate_rows):
    """The per-step vectors the backward needs, time-major: (T, B, ...) each; the write's gates
    (gate_rows, B, H)."""
    d, H, dk, dv = spec.d, spec.H, spec.dk, spec.dv
    new = lambda *shape: like.new_empty((T, B) + shape)  # noqa: E731
    ring = lambda *shape: like.new_empty((2, B) + shape)  # noqa: E731
    io = io_dtype(spec, like.dtype)
    gemm_ring = lambda *shape: like.new_empty((2, B) + shape, dtype=io)  # noqa: E731  (only GEMMs read or write it)
    gemm_kept = lambda *shape: like.new_empty((T, B) + shape, dtype=io)  # noqa: E731
    S = Saved(
        # Normalised layer inputs and their rms. Layer 0's is the grounded state's, which the
        # backward forms again from u, P and the fuse gates: it lives in the work ring, read by
        # the projection GEMM only. Later layers' are saved in the state's dtype for the backward.
        X=[gemm_ring(d)] + [new(d) for _ in layers[1:]],
        R=[ring(1)] + [new(1) for _ in layers[1:]],
        # Everything else is recomputed per chunk in the backward: the projections with one GEMM
        # (unless kept: core_projections), keys and queries from them, the fuse gates' inputs from
        # the predictions, the write's errors and the reads while M is rebuilt. The loop keeps only
        # the current step's.
        Y=[(gemm_kept if spec.keep_projections else gemm_ring)(L.W.shape[1]) for L in layers],  # fused projection outputs
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
        keeps = memory_form(spec).KEEPS_READS
        kept = new if keeps else ring
        S.O = [kept(H * dv) for _ in layers]  # raw reads
        S.E = kept(H, dv)  # the write's error
        S.DELTA = new(H, dv) if keeps else None  # beta e
        S.BETA, S.GAMMA, S.DECAY = (like.new_empty((gate_rows, B, H)) for _ in range(3))  # the write's gates
        S.M = []  # M before every chunk (the chunk form with memory_reads: compute keeps its reads' copy)
    return S


def _layer_views(spec: Spec, S, i, col):
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
    layers, fg_W, fg_b, A_log = cast(spec, weights)
    cols = [columns(spec, i == 0) for i in range(nl)]
    chunks = dict(bounds(spec, T))  # chunk start -> end
    S = _buffers(spec, layers, T if save else 2, B, g, memory_form(spec).gate_rows(T, chunks, save))
    V = [_layer_views(spec, S, i, cols[i]) for i in range(nl)]
    XP, RP, FG = _steps(S.XP), _steps(S.RP), _steps(S.FG)
    P = S.P = g.new_empty((T, B, d))
    u = u.contiguous()  # time-major in memory (as fused_recurrence gives it): a chunk's rows are one block
    Ps, us = _steps(P), _steps(u.to(g.dtype))
    ew = spec.backend.step
    if spec.memory:
        A = -torch.exp(A_log.to(g.dtype))
        # M's reads and writes, in the memory's form (memory_step.py, memory_chunk.py)
        form = memory_form(spec).Forward(spec, S, M.contiguous(), save, chunks)
        BETA, GAMMA, DECAY = _steps(S.BETA), _steps(S.GAMMA), _steps(S.DECAY)
        S.x_prev, S.r_prev = ew.rms_hat(g_prev)
        k_col = cols[0]["k"]
        kpre = ew.mm(S.x_prev, layers[0].W[:, k_col], bias=layers[0].b[k_col])
        S.k0, S.k0n = ew.l2n_relu(kpre.view(B, H, dk))
        k = S.k0
        v0 = V[0]
    S.u, S.g0 = u, g  # the backward forms layer 0's inputs again from them
    # The step's weights, in the layout its GEMM reads fastest (kernels/cpu/gemm.cpp packs them).
    packed = [L._replace(W=ew.pack(L.W, T, B), W2o=ew.pack(L.W2o, T, B)) for L in layers]
    Y2 = _steps(g.new_empty((2, B, d), dtype=io_dtype(spec, g.dtype)))  # the second GEMM's output, read by residual_rms
    fg_Wp = ew.pack(fg_W, T, B)
    # Each layer's normalised input is written by the group before it: the previous layer's
    # residual_rms, or (layer 0) the previous step's ground; the first step's here.
    ew.rms_hat(g, V[0].x[0], V[0].r[0])
    for t in range(T):
        s, w = (t if save else t % 2), t % 2  # saved and work-ring slots
        y = s if spec.keep_projections else w  # the projection's slot
        if spec.memory:
            if t in chunks:
                form.begin_chunk(t, chunks[t])
            gs = form.gate_slot(t, s)  # the row of the write's gates
        c = g
        for i, (L, v) in enumerate(zip(packed, V)):
            ew.mm(v.x[w if i == 0 else s], L.W, v.y[y], L.b)
            if not spec.memory:
                ew.post_projection(v.h1[y], v.h2[y], v.z_ffn[w])
            elif i == 0:
                ew.post_projection(v.h1[y], v.h2[y], v.z_ffn[w], v.heads[y], v.nq[w], v.nn[w], v.beta[y],
                                   v.a[y], A, BETA[gs], GAMMA[gs], DECAY[gs])
                form.write(t, w, s, y, v, k)
                k = v0.next_key[w]
            else:
                ew.post_projection(v.h1[y], v.h2[y], v.z_ffn[w], v.heads[y], v.nq[w], v.nn[w])
                form.read(t, w, s, y, v)
            last = i == nl - 1
            x_next, r_next = (XP[w], RP[w]) if last else (V[i + 1].x[s], V[i + 1].r[s])
            c = ew.residual_rms(ew.mm(v.z[w], L.W2o, Y2[w]), v.pg[y], c, Ps[t] if last else None, x_next, r_next)
        ew.mm(XP[w], fg_Wp, FG[w], fg_b)
        x_next, r_next = (V[0].x[1 - w], V[0].r[1 - w]) if t < T - 1 else (None, None)
        # The gates go to Y2's row, which residual_rms has read: over FG itself, the Triton
        # kernel's column blocks could read one another's gates where they need the row's norm.
        g_prev, g = g, ew.ground(FG[w], c, us[t], Y2[w], x_next, r_next)
    if spec.memory:
        M = form.finish()
    return P, g, g_prev, M, (S if save else None)


# ---- backward --------------------------------------------------------------------------------


def _workspace(spec: Spec, layers, L, B, like):
    """Per layer, the chunk's widest buffers (projections, second GEMM inputs, their gradients,
    the SwiGLU factors), made once for the sweep and reused by every chunk: fresh ones per chunk
    leave the heap fragmented, and the process's resident memory creeping up chunk by chunk."""
    new = lambda *shape, dtype=like.dtype: like.new_empty((L, B) + shape, dtype=dtype)  # noqa: E731
    io = io_dtype(spec, like.dtype)  # the sweep's GEMM outputs and inputs (the weight gradients' too)
    # Z is read by one GEMM only (W2o's weight gradient): written rounded, it is not cast there.
    # Y is the recomputed projection as its GEMM writes it (none with core_projections: keep, the
    # forward's are read): `gate_factors` and the memory kernels widen it on load, torch's ops take
    # widened copies of the blocks they read.
    return [Workspace(Y=None if spec.keep_projections else new(W.W.shape[1], dtype=io), dY=new(W.W.shape[1], dtype=io),
                      Z=new(W.W2o.shape[0], dtype=io), dZ=new(W.W2o.shape[0], dtype=io), ffn_fac=new(2, spec.F))
            for W in layers]


def _chunk_buffers(spec: Spec, S, span: Span, layers, A, rows: ChunkRows, work):
    """Per-step views of one chunk's gradient buffers and of its derivative factors.

    The factors are the parts of the elementwise derivatives that do not depend on the incoming
    gradient, computed for the chunk's steps at once: the sweep is left with products, dots and
    GEMMs. Buffers live for one chunk, so the backward's working memory is a chunk's, not T's.
    GPN+M: the keys and queries are normalised again from the recomputed projections (k_first:
    the key of the chunk's first step, which the step before projected); the reads and the
    write's errors are left to the memory form's `Backward.chunk` (the chunk form kept them). rows: the
    chunk's layer-0 inputs, normalised predictions and fuse gates (`ChunkRows`). work: the
    per-layer buffers of `_workspace`, of which the chunk uses its first L rows.
    """
    X0, R0, XP, RP, fg, fg_fac, k_first = rows
    sl, cols = span.rows, [columns(spec, i == 0) for i in range(len(layers))]
    L, B, d = XP.shape
    H, dk, Fd, sd, ew = spec.H, spec.dk, spec.F, XP.dtype, spec.backend.step
    empty = lambda *shape: XP.new_empty(shape)  # noqa: E731
    io, form = io_dtype(spec, sd), memory_form(spec)
    C = []
    for i, (W, col, ws) in enumerate(zip(layers, cols, work)):
        x_hat, r = (X0, R0) if i == 0 else (S.X[i][sl], S.R[i][sl])
        Z, dY, dZ, ffn_fac = (x[:L] for x in (ws.Z, ws.dY, ws.dZ, ws.ffn_fac))  # every row is written
        if spec.keep_projections:  # the forward's own rows
            Y = S.Y[i][sl]
        else:  # as the forward's, one GEMM, in the GEMMs' dtype (io)
            Y = ws.Y[:L]
            _mm(x_hat.reshape(L * B, d), W.W, Y.view(L * B, -1), W.b)
        rows = Y.view(L * B, -1)
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
            # The heads feed torch's elementwise ops: widened to the state's dtype. The read's factors
            # widen the gate on load; the step form's rebuild, which replays the reads, takes it widened.
            nq, norms = l2n_relu(Y[..., col["heads"]].to(sd).view(L, B, nh, H, dk))
            gate = Y[..., col["gate"]]
            O = S.O[i][sl] if form.KEEPS_READS else empty(L, B, H * spec.dv)  # kept, or from the rebuild
            c.update(nq=_steps(nq), q_full=nq[:, :, -1], q=_steps(nq[:, :, -1]), nq_mask=_steps((nq > 0) / norms), gate_full=gate,
                     gate=None if form.KEEPS_READS else _steps(gate.to(sd)), O_full=O, o=_steps(O), z_read=_steps(Z[..., Fd:]),
                     dgate=_steps(dY[..., col["gate"]]), dheads=_steps(dY[..., col["heads"]], nh, H, dk))
            if i == 0:
                c.update(keys=[k_first] + list(_steps(nq[:-1, :, 0])), v=_steps(Y[..., col["v"]], H, spec.dv))
        C.append(ChunkLayer(**c))
    dYfg = XP.new_empty((L, B, d), dtype=io)
    G = dict(dYfg_full=dYfg, dYfg=_steps(dYfg), fg=_steps(fg), fg_fac=_steps(fg_fac),
             XP=XP, xp=_steps(XP), rp=_steps(RP))
    if spec.memory:
        col0, dY0 = cols[0], C[0].dY_full
        # dL/d(beta, a pre-activations) = (dL/dbeta, dL/ddecay) * gate_fac
        # (a form whose backward gives dL/dgamma = dL/ddecay * decay has no decay in the factor)
        da_fac = A * torch.sigmoid(C[0].Y[..., col0["a"]].to(sd))
        if not form.GATE_GRAD_IS_GAMMA:
            da_fac = da_fac * S.DECAY[sl]
        dBD = empty(L, 2, B, H)  # (dL/dbeta, dL/ddecay)
        dKQ = empty(L, 2, B, H, dk)  # dL/d(normalised [next key | query]) of layer 0
        E = S.E[sl] if form.KEEPS_READS else empty(L, B, H, spec.dv)  # the write's errors: kept, or from the rebuild
        G.update(E_full=E, e=_steps(E), gate_fac=_steps(torch.stack([S.BETA[sl] * (1 - S.BETA[sl]), da_fac], 2)),
                 dBD_full=dBD, dBD=_steps(dBD.transpose(1, 2)),
                 dbeta=_steps(dBD[:, 0]), ddecay=_steps(dBD[:, 1]), dgates=_steps(dY0[..., col0["beta"].start : col0["a"].stop], 2, H),
                 dv=_steps(dY0[..., col0["v"]], H, spec.dv), dkn=_steps(dY0[..., col0["k"]]), dKQ_full=dKQ,
                 dKQ=_steps(dKQ.transpose(1, 2)), dk_out=_steps(dKQ[:, 0]), dq_out=_steps(dKQ[:, 1]))
    return C, ChunkShared(**G)


def _grounded_rows(spec: Spec, S, lo: int, hi: int, fg_W, fg_b):
    """The forward's per-step vectors around the grounded state, formed again from the
    predictions P and the inputs u, time-major, with the step's groups over all the rows at once:
    for steps lo..hi-1 the normalised predictions, their rms, the fuse gates fg = sigmoid(xp W_fg
    + b) (one GEMM, into the GEMMs' dtype as the forward's) and their derivative factor xp rp fg
    (1 - fg) (`gate_factors`, the predict gate's form); layer 0's normalised input and its rms,
    from g_t = u_{t-1} + fg_{t-1} P_{t-1} (`residual_rms`, the same form), for steps lo+1..hi-1
    (0..hi-1 when lo is 0: step 0's is the incoming state's). Returns (XP, RP, fg, fg_fac, X0, R0),
    whole: the caller cuts the chunk's `ChunkRows` from them."""
    ew = spec.backend.step
    P = S.P[lo:hi]
    L, B, d = P.shape
    XP, RP = ew.rms_hat(P.reshape(L * B, d))
    pre = _mm(XP, fg_W, out=XP.new_empty((L * B, d), dtype=io_dtype(spec, XP.dtype)), bias=fg_b)
    fg, fg_fac = XP.new_empty((L * B, d)), XP.new_empty((L * B, d))
    ew.gate_factors(None, None, pre, XP, RP, None, None, fg, fg_fac)
    head, n = (B if lo == 0 else 0), (L - 1) * B
    X0, R0 = XP.new_empty((head + n, d)), XP.new_empty((head + n, 1))
    if lo == 0:
        ew.rms_hat(S.g0, X0[:B], R0[:B])
    if n:
        ew.residual_rms(S.u[lo : hi - 1].reshape(n, d), pre[:n], P[:-1].reshape(n, d), out_hat=X0[head:], out_rms=R0[head:])
    return tuple(x.view(-1, B, x.shape[-1]) for x in (XP, RP, fg, fg_fac, X0, R0))


def _sweep(spec: Spec, sw: Sweep, C: list[ChunkLayer], G: ChunkShared, Ms, span: Span, carry: Carry, dk_next) -> Carry:
    """Steps c1-1 .. c0, backwards: through the fuse gate, the layers and the memory, writing the
    chunk's GEMM-output gradients (dY, dZ, dU rows), du, and dL/d(first key) into dk_next. Ms: the
    memory form's chunk (`Backward.chunk`)."""
    ew, form, WT, W2oT, fg_WT, dus, dPs, W_kT, dg_prev, dX = sw
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
            if form is not None:
                if i == 0:
                    dq, dM = form.write(j, t, c, G, Ms, dM, G.dk_out[j - 1] if j > 0 else dk_next)
                else:
                    dq, dM = form.read(i, j, c, Ms, dM)
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
                dM = form.cut(dM)
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
    if spec.memory:  # dBD holds dL/dgamma, or dL/ddecay (memory_form: GATE_GRAD_IS_GAMMA)
        dgamma = G.dBD_full[:, 1] if memory_form(spec).GATE_GRAD_IS_GAMMA else G.dBD_full[:, 1] * S.DECAY[sl]
        grads.A_log.add_((dgamma * S.GAMMA[sl]).sum((0, 1)))


def run_backward(spec: Spec, S, weights: Weights, out: OutputGrads):
    """The reverse sweep, chunk by chunk from the end: per chunk, its buffers and derivative
    factors (`_chunk_buffers`), the memory form's chunk (`Backward.chunk`: M rebuilt, or the
    chunk's algebra), the steps backwards (`_sweep`), and its weight gradients as GEMMs over its
    rows (`_weight_grads`).

    out: the gradients w.r.t. the outputs (`OutputGrads`). Returns (du (T, B, d), dg0, dg_prev0,
    dM0, dA_log, [per layer (dW, db, dW2o)], dfg_W, dfg_b).
    """
    T, B, d = S.P.shape
    dP, dg, dg_prev, dM = out
    H, dk, nl, sd = spec.H, spec.dk, len(weights.layers), S.P.dtype
    layers, fg_W, fg_b, A_log = cast(spec, weights)
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
    A = form = W_kT = dA_log = dk_next = None
    if spec.memory:
        col0 = cols[0]
        A = -torch.exp(A_log.to(sd))
        no_dM = dM is None  # the window's last M sends no gradient back (a training window's)
        dM = S.P.new_zeros((B, H, dk, spec.dv)) if no_dM else dM
        dk_next = S.P.new_zeros((B, H, dk))  # dL/d(normalised key) of the step after the chunk
        W_k, b_k = layers[0].W[:, col0["k"]], layers[0].b[col0["k"]]
        W_kT = W_k.T
        dA_log = torch.zeros_like(A)
        form = memory_form(spec).Backward(spec, S, dM, T, no_dM)  # dL/dM's way back, in the memory's form
    # The transposed weights of the sweep's GEMMs, in the layout they are read fastest.
    sw = Sweep(ew, form, [ew.pack(L.W.T, T, B) for L in layers], [ew.pack(L.W2o.T, T, B) for L in layers],
               ew.pack(fg_W.T, T, B), _steps(du), (_steps(dP) if dP is not None else None), W_kT, dg_prev,
               S.P.new_empty((B, d), dtype=io_dtype(spec, sd)))
    carry = Carry(dg, dM, True)
    wgrads = WeightGrads(grads, dfg_W, dfg_b, dA_log)

    lanes.fork()
    try:
        pending = None  # the chunk before's buffers and the event after its weight gradients
        for k, (ci, (c0, c1)) in enumerate(reversed(list(enumerate(bounds(spec, T))))):
            # From two steps back: the gate of step c0 - 2 forms the input of step c0 - 1, whose
            # projection holds the key of step c0.
            span = Span(ci, c0, c1)
            lo = max(c0 - 2, 0)
            XP, RP, fg, fg_fac, X0, R0 = _grounded_rows(spec, S, lo, c1, fg_W, fg_b)
            first = 0 if lo == 0 else lo + 1  # the step of X0[0]
            k_first = None
            if spec.memory:
                k_first = S.k0 if c0 == 0 else l2n_relu(ew.mm(X0[c0 - 1 - first], W_k, bias=b_k).view(B, H, dk))[0]
            rows = ChunkRows(X0[c0 - first :], R0[c0 - first :], XP[c0 - lo :], RP[c0 - lo :], fg[c0 - lo :], fg_fac[c0 - lo :],
                             k_first)
            C, G = _chunk_buffers(spec, S, span, layers, A, rows, works[k % len(works)])
            Ms = None
            if spec.memory:
                Ms = form.chunk(span, C, G, carry.dM)
                G.dKQ_full[-1, 0] = dk_next
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
    chunked = cfg.memory and cfg.memory_form_on(device) == "chunk"
    spec = Spec(cfg.d_state, cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.d_val, cfg.memory, cfg.core_chunk, cfg.bptt, cd, backend,
                chunked, chunked and cfg.memory_reads == "compute" and cd != g.dtype, cfg.core_projections == "keep")
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
            P, g, g_prev, M, _ = run_forward(spec, u, (g, g_prev, M), Weights(layers, fg_W, fg_b, A_log), save=False)
    return P.transpose(0, 1), (g, g_prev, M)
