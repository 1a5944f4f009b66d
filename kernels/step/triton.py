"""Triton kernels for the elementwise work of a fused-core step, one kernel per group.

The twin is kernels/step/reference.py (same functions, same signatures). Each group is one
launch, one program per column block of a sequence's row (`layout.split`: 2 x 132 programs at
batch 32, not 32), which reads the GEMM output it follows once and writes every per-step vector
that group produces: after the projection GEMM the SwiGLU, the heads' relu +
l2-normalisation and the write's gates (`post_projection`); after the second GEMM the gated
residual and the next input's RMS statistics (`residual_rms`); after the fuse-gate GEMM the
grounding and the next step's RMS statistics (`ground`); in the reverse sweep the rms-norm
backward with the gated residual (`residual_rms_backward`), the FFN and predict-gate factors
(`gate_grads`) and the heads' normalisation backward (`l2n_relu_backward`); once per chunk of the
sweep, the factors `gate_grads` multiplies by (`gate_factors`).

Arithmetic is in the dtype of the state (float32, or float64 for gradient checks): every input is
converted to it on load. Outputs that feed a GEMM may be narrower (bf16, the GEMM's compute
dtype) and are rounded on store, so the GEMMs around the groups cast nothing (`narrow_io`). Rows may be column slices of wider buffers (see
kernels/layout.py). exp, sigmoid and softplus are kernels/numerics.py's, accurate to a few ulps
on the GPU over float32's whole range (docs/kernels_accuracy.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import layout
from kernels.common import L2_EPS, RMS_EPS
from kernels.step import StepOps
from kernels.step import reference as twin
from kernels.numerics import _exp, _rounded, _sigmoid, _softplus

BLOCK = 1024  # the most columns a program takes (`layout.split` picks fewer to fill the GPU)


@triton.jit
def _post_projection(H1, H2, FFN, s_h1, s_h2, s_ffn, NF,
                     Z, NQ, NN, s_zb, s_zk, s_qb, s_qk, s_nb, s_nk, NHEADS, H, DK,
                     BETA_IN, A_IN, A, BETA, GAMMA, DECAY, s_bi, s_ai, s_b, s_g, s_d, NG,
                     HEADS: tl.constexpr, GATES: tl.constexpr, BHEADS: tl.constexpr, BK: tl.constexpr,
                     BH: tl.constexpr, BF: tl.constexpr, L2EPS: tl.constexpr):
    """Program (b, p): block p of the FFN's columns, block p of the heads, and (p = 0) the gates."""
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = FFN.dtype.element_ty
    if dt == tl.bfloat16:  # the next GEMM's input (`narrow_io`): computed in float32, rounded on store
        dt = tl.float32
    c = p * BF + tl.arange(0, BF)
    m = c < NF
    h1 = tl.load(H1 + b * s_h1 + c, mask=m, other=0.0).to(dt)
    h2 = tl.load(H2 + b * s_h2 + c, mask=m, other=0.0).to(dt)
    tl.store(FFN + b * s_ffn + c, _rounded(h1 * _sigmoid(h1) * h2, FFN.dtype.element_ty), mask=m)
    if HEADS:  # heads j = block * H + h, each dk wide: relu, then divide by sqrt(|.|^2 + eps)
        j, col = p * BHEADS + tl.arange(0, BHEADS), tl.arange(0, BK)
        blk, h = j // H, j % H
        m = (j < NHEADS)[:, None] & (col < DK)[None, :]
        z = tl.load(Z + b * s_zb + (blk * s_zk + h * DK)[:, None] + col[None, :], mask=m, other=0.0).to(NQ.dtype.element_ty)
        z = tl.where(z < 0.0, 0.0, z)  # relu; tl.maximum would turn a NaN into 0 (max.f32, fmax)
        n = tl.sqrt(tl.sum(z * z, 1) + L2EPS)
        tl.store(NQ + b * s_qb + (blk * s_qk + h * DK)[:, None] + col[None, :], z / n[:, None], mask=m)
        tl.store(NN + b * s_nb + blk * s_nk + h, n, mask=j < NHEADS)
    if GATES:
        h = tl.arange(0, BH)
        m = (h < NG) & (p == 0)
        dt = BETA.dtype.element_ty
        beta = tl.load(BETA_IN + b * s_bi + h, mask=m, other=0.0).to(dt)
        gamma = _softplus(tl.load(A_IN + b * s_ai + h, mask=m, other=0.0).to(dt)) * tl.load(A + h, mask=m, other=0.0).to(dt)
        tl.store(BETA + b * s_b + h, _sigmoid(beta), mask=m)
        tl.store(GAMMA + b * s_g + h, gamma, mask=m)
        tl.store(DECAY + b * s_d + h, _exp(gamma), mask=m)


