"""The per-step functions of the memory's chunk form in plain torch: the twin of the kernels.

A chunk starts from M_c (B, H, dk, dv) and is n steps long. Its keys and deltas (beta e) are
kept as it goes, in time-major chunk buffers K (C, B, H, dk) and D (C, B, H, dv) that `step`
fills (row j at step j); `decays` (>= j + 1, B, H) are the chunk's decays by step. With
G(a, b) = decay_{a+1} ... decay_b (1 when a = b, a = -1 the chunk's start):

    M_j = G(-1, j) M_c + sum_{i <= j} G(i, j) k_i delta_i^T

so a step reads M_c once, for the write's error and layer 0's read together, and M exists again
only at the chunk's end. The reverse sweep's functions read the chunk's once-per-chunk
`algebra.Rebuilt` and `algebra.Coefficients`, the read gradients of the chunk's later steps
(`read_grads`, per layer (C, B, H, dv), row j written at step j), and carry
phi = <dL/dM_j, M_j> per (sequence, head) in a (B, H) buffer, from which the decay's gradient
follows without M_j: dL/d gamma_j = phi_j - k_j . (dL/dM_j delta_j) (gamma = log decay).

Outputs and their `out_*` buffers follow kernels/memory/reference.py's contract (the read's
output y = silu(gate) o / rms(o), the gates' gradients times their factors). The products with
M_c may read it in a narrower dtype than the state's (`GPNConfig.memory_reads: compute`: the
backward's M_c argument, the forward's `M_read`); the arithmetic stays in the state's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.common import rms
from kernels.memory import ReadFactors
from kernels.memory.reference import read_output_backward
from kernels.memory_chunk import ChunkOps
from kernels.memory_chunk import algebra as chunk_algebra
from kernels.memory_chunk.algebra import CarryBack, Coefficients, Rebuilt


def _column(decays, j: int) -> torch.Tensor:
    """G(i, j) for i = -1..j, at index i + 1: (j + 2, B, H)."""
    d = decays[: j + 1]
    return torch.cat([torch.cumprod(d.flip(0), 0).flip(0), torch.ones_like(d[:1])])


def _m_times(M_c, x):
    """M_c^T x per head: x (B, H, dk) -> (B, H, dv), in x's dtype (M_c widened)."""
    return torch.einsum("bhkv,bhk->bhv", M_c.to(x.dtype), x)


def _m_apply(M_c, x):
    """M_c x per head: x (B, H, dv) -> (B, H, dk), in x's dtype (M_c widened)."""
    return torch.einsum("bhkv,bhv->bhk", M_c.to(x.dtype), x)


def _rows_dot(rows, x):
    """rows (n, B, H, d) . x (B, H, d) -> (n, B, H)."""
    return torch.einsum("nbhd,bhd->nbh", rows, x)


def _combine(weights, rows):
    """sum_i weights (n, B, H) * rows (n, B, H, d) -> (B, H, d)."""
    return torch.einsum("nbh,nbhd->bhd", weights, rows)


def _read_out(o, gate, out_y):
    B = o.shape[0]
    o = o.reshape(B, -1)
    return torch.mul(F.silu(gate), torch.div(o, rms(o)), out=out_y)


def _finish(x, out):
    return x if out is None else out.copy_(x.view(out.shape))


