"""C++ kernels for a fused-core step on CPU: the elementwise groups (kernels/cpu/elementwise.cpp)
and the step's GEMMs (kernels/cpu/gemm.cpp).

The twin is kernels/step/reference.py: same functions, same signatures, same outputs; the
Triton kernels (kernels/step/triton.py) are the same groups on GPUs. A group is 3 to 10 torch ops
on vectors of a few hundred elements, where dispatch costs more than arithmetic; here it is one
call. The step's GEMMs have a batch's rows against weights that every step of the window
reuses: `pack` lays the weights out once, `mm` reads them. Built on first use
(kernels/cpu_build.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.common import L2_EPS, RMS_EPS
from kernels.cpu_build import load as _load
from kernels.step import StepOps
from kernels.step import reference as twin

SMALL_MM_ROWS = 16  # a step's batch: up to here `mm` uses the packed kernel (1.6-1.8x MKL at 8-16 rows)
PACK_MIN_STEPS = 16  # packing copies W once: worth it for a window of this many steps, not for a token


class Packed(NamedTuple):
    """W (K, N) as the panels kernels/cpu/gemm.cpp reads (`data`), and W itself."""

    data: torch.Tensor
    W: torch.Tensor


def pack(W, steps, rows):
    """W in the layout `mm` reads fastest, for a window of `steps` steps of `rows` rows: packed
    panels for float32 (a copy of W, made once per window), else W. One row is a
    matrix-vector product, bound by reading W in any layout: BLAS's reads it in place."""
    if W.dtype != torch.float32 or steps < PACK_MIN_STEPS or not 1 < rows <= SMALL_MM_ROWS:
        return W
    return Packed(_load().pack_weights(W), W)


def mm(x, W, out=None, bias=None):
    """[bias +] x @ W into `out`: the C++ GEMM for a step's few float32 rows against packed
    weights, else the twin's."""
    if isinstance(W, Packed):
        f32 = torch.float32
        if x.shape[0] <= SMALL_MM_ROWS and x.dtype == f32 and (out is None or out.dtype == f32):
            return _load().packed_mm(x, W.data, W.W.shape[1], bias, out)
        W = W.W
    return twin.mm(x, W, out, bias)


def post_projection(h1, h2, out_ffn, heads=None, out_heads=None, out_norms=None, beta=None, a=None, A=None,
                    out_beta=None, out_gamma=None, out_decay=None):
    """After a layer's projection GEMM: SwiGLU, the heads' relu + l2-normalisation, the write's gates."""
    _load().post_projection(h1, h2, out_ffn, heads, out_heads, out_norms, beta, a, A, out_beta, out_gamma, out_decay, L2_EPS)


def residual_rms(y, pg, c, out=None, out_hat=None, out_rms=None):
    """c' = y + sigmoid(pg) c and (c' / rms(c'), rms(c')) into out_hat, out_rms. Returns c'."""
    return _load().residual_rms(y, pg, c, out, out_hat, out_rms, RMS_EPS)


def ground(y_fg, c, u, out_fg, out_hat=None, out_rms=None):
    """fg = sigmoid(y_fg) into out_fg, g = u + fg c, and (g / rms(g), rms(g)) into out_hat,
    out_rms when given. Returns g."""
    return _load().ground(y_fg, c, u, out_fg, out_hat, out_rms, RMS_EPS)


def residual_rms_backward(x_hat, r, dx_hat, dc, gate, extra=None, out=None, out_low=None, low_fac=None):
    """rms-norm backward of dx_hat + dc * gate [+ extra]; also into out_low when given, times
    low_fac when that is given: here a copy or a product after the kernel, one op on a row
    (on CPU a call costs its dispatch, not a launch in a chain)."""
    dc = _load().residual_rms_backward(x_hat, r, dx_hat, dc, gate, extra, out)
    if low_fac is not None:
        torch.mul(dc, low_fac, out=out_low)
    elif out_low is not None:
        out_low.copy_(dc)
    return dc


def gate_grads(dz_ffn, ffn_fac, out_dffn, dc, pg_fac, out_dpg):
    """dz_ffn (B, 1, F) * ffn_fac (B, 2, F) into out_dffn (B, 2, F); dc * pg_fac into out_dpg."""
    _load().gate_grads(dz_ffn, ffn_fac, out_dffn, dc, pg_fac, out_dpg)


def l2n_relu_backward(y, mask_over_norm, dy, out=None):
    """(dy - y (dy . y)) * mask_over_norm per head, over (B, n_blocks, H, dk) or (B, H, dk) views."""
    return _load().l2n_relu_backward(y, mask_over_norm, dy, out)


# l2n_relu, rms_hat and its backward, the chunk's gate factors and the cross-entropy run once per
# window or chunk, over many rows, where torch's own kernels are as good: the twin's.
OPS = StepOps(pack, mm, twin.rms_hat, twin.rms_hat_backward, twin.l2n_relu, l2n_relu_backward, post_projection, residual_rms,
              ground, residual_rms_backward, gate_grads, twin.gate_factors, twin.ce_lse, twin.ce_grad)