# The groups with a norm over the row run one program per column block too: each program sums
# the whole row itself (the same loop in every program, so every block divides by the same
# number, deterministically) and writes its own block. A row is a few KB, read again from L2 by
# each of its blocks; a second kernel summing per-block partials would cost a launch per group.


@triton.jit
def _residual(Y, PG, C, s_y, s_pg, s_c, b, c, m, dt: tl.constexpr):
    pg = tl.load(PG + b * s_pg + c, mask=m, other=0.0).to(dt)
    return tl.load(Y + b * s_y + c, mask=m, other=0.0).to(dt) + _sigmoid(pg) * tl.load(C + b * s_c + c, mask=m, other=0.0).to(dt)


@triton.jit
def _rms_out(x, ss, HAT, R, b, p, c, m, s_hat, s_r, N, eps):
    """HAT = x / rms, R = rms for the block c of row b, ss the row's squares summed per lane."""
    r = tl.sqrt(tl.sum(ss, 0) / N + eps)
    tl.store(HAT + b * s_hat + c, _rounded(x / r, HAT.dtype.element_ty), mask=m)
    tl.store(R + b * s_r, r, mask=p == 0)


@triton.jit
def _residual_rms(Y, PG, C, OUT, HAT, R, s_y, s_pg, s_c, s_out, s_hat, s_r, N, eps, BN: tl.constexpr):
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = OUT.dtype.element_ty
    ss = tl.zeros([BN], dtype=dt)
    for c0 in range(0, N, BN):
        c = c0 + tl.arange(0, BN)
        x = _residual(Y, PG, C, s_y, s_pg, s_c, b, c, c < N, dt)
        ss += x * x
    c = p * BN + tl.arange(0, BN)
    m = c < N
    x = _residual(Y, PG, C, s_y, s_pg, s_c, b, c, m, dt)
    tl.store(OUT + b * s_out + c, x, mask=m)
    _rms_out(x, ss, HAT, R, b, p, c, m, s_hat, s_r, N, eps)


@triton.jit
def _grounded(YFG, C, U, s_y, s_c, s_u, b, c, m, dt: tl.constexpr):
    fg = _sigmoid(tl.load(YFG + b * s_y + c, mask=m, other=0.0).to(dt))
    return fg, tl.load(U + b * s_u + c, mask=m, other=0.0).to(dt) + fg * tl.load(C + b * s_c + c, mask=m, other=0.0).to(dt)


@triton.jit
def _ground(YFG, C, U, FG, G, HAT, R, s_y, s_c, s_u, s_fg, s_g, s_hat, s_r, N, eps,
            HAS_HAT: tl.constexpr, BN: tl.constexpr):
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = G.dtype.element_ty
    c = p * BN + tl.arange(0, BN)
    m = c < N
    fg, g = _grounded(YFG, C, U, s_y, s_c, s_u, b, c, m, dt)
    if HAS_HAT:  # the row is read before the gates are stored: they may go over YFG
        ss = tl.zeros([BN], dtype=dt)
        for c0 in range(0, N, BN):
            cc = c0 + tl.arange(0, BN)
            _, gg = _grounded(YFG, C, U, s_y, s_c, s_u, b, cc, cc < N, dt)
            ss += gg * gg
        _rms_out(g, ss, HAT, R, b, p, c, m, s_hat, s_r, N, eps)
    tl.store(FG + b * s_fg + c, _rounded(fg, FG.dtype.element_ty), mask=m)
    tl.store(G + b * s_g + c, g, mask=m)