def step(M_c, K, D, decays, j: int, k, v, beta, q, gate, *, out_e=None, out_o=None, out_y=None, out_M=None, M_read=None,
         out_M_read=None):
    """Step j of the chunk: e = v - M_{j-1}^T k, delta = beta e, o = M_j^T q and the read's output.
    Writes k into K[j] and delta into D[j]. With `out_M` (the chunk's last step) also writes
    M_j, the chunk's end, there, and with `out_M_read` M_j rounded into it (the next chunk's
    copy in its reads' dtype). The products read `M_read` when given (M_c in a narrower dtype;
    M_j is formed from M_c itself). Returns (e, o, y)."""
    B, H, n_k, n_v = M_c.shape
    M_read = M_c if M_read is None else M_read
    K[j].copy_(k.view(B, H, n_k))
    col = _column(decays, j)  # G(i, j)
    prev = _column(decays, j - 1) if j > 0 else torch.ones_like(col[:1])  # G(i, j-1), i = -1..j-1
    mk, mq = _m_times(M_read, K[j]), _m_times(M_read, q.view(B, H, n_k))
    e = v.view(B, H, n_v) - prev[0].unsqueeze(-1) * mk
    if j > 0:
        e = e - _combine(prev[1:] * _rows_dot(K[:j], K[j]), D[:j])
    D[j].copy_(beta.view(B, H, 1) * e)
    o = col[0].unsqueeze(-1) * mq + _combine(col[1:] * _rows_dot(K[: j + 1], q.view(B, H, n_k)), D[: j + 1])
    if out_M is not None:
        out_M.copy_(col[0].view(B, H, 1, 1) * M_c + torch.einsum("nbhk,nbhv->bhkv", col[1:].unsqueeze(-1) * K[: j + 1], D[: j + 1]))
        if out_M_read is not None:
            out_M_read.copy_(out_M)
    return _finish(e, out_e), _finish(o.view(B, H * n_v), out_o), _read_out(o, gate, out_y)


def read(M_c, K, D, decays, j: int, q, gate, *, out_o=None, out_y=None, M_read=None):
    """A later layer's read of M_j at step j (after `step` wrote D[j]). Returns (o, y). The
    products read `M_read` when given."""
    B, H, n_k, n_v = M_c.shape
    M_c = M_c if M_read is None else M_read
    col = _column(decays, j)
    q = q.view(B, H, n_k).to(K.dtype)
    o = col[0].unsqueeze(-1) * _m_times(M_c, q) + _combine(col[1:] * _rows_dot(K[: j + 1], q), D[: j + 1])
    return _finish(o.view(B, H * n_v), out_o), _read_out(o, gate, out_y)


def _g_column(r: Rebuilt, j: int) -> torch.Tensor:
    """G(i, j) for i = -1..j from the chunk's matrix: (j + 2, B, H)."""
    return r.gam[:, :, : j + 2, j].movedim(-1, 0)


def _m_j_times(M_c, K, D, col, x):
    """M_j x for the M_j whose G column is `col` (j + 2 rows for M_j: rows i = -1..j), x (B, H, dv)."""
    n = col.shape[0] - 1
    return col[0].unsqueeze(-1) * _m_apply(M_c, x) + _combine(col[1:] * _rows_dot(D[:n], x), K[:n])


def read_backward(M_c, K, D, r: Rebuilt, j: int, o, f: ReadFactors, dy, read_grad, phi, *, out_dq=None, out_dgate=None):
    """A later layer's read at step j, backwards: do (into read_grad[j]), dq = M_j do, dgate;
    phi += do . o per head. Returns (dq, dgate)."""
    B, H, n_k, n_v = M_c.shape
    do = read_output_backward(f, dy).view(B, H, n_v)
    read_grad[j].copy_(do)
    phi.add_(torch.linalg.vecdot(do, o.view(B, H, n_v)))
    dq = _m_j_times(M_c, K, D, _g_column(r, j), do)
    return _finish(dq, out_dq), torch.mul(dy, f.to_gate, out=out_dgate)


