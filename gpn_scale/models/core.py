"""The fused recurrent core: the time loop of GPN / GPN+M with a hand-written backward through time.

Autograd's time loop keeps every intermediate of every step (M several times per token) and
spends most of its time on bookkeeping for thousands of tiny ops. This core does what the math
needs (DESIGN.md, "Where the time goes", points 2-4):

- Fused projections. Every projection of a layer's input c is one GEMM of c / rms(c) against
  the concatenated matrices with the norm weights folded in, `rms(c; w) @ W = (c / rms(c)) @
  (diag(w) W)`. Layer 0's input is the grounded state, so its GEMM also carries the write's
  projections (the *next* step's key, v, beta, a). FFN W2 and the read's W_o (with the read's
  output norm weight folded in the same way) are a second GEMM per layer, the fuse gate a
  third. `fuse_weights` builds the fused matrices from the parameters with ordinary autograd
  ops, so the parameters keep the paper's layout and the norm weights get their gradients from
  the chain rule of one elementwise product.
- Small saved state. The forward saves per-step vectors (normalised layer inputs, projection
  outputs, second-GEMM inputs, keys, queries, reads, the write's prediction errors) and M only
  at the start of every `chunk` steps.
- Reverse sweep for the input-gradient chain only. Step by step, back through the fuse gate,
  the layers and the memory, carrying dL/dg and dL/dM; M is rebuilt inside each chunk from the
  chunk's saved start. The gradients w.r.t. each GEMM's output are kept (dY rows), and every
  weight gradient is one GEMM over all B*T rows after the sweep (dW = X^T dY).

Under autocast the GEMMs run in the autocast dtype; the state, M and all elementwise math stay
float32 (float64 inputs stay float64, for gradient checks). Truncated BPTT (`bptt`) cuts the
sweep at the same places where the naive core detaches the state. The incoming state receives
gradients, as in the naive core.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from gpn_scale.models.memory_step import (
    ReadFactors,
    decay_and_write,
    memory_read,
    memory_read_backward,
    memory_step,
    memory_step_backward,
    read_factors,
    rms,
    _constants,
)
from gpn_scale.models.ops import L2_EPS


class LayerWeights(NamedTuple):
    W: torch.Tensor  # (d, N): the layer's fused projection, norm weights folded in
    b: torch.Tensor  # (N,)
    W2o: torch.Tensor  # (F [+ H*dv], d): [ffn_w2_k; diag(read_out_norm_w) read_W_o_k]


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


# ---- small pieces, each with its backward ----------------------------------------------------
# In the time loop every op counts (each costs microseconds of dispatch on tensors this small):
# `out=` writes straight into the saved buffers, and reductions are single vector norms or dots.


def _rms_hat(x, out=None, rms_out=None):
    """(x / rms(x), rms(x))."""
    r = rms(x, out=rms_out)
    return torch.div(x, r, out=out), r


def _rms_hat_backward(x_hat, r, dx_hat):
    dot = torch.linalg.vecdot(dx_hat, x_hat).unsqueeze(-1)
    return torch.addcmul(dx_hat, x_hat, dot, value=-1.0 / x_hat.shape[-1]).div_(r)


def _l2n_relu(z, out=None, norm_out=None):
    """(l2n(relu(z)), sqrt(|relu(z)|^2 + eps)) over the last axis."""
    z = torch.relu(z)
    (sqrt_eps,) = _constants(z, math.sqrt(L2_EPS))
    n = torch.hypot(torch.linalg.vector_norm(z, dim=-1, keepdim=True), sqrt_eps, out=norm_out)
    return torch.div(z, n, out=out), n


def _l2n_relu_backward(y, mask_over_norm, dy, out=None):
    """mask_over_norm = (y > 0) / norm: relu's mask is read off the output, y > 0 exactly where z > 0."""
    dot = torch.linalg.vecdot(dy, y).unsqueeze(-1)
    return torch.mul(torch.addcmul(dy, y, dot, value=-1.0), mask_over_norm, out=out)