@triton.jit
def _residual_rms_bwd(XH, R, DX, DC, GATE, EXTRA, OUT, LOW, LOW_FAC, s_xh, s_r, s_dx, s_dc, s_gate, s_ex, s_out, s_low,
                      s_lf, N, HAS_EXTRA: tl.constexpr, HAS_LOW: tl.constexpr, HAS_LOW_FAC: tl.constexpr,
                      BN: tl.constexpr):
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = OUT.dtype.element_ty
    dot = tl.zeros([BN], dtype=dt)  # dx . x_hat over the row, as _residual_rms sums its squares
    for c0 in range(0, N, BN):
        c = c0 + tl.arange(0, BN)
        m = c < N
        dot += tl.load(DX + b * s_dx + c, mask=m, other=0.0).to(dt) * tl.load(XH + b * s_xh + c, mask=m, other=0.0).to(dt)
    c = p * BN + tl.arange(0, BN)
    m = c < N
    xh = tl.load(XH + b * s_xh + c, mask=m, other=0.0).to(dt)
    dx = tl.load(DX + b * s_dx + c, mask=m, other=0.0).to(dt)
    out = (dx - xh * (tl.sum(dot, 0) / N)) / tl.load(R + b * s_r).to(dt)
    if HAS_EXTRA:
        out += tl.load(EXTRA + b * s_ex + c, mask=m, other=0.0).to(dt)
    out += tl.load(DC + b * s_dc + c, mask=m, other=0.0).to(dt) * tl.load(GATE + b * s_gate + c, mask=m, other=0.0).to(dt)
    tl.store(OUT + b * s_out + c, out, mask=m)
    if HAS_LOW:  # the same gradient rounded for the next GEMM, which reads its compute dtype
        low = out
        if HAS_LOW_FAC:  # through an elementwise factor first (the fuse gate's, for the next step's GEMM)
            low = out * tl.load(LOW_FAC + b * s_lf + c, mask=m, other=0.0).to(dt)
        tl.store(LOW + b * s_low + c, _rounded(low, LOW.dtype.element_ty), mask=m)


@triton.jit
def _gate_grads(DZ, FAC, DFFN, s_dz, s_fb, s_f2, s_db, s_d2, NF, DC, PGF, DPG, s_dc, s_pgf, s_dpg, ND,
                BF: tl.constexpr):
    """Program (b, p): block p of the FFN's columns and block p of the predict gate's."""
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = FAC.dtype.element_ty  # the state's: the outputs may be the next GEMM's narrower dtype
    dt_pg = PGF.dtype.element_ty
    c = p * BF + tl.arange(0, BF)
    m = c < NF
    dz = tl.load(DZ + b * s_dz + c, mask=m, other=0.0).to(dt)
    tl.store(DFFN + b * s_db + c, _rounded(dz * tl.load(FAC + b * s_fb + c, mask=m, other=0.0).to(dt), DFFN.dtype.element_ty),
             mask=m)
    tl.store(DFFN + b * s_db + s_d2 + c,
             _rounded(dz * tl.load(FAC + b * s_fb + s_f2 + c, mask=m, other=0.0).to(dt), DFFN.dtype.element_ty), mask=m)
    m = c < ND
    dpg = tl.load(DC + b * s_dc + c, mask=m, other=0.0).to(dt_pg) * tl.load(PGF + b * s_pgf + c, mask=m, other=0.0).to(dt_pg)
    tl.store(DPG + b * s_dpg + c, _rounded(dpg, DPG.dtype.element_ty), mask=m)


@triton.jit
def _gate_factors(H1, H2, FAC, FFN, s_h1, s_h2, s_fb, s_f2, s_ffn, NF, PG, XH, R, PGO, PGF, s_pg, s_xh, s_r, s_pgo, s_pgf,
                  ND, BF: tl.constexpr):
    """Program (row, p): block p of the SwiGLU's columns and block p of the predict gate's."""
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = FAC.dtype.element_ty  # the state's; the projection's blocks may be its GEMM's bf16, the SwiGLU's output too
    c = p * BF + tl.arange(0, BF)
    m = c < NF
    h1 = tl.load(H1 + b * s_h1 + c, mask=m, other=0.0).to(dt)
    h2 = tl.load(H2 + b * s_h2 + c, mask=m, other=0.0).to(dt)
    s1 = _sigmoid(h1)
    silu = h1 * s1
    tl.store(FAC + b * s_fb + c, (s1 + silu - silu * s1) * h2, mask=m)  # silu'(h1) h2
    tl.store(FAC + b * s_fb + s_f2 + c, silu, mask=m)
    tl.store(FFN + b * s_ffn + c, _rounded(silu * h2, FFN.dtype.element_ty), mask=m)
    m = c < ND
    g = _sigmoid(tl.load(PG + b * s_pg + c, mask=m, other=0.0).to(dt))
    tl.store(PGO + b * s_pgo + c, g, mask=m)
    xr = tl.load(XH + b * s_xh + c, mask=m, other=0.0).to(dt) * tl.load(R + b * s_r).to(dt)
    tl.store(PGF + b * s_pgf + c, xr * g * (1.0 - g), mask=m)


