"""The once-per-chunk work of the memory's chunk form, in plain torch: batched GEMMs against M_c or
dL/dM and C x C triangular algebra, for every implementation of the per-step functions.

Notation (docs/core.md, "The memory's chunk form"). A chunk has n steps j = 0..n-1 and starts
from M_c (M before step 0). A_j = decay_j I - beta_j k_j k_j^T is step j's transition: the write
is M_j = A_j M_{j-1} + beta_j k_j v_j^T, and dL/dM goes back through it, G_{j-1} = A_j G_j +
(step j-1's reads). G(a, b) = decay_{a+1} ... decay_b (1 when a = b; a = -1 is the chunk's
start). Tensors are time-major, (n, B, H, ...), as the core's chunk buffers; the C x C matrices
are (B, H, n, n).

The products A_{a+1} ... A_b that carry dL/dM back over part of a chunk are in the UT form of
the delta rule: with L = I + tril(diag(beta) (G(i, j-1) k_j . k_i), -1) and T = L^-1,

    A_{a+1} ... A_b = G(a, b) I - sum_{a < m <= b} beta_m G(a, m-1) k_m (sum_{m <= i <= b} T[i, m] G(i, b) k_i)^T,

for every sub-range at once (a diagonal block of a triangular matrix's inverse is the inverse of
that block), and the same L solves the chunk's deltas from M_c (`rebuild`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rebuilt(NamedTuple):
    """A chunk's forward values, as its steps made them (kept by the forward: `from_forward`) or
    formed again from M_c (`rebuild`), time-major.

    delta, e: (n, B, H, dv) the write's beta e and error; reads: (layers, n, B, H, dv), or a list
    of them, the raw reads M_j^T q_j; gam: (B, H, n + 1, n) G(a, b) at row a + 1, zero where a > b; T: (B, H, n, n)
    the UT transform's L^-1; KK: (B, H, n, n) the keys' Gram matrix.
    """

    delta: torch.Tensor
    e: torch.Tensor
    reads: torch.Tensor | list
    gam: torch.Tensor
    T: torch.Tensor
    KK: torch.Tensor


class Coefficients(NamedTuple):
    """What the reverse sweep reads of dL/dM at the chunk's end (dM_end) and of the chunk's later
    steps, per step j (`coefficients`).

    U: (B, H, n, dv) dM_end's share of d_delta_j = G_j^T k_j; V: (B, H, n, dk) its share of
    G_j delta_j (row j of (sequence, head) for step j); c: (layers, B, H, n, n), c[j, s] = k_j . (A_{j+1} ... A_s q_s) for s >= j, the
    weight of step s's read gradient in d_delta_j; h: (layers, B, H, n, n), h[m, s] =
    sum_{m <= i <= s} T[i, m] G(i, s) k_i . q_s, the UT form's coefficients of the reads; Bm:
    (B, H, n, n), Bm[m, j] = beta_m G(j, m-1) for m > j; U0: (B, H, n, dv) the rows k_i^T dM_end
    (for `finish`).
    """

    U: torch.Tensor
    V: torch.Tensor
    c: torch.Tensor
    h: torch.Tensor
    Bm: torch.Tensor
    U0: torch.Tensor


def _bh(x: torch.Tensor) -> torch.Tensor:
    """(n, B, H, ...) -> (B, H, n, ...)."""
    return x.movedim(0, 2)


def _time_major(x: torch.Tensor) -> torch.Tensor:
    """(B, H, n, ...) -> (n, B, H, ...), contiguous: as the per-step functions read it."""
    return x.movedim(2, 0).contiguous()


def decay_products(decays: torch.Tensor) -> torch.Tensor:
    """G(a, b) for a = -1..n-1 (row a + 1), b = 0..n-1, zero where a > b: (B, H, n + 1, n) from
    the chunk's decays (n, B, H). Products over each range, never ratios of running products
    (which underflow to 0 / 0 for fast-decaying heads)."""
    d = _bh(decays)  # (B, H, n)
    n = d.shape[-1]
    a = torch.arange(-1, n, device=d.device)[:, None]
    b = torch.arange(n, device=d.device)[None, :]
    factors = torch.where(b > a, d.unsqueeze(-2), torch.ones_like(d).unsqueeze(-2))  # (B, H, n + 1, n)
    return torch.where(b >= a, torch.cumprod(factors, -1), torch.zeros_like(factors))


def _previous_column(gam: torch.Tensor) -> torch.Tensor:
    """G(-1, j-1) for j = 0..n-1 (1 at j = 0): (B, H, n)."""
    return torch.cat([torch.ones_like(gam[..., 0, :1]), gam[..., 0, :-1]], -1)


def _strict_weights(gam: torch.Tensor) -> torch.Tensor:
    """W[j, i] = G(i, j-1) for i < j, else 0: (B, H, n, n)."""
    up = gam[..., 1:, :]  # G(i, b), i = 0..n-1
    return torch.cat([torch.zeros_like(up[..., :1, :]), up.transpose(-1, -2)[..., :-1, :]], -2)


def _structure(K, beta_, decays):
    """(decay products, W o KK, L, T = L^-1, KK) of a chunk: its C x C algebra, from its keys
    (B, H, n, dk), betas (B, H, n) and decays (n, B, H)."""
    n = K.shape[-2]
    gam = decay_products(decays)
    KK = K @ K.transpose(-1, -2)
    Ls = _strict_weights(gam) * KK  # (W o KK)
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    L = eye + beta_.unsqueeze(-1) * Ls
    T = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)
    return gam, Ls, L, T, KK


def from_forward(keys, beta, decays, delta, e, reads) -> Rebuilt:
    """A chunk's values as its forward steps made them (delta, e (n, B, H, dv); reads (layers, n,
    B, H, dv) or a list of them), with the C x C algebra of its keys, betas and decays."""
    gam, _, _, T, KK = _structure(_bh(keys), _bh(beta), decays)
    return Rebuilt(delta, e, reads, gam, T, KK)


def rebuild(M_c, keys, values, beta, decays, queries) -> Rebuilt:
    """The chunk's deltas, errors and reads formed again from M_c and its steps' vectors: keys
    (n, B, H, dk), values (n, B, H, dv), beta and decays (n, B, H), queries (layers, n, B, H, dk).
    One GEMM over M_c for all of them, then the deltas by one triangular solve:
    (I + diag(beta) (W o KK)) Delta = diag(beta) (V - G(-1, j-1) K M_c)."""
    K, beta_ = _bh(keys), _bh(beta)
    n = K.shape[-2]
    gam, Ls, L, T, KK = _structure(K, beta_, decays)
    Qs = [_bh(q) for q in queries]
    MKQ = torch.cat([K, *Qs], -2) @ M_c  # (B, H, n (1 + layers), dv): one pass over M_c
    MK = MKQ[..., :n, :]
    base = _bh(values) - _previous_column(gam).unsqueeze(-1) * MK
    delta = torch.linalg.solve_triangular(L, beta_.unsqueeze(-1) * base, upper=False, unitriangular=True)
    e = base - Ls @ delta
    up = gam[..., 1:, :]
    reads = []
    for layer, Q in enumerate(Qs):
        MQ = MKQ[..., n * (1 + layer): n * (2 + layer), :]
        KQ = K @ Q.transpose(-1, -2)  # [i, j] = k_i . q_j
        reads.append(_time_major(gam[..., 0, :].unsqueeze(-1) * MQ + (up * KQ).transpose(-1, -2) @ delta))
    return Rebuilt(_time_major(delta), _time_major(e), torch.stack(reads), gam, T, KK)


def _later_weights(gam: torch.Tensor, beta_: torch.Tensor) -> torch.Tensor:
    """Bm[m, j] = beta_m G(j, m-1) for m > j, else 0: (B, H, n, n)."""
    up = gam[..., 1:, :]  # G(j, b)
    shifted = torch.cat([torch.zeros_like(up[..., :, :1]), up[..., :, :-1]], -1)  # [j, m] = G(j, m-1)
    return beta_.unsqueeze(-1) * shifted.transpose(-1, -2)


def coefficients(U0, V0, keys, r: Rebuilt, beta, queries) -> Coefficients:
    """The C x C weights the sweep reads and dM_end's shares of its steps (`Coefficients`), from
    dM_end's products with the chunk's keys and deltas (U0 = K dM_end, (B, H, n, dv); V0 =
    Delta dM_end^T, (B, H, n, dk): `ChunkOps.dm_products`, the one pass over dM_end), the
    chunk's keys, rebuilt values, betas and queries."""
    K, D, beta_ = _bh(keys), _bh(r.delta), _bh(beta)
    n = K.shape[-2]
    up = r.gam[..., 1:, :]  # G(i, b) for i, b in 0..n-1
    g_end = up[..., :, n - 1]  # G(i, n-1)
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    Bm = _later_weights(r.gam, beta_)
    X = (r.T @ (Bm * r.KK)).transpose(-1, -2)  # X[j, i] = sum_m T[i, m] Bm[m, j] k_m . k_j
    U = ((eye - X) * g_end.unsqueeze(-2)) @ U0
    Z = r.T.transpose(-1, -2) @ (g_end.unsqueeze(-1) * (U0 @ D.transpose(-1, -2)))
    V = torch.baddbmm((g_end.unsqueeze(-1) * V0).flatten(0, 1), (Bm * Z).transpose(-1, -2).flatten(0, 1), K.flatten(0, 1),
                      alpha=-1).view(V0.shape)
    cs, hs = [], []
    for q in queries:
        GKQ = up * (K @ _bh(q).transpose(-1, -2))  # G(i, s) k_i . q_s for i <= s
        cs.append(GKQ - X @ GKQ)
        hs.append(r.T.transpose(-1, -2) @ GKQ)
    return Coefficients(U, V, torch.stack(cs), torch.stack(hs), Bm.contiguous(), U0)


