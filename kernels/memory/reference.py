"""The memory step of GPN+M, forward and backward, in plain PyTorch: the reference twin.

One step of the shared matrix memory (docs/model.md, "Memory"): the gated delta write, then a
read whose output is RMS-normalised and gated. This is the contract a fused kernel keeps (same
signatures, same outputs): the fused core calls `memory_step` for the write and layer 0's read
(the only read whose query is known when the write happens), `memory_read` for the reads of
later layers, and the `*_backward` twins in its reverse sweep.

Shapes, per sequence b and head h: M (B, H, dk, dv) float32, contiguous; k, q (B, H, dk),
l2-normalised; v, e (B, H, dv); beta, decay (B, H) (decay = exp(gamma) in (0, 1]); gate
(B, H*dv) pre-activation. A read returns the raw read o = M^T q (B, H*dv), which the backward
needs, and y = silu(gate) * o / rms(o). The read's norm weight is not applied here: the caller
folds it into the out-projection, `(y * w) @ W_o = y @ (diag(w) W_o)`.

The `out_*` arguments name buffers the results are written into (the fused core's saved
per-step vectors): in a time loop of tiny ops, every copy counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.common import rms
from kernels.memory import MemoryOps, ReadFactors


def decay_and_write(M, k, delta, decay, *, out_M=None):
    """decay M + k delta^T per head, delta = beta (v - M^T k), into `out_M` (never M itself).

    The write of `memory_step`, which the reverse sweep also replays to rebuild M inside a chunk.
    The outer product is an elementwise addcmul over broadcast views: a baddbmm would first copy
    its input into a fresh output.
    """
    B, H, n_k, n_v = M.shape
    return torch.mul(M, decay.view(B, H, 1, 1), out=out_M).addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))


def memory_read(M, q, gate, *, out_o=None, out_y=None):
    """Read M with q: returns (o, y)."""
    B, H, n_k, n_v = M.shape
    o = torch.bmm(q.reshape(B * H, 1, n_k), M.view(B * H, n_k, n_v), out=None if out_o is None else out_o.view(B * H, 1, n_v))
    o = o.view(B, H * n_v)
    return o, torch.mul(F.silu(gate), torch.div(o, rms(o)), out=out_y)


def memory_step(M, k, v, beta, decay, q, gate, *, out_e=None, out_o=None, out_y=None, out_M=None):
    """Write (k, v) into M, then read the new M with q. Returns (M_t, e, o, y), e = v - M^T k.
    M_t goes to `out_M` when given (a buffer other than M)."""
    B, H, n_k, n_v = M.shape
    e = torch.sub(v, torch.bmm(k.reshape(B * H, 1, n_k), M.view(B * H, n_k, n_v)).view(B, H, n_v), out=out_e)
    M = decay_and_write(M, k, beta.unsqueeze(-1) * e, decay, out_M=out_M)
    o, y = memory_read(M, q, gate, out_o=out_o, out_y=out_y)
    return M, e, o, y


def read_factors(o, gate, *, out_y=None) -> ReadFactors:
    """The reads' `ReadFactors` over rows of raw reads o (R, H*dv) and gates (R, H*dv), the gate
    in any dtype (widened to o's); with `out_y`, the read outputs y = silu(gate) o / rms(o) too,
    rounded into its dtype. Once per chunk of the reverse sweep, for all its steps at once."""
    gate = gate.to(o.dtype)
    r = rms(o)
    o_hat = o / r
    sg = torch.sigmoid(gate)
    silu_gate = gate * sg
    if out_y is not None:
        torch.mul(silu_gate, o_hat, out=out_y)
    return ReadFactors(r, o_hat, silu_gate, o_hat * sg * (1 + gate * (1 - sg)))


def read_output_backward(f: ReadFactors, dy):
    """dL/do of the read's output y = silu(gate) o / rms(o) given dy, (B, H*dv)."""
    dhat = dy * f.silu_gate
    dot = torch.linalg.vecdot(dhat, f.o_hat).unsqueeze(-1)
    return torch.addcmul(dhat, f.o_hat, dot, value=-1.0 / dhat.shape[-1]).div_(f.rms)


def memory_read_backward(M, q, f: ReadFactors, dy, dM, *, out_dq=None, out_dgate=None, out_dM=None):
    """Gradients of `memory_read` given dy. Returns (dq, dgate, dM + the read's share of dL/dM);
    the last goes to `out_dM` when given (a buffer other than dM)."""
    B, H, n_k, n_v = M.shape
    do = read_output_backward(f, dy).view(B, H, 1, n_v)
    # M times a vector as a dot over M's rows: on CPU several times faster than a batched GEMM
    # with one column (products from the left, k^T M, are fast as bmm).
    dq = torch.linalg.vecdot(M, do, out=out_dq)
    dM = torch.addcmul(dM, q.unsqueeze(-1), do, out=out_dM)
    return dq, torch.mul(dy, f.to_gate, out=out_dgate), dM


def memory_step_backward(M_prev, M, k, beta, decay, e, delta, q, f: ReadFactors, dM, dy, *,
                         out_dk=None, out_dq=None, out_dbeta=None, out_ddecay=None, out_dgate=None, out_dM=None,
                         out_dv=None, gate_fac=None, out_dgates=None):
    """Gradients of `memory_step` given dM (w.r.t. M_t, from later steps) and dy.

    M_prev and M are the memory before and after the write, delta = beta e. Returns
    (dM_prev, dk, dv, dbeta, ddecay, dq, dgate); dM_prev goes to `out_dM` when given (a buffer
    other than dM). `out_dv` may have another dtype than M (dv is rounded into it: the core's
    projection-gradient rows, which its GEMM reads). With `gate_fac` (B, 2, H), the derivatives
    of (beta, decay) w.r.t. their pre-activations, (dbeta, ddecay) * gate_fac goes to
    `out_dgates` (B, 2, H), rounded to its dtype likewise.
    """
    dq, dgate, dM = memory_read_backward(M, q, f, dy, dM, out_dq=out_dq, out_dgate=out_dgate, out_dM=out_dM)
    # M = decay M_prev + k delta^T, delta = beta (v - M_prev^T k)
    B, H, n_k, n_v = M.shape
    d_delta = torch.bmm(k.reshape(B * H, 1, n_k), dM.view(B * H, n_k, n_v)).view(B, H, 1, n_v)
    dbeta = torch.linalg.vecdot(d_delta.squeeze(-2), e, out=out_dbeta)
    dv = d_delta.mul_(beta.view(B, H, 1, 1))
    dk = torch.linalg.vecdot(dM, delta.unsqueeze(-2), out=out_dk).sub_(torch.linalg.vecdot(M_prev, dv))
    ddecay = torch.linalg.vecdot(dM.view(B, H, -1), M_prev.view(B, H, -1), out=out_ddecay)
    # dM_prev = decay dM - k dv^T, in dM's buffer: dM is not needed after this
    dM.mul_(decay.view(B, H, 1, 1)).addcmul_(k.unsqueeze(-1), dv, value=-1.0)
    dv = dv.view(B, H, n_v) if out_dv is None else out_dv.copy_(dv.view(B, H, n_v))
    if gate_fac is not None:
        torch.mul(torch.stack([dbeta, ddecay], -2), gate_fac, out=out_dgates)
    return dM, dk, dv, dbeta, ddecay, dq, dgate


OPS = MemoryOps(memory_step, memory_read, decay_and_write, memory_read_backward, memory_step_backward, read_factors)