@triton.jit
def _l2n_relu_bwd(Y, MASK, DY, OUT, s_yb, s_yk, s_mb, s_mk, s_db, s_dk, s_ob, s_ok, NHEADS, H, DK,
                  BHEADS: tl.constexpr, BK: tl.constexpr):
    """Program (b, p): heads p BHEADS to (p + 1) BHEADS - 1 of sequence b."""
    b = tl.program_id(0).to(tl.int64)
    j, col = tl.program_id(1) * BHEADS + tl.arange(0, BHEADS), tl.arange(0, BK)
    blk, h = j // H, j % H
    m = (j < NHEADS)[:, None] & (col < DK)[None, :]
    at = (h * DK)[:, None] + col[None, :]
    dt = Y.dtype.element_ty  # the state's: the output may be the next GEMM's narrower dtype
    y = tl.load(Y + b * s_yb + (blk * s_yk)[:, None] + at, mask=m, other=0.0).to(dt)
    dy = tl.load(DY + b * s_db + (blk * s_dk)[:, None] + at, mask=m, other=0.0).to(dt)
    mask_over_norm = tl.load(MASK + b * s_mb + (blk * s_mk)[:, None] + at, mask=m, other=0.0).to(dt)
    out = (dy - y * tl.sum(dy * y, 1)[:, None]) * mask_over_norm
    tl.store(OUT + b * s_ob + (blk * s_ok)[:, None] + at, _rounded(out, OUT.dtype.element_ty), mask=m)


# ---- launchers: the twin's signatures --------------------------------------------------------


def post_projection(h1, h2, out_ffn, heads=None, out_heads=None, out_norms=None, beta=None, a=None, A=None,
                    out_beta=None, out_gamma=None, out_decay=None):
    """After a layer's projection GEMM: SwiGLU, the heads' relu + l2-normalisation, the write's gates."""
    B, nf = h1.shape
    h1, s_h1 = layout.rows(h1, nf)
    h2, s_h2 = layout.rows(h2, nf)
    ffn_w, ffn, s_ffn = layout.out(out_ffn, nf, h1, (B, nf))
    written = [(ffn_w, ffn)]
    # The arguments of a group that is off are placeholders the kernel never reads.
    heads_args, bheads, bk = (h1, h1, h1, 0, 0, 0, 0, 0, 0, 0, 1, 1), 1, 1
    if heads is not None:
        _, nb, H, dk = heads.shape
        out_heads = layout.empty(heads, heads.shape) if out_heads is None else out_heads
        out_norms = layout.empty(heads, (B, nb, H, 1)) if out_norms is None else out_norms
        z, s_zb, s_zk = layout.heads_in(heads)
        q_w, s_qb, s_qk = layout.heads_out(out_heads)
        n_w, s_nb, s_nk = layout.heads_out(out_norms)
        heads_args = (z, q_w, n_w, s_zb, s_zk, s_qb, s_qk, s_nb, s_nk, nb * H, H, dk)
        written += [(q_w, out_heads), (n_w, out_norms)]
        bk = triton.next_power_of_2(dk)
    bf = layout.split(nf, BLOCK)
    blocks = triton.cdiv(nf, bf)
    if heads is not None:  # as many programs for the heads as for the FFN, or more
        bheads = layout.split(nb * H, triton.next_power_of_2(triton.cdiv(nb * H, blocks)), least=1)
        blocks = max(blocks, triton.cdiv(nb * H, bheads))
    gate_args, bh = (h1,) * 6 + (0,) * 6, 1
    if beta is not None:
        nh = beta.shape[-1]
        beta, s_bi = layout.rows(beta, nh)
        a, s_ai = layout.rows(a, nh)
        outs = [layout.out(o, nh, beta, (B, nh)) for o in (out_beta, out_gamma, out_decay)]
        gate_args = (beta, a, A.contiguous(), *(w for w, _, _ in outs), s_bi, s_ai, *(st for _, _, st in outs), nh)
        written += [(w, o) for w, o, _ in outs]
        bh = triton.next_power_of_2(nh)
    _post_projection[(B, blocks)](h1, h2, ffn_w, s_h1, s_h2, s_ffn, nf, *heads_args, *gate_args, HEADS=heads is not None,
                                  GATES=beta is not None, BHEADS=bheads, BK=bk, BH=bh, BF=bf, L2EPS=L2_EPS,
                                  num_warps=layout.warps(max(bheads * bk, bf)))
    for w, o in written:
        layout.finish(w, o)


