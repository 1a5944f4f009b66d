"""Triton kernels for the per-step functions of the memory's chunk form, forward and backward.

The twin is kernels/memory_chunk/reference.py: same functions, same signatures, same outputs.

Layout of the work, as kernels/memory/triton.py's: one program per (sequence, head, block of
M's columns), so a step moves M_c through memory once. Each program holds its dk x BV tile of
M_c and, for the chunk's terms, the chunk's keys (rows x dk) and its block of the chunk's deltas
and read gradients (rows x BV). What reduces over M's columns (the M_c products that give
dk-vectors, the dots that weight the chunk's rows) each block writes as partial sums, and one
small program per (sequence, head) adds the blocks in a fixed order (`_chunk_sums`), where it
also finishes the scalars: the decay's gradient from phi, and phi's update. A row of a chunk
buffer written in a launch is never read back in it: a step's own key and delta are used from
registers.

The chunk buffers are time-major and contiguous, (rows, B, H, d): row i of (sequence, head) bh
starts at (i B H + bh) d. A launcher passes each kernel exactly the rows it reads (K[:j] for the
keys before step j, the read gradients of rows j.., row j of a C x C matrix), as views whose
first element is that of their first row, so that a launch's arguments are the memory it moves
(bench/step_cost.py counts them); inside, rows are addressed from the view's first row. The
forward forms the decay products G(a, b) = d_{a+1} ... d_b from the chunk's decays with a
reversed cumulative product (a product over each range, never a ratio); the backward reads the
chunk's matrix of them, which `_chunk_coefficients` forms once per chunk with the rest of the
chunk's C x C algebra (one program per (sequence, head); `_chunk_finish` after the sweep).
Arithmetic follows M_c's dtype; every other input is converted on load. The read's output norm
and gate, forward and backward, are kernels/memory/triton.py's kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import layout
from kernels.memory import ReadFactors
from kernels.memory.triton import _blocks, _check_m, _gated_rms, _read_grad
from kernels.memory_chunk import ChunkOps
from kernels.memory_chunk import algebra as chunk_algebra
from kernels.memory_chunk.algebra import CarryBack, Coefficients, Rebuilt
from kernels.numerics import _rounded

@triton.jit
def _decays_to(DEC, sdt, bh, j, ci, dt: tl.constexpr):
    """G(i, j) for the chunk rows i (1 for i >= j), and G(-1, j), in dt: products of d_{i+1}..d_j
    from the chunk's decays (rows of B H from row 0, the time stride sdt). For j = -1: all 1."""
    d_next = tl.load(DEC + (ci + 1) * sdt + bh, mask=ci + 1 <= j, other=1.0).to(dt)
    g = tl.cumprod(d_next, 0, reverse=True)
    start = tl.load(DEC + bh, mask=j >= 0, other=1.0).to(dt) * tl.sum(tl.where(ci == 0, g, 0.0), 0)
    return g, start


@triton.jit
def _row(X, bh, d, idx, mask):
    """(Sequence, head) bh's elements idx of a (B, H, d) row."""
    return tl.load(X + bh * d + idx, mask=mask, other=0.0)


@triton.jit
def _rows(X, ci, bh, BH, d, idx, rmask, imask):
    """Rows ci (masked by rmask) of (sequence, head) bh of a time-major chunk buffer or view,
    elements idx."""
    return tl.load(X + (ci[:, None] * BH + bh) * d + idx[None, :], mask=rmask[:, None] & imask[None, :], other=0.0)


# ---- forward ---------------------------------------------------------------------------------