def _mm(x, W, out=None, bias=None):
    """[bias +] x @ W with the GEMM in W's dtype (the compute dtype), into `out` (state dtype)."""
    if out is not None and W.dtype == out.dtype:
        return torch.mm(x, W, out=out) if bias is None else torch.addmm(bias, x, W, out=out)
    if out is None and bias is None and W.dtype == x.dtype:
        return torch.mm(x, W)
    y = x.to(W.dtype) @ W if bias is None else torch.addmm(bias, x.to(W.dtype), W)
    return y.to(x.dtype) if out is None else out.copy_(y)


def _cast(spec: Spec, layers, fg_W, fg_b):
    cd = spec.compute_dtype
    return [LayerWeights(*(w.to(cd) for w in L)) for L in layers], fg_W.to(cd), fg_b.to(cd)


# ---- forward ---------------------------------------------------------------------------------


def _steps(x, *shape):
    """Per-step views of a time-major (T, B, ...) tensor, made in one call: indexing inside the
    loop would cost a dispatched op per step and use."""
    return (x.view(*x.shape[:2], *shape) if shape else x).unbind(0)


def _buffers(spec: Spec, layers, T, B, like):
    """The per-step vectors the backward needs, time-major: (T, B, ...) each."""
    d, H, dk, dv = spec.d, spec.H, spec.dk, spec.dv
    new = lambda *shape: like.new_empty((T, B) + shape)  # noqa: E731
    S = SimpleNamespace(
        X=[new(d) for _ in layers],  # normalised layer inputs
        R=[new(1) for _ in layers],  # their rms
        Y=[new(L.W.shape[1]) for L in layers],  # fused projection outputs
        Z=[new(L.W2o.shape[0]) for L in layers],  # second GEMM inputs [silu(h1) * h2 | read output]
        XP=new(d), RP=new(1), FG=new(d),  # normalised predictions, their rms, fuse gates
    )
    if spec.memory:
        # Normalised [next key | query] of layer 0, [query] of later layers, and their norms;
        # head-block-major so that each step's key and query are contiguous.
        heads = [2] + [1] * (len(layers) - 1)
        S.NQ = [like.new_empty((T, h, B, H, dk)) for h in heads]
        S.NN = [like.new_empty((T, h, B, H, 1)) for h in heads]
        S.O = [new(H * dv) for _ in layers]  # raw reads
        S.E, S.BETA, S.GAMMA, S.DECAY = new(H, dv), new(H), new(H), new(H)  # the write's error and gates
        S.M = []  # M before every chunk
    return S


def _layer_steps(spec: Spec, S, i, col):
    """Per-step views of layer i's buffers and of the blocks of its projection."""
    Y, Fd, H, dk = S.Y[i], spec.F, spec.H, spec.dk
    v = dict(x=_steps(S.X[i]), r=_steps(S.R[i]), y=_steps(Y), z=_steps(S.Z[i]), pg=_steps(Y[..., col["pg"]]),
             h1=_steps(Y[..., col["ffn"]][..., :Fd]), h2=_steps(Y[..., col["ffn"]][..., Fd:]),
             z_ffn=_steps(S.Z[i][..., :Fd]), z_read=_steps(S.Z[i][..., Fd:]))
    if spec.memory:
        nh = S.NQ[i].shape[1]
        v.update(heads=_steps(Y[..., col["heads"]], nh, H, dk), gate=_steps(Y[..., col["gate"]]),
                 nq=_steps(S.NQ[i].transpose(1, 2)), nn=_steps(S.NN[i].transpose(1, 2)), q=_steps(S.NQ[i][:, -1]),
                 o=_steps(S.O[i]))
        if "k" in col:
            v.update(next_key=_steps(S.NQ[i][:, 0]), v=_steps(Y[..., col["v"]], H, spec.dv),
                     beta=_steps(Y[..., col["beta"]]), a=_steps(Y[..., col["a"]]))
    return v