def _row_out(buf, like):
    return layout.out(buf, like.shape[1], like, like.shape)


def residual_rms(y, pg, c, out=None, out_hat=None, out_rms=None):
    """c' = y + sigmoid(pg) c and (c' / rms(c'), rms(c')) into out_hat, out_rms. Returns c'."""
    B, n = c.shape
    y, s_y = layout.rows(y, n)
    pg, s_pg = layout.rows(pg, n)
    c, s_c = layout.rows(c, n)
    o_w, o, s_o = _row_out(out, c)
    h_w, hat, s_h = _row_out(out_hat, c)
    r_w, r, s_r = layout.out(out_rms, 1, c, (B, 1))
    bn = layout.split(n, BLOCK)
    _residual_rms[(B, triton.cdiv(n, bn))](y, pg, c, o_w, h_w, r_w, s_y, s_pg, s_c, s_o, s_h, s_r, n, RMS_EPS, BN=bn,
                                           num_warps=layout.warps(bn))
    layout.finish(h_w, hat)
    layout.finish(r_w, r)
    return layout.finish(o_w, o)


def ground(y_fg, c, u, out_fg, out_hat=None, out_rms=None):
    """fg = sigmoid(y_fg) into out_fg, g = u + fg c, and (g / rms(g), rms(g)) into out_hat,
    out_rms when given. Returns g. With out_fg over y_fg and a norm to compute, one program per
    row (otherwise one per column block)."""
    B, n = c.shape
    y_fg, s_y = layout.rows(y_fg, n)
    c, s_c = layout.rows(c, n)
    u, s_u = layout.rows(u, n)
    fg_w, fg, s_fg = _row_out(out_fg, c)
    g = layout.empty(c, (B, n))
    h_w, r_w, s_h, s_r = g, g, 0, 0  # placeholders when there is no next step
    if out_hat is not None:
        h_w, hat, s_h = _row_out(out_hat, c)
        r_w, r, s_r = layout.out(out_rms, 1, c, (B, 1))
    bn = layout.split(n, BLOCK)
    if out_hat is not None and out_fg.untyped_storage().data_ptr() == y_fg.untyped_storage().data_ptr():
        # The gates written over their own input: every column block reads the whole row for the
        # norm, so one program must take the whole row, or a block could read another's gates.
        bn = max(bn, triton.next_power_of_2(n))
    _ground[(B, triton.cdiv(n, bn))](y_fg, c, u, fg_w, g, h_w, r_w, s_y, s_c, s_u, s_fg, n, s_h, s_r, n, RMS_EPS,
                                     HAS_HAT=out_hat is not None, BN=bn, num_warps=layout.warps(bn))
    layout.finish(fg_w, fg)
    if out_hat is not None:
        layout.finish(h_w, hat)
        layout.finish(r_w, r)
    return g


def residual_rms_backward(x_hat, r, dx_hat, dc, gate, extra=None, out=None, out_low=None, low_fac=None):
    """rms-norm backward of dx_hat + dc * gate [+ extra]; also into out_low (another dtype) when
    given, times low_fac when that is given."""
    B, n = x_hat.shape
    x_hat, s_xh = layout.rows(x_hat, n)
    r, s_r = layout.rows(r, 1)
    dx_hat, s_dx = layout.rows(dx_hat, n)
    dc, s_dc = layout.rows(dc, n)
    gate, s_gate = layout.rows(gate, n)
    has_extra = extra is not None
    extra, s_ex = layout.rows(extra, n) if has_extra else (x_hat, 0)  # a placeholder when there is none
    o_w, o, s_o = _row_out(out, x_hat)
    low_w, low, s_low = (o_w, None, 0) if out_low is None else _row_out(out_low, out_low)  # a placeholder when there is none
    has_fac = low_fac is not None
    low_fac, s_lf = layout.rows(low_fac, n) if has_fac else (x_hat, 0)
    bn = layout.split(n, BLOCK)
    _residual_rms_bwd[(B, triton.cdiv(n, bn))](x_hat, r, dx_hat, dc, gate, extra, o_w, low_w, low_fac, s_xh, s_r, s_dx, s_dc,
                                               s_gate, s_ex, s_o, s_low, s_lf, n, HAS_EXTRA=has_extra,
                                               HAS_LOW=out_low is not None, HAS_LOW_FAC=has_fac, BN=bn,
                                               num_warps=layout.warps(bn))
    if out_low is not None:
        layout.finish(low_w, low)
    return layout.finish(o_w, o)