def step_backward(M_c, K, D, r: Rebuilt, co: Coefficients, j: int, beta, e, v, queries: list, o, f: ReadFactors, dy,
                  read_grads: list, phi, *, out_dk=None, out_dq=None, out_dbeta=None, out_dgamma=None, out_dgate=None,
                  out_dv=None, gate_fac=None, out_dgates=None):
    """Step j backwards: the write's and layer 0's read's gradients, given dy of layer 0's read
    and the chunk's later steps (read_grads rows > j, and row j of the later layers, written
    before). phi comes in as <dL/dM_j, M_j> without step j's reads and leaves as
    <dL/dM_{j-1}, M_{j-1}> without step j-1's. Returns (dk, dv, dbeta, dgamma, dq, dgate); dv
    rounded into `out_dv`, and with `gate_fac` (B, 2, H), (dbeta, dgamma) * gate_fac into
    `out_dgates`, in their dtypes."""
    B, H, n_k, n_v = M_c.shape
    n = r.gam.shape[-1]
    beta = beta.view(B, H)
    do = read_output_backward(f, dy).view(B, H, n_v)
    read_grads[0][j].copy_(do)
    phi.add_(torch.linalg.vecdot(do, o.view(B, H, n_v)))
    dq = _m_j_times(M_c, K, D, _g_column(r, j), do)
    # d_delta = G_j^T k_j and G_j delta_j: dM_end's share (co.U, co.V), then the chunk's later reads
    d_delta, g_delta = co.U[:, :, j].clone(), co.V[:, :, j].clone()
    later = r.gam[:, :, j + 1, j:].movedim(-1, 0)  # G(j, s), s = j..n-1
    betas = co.Bm[:, :, j + 1 :, j].movedim(-1, 0)  # beta_m G(j, m-1), m = j+1..n-1
    for q, c, h, g in zip(queries, co.c, co.h, read_grads):
        rows = g[j:n]  # the read gradients of steps j..n-1
        d_delta += _combine(c[:, :, j, j:].movedim(-1, 0), rows)
        a = _rows_dot(rows, D[j])  # do_s . delta_j
        g_delta += _combine(later * a, q[j:n])
        if j + 1 < n:
            ha = torch.einsum("bhms,sbh->mbh", h[:, :, j + 1 :, j:], a)  # (h a)_m for m > j
            g_delta -= _combine(betas * ha, K[j + 1 : n])
    m_dd = _m_j_times(M_c, K, D, _g_column(r, j - 1), d_delta) if j > 0 else _m_apply(M_c, d_delta)  # M_{j-1} d_delta
    b = beta.unsqueeze(-1)
    dk = g_delta - b * m_dd
    dv = b * d_delta
    dbeta = torch.linalg.vecdot(d_delta, e.view(B, H, n_v))
    dgamma = phi - torch.linalg.vecdot(K[j], g_delta)
    phi.sub_(beta * torch.linalg.vecdot(d_delta, v.view(B, H, n_v)))
    if gate_fac is not None:
        torch.mul(torch.stack([dbeta, dgamma], -2), gate_fac, out=out_dgates)
    return (_finish(dk, out_dk), _finish(dv, out_dv), _finish(dbeta, out_dbeta), _finish(dgamma, out_dgamma),
            _finish(dq, out_dq), torch.mul(dy, f.to_gate, out=out_dgate))


def dm_products(dM_end, K, D):
    """dM_end's products with the chunk's keys and deltas, (n, B, H, ...) each: (U0, V0) =
    (K dM_end (B, H, n, dv), Delta dM_end^T (B, H, n, dk)), in one pass over dM_end."""
    return torch.einsum("nbhk,bhkv->bhnv", K, dM_end), torch.einsum("nbhv,bhkv->bhnk", D, dM_end)


def algebra(dM_end, K, beta, decays, D, e, reads, queries) -> tuple[Rebuilt, Coefficients]:
    """The chunk's algebra before its sweep: its forward values with the C x C algebra of its keys,
    betas and decays (`algebra.from_forward`: K, D (n, B, H, d), beta and decays (n, B, H), the
    errors e and the raw reads passed through), and the weights the sweep reads of dM_end
    (`algebra.coefficients`, from `dm_products`). Returns (Rebuilt, Coefficients)."""
    r = chunk_algebra.from_forward(K, beta, decays, D, e, reads)
    return r, chunk_algebra.coefficients(*dm_products(dM_end, K, D), K, r, beta, queries)


def carry_back(dM_end, c: CarryBack, *, out=None):
    """dL/dM_c = scale dM_end + sum_r rows_r^T weights_r, into `out` (a buffer other than dM_end)."""
    x = c.scale[..., None, None] * dM_end + torch.einsum("bhrk,bhrv->bhkv", c.rows, c.weights)
    return x if out is None else out.copy_(x)


OPS = ChunkOps(step, read, step_backward, read_backward, dm_products, algebra, chunk_algebra.finish, carry_back)