def run_forward(spec: Spec, u, g, g_prev, M, A_log, layers, fg_W, fg_b, save: bool):
    """The loop over u (T, B, d), time-major. Returns (P (T, B, d), g, g_prev, M, saved or None).

    Without `save` the buffers hold one step (two for the key, which lives into the next step).
    """
    T, B, d = u.shape
    H, dk, nl = spec.H, spec.dk, len(layers)
    layers, fg_W, fg_b = _cast(spec, layers, fg_W, fg_b)
    cols = [columns(spec, i == 0) for i in range(nl)]
    S = _buffers(spec, layers, T if save else 2, B, g)
    V = [_layer_steps(spec, S, i, cols[i]) for i in range(nl)]
    XP, RP, FG = _steps(S.XP), _steps(S.RP), _steps(S.FG)
    P = g.new_empty((T, B, d))
    Ps, us = _steps(P), _steps(u.to(g.dtype))
    if spec.memory:
        A = -torch.exp(A_log.to(g.dtype))
        M = M.contiguous()
        E, BETA, GAMMA, DECAY = _steps(S.E), _steps(S.BETA), _steps(S.GAMMA), _steps(S.DECAY)
        S.x_prev, S.r_prev = _rms_hat(g_prev)
        k_col = cols[0]["k"]
        kpre = _mm(S.x_prev, layers[0].W[:, k_col], bias=layers[0].b[k_col])
        S.k0, S.k0n = _l2n_relu(kpre.view(B, H, dk))
        k = S.k0
    for t in range(T):
        s = t if save else t % 2
        if save and spec.memory and t % spec.chunk == 0:
            S.M.append(M)
        c = g
        for i, (L, v) in enumerate(zip(layers, V)):
            x, _ = _rms_hat(c, v["x"][s], v["r"][s])
            _mm(x, L.W, v["y"][s], L.b)
            torch.mul(F.silu(v["h1"][s]), v["h2"][s], out=v["z_ffn"][s])
            if spec.memory:
                _l2n_relu(v["heads"][s], v["nq"][s], v["nn"][s])
                if i == 0:
                    beta = torch.sigmoid(v["beta"][s], out=BETA[s])
                    decay = torch.exp(torch.mul(F.softplus(v["a"][s]), A, out=GAMMA[s]), out=DECAY[s])
                    M, *_ = memory_step(M, k, v["v"][s], beta, decay, v["q"][s], v["gate"][s],
                                        out_e=E[s], out_o=v["o"][s], out_y=v["z_read"][s])
                    k = v["next_key"][s]
                else:
                    memory_read(M, v["q"][s], v["gate"][s], out_o=v["o"][s], out_y=v["z_read"][s])
            c = torch.addcmul(_mm(v["z"][s], L.W2o), torch.sigmoid(v["pg"][s]), c, out=Ps[t] if i == nl - 1 else None)
        xp, _ = _rms_hat(c, XP[s], RP[s])
        fg = torch.sigmoid(_mm(xp, fg_W, FG[s], fg_b), out=FG[s])
        g_prev, g = g, torch.addcmul(us[t], fg, c)
    return P, g, g_prev, M, (S if save else None)


# ---- backward --------------------------------------------------------------------------------