def gate_grads(dz_ffn, ffn_fac, out_dffn, dc, pg_fac, out_dpg):
    """dz_ffn (B, 1, F) * ffn_fac (B, 2, F) into out_dffn (B, 2, F); dc * pg_fac into out_dpg."""
    B, _, nf = ffn_fac.shape
    dz, s_dz = layout.rows(dz_ffn.reshape(B, nf) if dz_ffn.dim() == 3 else dz_ffn, nf)
    fac, s_fb, s_f2 = _pair(ffn_fac)
    dffn_w, s_db, s_d2 = _pair(out_dffn, out=True)
    n = dc.shape[1]
    dc, s_dc = layout.rows(dc, n)
    pg_fac, s_pgf = layout.rows(pg_fac, n)
    dpg_w, dpg, s_dpg = _row_out(out_dpg, dc)
    bf = layout.split(max(nf, n), BLOCK)
    _gate_grads[(B, triton.cdiv(max(nf, n), bf))](dz, fac, dffn_w, s_dz, s_fb, s_f2, s_db, s_d2, nf, dc, pg_fac, dpg_w, s_dc,
                                                  s_pgf, s_dpg, n, BF=bf, num_warps=layout.warps(bf))
    layout.finish(dffn_w, out_dffn)
    layout.finish(dpg_w, dpg)


def gate_factors(h1, h2, pg, x_hat, r, out_fac, out_ffn, out_pg, out_pg_fac):
    """(silu'(h1) h2, silu(h1)) into out_fac (R, 2, F), silu(h1) h2 into out_ffn, sigmoid(pg) into
    out_pg and x_hat r sigmoid(pg) (1 - sigmoid(pg)) into out_pg_fac; the rows of a chunk. With h1
    None, the gate's alone (the fuse gate's)."""
    R, n = pg.shape
    pg, s_pg = layout.rows(pg, n)
    x_hat, s_xh = layout.rows(x_hat, n)
    r, s_r = layout.rows(r, 1)
    written = []
    if h1 is None:  # NF = 0: the FFN's arguments are placeholders the kernel never touches
        nf, h1, h2, fac_w, ffn_w, s_h1, s_h2, s_fb, s_f2, s_ffn = 0, pg, pg, out_pg, out_pg, 0, 0, 0, 0, 0
    else:
        nf = h1.shape[1]
        h1, s_h1 = layout.rows(h1, nf)
        h2, s_h2 = layout.rows(h2, nf)
        fac_w, s_fb, s_f2 = _pair(out_fac, out=True)
        ffn_w, ffn, s_ffn = layout.out(out_ffn, nf, out_ffn, out_ffn.shape)
        written = [(fac_w, out_fac), (ffn_w, ffn)]
    pgo_w, pgo, s_pgo = layout.out(out_pg, n, out_pg, out_pg.shape)
    pgf_w, pgf, s_pgf = layout.out(out_pg_fac, n, out_pg_fac, out_pg_fac.shape)
    bf = layout.split(max(nf, n), BLOCK)
    _gate_factors[(R, triton.cdiv(max(nf, n), bf))](h1, h2, fac_w, ffn_w, s_h1, s_h2, s_fb, s_f2, s_ffn, nf, pg, x_hat, r, pgo_w,
                                                    pgf_w, s_pg, s_xh, s_r, s_pgo, s_pgf, n, BF=bf, num_warps=layout.warps(bf))
    for w, buf in written + [(pgo_w, pgo), (pgf_w, pgf)]:
        layout.finish(w, buf)


def _pair(x, out=False):
    """A (B, 2, F) tensor with a contiguous last axis as (tensor, batch stride, pair stride)."""
    if x.stride(2) == 1 or x.shape[2] == 1:
        return x, x.stride(0), x.stride(1)
    if out:
        w = layout.empty(x, x.shape)
        return w, w.stride(0), w.stride(1)
    x = x.contiguous()
    return x, x.stride(0), x.stride(1)


