"""Triton kernels for the memory step of GPN+M, forward and backward.

The twin is kernels/memory/reference.py: same functions, same signatures, same outputs.

Layout of the work. Per (sequence, head) M is a dk x dv float32 block; the write and the read
are independent per column of M (e_j = v_j - M[:, j] . k, M[:, j] <- decay M[:, j] + k beta e_j,
o_j = M[:, j] . q), so the forward kernels run one program per (sequence, head, block of
columns) and move M through memory exactly once: one read, one write for a step, one read for
a read. The backward kernels split the columns the same way, reading M_prev and dM and writing
dM_prev (the M after the write is rebuilt in registers from M_prev, one M-sized read fewer).
What they reduce over columns (dq, dk, dbeta, ddecay) each block writes as partial sums to a
scratch buffer, and a small kernel per (sequence, head) adds the blocks in a fixed order
(`_head_sums`): a (sequence, head) of the 130M model is 16 blocks, so at batch 32 the backward
runs 7680 programs rather than 480, and the sums stay deterministic without atomics.

The output RMS norm and gate, y = silu(gate) o / rms(o), reduce over all heads of a sequence,
so they are a small kernel after the memory kernel (and before it, in the backward), not part
of it, split into column blocks of the sequence's row as kernels/step/triton.py's groups are.

Arithmetic follows M's dtype (float32, or float64 for gradient checks), which the outputs have:
every other input (k, v, q, gates, gradients) is converted to it on load, so one in a lower
precision is widened and one in float64 narrowed. The read's silu is kernels/numerics.py's
sigmoid, accurate to a few ulps on the GPU (docs/kernels_accuracy.md). Vectors are (B, H, n)
views whose last axis is contiguous with heads packed (a row of a wider buffer is fine);
anything else is copied first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import layout
from kernels.common import RMS_EPS
from kernels.memory import MemoryOps, ReadFactors
from kernels.numerics import _rounded, _sigmoid

# Elements of M per program tile. Small enough that the backward, which holds M_prev, dM and the
# per-row vectors of a tile at once, stays well under 128 registers per thread at 8 warps (128 x 16
# at dk = 128: 62 registers for sm_90, four programs per SM; 128 x 32 needs 118, two); large
# enough for 16 contiguous float32 (64 bytes) per row segment. Tiles are addressed from an int64 base pointer
# with int32 offsets inside, which saves a third of the registers against int64 offsets.
TILE = 2048
ROW_BLOCK = 1024  # the most columns of a row a program of the output norm takes (`layout.split`)


def _blocks(n_k: int, n_v: int) -> tuple[int, int]:
    bk = triton.next_power_of_2(n_k)
    return bk, min(triton.next_power_of_2(n_v), max(16, TILE // bk))


# ---- kernels ---------------------------------------------------------------------------------


@triton.jit
def _step_fwd(M, M_out, K, V, Q, BETA, DECAY, E, O, sk, sv, sq, sbeta, sdecay, se, so,
              H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    """M_out = decay M + k (beta e)^T, e = v - M^T k, o = M_out^T q, for one block of columns."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    M, M_out = M + bh * DK * DV, M_out + bh * DK * DV  # int64 once; offsets inside the block stay int32
    rows, cols = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    rmask, cmask = rows < DK, cols < DV
    mask = rmask[:, None] & cmask[None, :]
    tile = rows[:, None] * DV + cols[None, :]
    m = tl.load(M + tile, mask=mask, other=0.0)
    dt = M.dtype.element_ty
    k = tl.load(K + b * sk + h * DK + rows, mask=rmask, other=0.0).to(dt)
    q = tl.load(Q + b * sq + h * DK + rows, mask=rmask, other=0.0).to(dt)
    v = tl.load(V + b * sv + h * DV + cols, mask=cmask, other=0.0).to(dt)
    beta = tl.load(BETA + b * sbeta + h).to(dt)
    decay = tl.load(DECAY + b * sdecay + h).to(dt)
    e = v - tl.sum(m * k[:, None], 0)
    m = m * decay + k[:, None] * (beta * e)[None, :]
    tl.store(M_out + tile, m, mask=mask)
    tl.store(E + b * se + h * DV + cols, e, mask=cmask)
    tl.store(O + b * so + h * DV + cols, tl.sum(m * q[:, None], 0), mask=cmask)