@triton.jit
def _chunk_step_fwd(MC, MC_END, KC, DC, DEC, K, V, Q, BETA, E, O, K_OUT, D_OUT, M_OUT, M_OUT_READ, j, sdt, sk, sv, sq, sbeta,
                    se, so, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, CLOSE: tl.constexpr,
                    APART: tl.constexpr, COPY: tl.constexpr):
    """Step j for one block of columns, from the chunk's rows before it (KC, DC: rows 0..j-1;
    DEC: the decays of rows 0..j): e = v - M_{j-1}^T k, delta = beta e (into D_OUT, and k into
    K_OUT: row j of the chunk buffers), o = M_j^T q; with CLOSE also M_j, the chunk's end, into
    M_OUT, and with COPY M_j rounded into M_OUT_READ (the next chunk's copy in the reads' dtype, as a
    cast would make it). The products read MC (M_c, or with APART its copy in a narrower dtype);
    M_j is formed from MC_END, M_c itself (APART), in the outputs' dtype."""
    bh = tl.program_id(0).to(tl.int64)
    BH = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows, cols, ci = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV), tl.arange(0, BC)
    rmask, cmask = rows < DK, cols < DV
    tile = rows[:, None] * DV + cols[None, :]
    dt = E.dtype.element_ty
    m = tl.load(MC + bh * DK * DV + tile, mask=rmask[:, None] & cmask[None, :], other=0.0).to(dt)
    k = tl.load(K + b * sk + h * DK + rows, mask=rmask, other=0.0).to(dt)
    q = tl.load(Q + b * sq + h * DK + rows, mask=rmask, other=0.0).to(dt)
    v = tl.load(V + b * sv + h * DV + cols, mask=cmask, other=0.0).to(dt)
    beta = tl.load(BETA + b * sbeta + h).to(dt)
    mk, mq = tl.sum(m * k[:, None], 0), tl.sum(m * q[:, None], 0)
    before = ci < j
    kc = _rows(KC, ci, bh, BH, DK, rows, before, rmask).to(dt)
    kk, kq = tl.sum(kc * k[None, :], 1), tl.sum(kc * q[None, :], 1)  # the chunk's keys are needed no further
    g_prev, start_prev = _decays_to(DEC, sdt, bh, j - 1, ci, dt)  # G(i, j-1), G(-1, j-1)
    d_j = tl.load(DEC + j * sdt + bh).to(dt)
    dc = _rows(DC, ci, bh, BH, DV, cols, before, cmask).to(dt)
    e = v - start_prev * mk - tl.sum((g_prev * kk)[:, None] * dc, 0)
    delta = beta * e
    tl.store(E + b * se + h * DV + cols, e, mask=cmask)
    tl.store(D_OUT + bh * DV + cols, delta, mask=cmask)
    if tl.program_id(1) == 0:
        tl.store(K_OUT + bh * DK + rows, k, mask=rmask)
    g, start = g_prev * d_j, start_prev * d_j  # G(i, j) for i < j, G(-1, j)
    o = start * mq + tl.sum((g * kq)[:, None] * dc, 0) + tl.sum(k * q, 0) * delta
    tl.store(O + b * so + h * DV + cols, o, mask=cmask)
    if CLOSE:  # M_j = G(-1, j) M_c + sum_{i <= j} G(i, j) k_i delta_i^T
        if APART:
            m = tl.load(MC_END + bh * DK * DV + tile, mask=rmask[:, None] & cmask[None, :], other=0.0).to(dt)
        acc = start * m + k[:, None] * delta[None, :]
        for i in range(0, j):
            g_i = tl.sum(tl.where(ci == i, g, 0.0), 0)
            k_i = tl.load(KC + (i * BH + bh) * DK + rows, mask=rmask, other=0.0).to(dt)
            d_i = tl.load(DC + (i * BH + bh) * DV + cols, mask=cmask, other=0.0).to(dt)
            acc += g_i * k_i[:, None] * d_i[None, :]
        tl.store(M_OUT + bh * DK * DV + tile, acc, mask=rmask[:, None] & cmask[None, :])
        if COPY:
            tl.store(M_OUT_READ + bh * DK * DV + tile, _rounded(acc, M_OUT_READ.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _chunk_read_fwd(MC, KC, DC, DEC, Q, O, j, sdt, sq, so, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr,
                    BC: tl.constexpr):
    """A later layer's read of M_j at step j (KC, DC: the chunk's rows 0..j), one block of
    columns: o = G(-1, j) M_c^T q + sum_{i <= j} G(i, j) (k_i . q) delta_i."""
    bh = tl.program_id(0).to(tl.int64)
    BH = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows, cols, ci = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV), tl.arange(0, BC)
    rmask, cmask = rows < DK, cols < DV
    dt = O.dtype.element_ty
    m = tl.load(MC + bh * DK * DV + rows[:, None] * DV + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(dt)
    q = tl.load(Q + b * sq + h * DK + rows, mask=rmask, other=0.0).to(dt)
    g, start = _decays_to(DEC, sdt, bh, j, ci, dt)
    upto = ci <= j
    kq = tl.sum(_rows(KC, ci, bh, BH, DK, rows, upto, rmask).to(dt) * q[None, :], 1)
    dc = _rows(DC, ci, bh, BH, DV, cols, upto, cmask).to(dt)
    o = start * tl.sum(m * q[:, None], 0) + tl.sum((g * kq)[:, None] * dc, 0)
    tl.store(O + b * so + h * DV + cols, o, mask=cmask)


# ---- backward --------------------------------------------------------------------------------
# One program per (sequence, head): what the step reduces over M's columns (the M_c products that
# give dk-vectors, the dots that weight the chunk's rows) it accumulates over a loop of column
# tiles, so nothing goes through memory between blocks; then it combines the chunk's keys and
# queries with those coefficients, reading them once per head. The chunk's C x C matrices (decay
# products, c, h, Bm: (B, H, N [+ 1], N) each, contiguous) are passed as views of the row or
# column a step reads: element i of (sequence, head) bh of a column view is at bh (N + 1) N + i N
# (decay products; bh N N + i N for Bm), of a row view at bh (...) + i.


@triton.jit
def _chunk_read_bwd(MC, KC, DC, G_J, DO, O, PHI, DQ, j, N, sdo, so, sdq, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr,
                    BC: tl.constexpr):
    """A later layer's read at step j backwards (KC, DC: the chunk's keys and deltas of rows
    0..j; G_J: column j of the decay products): dq = M_j do = G(-1, j) M_c do + sum_{i <= j}
    G(i, j) (delta_i . do) k_i into DQ, and phi += do . o."""
    bh = tl.program_id(0).to(tl.int64)
    BH = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows, ci = tl.arange(0, BK), tl.arange(0, BC)
    rmask, upto = rows < DK, ci <= j
    dt = DQ.dtype.element_ty
    m_do = tl.zeros([BK], dtype=dt)
    w_do = tl.zeros([BC], dtype=dt)
    do_o = tl.zeros([BV], dtype=dt)
    for c0 in range(0, DV, BV):
        cols = c0 + tl.arange(0, BV)
        cmask = cols < DV
        m = tl.load(MC + bh * DK * DV + rows[:, None] * DV + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(dt)
        do = tl.load(DO + b * sdo + h * DV + cols, mask=cmask, other=0.0).to(dt)
        dc = _rows(DC, ci, bh, BH, DV, cols, upto, cmask).to(dt)
        m_do += tl.sum(m * do[None, :], 1)
        w_do += tl.sum(dc * do[None, :], 1)
        do_o += do * tl.load(O + b * so + h * DV + cols, mask=cmask, other=0.0).to(dt)
    kc = _rows(KC, ci, bh, BH, DK, rows, upto, rmask).to(dt)
    g = tl.load(G_J + bh * (N + 1) * N + (ci + 1) * N, mask=upto, other=0.0).to(dt)  # G(i, j)
    start = tl.load(G_J + bh * (N + 1) * N).to(dt)  # G(-1, j)
    tl.store(DQ + b * sdq + h * DK + rows, start * m_do + tl.sum((g * w_do)[:, None] * kc, 0), mask=rmask)
    tl.store(PHI + bh, tl.load(PHI + bh).to(dt) + tl.sum(do_o, 0))


@triton.jit
def _chunk_step_bwd(MC, KC, DC, QS, RG, CC, U, VC, G_J, G_P, G_ROW, HH, BM, E, V, O, BETA, PHI, DV_OUT, DQ, DK_OUT, DBETA,
                    DGAMMA, GF, DG, j, N, NL, sq_l, srg_l, su, svc, se, sv, so, sbeta, sdv, sdq, sdk, sdbeta, sdgamma, sgf, sdg,
                    H, DK, DV, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, BL: tl.constexpr,
                    GATES: tl.constexpr):
    """Step j backwards for one (sequence, head). KC: the chunk's keys (all N rows); DC: its
    deltas of rows 0..j; QS: every layer's queries of rows j..N-1; RG: every layer's read
    gradients of rows j..N-1 (row j of layer 0's too, written by earlier launches); CC: row j of
    each layer's c from column j; U, VC: row j of U and V (strides su, svc between (sequence, head)); G_J, G_P: columns j and j-1 of the
    decay products; G_ROW: G(j, s) from s = j; HH: each layer's h from [j+1, j]; BM: Bm's column
    j from row j+1. Over the column tiles: d_delta = U_j + sum_layers sum_{s >= j} c[j, s] do_s
    (dv = beta d_delta into DV_OUT), a_s = do_s . delta_j, and the M_c products and row dots;
    then
        dq = M_j do_0,  dk = G_j delta_j - beta M_{j-1} d_delta,
        G_j delta_j = V_j + sum_layers (sum_{s >= j} a_s G(j, s) q_s - sum_{m > j} Bm[m, j] (h a)_m k_m),
        dbeta = d_delta . e;  phi += do_0 . o_0, dL/dgamma = phi - k_j . G_j delta_j, phi -= beta d_delta . v,
    with GATES also (dbeta, dL/dgamma) times their factors GF into DG, rounded to its dtype."""
    bh = tl.program_id(0).to(tl.int64)
    BH = tl.num_programs(0)
    b, h = bh // H, bh % H
    rows, ci, li = tl.arange(0, BK), tl.arange(0, BC), tl.arange(0, BL)
    rmask = rows < DK
    dt = DQ.dtype.element_ty
    later, after, upto = ci < N - j, ci < N - j - 1, ci <= j  # rows j + ci, j + 1 + ci, ci
    beta = tl.load(BETA + b * sbeta + h).to(dt)
    c_rows = tl.load(CC + (li[:, None] * BH + bh) * N * N + ci[None, :], mask=(li < NL)[:, None] & later[None, :],
                     other=0.0).to(dt)  # c[j, j + ci] per layer
    m_do = tl.zeros([BK], dtype=dt)
    m_dd = tl.zeros([BK], dtype=dt)
    w_do = tl.zeros([BC], dtype=dt)
    w_dd = tl.zeros([BC], dtype=dt)
    a_rows = tl.zeros([BL, BC], dtype=dt)  # per layer do_s . delta_j, s = j + ci
    dd_e = tl.zeros([BV], dtype=dt)
    dd_v = tl.zeros([BV], dtype=dt)
    do_o = tl.zeros([BV], dtype=dt)
    for c0 in range(0, DV, BV):
        cols = c0 + tl.arange(0, BV)
        cmask = cols < DV
        delta = tl.load(DC + (j * BH + bh) * DV + cols, mask=cmask, other=0.0).to(dt)
        d_delta = tl.load(U + bh * su + cols, mask=cmask, other=0.0).to(dt)
        for layer in range(0, NL):
            rg = _rows(RG + layer * srg_l, ci, bh, BH, DV, cols, later, cmask).to(dt)
            c_row = tl.sum(tl.where((li == layer)[:, None], c_rows, 0.0), 0)
            d_delta += tl.sum(c_row[:, None] * rg, 0)
            a_rows += tl.where((li == layer)[:, None], tl.sum(rg * delta[None, :], 1)[None, :], 0.0)
        tl.store(DV_OUT + b * sdv + h * DV + cols, _rounded(beta * d_delta, DV_OUT.dtype.element_ty), mask=cmask)
        m = tl.load(MC + bh * DK * DV + rows[:, None] * DV + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(dt)
        do = tl.load(RG + bh * DV + cols, mask=cmask, other=0.0).to(dt)
        dc = _rows(DC, ci, bh, BH, DV, cols, upto, cmask).to(dt)
        m_do += tl.sum(m * do[None, :], 1)
        m_dd += tl.sum(m * d_delta[None, :], 1)
        w_do += tl.sum(dc * do[None, :], 1)
        w_dd += tl.sum(dc * d_delta[None, :], 1)
        dd_e += d_delta * tl.load(E + b * se + h * DV + cols, mask=cmask, other=0.0).to(dt)
        dd_v += d_delta * tl.load(V + b * sv + h * DV + cols, mask=cmask, other=0.0).to(dt)
        do_o += do * tl.load(O + b * so + h * DV + cols, mask=cmask, other=0.0).to(dt)
    # The chunk's keys and queries enter through combinations with coefficients over its rows i:
    # dq = G(-1, j) M_c do_0 + sum_i G(i, j) w_do[i] k_i, and
    # dk = V_j + sum_s (a_s G(j, s)) q_s - beta G(-1, j-1) M_c d_delta
    #      - sum_i (beta G(i, j-1) w_dd[i] + [i > j] Bm[i, j] (h a)_i) k_i,
    # taken a row at a time (no rows x dk tile is held).
    g_j = tl.load(G_J + bh * (N + 1) * N + (ci + 1) * N, mask=upto, other=0.0).to(dt)  # G(i, j)
    start_j = tl.load(G_J + bh * (N + 1) * N).to(dt)  # G(-1, j)
    g_p = tl.load(G_P + bh * (N + 1) * N + (ci + 1) * N, mask=ci < j, other=0.0).to(dt)  # G(i, j-1)
    start_p = tl.load(G_P + bh * (N + 1) * N, mask=j > 0, other=1.0).to(dt)  # G(-1, j-1); 1 at j = 0
    g_later = tl.load(G_ROW + bh * (N + 1) * N + ci, mask=later, other=0.0).to(dt)  # G(j, j + ci)
    bm = tl.load(BM + bh * N * N + ci * N, mask=after, other=0.0).to(dt)  # beta_m G(j, m-1), m = j + 1 + ci
    g_delta = tl.load(VC + bh * svc + rows, mask=rmask, other=0.0).to(dt)  # V_j, then each layer's queries
    ha = tl.zeros([BC], dtype=dt)  # sum over layers of (h a)_m, m = j + 1 + ci
    for layer in range(0, NL):
        a = tl.sum(tl.where((li == layer)[:, None], a_rows, 0.0), 0) * g_later
        for s in range(j, N):
            q_s = tl.load(QS + layer * sq_l + ((s - j) * BH + bh) * DK + rows, mask=rmask, other=0.0).to(dt)
            g_delta += tl.sum(tl.where(ci == s - j, a, 0.0), 0) * q_s
        hh = tl.load(HH + (layer * BH + bh) * N * N + ci[:, None] * N + ci[None, :],
                     mask=after[:, None] & later[None, :], other=0.0).to(dt)  # h[j + 1 + m', j + s']
        ha += tl.sum(hh * tl.sum(tl.where((li == layer)[:, None], a_rows, 0.0), 0)[None, :], 1)
    # (Bm h a) of rows j + 1 + m', moved to the chunk's rows i = j + 1 + m'
    shifted = tl.sum(tl.where(ci[:, None] == ci[None, :] + j + 1, (bm * ha)[None, :], 0.0), 1)
    coef_q = g_j * w_do
    coef_k = beta * g_p * w_dd + shifted
    k_j = tl.load(KC + (j * BH + bh) * DK + rows, mask=rmask, other=0.0).to(dt)
    dq = start_j * m_do
    dk = g_delta - beta * start_p * m_dd
    k_g_delta = tl.sum(k_j * g_delta, 0)
    for i in range(0, N):
        k_i = tl.load(KC + (i * BH + bh) * DK + rows, mask=rmask, other=0.0).to(dt)
        dq += tl.sum(tl.where(ci == i, coef_q, 0.0), 0) * k_i
        dk -= tl.sum(tl.where(ci == i, coef_k, 0.0), 0) * k_i
        k_g_delta -= tl.sum(tl.where(ci == i, shifted, 0.0), 0) * tl.sum(k_i * k_j, 0)
    tl.store(DQ + b * sdq + h * DK + rows, dq, mask=rmask)
    tl.store(DK_OUT + b * sdk + h * DK + rows, dk, mask=rmask)
    dbeta = tl.sum(dd_e, 0)
    phi = tl.load(PHI + bh).to(dt) + tl.sum(do_o, 0)
    dgamma = phi - k_g_delta
    tl.store(PHI + bh, phi - beta * tl.sum(dd_v, 0))
    tl.store(DBETA + b * sdbeta + h, dbeta)
    tl.store(DGAMMA + b * sdgamma + h, dgamma)
    if GATES:
        tl.store(DG + b * sdg + h, _rounded(dbeta * tl.load(GF + b * sgf + h).to(dt), DG.dtype.element_ty))
        tl.store(DG + b * sdg + H + h, _rounded(dgamma * tl.load(GF + b * sgf + H + h).to(dt), DG.dtype.element_ty))


# ---- once per chunk: the passes over dL/dM ---------------------------------------------------


@triton.jit
def _chunk_dm_products(DM, KC, DC, U0, V0, N, DK, DV, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr):
    """Per (sequence, head), one pass over dM_end's column tiles: U0 = K dM_end (rows k_i^T dM_end,
    (B, H, N, DV)) and V0 = Delta dM_end^T (rows (dM_end delta_i)^T, (B, H, N, DK))."""
    bh = tl.program_id(0).to(tl.int64)
    BH = tl.num_programs(0)
    rows, ci = tl.arange(0, BK), tl.arange(0, BC)
    rmask, inrows = rows < DK, ci < N
    dt = DM.dtype.element_ty
    kc = _rows(KC, ci, bh, BH, DK, rows, inrows, rmask).to(dt)
    v0 = tl.zeros([BC, BK], dtype=dt)
    for c0 in range(0, DV, BV):
        cols = c0 + tl.arange(0, BV)
        cmask = cols < DV
        m = tl.load(DM + bh * DK * DV + rows[:, None] * DV + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        dc = _rows(DC, ci, bh, BH, DV, cols, inrows, cmask).to(dt)
        u = tl.dot(kc, m, input_precision="ieee")
        tl.store(U0 + bh * N * DV + ci[:, None] * DV + cols[None, :], u, mask=inrows[:, None] & cmask[None, :])
        v0 += tl.dot(dc, tl.trans(m), input_precision="ieee")
    tl.store(V0 + bh * N * DK + ci[:, None] * DK + rows[None, :], v0, mask=inrows[:, None] & rmask[None, :])


@triton.jit
def _square(N, BC: tl.constexpr):
    """A once-per-chunk program's (sequence, head) bh (of BH) and its chunk's C x C tile: the rows
    ci, as a column r and a row c, and the masks of the N rows and of the N x N block."""
    bh = tl.program_id(0).to(tl.int64)
    ci = tl.arange(0, BC)
    r, c = ci[:, None], ci[None, :]
    return bh, tl.num_programs(0), ci, r, c, ci < N, (r < N) & (c < N)


@triton.jit
def _chunk_coefficients(KC, DC, BETA, DEC, Q, U0, V0, GAM, T_OUT, KK_OUT, BM_OUT, U_OUT, V_OUT, C_OUT, H_OUT, N, NL, sq, DK,
                        DV, BD: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr):
    """Per (sequence, head), the chunk's C x C algebra and the weights its sweep reads of dM_end, as
    `algebra.from_forward` and `algebra.coefficients` make them, from its keys (KC), deltas (DC),
    betas, decays, queries (Q: NL layers of time-major rows, sq apart) and dM_end's products U0, V0
    (`_chunk_dm_products`, (B, H, N, d)). Writes G(a, b) (GAM, (B, H, N + 1, N)), the UT form's
    T = L^-1, the keys' Gram matrix, Bm, U, V and per layer c and h. The decay products are
    cumulative products over each range (never ratios), T comes by forward substitution, one row
    after the other; the products over the keys' and values' widths take BD and BV columns at a
    time (a whole key row beside the C x C matrices would not fit in registers)."""
    bh, BH, ci, r, c, inrows, nn = _square(N, BC)
    dt = T_OUT.dtype.element_ty
    d = tl.load(DEC + ci * BH + bh, mask=inrows, other=1.0).to(dt)
    d_prev = tl.load(DEC + tl.maximum(ci - 1, 0) * BH + bh, mask=(ci >= 1) & (ci <= N), other=1.0).to(dt)  # d_{b-1}
    beta = tl.load(BETA + ci * BH + bh, mask=inrows, other=0.0).to(dt)
    one = tl.full([BC, BC], 1.0, dt)
    g = tl.where(c >= r, tl.cumprod(tl.where(c > r, d[None, :], one), 1), 0.0)  # G(i, b) = d_{i+1} ... d_b
    w = tl.trans(tl.cumprod(tl.where(c > r + 1, d_prev[None, :], one), 1))  # w[j, i] = G(i, j - 1)
    kk = tl.zeros([BC, BC], dtype=dt)
    for k0 in range(0, DK, BD):
        ks = k0 + tl.arange(0, BD)
        kc = _rows(KC, ci, bh, BH, DK, ks, inrows, ks < DK).to(dt)
        kk += tl.dot(kc, tl.trans(kc), input_precision="ieee")
    bm = tl.where(r > c, beta[:, None] * w, 0.0)  # Bm[m, j] = beta_m G(j, m - 1), m > j
    lsb = bm * kk  # L - I: beta_j G(i, j - 1) k_j . k_i below the diagonal
    eye = tl.where(r == c, one, 0.0)
    t, lsb_t = eye, tl.trans(lsb)
    for i in range(1, N):  # row i of L^-1 from the rows above it
        col = tl.sum(tl.where(c == i, lsb_t, 0.0), 1)  # L[i, m], along m
        row = tl.sum(tl.where(r == i, eye, 0.0), 0) - tl.sum(col[:, None] * t, 0)
        t = tl.where(r == i, row[None, :], t)
    x = tl.trans(tl.dot(t, lsb, input_precision="ieee"))  # X[j, i] = sum_m T[i, m] Bm[m, j] k_m . k_j
    g_end = tl.sum(tl.where(c == N - 1, g, 0.0), 1)  # G(i, n - 1)
    mx = (eye - x) * g_end[None, :]
    ud = tl.zeros([BC, BC], dtype=dt)
    for v0 in range(0, DV, BV):
        cols = v0 + tl.arange(0, BV)
        cmask = inrows[:, None] & (cols < DV)[None, :]
        tile = bh * N * DV + r * DV + cols[None, :]
        u0 = tl.load(U0 + tile, mask=cmask, other=0.0).to(dt)
        tl.store(U_OUT + tile, tl.dot(mx, u0, input_precision="ieee"), mask=cmask)
        ud += tl.dot(u0, tl.trans(_rows(DC, ci, bh, BH, DV, cols, inrows, cols < DV).to(dt)), input_precision="ieee")
    bz_t = tl.trans(bm * tl.dot(tl.trans(t), g_end[:, None] * ud, input_precision="ieee"))  # (Bm o Z)^T
    for k0 in range(0, DK, BD):
        ks = k0 + tl.arange(0, BD)
        kmask = inrows[:, None] & (ks < DK)[None, :]
        tile = bh * N * DK + r * DK + ks[None, :]
        kc = _rows(KC, ci, bh, BH, DK, ks, inrows, ks < DK).to(dt)
        v_0 = tl.load(V0 + tile, mask=kmask, other=0.0).to(dt)
        tl.store(V_OUT + tile, g_end[:, None] * v_0 - tl.dot(bz_t, kc, input_precision="ieee"), mask=kmask)
    t_t = tl.trans(t)
    for layer in range(0, NL):
        kq = tl.zeros([BC, BC], dtype=dt)
        for k0 in range(0, DK, BD):
            ks = k0 + tl.arange(0, BD)
            kc = _rows(KC, ci, bh, BH, DK, ks, inrows, ks < DK).to(dt)
            q = _rows(Q + layer * sq, ci, bh, BH, DK, ks, inrows, ks < DK).to(dt)
            kq += tl.dot(kc, tl.trans(q), input_precision="ieee")
        gkq = g * kq  # G(i, s) k_i . q_s
        cn = (layer * BH + bh) * N * N + r * N + c
        tl.store(C_OUT + cn, gkq - tl.dot(x, gkq, input_precision="ieee"), mask=nn)
        tl.store(H_OUT + cn, tl.dot(t_t, gkq, input_precision="ieee"), mask=nn)
    cn = bh * N * N + r * N + c
    tl.store(T_OUT + cn, t, mask=nn)
    tl.store(KK_OUT + cn, kk, mask=nn)
    tl.store(BM_OUT + cn, bm, mask=nn)
    tl.store(GAM + bh * (N + 1) * N + ci, tl.cumprod(d, 0), mask=inrows)  # G(-1, b)
    tl.store(GAM + bh * (N + 1) * N + (r + 1) * N + c, g, mask=nn)


@triton.jit
def _chunk_finish(KC, Q, RG, GAM, T, U0, HH, BETA, SCALE, ROWS, W, N, NL, sq, srg, DK, DV, BD: tl.constexpr,
                  BV: tl.constexpr, BC: tl.constexpr):
    """Per (sequence, head), what dL/dM_c is made of after the chunk's sweep, as `algebra.finish`
    makes it: the scale G(-1, n-1), the rows (the queries of every layer, then the keys) and their
    weights (G(-1, s) do_s for the reads; -beta_m G(-1, m-1) (T^T diag(G(., n-1)) U0 + sum_layers h
    do)_m for the keys), from the chunk's decay products (GAM), T, U0, h (HH) and the read
    gradients (RG: NL layers of time-major rows, srg apart; the queries Q sq apart)."""
    bh, BH, ci, r, c, inrows, nn = _square(N, BC)
    dt = W.dtype.element_ty
    NR = (NL + 1) * N
    gam = GAM + bh * (N + 1) * N
    g0 = tl.load(gam + ci, mask=inrows, other=0.0).to(dt)  # G(-1, s)
    g_prev = tl.load(gam + tl.maximum(ci - 1, 0), mask=inrows & (ci >= 1), other=1.0).to(dt)  # G(-1, m - 1)
    g_end = tl.load(gam + (ci + 1) * N + N - 1, mask=inrows, other=0.0).to(dt)  # G(i, n - 1)
    key_w = -tl.load(BETA + ci * BH + bh, mask=inrows, other=0.0).to(dt) * g_prev
    w_rows = W + (bh * NR + r) * DV  # row m of layer l's block at w_rows + l N DV
    for v0 in range(0, DV, BV):
        cols = v0 + tl.arange(0, BV)
        mask = inrows[:, None] & (cols < DV)[None, :]
        # T^T diag(G(., n-1)), loaded again per block: held across the loop it spills (ptxas, 8 warps)
        tg = tl.trans(tl.load(T + bh * N * N + r * N + c, mask=nn, other=0.0).to(dt)) * g_end[None, :]
        acc = tl.dot(tg, tl.load(U0 + bh * N * DV + r * DV + cols[None, :], mask=mask, other=0.0).to(dt), input_precision="ieee")
        for layer in range(0, NL):
            do = tl.load(RG + layer * srg + (r * BH + bh) * DV + cols[None, :], mask=mask, other=0.0).to(dt)
            h = tl.load(HH + (layer * BH + bh) * N * N + r * N + c, mask=nn, other=0.0).to(dt)
            acc += tl.dot(h, do, input_precision="ieee")
            tl.store(w_rows + layer * N * DV + cols[None, :], g0[:, None] * do, mask=mask)
        tl.store(w_rows + NL * N * DV + cols[None, :], key_w[:, None] * acc, mask=mask)
    for k0 in range(0, DK, BD):
        ks = k0 + tl.arange(0, BD)
        mask = inrows[:, None] & (ks < DK)[None, :]
        for layer in range(0, NL):
            q = _rows(Q + layer * sq, ci, bh, BH, DK, ks, inrows, ks < DK)
            tl.store(ROWS + (bh * NR + layer * N + r) * DK + ks[None, :], q.to(dt), mask=mask)
        k = _rows(KC, ci, bh, BH, DK, ks, inrows, ks < DK)
        tl.store(ROWS + (bh * NR + NL * N + r) * DK + ks[None, :], k.to(dt), mask=mask)
    tl.store(SCALE + bh, tl.sum(tl.where(ci == N - 1, g0, 0.0), 0))


@triton.jit
def _chunk_carry_back(DM, SCALE, ROWS, W, OUT, NR, DK, DV, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    """One block of columns of dL/dM_c = scale dM_end + rows^T weights, per (sequence, head)."""
    bh = tl.program_id(0).to(tl.int64)
    rows, cols = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    rmask, cmask = rows < DK, cols < DV
    tile = bh * DK * DV + rows[:, None] * DV + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    dt = DM.dtype.element_ty
    acc = tl.load(SCALE + bh).to(dt) * tl.load(DM + tile, mask=mask, other=0.0)
    for r0 in range(0, NR, BR):  # rows and weights are (B, H, NR, d): (sequence, head) bh's from bh NR
        ri = r0 + tl.arange(0, BR)
        rt = tl.load(ROWS + (bh * NR + ri[:, None]) * DK + rows[None, :], mask=(ri < NR)[:, None] & rmask[None, :], other=0.0)
        wt = tl.load(W + (bh * NR + ri[:, None]) * DV + cols[None, :], mask=(ri < NR)[:, None] & cmask[None, :], other=0.0)
        rt, wt = rt.to(dt), wt.to(dt)
        acc += tl.dot(tl.trans(rt), wt, input_precision="ieee")
    tl.store(OUT + tile, acc, mask=mask)


# ---- launchers: the twin's signatures --------------------------------------------------------


def _chunk_buffer(x: torch.Tensor, name: str) -> torch.Tensor:
    if not x.is_contiguous():
        raise ValueError(f"chunk kernels: {name} must be a contiguous time-major chunk buffer (rows, B, H, d)")
    return x


def _decay_rows(decays: torch.Tensor) -> int:
    """The time stride of the chunk's decays (rows, B, H), whose rows must be packed (B, H)."""
    if decays.stride(2) != 1 or decays.stride(1) != decays.shape[2]:
        raise ValueError("chunk kernels: decays must be rows of packed (B, H)")
    return decays.stride(0)


def _rows_block(n: int) -> int:
    """Chunk rows per program tile: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


def step(M_c, K, D, decays, j: int, k, v, beta, q, gate, *, out_e=None, out_o=None, out_y=None, out_M=None, M_read=None,
         out_M_read=None):
    """Step j of the chunk: returns (e, o, y); k into K[j], beta e into D[j]; with `out_M`, M_j,
    and with `out_M_read` too, M_j rounded into it. The products read `M_read` when given (M_c in
    the compute dtype)."""
    M_c = _check_m(M_c)
    B, H, n_k, n_v = M_c.shape
    apart = M_read is not None
    M_read = _check_m(M_read) if apart else M_c
    bk, bv = _blocks(n_k, n_v)
    K, D = _chunk_buffer(K, "K"), _chunk_buffer(D, "D")
    k, sk = layout.rows(k, H * n_k)
    q, sq = layout.rows(q, H * n_k)
    v, sv = layout.rows(v, H * n_v)
    beta, sbeta = layout.rows(beta, H)
    e_w, e, se = layout.out(out_e, H * n_v, M_c, (B, H, n_v))
    o_w, o, so = layout.out(out_o, H * n_v, M_c, (B, H * n_v))
    close = out_M is not None
    M_out = _check_m(out_M) if close else M_c[:0]  # never touched without CLOSE
    M_end = M_c if close and apart else M_c[:0]  # read only to form M at the chunk's end, apart from M_read
    copy = close and out_M_read is not None
    M_out_read = _check_m(out_M_read) if copy else M_c[:0]
    _chunk_step_fwd[(B * H, triton.cdiv(n_v, bv))](
        M_read, M_end, K[:j], D[:j], decays[: j + 1], k, v, q, beta, e_w, o_w, K[j], D[j], M_out, M_out_read, j,
        _decay_rows(decays), sk, sv, sq, sbeta, se, so, H, n_k, n_v, BK=bk, BV=bv, BC=_rows_block(K.shape[0]), CLOSE=close,
        APART=apart, COPY=copy, num_warps=layout.warps(bk * bv))
    layout.finish(e_w, e)
    layout.finish(o_w, o)
    return e, o, _gated_rms(o, gate, out_y)


def read(M_c, K, D, decays, j: int, q, gate, *, out_o=None, out_y=None, M_read=None):
    """A later layer's read of M_j at step j. Returns (o, y). The products read `M_read` when given."""
    o_like = M_c
    M_c = _check_m(M_c if M_read is None else M_read)
    B, H, n_k, n_v = M_c.shape
    bk, bv = _blocks(n_k, n_v)
    K, D = _chunk_buffer(K, "K"), _chunk_buffer(D, "D")
    q, sq = layout.rows(q, H * n_k)
    o_w, o, so = layout.out(out_o, H * n_v, o_like, (B, H * n_v))
    _chunk_read_fwd[(B * H, triton.cdiv(n_v, bv))](M_c, K[: j + 1], D[: j + 1], decays[: j + 1], q, o_w, j, _decay_rows(decays),
                                                   sq, so, H, n_k, n_v, BK=bk, BV=bv, BC=_rows_block(K.shape[0]),
                                                   num_warps=layout.warps(bk * bv))
    layout.finish(o_w, o)
    return o, _gated_rms(o, gate, out_y)


def read_backward(M_c, K, D, r: Rebuilt, j: int, o, f: ReadFactors, dy, read_grad, phi, *, out_dq=None, out_dgate=None):
    """A later layer's read at step j backwards: do (into read_grad[j]), dq = M_j do, dgate;
    phi += do . o. Returns (dq, dgate). M_c may be in a narrower dtype than the state's (K's)."""
    M_c = _check_m(M_c)
    B, H, n_k, n_v = M_c.shape
    bk, bv = _blocks(n_k, n_v)
    K, D, gam = _chunk_buffer(K, "K"), _chunk_buffer(D, "D"), _chunk_buffer(r.gam, "decay products")
    n = gam.shape[-1]
    do, dgate = _read_grad(f, dy, out_dgate, out_do=read_grad[j])
    o, so = layout.rows(o, H * n_v)
    dq_w, dq, sdq = layout.out(out_dq, H * n_k, K, (B, H, n_k))
    _chunk_read_bwd[(B * H,)](M_c, K[: j + 1], D[: j + 1], gam[..., j], do, o, phi, dq_w, j, n, do.stride(0), so, sdq, H, n_k,
                              n_v, BK=bk, BV=bv, BC=_rows_block(n), num_warps=layout.warps(bk * bv))
    return layout.finish(dq_w, dq), dgate


def step_backward(M_c, K, D, r: Rebuilt, co: Coefficients, j: int, beta, e, v, queries, o, f: ReadFactors, dy,
                  read_grads, phi, *, out_dk=None, out_dq=None, out_dbeta=None, out_dgamma=None, out_dgate=None,
                  out_dv=None, gate_fac=None, out_dgates=None):
    """Step j backwards (the twin's contract). Returns (dk, dv, dbeta, dgamma, dq, dgate). M_c may be
    in a narrower dtype than the state's (K's)."""
    M_c = _check_m(M_c)
    B, H, n_k, n_v = M_c.shape
    bk, bv = _blocks(n_k, n_v)
    K, D, gam = _chunk_buffer(K, "K"), _chunk_buffer(D, "D"), _chunk_buffer(r.gam, "decay products")
    c, h, Bm = (_chunk_buffer(x, name) for x, name in ((co.c, "c"), (co.h, "h"), (co.Bm, "Bm")))
    queries, read_grads = _chunk_buffer(queries, "queries"), _chunk_buffer(read_grads, "read gradients")
    n, layers = gam.shape[-1], queries.shape[0]
    _, dgate = _read_grad(f, dy, out_dgate, out_do=read_grads[0][j])
    beta, sbeta = layout.rows(beta, H)
    e, se = layout.rows(e, H * n_v)
    v, sv = layout.rows(v, H * n_v)
    o, so = layout.rows(o, H * n_v)
    dv_w, dv, sdv = layout.out(out_dv, H * n_v, K, (B, H, n_v))
    dq_w, dq, sdq = layout.out(out_dq, H * n_k, K, (B, H, n_k))
    dk_w, dk, sdk = layout.out(out_dk, H * n_k, K, (B, H, n_k))
    db_w, dbeta, sdb = layout.out(out_dbeta, H, K, (B, H))
    dg_w, dgamma, sdg = layout.out(out_dgamma, H, K, (B, H))
    gates = gate_fac is not None  # without it, dq_w stands in for GF and DG, which GATES=False never touches
    gate_fac, sgf = layout.rows(gate_fac, 2 * H) if gates else (dq_w, 0)
    dgs_w, dgates, sdgs = layout.out(out_dgates, 2 * H, K, (B, 2, H)) if gates else (dq_w, None, 0)
    g_p = gam[..., max(j - 1, 0)]  # unread at j = 0 (the chunk's start: G(-1, -1) = 1)
    _chunk_step_bwd[(B * H,)](
        M_c, K[:n], D[: j + 1], queries[:, j:n], read_grads[:, j:n], c[..., j, j:], co.U[:, :, j], co.V[:, :, j], gam[..., j], g_p,
        gam[..., j + 1, j:], h[..., j + 1 :, j:], Bm[..., j + 1 :, j], e, v, o, beta, phi, dv_w, dq_w, dk_w, db_w, dg_w, gate_fac,
        dgs_w, j, n, layers, queries.stride(0), read_grads.stride(0), co.U.stride(1), co.V.stride(1), se, sv, so, sbeta, sdv,
        sdq, sdk, sdb, sdg, sgf, sdgs, H,
        n_k, n_v, BK=bk, BV=bv, BC=_rows_block(n), BL=triton.next_power_of_2(layers), GATES=gates,
        num_warps=layout.warps(bk * bv))
    for w, out in ((dk_w, dk), (dq_w, dq), (db_w, dbeta), (dg_w, dgamma), (dv_w, dv)) + (((dgs_w, dgates),) if gates else ()):
        layout.finish(w, out)
    return dk, dv, dbeta, dgamma, dq, dgate


def dm_products(dM_end, K, D):
    """dM_end's products with the chunk's keys and deltas: (U0 (B, H, n, dv), V0 (B, H, n, dk)),
    in one pass over dM_end."""
    dM_end = _check_m(dM_end)
    B, H, n_k, n_v = dM_end.shape
    K, D = _chunk_buffer(K, "K"), _chunk_buffer(D, "D")
    n = K.shape[0]
    bk, bv = _blocks(n_k, n_v)
    U0, V0 = layout.empty(dM_end, (B, H, n, n_v)), layout.empty(dM_end, (B, H, n, n_k))
    _chunk_dm_products[(B * H,)](dM_end, K, D, U0, V0, n, n_k, n_v, BK=bk, BV=bv, BC=_rows_block(n),
                                 num_warps=layout.warps(bk * bv))
    return U0, V0


# Columns of the keys, U0 and the deltas the chunk's algebra takes at a time: its C x C matrices and
# float32 dots fill the registers (at C 32 and 8 warps, 177 per thread with 16 columns, spills with 32).
ALGEBRA_COLUMNS = 16
# The longest chunk the algebra's kernels take: a 32 x 32 tile. Longer chunks spill (64) or cannot
# launch (over 128: more threads than a block holds) and run the torch twin's algebra instead.
ALGEBRA_ROWS = 32


def _chunk_rows(x, n: int, name: str) -> torch.Tensor:
    """A chunk buffer (a tensor or, as the twin takes them, a list of per-layer rows) of exactly n
    rows per layer, each layer's rows contiguous."""
    x = torch.stack(list(x)) if isinstance(x, (list, tuple)) else x
    if x.shape[1] != n or not x[0].is_contiguous():
        raise ValueError(f"chunk kernels: {name} must be per layer {n} time-major rows (rows, B, H, d), got {tuple(x.shape)}")
    return x


def _algebra_grid(n: int, n_k: int, n_v: int) -> dict:
    bd, bv = (min(ALGEBRA_COLUMNS, max(16, triton.next_power_of_2(w))) for w in (n_k, n_v))  # tl.dot: 16 at least
    return dict(BD=bd, BV=bv, BC=_rows_block(n), num_warps=4 if n <= 16 else 8)


def algebra(dM_end, K, beta, decays, D, e, reads, queries):
    """The chunk's algebra before its sweep (the twin's contract): dM_end's products
    (`_chunk_dm_products`), then its C x C algebra and coefficients in one program per (sequence,
    head). Returns (Rebuilt, Coefficients). Chunks over ALGEBRA_ROWS run the twin's algebra."""
    n = K.shape[0]
    if n > ALGEBRA_ROWS:
        r = chunk_algebra.from_forward(K, beta, decays, D, e, reads)
        return r, chunk_algebra.coefficients(*dm_products(dM_end, K, D), K, r, beta, queries)
    K, D = _chunk_buffer(K, "K"), _chunk_buffer(D, "D")
    queries, beta, decays = _chunk_rows(queries, n, "queries"), _chunk_buffer(beta, "beta"), _chunk_buffer(decays, "decays")
    _, B, H, n_k = K.shape
    n_v, layers = D.shape[-1], queries.shape[0]
    if D.shape[:3] != K.shape[:3] or beta.shape != K.shape[:3] or decays.shape != K.shape[:3]:
        raise ValueError(f"chunk kernels: keys {tuple(K.shape)}, deltas {tuple(D.shape)}, betas {tuple(beta.shape)} and decays "
                         f"{tuple(decays.shape)} must share their (rows, B, H)")
    U0, V0 = dm_products(dM_end, K, D)
    gam = layout.empty(K, (B, H, n + 1, n))
    T, KK, Bm = (layout.empty(K, (B, H, n, n)) for _ in range(3))
    U, V = layout.empty(K, (B, H, n, n_v)), layout.empty(K, (B, H, n, n_k))
    c, h = layout.empty(K, (layers, B, H, n, n)), layout.empty(K, (layers, B, H, n, n))
    _chunk_coefficients[(B * H,)](K, D, beta, decays, queries, U0, V0, gam, T, KK, Bm, U, V, c, h, n, layers, queries.stride(0),
                                  n_k, n_v, **_algebra_grid(n, n_k, n_v))
    return Rebuilt(D, e, reads, gam, T, KK), Coefficients(U, V, c, h, Bm, U0)


def finish(K, r: Rebuilt, co: Coefficients, beta, queries, read_grads) -> CarryBack:
    """What dL/dM_c is made of (the twin's contract, `algebra.finish`), in one program per
    (sequence, head). read_grads: (layers, n, B, H, dv), each layer's rows contiguous. Chunks over
    ALGEBRA_ROWS run the twin's."""
    n = K.shape[0]
    if n > ALGEBRA_ROWS:
        return chunk_algebra.finish(K, r, co, beta, queries, read_grads)
    K, beta = _chunk_buffer(K, "K"), _chunk_buffer(beta, "beta")
    queries, read_grads = _chunk_rows(queries, n, "queries"), _chunk_rows(read_grads, n, "read gradients")
    gam, T, U0, h = (x.contiguous() for x in (r.gam, r.T, co.U0, co.h))  # as `algebra` makes them: no copy
    _, B, H, n_k = K.shape
    n_v, layers = U0.shape[-1], queries.shape[0]
    scale = layout.empty(K, (B, H))
    rows, weights = layout.empty(K, (B, H, (layers + 1) * n, n_k)), layout.empty(K, (B, H, (layers + 1) * n, n_v))
    _chunk_finish[(B * H,)](K, queries, read_grads, gam, T, U0, h, beta, scale, rows, weights, n, layers, queries.stride(0),
                            read_grads.stride(0), n_k, n_v, **_algebra_grid(n, n_k, n_v))
    return CarryBack(scale, rows, weights)

CARRY_ROWS = 32  # rows of the carry-back's sum taken at a time


def carry_back(dM_end, c: CarryBack, *, out=None):
    """dL/dM_c = scale dM_end + sum_r rows_r^T weights_r, into `out` (a buffer other than dM_end)."""
    dM_end = _check_m(dM_end)
    B, H, n_k, n_v = dM_end.shape
    bk, bv = _blocks(n_k, n_v)
    rows, weights = _chunk_buffer(c.rows, "rows"), _chunk_buffer(c.weights, "weights")
    out = layout.empty(dM_end, dM_end.shape) if out is None else _check_m(out)
    _chunk_carry_back[(B * H, triton.cdiv(n_v, bv))](dM_end, _chunk_buffer(c.scale, "scale"), rows, weights, out, rows.shape[2],
                                                     n_k, n_v, BK=bk, BV=bv, BR=CARRY_ROWS, num_warps=layout.warps(bk * bv))
    return out


OPS = ChunkOps(step, read, step_backward, read_backward, dm_products, algebra, finish, carry_back)