def l2n_relu_backward(y, mask_over_norm, dy, out=None):
    """(dy - y (dy . y)) * mask_over_norm per head, over (B, n_blocks, H, dk) or (B, H, dk) views."""
    if y.dim() == 3:
        out = l2n_relu_backward(y.unsqueeze(1), mask_over_norm.unsqueeze(1), dy.unsqueeze(1), None if out is None else out.unsqueeze(1))
        return out.squeeze(1)
    B, nb, H, dk = y.shape
    y, s_yb, s_yk = layout.heads_in(y)
    mask_over_norm, s_mb, s_mk = layout.heads_in(mask_over_norm)
    dy, s_db, s_dk = layout.heads_in(dy)
    out = layout.empty(y, y.shape) if out is None else out
    o_w, s_ob, s_ok = layout.heads_out(out)
    bheads, bk = layout.split(nb * H, triton.next_power_of_2(nb * H), least=1), triton.next_power_of_2(dk)
    _l2n_relu_bwd[(B, triton.cdiv(nb * H, bheads))](y, mask_over_norm, dy, o_w, s_yb, s_yk, s_mb, s_mk, s_db, s_dk, s_ob, s_ok,
                                                    nb * H, H, dk, BHEADS=bheads, BK=bk, num_warps=layout.warps(bheads * bk))
    return layout.finish(o_w, out)


@triton.jit
def _ce_lse(X, LSE, s_x, N, BN: tl.constexpr):
    """Program b: row b's log-sum-exp in one pass over its N logits, a running maximum and sum
    per lane (the twin widens the row to float32 first, a pass and a row's float32 more)."""
    b = tl.program_id(0).to(tl.int64)
    dt = LSE.dtype.element_ty
    m = tl.full([BN], float("-inf"), dt)
    s = tl.zeros([BN], dt)
    for c0 in range(0, N, BN):
        c = c0 + tl.arange(0, BN)
        x = tl.load(X + b * s_x + c, mask=c < N, other=float("-inf")).to(dt)
        m_new = tl.where(x > m, x, m)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with no logit yet adds e^-inf = 0 (a NaN adds NaN)
        s = s * _exp(m - shift) + _exp(x - shift)
        m = m_new
    top = tl.max(m, 0)
    tl.store(LSE + b, top + tl.log(tl.sum(s * _exp(m - top), 0)))


@triton.jit
def _ce_grad(X, LSE, TGT, GL, OUT, s_x, s_t, s_g, s_o, N, BN: tl.constexpr):
    """Program (b, p): block p of row b's logit gradients (e^(x - lse) - [column = target]) g,
    computed in the log-sum-exp's dtype and rounded once on store."""
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = LSE.dtype.element_ty
    c = p * BN + tl.arange(0, BN)
    m = c < N
    x = tl.load(X + b * s_x + c, mask=m, other=0.0).to(dt)
    d = _exp(x - tl.load(LSE + b))
    d = tl.where(c == tl.load(TGT + b * s_t), d - 1.0, d)
    tl.store(OUT + b * s_o + c, _rounded(d * tl.load(GL + b * s_g).to(dt), OUT.dtype.element_ty), mask=m)


CE_BLOCK = 2048  # logits per program and loop iteration: rows are the vocabulary wide


def _rows(logits):
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected rows with contiguous columns, got shape {tuple(logits.shape)}, "
                         f"strides {logits.stride()}")
    return logits.shape


def ce_lse(logits):
    rows, n = _rows(logits)
    lse = torch.empty(rows, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    _ce_lse[(rows,)](logits, lse, logits.stride(0), n, BN=CE_BLOCK)
    return lse


def ce_grad(logits, lse, targets, g, dtype):
    rows, n = _rows(logits)
    out = torch.empty((rows, n), dtype=dtype, device=logits.device)
    g = g.to(lse.dtype)
    _ce_grad[(rows, triton.cdiv(n, CE_BLOCK))](logits, lse, targets, g, out, logits.stride(0), targets.stride(0),
                                               g.stride(0), out.stride(0), n, BN=CE_BLOCK)
    return out


# The GEMMs are BLAS's, and l2n_relu, rms_hat and its backward run once per window, outside the
# time loop: the twin's are as good as a kernel there.
OPS = StepOps(twin.pack, twin.mm, twin.rms_hat, twin.rms_hat_backward, twin.l2n_relu, l2n_relu_backward, post_projection,
              residual_rms, ground, residual_rms_backward, gate_grads, gate_factors, ce_lse, ce_grad, narrow_io=True)