@triton.jit
def _write(M, M_out, K, DELTA, DECAY, sk, sdelta, sdecay, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    """M_out = decay M + k delta^T: the same arithmetic as `_step_fwd`, the write alone (`decay_and_write`)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    M, M_out = M + bh * DK * DV, M_out + bh * DK * DV
    rows, cols = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    rmask, cmask = rows < DK, cols < DV
    mask = rmask[:, None] & cmask[None, :]
    tile = rows[:, None] * DV + cols[None, :]
    m = tl.load(M + tile, mask=mask, other=0.0)
    dt = M.dtype.element_ty
    k = tl.load(K + b * sk + h * DK + rows, mask=rmask, other=0.0).to(dt)
    delta = tl.load(DELTA + b * sdelta + h * DV + cols, mask=cmask, other=0.0).to(dt)
    decay = tl.load(DECAY + b * sdecay + h).to(dt)
    tl.store(M_out + tile, m * decay + k[:, None] * delta[None, :], mask=mask)


@triton.jit
def _read_fwd(M, Q, O, sq, so, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    """o = M^T q for one block of columns."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    rows, cols = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    rmask, cmask = rows < DK, cols < DV
    m = tl.load(M + bh * DK * DV + (rows[:, None] * DV + cols[None, :]), mask=rmask[:, None] & cmask[None, :], other=0.0)
    q = tl.load(Q + b * sq + h * DK + rows, mask=rmask, other=0.0).to(M.dtype.element_ty)
    tl.store(O + b * so + h * DV + cols, tl.sum(m * q[:, None], 0), mask=cmask)


@triton.jit
def _row_rms(ROW, N, eps, dt: tl.constexpr, BN: tl.constexpr):
    """rms of a row's N values (sqrt(mean of squares + eps)), summed in blocks of BN, in dt."""
    ss = tl.zeros([BN], dtype=dt)
    for c0 in range(0, N, BN):
        c = c0 + tl.arange(0, BN)
        o = tl.load(ROW + c, mask=c < N, other=0.0).to(dt)
        ss += o * o
    return tl.sqrt(tl.sum(ss, 0) / N + eps)


@triton.jit
def _gated_rms_fwd(O, GATE, Y, so, sg, sy, N, eps, BN: tl.constexpr):
    """y = silu(gate) o / rms(o) over one sequence's N = H dv read outputs, block p of them in
    program (b, p), which sums the row's squares itself (as kernels/step/triton.py's norms do).
    Computed in o's dtype, the state's; y may be the next GEMM's bf16, rounded on store."""
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = O.dtype.element_ty
    r = _row_rms(O + b * so, N, eps, dt, BN)
    c = p * BN + tl.arange(0, BN)
    mask = c < N
    o = tl.load(O + b * so + c, mask=mask, other=0.0).to(dt)
    g = tl.load(GATE + b * sg + c, mask=mask, other=0.0).to(dt)
    tl.store(Y + b * sy + c, _rounded(g * _sigmoid(g) * (o / r), Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_bwd(DY, R, O_HAT, SILU_GATE, TO_GATE, DO, DGATE, sdy, sr, soh, ssg, stg, sdo, sdg, N, BN: tl.constexpr):
    """do = (dhat - o_hat (dhat . o_hat) / N) / rms, dhat = dy silu(gate); dgate = dy to_gate
    (rounded on store: it may be the next GEMM's bf16). Block p in program (b, p), the dot
    product over the whole row in each."""
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = DO.dtype.element_ty
    dot = tl.zeros([BN], dtype=dt)
    for c0 in range(0, N, BN):
        c = c0 + tl.arange(0, BN)
        m = c < N
        dhat = tl.load(DY + b * sdy + c, mask=m, other=0.0).to(dt) * tl.load(SILU_GATE + b * ssg + c, mask=m, other=0.0).to(dt)
        dot += dhat * tl.load(O_HAT + b * soh + c, mask=m, other=0.0).to(dt)
    c = p * BN + tl.arange(0, BN)
    mask = c < N
    o_hat = tl.load(O_HAT + b * soh + c, mask=mask, other=0.0).to(dt)
    dy = tl.load(DY + b * sdy + c, mask=mask, other=0.0).to(dt)
    dhat = dy * tl.load(SILU_GATE + b * ssg + c, mask=mask, other=0.0).to(dt)
    r = tl.load(R + b * sr).to(dt)
    tl.store(DO + b * sdo + c, (dhat - o_hat * (tl.sum(dot, 0) / N)) / r, mask=mask)
    dgate = dy * tl.load(TO_GATE + b * stg + c, mask=mask, other=0.0).to(dt)
    tl.store(DGATE + b * sdg + c, _rounded(dgate, DGATE.dtype.element_ty), mask=mask)


@triton.jit
def _read_factors(O, GATE, R, O_HAT, SILU_GATE, TO_GATE, Y, so, sg, soh, ssg, stg, sy, N, eps, WRITE_Y: tl.constexpr,
                  BN: tl.constexpr):
    """The read's factors for block p of row b in program (b, p): o_hat = o / rms(o), silu(gate),
    o_hat silu'(gate) and (WRITE_Y) y = silu(gate) o_hat, rounded on store; rms(o) by block 0.
    The row's squares are summed by every program, as `_gated_rms_fwd` does. Computed in o's dtype;
    the gate may be the projection's bf16, widened on load."""
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dt = O.dtype.element_ty
    r = _row_rms(O + b * so, N, eps, dt, BN)
    tl.store(R + b, r, mask=p == 0)
    c = p * BN + tl.arange(0, BN)
    mask = c < N
    o_hat = tl.load(O + b * so + c, mask=mask, other=0.0).to(dt) / r
    g = tl.load(GATE + b * sg + c, mask=mask, other=0.0).to(dt)
    s = _sigmoid(g)
    silu = g * s
    tl.store(O_HAT + b * soh + c, o_hat, mask=mask)
    tl.store(SILU_GATE + b * ssg + c, silu, mask=mask)
    tl.store(TO_GATE + b * stg + c, o_hat * s * (1.0 + g * (1.0 - s)), mask=mask)
    if WRITE_Y:
        tl.store(Y + b * sy + c, _rounded(silu * o_hat, Y.dtype.element_ty), mask=mask)


@triton.jit
def _read_bwd(M, Q, DO, DM, DM_OUT, PART, sq, sdo, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    """dM_out = dM + q do^T for one block of columns; this block's share of dq = M do goes to PART."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    base = bh * DK * DV
    M, DM, DM_OUT = M + base, DM + base, DM_OUT + base
    rows, cols = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    rmask, cmask = rows < DK, cols < DV
    mask = rmask[:, None] & cmask[None, :]
    tile = rows[:, None] * DV + cols[None, :]
    dt = M.dtype.element_ty
    q = tl.load(Q + b * sq + h * DK + rows, mask=rmask, other=0.0).to(dt)
    do = tl.load(DO + b * sdo + h * DV + cols, mask=cmask, other=0.0).to(dt)
    tl.store(DM_OUT + tile, tl.load(DM + tile, mask=mask, other=0.0).to(dt) + q[:, None] * do[None, :], mask=mask)
    dq = tl.sum(tl.load(M + tile, mask=mask, other=0.0) * do[None, :], 1)
    tl.store(PART + (bh * tl.num_programs(1) + tl.program_id(1)) * DK + rows, dq, mask=rmask)


@triton.jit
def _step_bwd(M_PREV, K, Q, BETA, DECAY, E, DELTA, DO, DM, DM_PREV, DV_OUT, PART,
              sk, sq, sbeta, sdecay, se, sdelta, sdo, sdv, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    """The backward of `_step_fwd` and of the read's M^T q, given do (from `_gated_rms_bwd`), for
    one block of columns.

    With dM' = dM + q do^T (the read's share) and M = decay M_prev + k delta^T:
    dq = M do, d_delta = dM'^T k, dbeta = d_delta . e, dv = beta d_delta,
    dk = dM' delta - M_prev dv, ddecay = <dM', M_prev>, dM_prev = decay dM' - k dv^T.
    dv and dM_prev are per column, written here (dv rounded to DV_OUT's dtype; the rest of the
    block uses it unrounded); dq, dk, dbeta and ddecay sum over all columns: this block's shares
    go to its row of PART, [dq | dk | dbeta, ddecay], for `_head_sums`.
    """
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    base = bh * DK * DV  # int64 once; offsets inside the block stay int32
    M_PREV, DM, DM_PREV = M_PREV + base, DM + base, DM_PREV + base
    rows, cols = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    rmask, cmask = rows < DK, cols < DV
    mask = rmask[:, None] & cmask[None, :]
    tile = rows[:, None] * DV + cols[None, :]
    dt = M_PREV.dtype.element_ty
    k = tl.load(K + b * sk + h * DK + rows, mask=rmask, other=0.0).to(dt)
    q = tl.load(Q + b * sq + h * DK + rows, mask=rmask, other=0.0).to(dt)
    beta = tl.load(BETA + b * sbeta + h).to(dt)
    decay = tl.load(DECAY + b * sdecay + h).to(dt)
    p = tl.load(M_PREV + tile, mask=mask, other=0.0)
    do = tl.load(DO + b * sdo + h * DV + cols, mask=cmask, other=0.0).to(dt)
    e = tl.load(E + b * se + h * DV + cols, mask=cmask, other=0.0).to(dt)
    delta = tl.load(DELTA + b * sdelta + h * DV + cols, mask=cmask, other=0.0).to(dt)
    g = tl.load(DM + tile, mask=mask, other=0.0).to(dt) + q[:, None] * do[None, :]
    d_delta = tl.sum(k[:, None] * g, 0)
    dv = beta * d_delta
    tl.store(DV_OUT + b * sdv + h * DV + cols, _rounded(dv, DV_OUT.dtype.element_ty), mask=cmask)  # may be a GEMM's bf16 row
    tl.store(DM_PREV + tile, g * decay - k[:, None] * dv[None, :], mask=mask)
    part = PART + (bh * tl.num_programs(1) + tl.program_id(1)) * (2 * DK + 2)
    tl.store(part + rows, tl.sum((p * decay + k[:, None] * delta[None, :]) * do[None, :], 1), mask=rmask)
    tl.store(part + DK + rows, tl.sum(g * delta[None, :] - p * dv[None, :], 1), mask=rmask)
    tl.store(part + 2 * DK, tl.sum(d_delta * e, 0))
    tl.store(part + 2 * DK + 1, tl.sum(tl.sum(g * p, 0), 0))


@triton.jit
def _head_sums(PART, DQ, DK_OUT, DBETA, DDECAY, GF, DG, sdq, sdk, sdbeta, sddecay, sgf, sdg, H, DK, NB,
               BK: tl.constexpr, STEP: tl.constexpr, GATES: tl.constexpr):
    """The column sums of a backward run by column blocks, per (sequence, head): the NB blocks'
    partials added in block order, so the result does not depend on which program ran first.
    STEP: `_step_bwd`'s rows [dq | dk | dbeta, ddecay]; else `_read_bwd`'s [dq]. GATES: also
    (dbeta, ddecay) times their factors GF (rows [beta's | decay's], H each) into DG, rounded
    to its dtype (the projection GEMM's gradient row)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    rows = tl.arange(0, BK)
    rmask = rows < DK
    width = 2 * DK + 2 if STEP else DK
    part = PART + bh * NB * width
    dq = tl.load(part + rows, mask=rmask, other=0.0)
    if STEP:
        dk = tl.load(part + DK + rows, mask=rmask, other=0.0)
        dbeta = tl.load(part + 2 * DK)
        ddecay = tl.load(part + 2 * DK + 1)
    for j in range(1, NB):
        block = part + j * width
        dq += tl.load(block + rows, mask=rmask, other=0.0)
        if STEP:
            dk += tl.load(block + DK + rows, mask=rmask, other=0.0)
            dbeta += tl.load(block + 2 * DK)
            ddecay += tl.load(block + 2 * DK + 1)
    tl.store(DQ + b * sdq + h * DK + rows, dq, mask=rmask)
    if STEP:
        tl.store(DK_OUT + b * sdk + h * DK + rows, dk, mask=rmask)
        tl.store(DBETA + b * sdbeta + h, dbeta)
        tl.store(DDECAY + b * sddecay + h, ddecay)
        if GATES:
            dt = PART.dtype.element_ty
            tl.store(DG + b * sdg + h, _rounded(dbeta * tl.load(GF + b * sgf + h).to(dt), DG.dtype.element_ty))
            tl.store(DG + b * sdg + H + h, _rounded(ddecay * tl.load(GF + b * sgf + H + h).to(dt), DG.dtype.element_ty))


# ---- launchers: the twin's signatures --------------------------------------------------------


def _check_m(M: torch.Tensor) -> torch.Tensor:
    if not M.is_contiguous():
        raise ValueError("memory kernels: M must be contiguous (B, H, dk, dv)")
    return M


def memory_step(M, k, v, beta, decay, q, gate, *, out_e=None, out_o=None, out_y=None, out_M=None):
    """Write (k, v) into M, then read the new M with q. Returns (M_t, e, o, y), e = v - M^T k.
    M_t goes to `out_M` when given (contiguous, a buffer other than M)."""
    M = _check_m(M)
    B, H, n_k, n_v = M.shape
    bk, bv = _blocks(n_k, n_v)
    k, sk = layout.rows(k, H * n_k)
    q, sq = layout.rows(q, H * n_k)
    v, sv = layout.rows(v, H * n_v)
    beta, sbeta = layout.rows(beta, H)
    decay, sdecay = layout.rows(decay, H)
    M_out = layout.empty(M, M.shape) if out_M is None else _check_m(out_M)
    e_w, e, se = layout.out(out_e, H * n_v, M, (B, H, n_v))
    o_w, o, so = layout.out(out_o, H * n_v, M, (B, H * n_v))
    _step_fwd[(B * H, triton.cdiv(n_v, bv))](M, M_out, k, v, q, beta, decay, e_w, o_w, sk, sv, sq, sbeta, sdecay, se, so,
                                               H, n_k, n_v, BK=bk, BV=bv, num_warps=layout.warps(bk * bv))
    layout.finish(e_w, e)
    layout.finish(o_w, o)
    return M_out, e, o, _gated_rms(o, gate, out_y)


def decay_and_write(M, k, delta, decay, *, out_M=None):
    """decay M + k delta^T per head (the write alone), into `out_M` when given."""
    M = _check_m(M)
    B, H, n_k, n_v = M.shape
    bk, bv = _blocks(n_k, n_v)
    k, sk = layout.rows(k, H * n_k)
    delta, sdelta = layout.rows(delta, H * n_v)
    decay, sdecay = layout.rows(decay, H)
    M_out = layout.empty(M, M.shape) if out_M is None else _check_m(out_M)
    _write[(B * H, triton.cdiv(n_v, bv))](M, M_out, k, delta, decay, sk, sdelta, sdecay, H, n_k, n_v, BK=bk, BV=bv, num_warps=layout.warps(bk * bv))
    return M_out


def memory_read(M, q, gate, *, out_o=None, out_y=None):
    """Read M with q: returns (o, y)."""
    M = _check_m(M)
    B, H, n_k, n_v = M.shape
    bk, bv = _blocks(n_k, n_v)
    q, sq = layout.rows(q, H * n_k)
    o_w, o, so = layout.out(out_o, H * n_v, M, (B, H * n_v))
    _read_fwd[(B * H, triton.cdiv(n_v, bv))](M, q, o_w, sq, so, H, n_k, n_v, BK=bk, BV=bv, num_warps=layout.warps(bk * bv))
    layout.finish(o_w, o)
    return o, _gated_rms(o, gate, out_y)


def _gated_rms(o, gate, out_y):
    B, n = o.shape[0], o.numel() // o.shape[0]
    o, so = layout.rows(o, n)
    gate, sg = layout.rows(gate, n)
    y_w, y, sy = layout.out(out_y, n, o, (B, n))
    bn = layout.split(n, ROW_BLOCK)
    _gated_rms_fwd[(B, triton.cdiv(n, bn))](o, gate, y_w, so, sg, sy, n, RMS_EPS, BN=bn, num_warps=layout.warps(bn))
    return layout.finish(y_w, y)


def _read_grad(f: ReadFactors, dy, out_dgate, out_do=None):
    """(do, dgate) of y = silu(gate) o / rms(o), from the read's factors; do into `out_do` when
    given (B rows of H dv)."""
    B, n = dy.shape[0], dy.numel() // dy.shape[0]
    dy, sdy = layout.rows(dy, n)
    r, sr = layout.rows(f.rms, 1)
    o_hat, soh = layout.rows(f.o_hat, n)
    silu_gate, ssg = layout.rows(f.silu_gate, n)
    to_gate, stg = layout.rows(f.to_gate, n)
    do_w, do, sdo = layout.out(out_do, n, o_hat, (B, n))
    dg_w, dgate, sdg = layout.out(out_dgate, n, o_hat, (B, n))
    bn = layout.split(n, ROW_BLOCK)
    _gated_rms_bwd[(B, triton.cdiv(n, bn))](dy, r, o_hat, silu_gate, to_gate, do_w, dg_w, sdy, sr, soh, ssg, stg, sdo,
                                            sdg, n, BN=bn, num_warps=layout.warps(bn))
    return layout.finish(do_w, do), layout.finish(dg_w, dgate)


def read_factors(o, gate, *, out_y=None) -> ReadFactors:
    """The reads' `ReadFactors` over rows o (R, H*dv) and gates (R, H*dv, any dtype), and with
    `out_y` the read outputs, in one pass: once per chunk of the reverse sweep."""
    R, n = o.shape[0], o.numel() // o.shape[0]
    o, so = layout.rows(o, n)
    gate, sg = layout.rows(gate, n)
    r = layout.empty(o, (R, 1))
    o_hat, silu_gate, to_gate = (layout.empty(o, (R, n)) for _ in range(3))
    y_w, y, sy = (o_hat, None, 0) if out_y is None else layout.out(out_y, n, out_y, out_y.shape)
    bn = layout.split(n, ROW_BLOCK)
    _read_factors[(R, triton.cdiv(n, bn))](o, gate, r, o_hat, silu_gate, to_gate, y_w, so, sg, n, n, n, sy, n, RMS_EPS,
                                           WRITE_Y=out_y is not None, BN=bn, num_warps=layout.warps(bn))
    if out_y is not None:
        layout.finish(y_w, y)
    return ReadFactors(r, o_hat, silu_gate, to_gate)


def memory_read_backward(M, q, f: ReadFactors, dy, dM, *, out_dq=None, out_dgate=None, out_dM=None):
    """Gradients of `memory_read` given dy. Returns (dq, dgate, dM + the read's share of dL/dM),
    the last in `out_dM` when given (contiguous, a buffer other than dM)."""
    M = _check_m(M)
    B, H, n_k, n_v = M.shape
    bk, bv = _blocks(n_k, n_v)
    q, sq = layout.rows(q, H * n_k)
    do, dgate = _read_grad(f, dy, out_dgate)
    dM_out = layout.empty(M, M.shape) if out_dM is None else _check_m(out_dM)
    dq_w, dq, sdq = layout.out(out_dq, H * n_k, M, (B, H, n_k))
    nb = triton.cdiv(n_v, bv)
    part = layout.empty(M, (B * H, nb, n_k))
    _read_bwd[(B * H, nb)](M, q, do, dM.contiguous(), dM_out, part, sq, do.stride(0), H, n_k, n_v, BK=bk, BV=bv,
                           num_warps=layout.warps(bk * bv))
    # STEP=False writes dq alone: the other outputs' arguments are never touched.
    _head_sums[(B * H,)](part, dq_w, dq_w, dq_w, dq_w, dq_w, dq_w, sdq, sdq, sdq, sdq, sdq, sdq, H, n_k, nb, BK=bk, STEP=False,
                         GATES=False, num_warps=layout.warps(bk))
    return layout.finish(dq_w, dq), dgate, dM_out


def memory_step_backward(M_prev, M, k, beta, decay, e, delta, q, f: ReadFactors, dM, dy, *,
                         out_dk=None, out_dq=None, out_dbeta=None, out_ddecay=None, out_dgate=None, out_dM=None,
                         out_dv=None, gate_fac=None, out_dgates=None):
    """Gradients of `memory_step` given dM (w.r.t. M_t, from later steps) and dy.

    Returns (dM_prev, dk, dv, dbeta, ddecay, dq, dgate), dM_prev in `out_dM` when given
    (contiguous, a buffer other than dM); dv rounded into `out_dv` and, with `gate_fac`,
    (dbeta, ddecay) * gate_fac into `out_dgates`, in their dtypes (the twin's contract). M, the
    memory after the write, is rebuilt in registers from M_prev, k and delta rather than read:
    one M-sized read fewer. It stays in the signature of the twin, which reads it.
    """
    M_prev = _check_m(M_prev)
    B, H, n_k, n_v = M_prev.shape
    bk, bv = _blocks(n_k, n_v)
    k, sk = layout.rows(k, H * n_k)
    q, sq = layout.rows(q, H * n_k)
    beta, sbeta = layout.rows(beta, H)
    decay, sdecay = layout.rows(decay, H)
    e, se = layout.rows(e, H * n_v)
    delta, sdelta = layout.rows(delta, H * n_v)
    do, dgate = _read_grad(f, dy, out_dgate)
    dM_prev = layout.empty(M_prev, M_prev.shape) if out_dM is None else _check_m(out_dM)
    dv_w, dv, sdv = layout.out(out_dv, H * n_v, M_prev, (B, H, n_v))
    dk_w, dk, sdk = layout.out(out_dk, H * n_k, M_prev, (B, H, n_k))
    dq_w, dq, sdq = layout.out(out_dq, H * n_k, M_prev, (B, H, n_k))
    db_w, dbeta, sdb = layout.out(out_dbeta, H, M_prev, (B, H))
    dd_w, ddecay, sdd = layout.out(out_ddecay, H, M_prev, (B, H))
    nb = triton.cdiv(n_v, bv)
    gates = gate_fac is not None  # without it, dq_w stands in for GF and DG, which GATES=False never touches
    gate_fac, sgf = layout.rows(gate_fac, 2 * H) if gates else (dq_w, 0)
    dg_w, dgates, sdg = layout.out(out_dgates, 2 * H, M_prev, (B, 2, H)) if gates else (dq_w, None, 0)
    part = layout.empty(M_prev, (B * H, nb, 2 * n_k + 2))
    _step_bwd[(B * H, nb)](M_prev, k, q, beta, decay, e, delta, do, dM.contiguous(), dM_prev, dv_w, part,
                           sk, sq, sbeta, sdecay, se, sdelta, do.stride(0), sdv, H, n_k, n_v, BK=bk, BV=bv,
                           num_warps=layout.warps(bk * bv))
    _head_sums[(B * H,)](part, dq_w, dk_w, db_w, dd_w, gate_fac, dg_w, sdq, sdk, sdb, sdd, sgf, sdg, H, n_k, nb, BK=bk,
                         STEP=True, GATES=gates, num_warps=layout.warps(bk))
    for w, o in ((dk_w, dk), (dq_w, dq), (db_w, dbeta), (dd_w, ddecay), (dv_w, dv)) + (((dg_w, dgates),) if gates else ()):
        layout.finish(w, o)
    return dM_prev, dk, dv, dbeta, ddecay, dq, dgate


OPS = MemoryOps(memory_step, memory_read, decay_and_write, memory_read_backward, memory_step_backward, read_factors)
