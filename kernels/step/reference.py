"""The elementwise work of one step of the fused core, in plain PyTorch: the reference twin.

Between the step's GEMMs sit only elementwise maps and per-row reductions. They are grouped
here by where they sit, so that each group is one kernel (kernels/step/triton.py, same
signatures) and a step is: GEMM, `post_projection`, memory kernel, GEMM, `residual_rms`, ...,
GEMM, `ground`. The backward's groups are `residual_rms_backward` and `gate_grads`. The GEMMs
(`mm`) are here too: on CPU their rows are few enough for a kernel of our own to beat BLAS
(kernels/cpu/gemm.cpp).

Every function writes into the `out*` buffers it is given (the core's saved per-step vectors):
in a time loop of tiny ops, every copy counts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.common import L2_EPS, rms, scalar_tensors
from kernels.step import StepOps


def pack(W, steps, rows):
    """W in the layout `mm` reads fastest (for the kernels that have one, kernels/step/cpu.py)."""
    return W


def mm(x, W, out=None, bias=None):
    """[bias +] x @ W with the GEMM in W's dtype (the compute dtype): x of another dtype is cast
    in; the result goes into `out` (cast if its dtype differs), or is returned in x's dtype."""
    xc = x if x.dtype == W.dtype else x.to(W.dtype)
    if out is not None and W.dtype == out.dtype:
        return torch.mm(xc, W, out=out) if bias is None else torch.addmm(bias, xc, W, out=out)
    y = torch.mm(xc, W) if bias is None else torch.addmm(bias, xc, W)
    if out is not None:
        return out.copy_(y)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def rms_hat(x, out=None, rms_out=None):
    """(x / rms(x), rms(x))."""
    r = rms(x, out=rms_out)
    return torch.div(x, r, out=out), r


def rms_hat_backward(x_hat, r, dx_hat):
    dot = torch.linalg.vecdot(dx_hat, x_hat).unsqueeze(-1)
    return torch.addcmul(dx_hat, x_hat, dot, value=-1.0 / x_hat.shape[-1]).div_(r)


def l2n_relu(z, out=None, norm_out=None):
    """(l2n(relu(z)), sqrt(|relu(z)|^2 + eps)) over the last axis."""
    z = torch.relu(z)
    (sqrt_eps,) = scalar_tensors(z, math.sqrt(L2_EPS))
    n = torch.hypot(torch.linalg.vector_norm(z, dim=-1, keepdim=True), sqrt_eps, out=norm_out)
    return torch.div(z, n, out=out), n


def l2n_relu_backward(y, mask_over_norm, dy, out=None):
    """mask_over_norm = (y > 0) / norm: relu's mask is read off the output, y > 0 exactly where z > 0."""
    dot = torch.linalg.vecdot(dy, y).unsqueeze(-1)
    return torch.mul(torch.addcmul(dy, y, dot, value=-1.0), mask_over_norm, out=out)


# ---- forward groups --------------------------------------------------------------------------


def post_projection(h1, h2, out_ffn, heads=None, out_heads=None, out_norms=None, beta=None, a=None, A=None,
                    out_beta=None, out_gamma=None, out_decay=None):
    """After a layer's projection GEMM: the SwiGLU silu(h1) h2; the heads' relu + l2-normalisation
    (a layer with memory); the write's gates beta = sigmoid, gamma = softplus(a) A, decay = exp(gamma)
    (layer 0 of GPN+M). heads: (B, n_blocks, H, dk); beta, a: (B, H) pre-activations; A: (H,)."""
    torch.mul(F.silu(h1), h2, out=out_ffn)
    if heads is not None:
        l2n_relu(heads, out_heads, out_norms)
    if beta is not None:
        torch.sigmoid(beta, out=out_beta)
        torch.exp(torch.mul(F.softplus(a), A, out=out_gamma), out=out_decay)


def residual_rms(y, pg, c, out=None, out_hat=None, out_rms=None):
    """After a layer's second GEMM: c' = y + sigmoid(pg) c, and (c' / rms(c'), rms(c')) for the
    next layer's (or the fuse gate's) input. Returns c'."""
    c = torch.addcmul(y, torch.sigmoid(pg), c, out=out)
    rms_hat(c, out_hat, out_rms)
    return c