class CarryBack(NamedTuple):
    """dL/dM_c = scale dM_end + sum_r rows_r^T weights_r per (sequence, head) (`finish`): scale
    (B, H), rows (B, H, R, dk) the chunk's queries of every layer, then its keys; weights (B, H,
    R, dv). `ChunkOps.carry_back` makes it, in one pass over dM_end."""

    scale: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor


def finish(keys, r: Rebuilt, co: Coefficients, beta, queries, read_grads) -> CarryBack:
    """What dL/dM_c, the gradient the chunk hands to the one before it, is made of:
    A_0 ... A_{n-1} dM_end plus every read of the chunk carried back to its start. read_grads:
    (layers, n, B, H, dv), dL/d(raw read) of each step."""
    K, beta_ = _bh(keys), _bh(beta)
    n = K.shape[-2]
    g0 = r.gam[..., 0, :]  # G(-1, s)
    # inner = T^T diag(G(., n-1)) U0 + sum_layers h do: one product, then accumulated in place
    inner = (r.T.transpose(-1, -2) * r.gam[..., 1:, n - 1].unsqueeze(-2)) @ co.U0
    weights = K.new_empty((*K.shape[:2], n * (len(read_grads) + 1), co.U0.shape[-1]))  # each block written once
    for layer, (h, do) in enumerate(zip(co.h, read_grads)):
        do = _bh(do)
        inner.view(-1, n, inner.shape[-1]).baddbmm_(h.flatten(0, 1), do.flatten(0, 1))
        torch.mul(g0.unsqueeze(-1), do, out=weights[..., layer * n : (layer + 1) * n, :])
    torch.mul(-(beta_ * _previous_column(r.gam)).unsqueeze(-1), inner, out=weights[..., -n:, :])
    rows = torch.cat([*(_bh(q) for q in queries), K], -2)
    return CarryBack(g0[..., n - 1].contiguous(), rows, weights)
