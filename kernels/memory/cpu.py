"""C++ kernels for the memory step of GPN+M on CPU (kernels/cpu/memory_step.cpp).

The twin is kernels/memory/reference.py: same functions, same signatures, same outputs; the
Triton kernels (kernels/memory/triton.py) are the same contract on GPUs. On CPU the torch twin
spends most of a step walking M again and again (a dozen ops, each a pass over M), and the
fused core runs it twice per step in the forward (the loop and the rebuild) and its backward
once; here a call is one pass. Built on first use (kernels/cpu_build.py).
"""

from __future__ import annotations

from kernels.common import RMS_EPS
from kernels.cpu_build import load as _load
from kernels.memory import MemoryOps, ReadFactors
from kernels.memory import reference as twin


def memory_step(M, k, v, beta, decay, q, gate, *, out_e=None, out_o=None, out_y=None, out_M=None):
    """Write (k, v) into M, then read the new M with q. Returns (M_t, e, o, y), e = v - M^T k.
    M_t goes to `out_M` when given (contiguous, a buffer other than M)."""
    return tuple(_load().memory_step(M, k, v, beta, decay, q, gate, out_e, out_o, out_y, out_M, RMS_EPS))


def decay_and_write(M, k, delta, decay, *, out_M=None):
    """decay M + k delta^T per head (the write alone), into `out_M` when given. The core's
    rebuild replays `memory_step`, so this is the twin's, kept for the contract."""
    return twin.decay_and_write(M, k, delta, decay, out_M=out_M)


def memory_read(M, q, gate, *, out_o=None, out_y=None):
    """Read M with q: returns (o, y)."""
    return tuple(_load().memory_read(M, q, gate, out_o, out_y, RMS_EPS))


def memory_read_backward(M, q, f: ReadFactors, dy, dM, *, out_dq=None, out_dgate=None, out_dM=None):
    """Gradients of `memory_read` given dy. Returns (dq, dgate, dM + the read's share of dL/dM),
    the last in `out_dM` when given (contiguous, a buffer other than dM)."""
    return tuple(_load().memory_read_backward(M, q, *f, dy, dM, out_dq, out_dgate, out_dM))


def memory_step_backward(M_prev, M, k, beta, decay, e, delta, q, f: ReadFactors, dM, dy, *,
                         out_dk=None, out_dq=None, out_dbeta=None, out_ddecay=None, out_dgate=None, out_dM=None,
                         out_dv=None, gate_fac=None, out_dgates=None):
    """Gradients of `memory_step` given dM (w.r.t. M_t, from later steps) and dy.

    Returns (dM_prev, dk, dv, dbeta, ddecay, dq, dgate), dM_prev in `out_dM` when given
    (contiguous, a buffer other than dM); dv into `out_dv` and, with `gate_fac`,
    (dbeta, ddecay) * gate_fac into `out_dgates`. The kernel writes M's dtype: an `out_dv` or
    `out_dgates` of another dtype is filled by a copy after it.
    """
    dt = M_prev.dtype
    dv_in = out_dv if out_dv is not None and out_dv.dtype == dt else None
    dg_in = out_dgates if out_dgates is not None and out_dgates.dtype == dt else None
    dM_prev, dk, dv, dbeta, ddecay, dq, dgate, *dgates = _load().memory_step_backward(
        M_prev, M, k, beta, decay, e, delta, q, *f, dM, dy, out_dk, out_dq, out_dbeta, out_ddecay, out_dgate, out_dM, dv_in,
        gate_fac, dg_in)
    if out_dv is not None and dv_in is None:
        dv = out_dv.copy_(dv)
    if out_dgates is not None and dg_in is None:
        out_dgates.copy_(dgates[0])
    return dM_prev, dk, dv, dbeta, ddecay, dq, dgate


OPS = MemoryOps(memory_step, memory_read, decay_and_write, memory_read_backward, memory_step_backward, twin.read_factors)