def ground(y_fg, c, u, out_fg, out_hat=None, out_rms=None):
    """After the fuse-gate GEMM: fg = sigmoid(y_fg), g = u + fg c, and (g / rms(g), rms(g)) for
    the next step's first layer when `out_hat` is given. Returns g."""
    fg = torch.sigmoid(y_fg, out=out_fg)
    g = torch.addcmul(u, fg, c)
    if out_hat is not None:
        rms_hat(g, out_hat, out_rms)
    return g


# ---- backward groups -------------------------------------------------------------------------


def residual_rms_backward(x_hat, r, dx_hat, dc, gate, extra=None, out=None, out_low=None, low_fac=None):
    """dL/dc of c -> (c / rms(c) fed to a GEMM, gate * c): the rms-norm backward of dx_hat plus
    dc * gate [+ extra]; also into out_low (the next GEMM's dtype) when given, times low_fac
    when that is given (the next GEMM's input is the gradient through an elementwise factor)."""
    dx = rms_hat_backward(x_hat, r, dx_hat)
    if extra is not None:
        dx += extra
    dc = torch.addcmul(dx, dc, gate, out=out)
    if low_fac is not None:
        torch.mul(dc, low_fac, out=out_low)
    elif out_low is not None:
        out_low.copy_(dc)
    return dc


def gate_grads(dz_ffn, ffn_fac, out_dffn, dc, pg_fac, out_dpg):
    """The projection-output gradients of the FFN and the predict gate: dz_ffn (B, 1, F) times
    the factors (B, 2, F) -> (B, 2, F); dc * pg_fac."""
    torch.mul(dz_ffn, ffn_fac, out=out_dffn)
    torch.mul(dc, pg_fac, out=out_dpg)


def gate_factors(h1, h2, pg, x_hat, r, out_fac, out_ffn, out_pg, out_pg_fac):
    """Once per chunk of the reverse sweep, over its rows: the factors of the SwiGLU's and the
    predict gate's derivatives that do not depend on the incoming gradient (`gate_grads` takes
    the products), and the SwiGLU's output again. h1, h2 (R, F), pg (R, d): the recomputed
    projection's blocks, in any dtype (widened to out_fac's); x_hat (R, d), r (R, 1): the
    layer's normalised input and its rms. Writes out_fac (R, 2, F) = (silu'(h1) h2, silu(h1)),
    out_ffn (R, F) = silu(h1) h2 (the second GEMM's input, in its dtype), out_pg = sigmoid(pg)
    and out_pg_fac = x_hat r out_pg (1 - out_pg). With h1 None (and h2, out_fac, out_ffn) the gate's
    alone: the fuse gate's, whose derivative has the same form."""
    dt = out_pg.dtype
    pg = torch.sigmoid(pg.to(dt), out=out_pg)
    torch.mul(x_hat, r, out=out_pg_fac).mul_(pg).mul_(1 - pg)
    if h1 is None:
        return
    h1, h2 = h1.to(dt), h2.to(dt)
    s1 = torch.sigmoid(h1)
    silu = torch.mul(h1, s1, out=out_fac[:, 1])
    torch.mul(torch.addcmul(s1 + silu, silu, s1, value=-1.0), h2, out=out_fac[:, 0])  # silu'(h1) h2
    torch.mul(silu, h2, out=out_ffn)


def ce_lse(logits):
    """The cross-entropy's forward: each row's log-sum-exp, in float32 at least (the rows are a
    chunk of the decoder GEMM's logits, in its compute dtype)."""
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)


def ce_grad(logits, lse, targets, g, dtype):
    """The cross-entropy's logit gradients (softmax - onehot(targets)) * g per row, computed from
    the logits and their log-sum-exp in float32 at least and rounded once into `dtype`."""
    p = torch.sub(logits, lse[:, None]).exp_()  # a bf16 minus a float32 is computed in float32
    p[torch.arange(p.shape[0], device=p.device), targets] -= 1.0
    g = g[:, None]
    return p.mul_(g) if p.dtype == dtype else torch.mul(p, g, out=torch.empty_like(p, dtype=dtype))


OPS = StepOps(pack, mm, rms_hat, rms_hat_backward, l2n_relu, l2n_relu_backward, post_projection, residual_rms, ground,
              residual_rms_backward, gate_grads, gate_factors, ce_lse, ce_grad)