def run_backward(spec: Spec, S, A_log, layers, fg_W, fg_b, dP, dg, dg_prev, dM):
    """The reverse sweep, then the weight GEMMs.

    dP (T, B, d), dg, dg_prev, dM: gradients w.r.t. the outputs (None where unused). Returns
    (du (T, B, d), dg0, dg_prev0, dM0, dA_log, [per layer (dW, db, dW2o)], dfg_W, dfg_b).
    """
    T, B, d = S.XP.shape
    H, dk, Fd, nl = spec.H, spec.dk, spec.F, len(layers)
    layers, fg_W, fg_b = _cast(spec, layers, fg_W, fg_b)
    cols = [columns(spec, i == 0) for i in range(nl)]
    zeros = lambda *shape: S.XP.new_zeros(shape)  # noqa: E731
    WT, W2oT, fg_WT = [L.W.T for L in layers], [L.W2o.T for L in layers], fg_W.T

    # Gradient buffers: w.r.t. each GEMM's output, kept for the weight GEMMs after the sweep.
    # The sweep writes every row of these.
    empty = lambda *shape: S.XP.new_empty(shape)  # noqa: E731
    dY = [empty(T, B, L.W.shape[1]) for L in layers]
    dZ = [empty(T, B, L.W2o.shape[0]) for L in layers]
    dU = [empty(T, B, d) for _ in layers]  # dL/d(layer output) = dL/d(second GEMM output)
    dYfg, du = empty(T, B, d), empty(T, B, d)

    # The parts of the elementwise derivatives that do not depend on the incoming gradient are
    # computed for all steps at once: the sweep is left with products, dots and GEMMs.
    V = [_layer_steps(spec, S, i, cols[i]) for i in range(nl)]
    for i, v in enumerate(V):
        Y, col = S.Y[i], cols[i]
        pg = torch.sigmoid(Y[..., col["pg"]])
        pg_fac = (S.X[i] * S.R[i]).mul_(pg).mul_(1 - pg)
        h1, h2 = Y[..., col["ffn"]].chunk(2, -1)
        ffn_fac = S.XP.new_empty((T, B, 2, Fd))  # (dL/dh1, dL/dh2) = dL/d(silu(h1) h2) * ffn_fac
        s1 = torch.sigmoid(h1)
        silu = torch.mul(h1, s1, out=ffn_fac[:, :, 1])
        torch.mul(torch.addcmul(s1 + silu, silu, s1, value=-1.0), h2, out=ffn_fac[:, :, 0])  # silu'(h1) h2
        v.update(pg_gate=_steps(pg), pg_fac=_steps(pg_fac), ffn_fac=_steps(ffn_fac),
                 dY=_steps(dY[i]), dZ=_steps(dZ[i]), dU=_steps(dU[i]), dffn=_steps(dY[i][..., col["ffn"]], 2, Fd),
                 dpg=_steps(dY[i][..., col["pg"]]), dz_ffn=_steps(dZ[i][..., None, :Fd]),
                 dz_read=_steps(dZ[i][..., Fd:]))
        if spec.memory:
            rf = read_factors(S.O[i], Y[..., col["gate"]])
            nh = S.NQ[i].shape[1]
            v.update(rf=[ReadFactors(*f) for f in zip(*map(_steps, rf))],
                     nq_mask=_steps(((S.NQ[i] > 0) / S.NN[i]).transpose(1, 2)),
                     dgate=_steps(dY[i][..., col["gate"]]), dheads=_steps(dY[i][..., col["heads"]], nh, H, dk))
    XP, RP, FG = _steps(S.XP), _steps(S.RP), _steps(S.FG)
    fg_fac = _steps((S.XP * S.RP).mul_(S.FG).mul_(1 - S.FG))
    dYfgs, dus = _steps(dYfg), _steps(du)
    dPs = _steps(dP) if dP is not None else None
    if spec.memory:
        col0, v0 = cols[0], V[0]
        A = -torch.exp(A_log.to(S.XP.dtype))
        # dL/d(beta, a pre-activations) = (dL/dbeta, dL/ddecay) * gate_fac
        da_fac = A * torch.sigmoid(S.Y[0][..., col0["a"]]) * S.DECAY
        gate_fac = _steps(torch.stack([S.BETA * (1 - S.BETA), da_fac], 2))  # (T, B, 2, H)
        delta = _steps(S.BETA.unsqueeze(-1) * S.E)
        E, BETA, DECAY = _steps(S.E), _steps(S.BETA), _steps(S.DECAY)
        keys = (S.k0,) + v0["next_key"][:-1]  # the key each step writes with
        dBD = S.XP.new_empty((T, 2, B, H))  # (dL/dbeta, dL/ddecay)
        dBDs, dBeta, dDecay = _steps(dBD.transpose(1, 2)), _steps(dBD[:, 0]), _steps(dBD[:, 1])
        dgates = _steps(dY[0][..., col0["beta"].start : col0["a"].stop], 2, H)
        dv, dkn = _steps(dY[0][..., col0["v"]], H, spec.dv), _steps(dY[0][..., col0["k"]])
        # dL/d(normalised [next key | query]) of layer 0: the key's part comes from the next step.
        dKQ = S.XP.new_empty((T, 2, B, H, dk))
        dKQ[-1, 0] = 0
        dKQs, dk_out, dq_out = _steps(dKQ.transpose(1, 2)), _steps(dKQ[:, 0]), _steps(dKQ[:, 1])
        dk0 = torch.empty_like(S.k0)
        dM = zeros(B, H, dk, spec.dv) if dM is None else dM
        kn_flows = True
        W_kT = layers[0].W[:, col0["k"]].T
    dg = zeros(B, d) if dg is None else dg

    for c0 in reversed(range(0, T, spec.chunk)):
        c1 = min(c0 + spec.chunk, T)
        if spec.memory:  # Ms[j] = M before step c0 + j, rebuilt from the chunk's start
            Ms = [S.M[c0 // spec.chunk]]
            for t in range(c0, c1):
                Ms.append(decay_and_write(Ms[-1], keys[t], delta[t], DECAY[t]))
        for t in reversed(range(c0, c1)):
            j = t - c0
            dus[t].copy_(dg)
            dc = _rms_hat_backward(XP[t], RP[t], _mm(torch.mul(dg, fg_fac[t], out=dYfgs[t]), fg_WT))
            if dPs is not None:
                dc += dPs[t]
            dc = torch.addcmul(dc, dg, FG[t], out=V[-1]["dU"][t])
            for i in reversed(range(nl)):
                v = V[i]
                dz = _mm(dc, W2oT[i], v["dZ"][t])
                torch.mul(v["dz_ffn"][t], v["ffn_fac"][t], out=v["dffn"][t])
                torch.mul(dc, v["pg_fac"][t], out=v["dpg"][t])
                if spec.memory:
                    if i == 0:
                        dM, _, dv_t, *_ = memory_step_backward(
                            Ms[j], Ms[j + 1], keys[t], BETA[t], DECAY[t], E[t], delta[t], v["q"][t], v["rf"][t], dM,
                            v["dz_read"][t], out_dk=dk_out[t - 1] if t > 0 else dk0, out_dq=dq_out[t],
                            out_dbeta=dBeta[t], out_ddecay=dDecay[t], out_dgate=v["dgate"][t])
                        dv[t].copy_(dv_t)
                        torch.mul(dBDs[t], gate_fac[t], out=dgates[t])
                        dq = dKQs[t]
                    else:
                        dq, _, dM = memory_read_backward(Ms[j + 1], v["q"][t], v["rf"][t], v["dz_read"][t], dM,
                                                         out_dgate=v["dgate"][t])
                        dq = dq.unsqueeze(1)
                    _l2n_relu_backward(v["nq"][t], v["nq_mask"][t], dq, out=v["dheads"][t])
                dx = _mm(v["dY"][t], WT[i])
                if i == 0 and spec.memory and not kn_flows:  # the next key's gradient reaches the weights only
                    dx -= _mm(dkn[t], W_kT)
                dc = torch.addcmul(_rms_hat_backward(v["x"][t], v["r"][t], dx), dc, v["pg_gate"][t],
                                   out=V[i - 1]["dU"][t] if i > 0 else None)
            dg = dc if (t < T - 1 or dg_prev is None) else dc + dg_prev
            if spec.bptt and t > 0 and t % spec.bptt == 0:  # where the naive core detaches the state
                dg = torch.zeros_like(dg)
                if spec.memory:
                    dM = torch.zeros_like(dM)
                    kn_flows = False
            elif spec.memory:
                kn_flows = True

    def gemm(X, G):  # X^T G over all rows, in the compute dtype, the result in the state dtype
        cd = spec.compute_dtype
        return (X.reshape(-1, X.shape[-1]).to(cd).T @ G.reshape(-1, G.shape[-1]).to(cd)).to(S.XP.dtype)

    grads = [(gemm(S.X[i], dY[i]), dY[i].sum((0, 1)), gemm(S.Z[i], dU[i])) for i in range(nl)]
    if not spec.memory:
        return du, dg, None, None, None, grads, gemm(S.XP, dYfg), dYfg.sum((0, 1))
    # The first key comes from the incoming previous state.
    dk0 = _l2n_relu_backward(S.k0, (S.k0 > 0) / S.k0n, dk0).flatten(1)
    grads[0][0][:, col0["k"]] += gemm(S.x_prev, dk0)
    grads[0][1][col0["k"]] += dk0.sum(0)
    dg_prev0 = _rms_hat_backward(S.x_prev, S.r_prev, _mm(dk0, W_kT))
    dA_log = (dBD[:, 1] * S.DECAY * S.GAMMA).sum((0, 1))
    return du, dg, dg_prev0, dM, dA_log, grads, gemm(S.XP, dYfg), dYfg.sum((0, 1))


class FusedCore(torch.autograd.Function):
    """(u, state, fused weights) -> (P, g, g_prev, M) with `run_forward` / `run_backward`."""

    @staticmethod
    def forward(ctx, spec, u, g, g_prev, M, A_log, fg_W, fg_b, *flat):
        layers = [LayerWeights(*flat[j : j + 3]) for j in range(0, len(flat), 3)]
        P, g, g_prev, M, S = run_forward(spec, u, g, g_prev, M, A_log, layers, fg_W, fg_b, save=True)
        ctx.spec, ctx.S, ctx.u_dtype = spec, S, u.dtype
        ctx.save_for_backward(A_log, fg_W, fg_b, *flat)
        ctx.set_materialize_grads(False)
        return P, g, g_prev.clone(), M

    @staticmethod
    def backward(ctx, dP, dg, dg_prev, dM):
        A_log, fg_W, fg_b, *flat = ctx.saved_tensors
        layers = [LayerWeights(*flat[j : j + 3]) for j in range(0, len(flat), 3)]
        with torch.autocast(fg_W.device.type, enabled=False):  # the compute dtype is the spec's
            du, dg0, dg_prev0, dM0, dA_log, grads, dfg_W, dfg_b = run_backward(
                ctx.spec, ctx.S, A_log, layers, fg_W, fg_b, dP, dg, dg_prev, dM)
        return (None, du.to(ctx.u_dtype), dg0, dg_prev0, dM0, dA_log, dfg_W, dfg_b, *(x for l in grads for x in l))


def fused_recurrence(model, u: torch.Tensor, state):
    """The fused core for a `GPN`: u (B, T, d) input projections, state a `GPNState`.

    Returns (predictions (B, T, d), (g, g_prev, M)).
    """
    cfg = model.config
    g, g_prev, M = state
    device = u.device.type
    cd = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else g.dtype
    spec = Spec(cfg.d_state, cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.d_val, cfg.memory, cfg.core_chunk, cfg.bptt, cd)
    A_log = model.write_A_log if cfg.memory else None
    u = u.transpose(0, 1)
    with torch.autocast(device, enabled=False):
        layers, fg_W, fg_b = fuse_weights(model)
        if torch.is_grad_enabled():
            flat = [x for L in layers for x in L]
            P, g, g_prev, M = FusedCore.apply(spec, u, g, g_prev, M, A_log, fg_W, fg_b, *flat)
        else:
            P, g, g_prev, M, _ = run_forward(spec, u, g, g_prev, M, A_log, layers, fg_W, fg_b, save=False)
    return P.transpose(0, 1), (g, g_prev, M)
