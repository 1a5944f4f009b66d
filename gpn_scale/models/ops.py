"""Small numerical building blocks shared by the models (docs/model.md, "Building blocks")."""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from kernels.common import L2_EPS, RMS_EPS  # one number each, for the models and the kernels
from kernels.step import StepOps
from kernels.step import reference as twin


def at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 when it already is (float64 runs serve gradient checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + 1e-6) * w, computed in float32 and cast back to x's dtype."""
    xf = at_least_f32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS) * weight.to(xf.dtype)
    return y.to(x.dtype)


class _RMSNormRows(torch.autograd.Function):
    """`rms_norm` with its backward written out: autograd's, through the mean, the power, the
    rsqrt and both products, makes about a dozen passes over the rows; this makes five
    (dy w, dy x_hat for dw and its sum, the dot, and dx = (dy w - x_hat dot / n) / rms)."""

    @staticmethod
    def forward(ctx, x, weight):
        xf = at_least_f32(x)
        rs = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        x_hat = xf * rs
        ctx.save_for_backward(x_hat, rs, weight)
        ctx.x_dtype = x.dtype
        return (x_hat * weight.to(xf.dtype)).to(x.dtype)  # as rms_norm, rounded once

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x_hat, rs, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.mul(dy, x_hat).reshape(-1, x_hat.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = dy * weight.to(x_hat.dtype)
            dot = torch.linalg.vecdot(g, x_hat).unsqueeze(-1)
            dx = torch.addcmul(g, x_hat, dot, value=-1.0 / x_hat.shape[-1]).mul_(rs).to(ctx.x_dtype)
        return dx, dw


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rms_norm` of many rows at once (the window's inputs and predictions, outside the time
    loop), with a backward of fewer passes than autograd's; the same forward numbers."""
    return _RMSNormRows.apply(x, weight)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-12) over the last axis, in float32."""
    xf = at_least_f32(x)
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2_EPS)


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """Truncated normal (at +-2 std) with variance 1/fan_in, fan_in = w.shape[0] (in x out layout).

    The truncation shrinks the variance by 0.8796^2; the standard deviation is scaled up to undo it,
    as in JAX's `lecun_normal`.
    """
    std = math.sqrt(1.0 / w.shape[0]) / 0.87962566103423978
    return torch.nn.init.trunc_normal_(w, 0.0, std, -2.0 * std, 2.0 * std)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    device = t.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """Per-row CE of `h @ weight.T` against `targets`, chunked over rows.

    Logits for `chunk` rows exist at a time, in the forward and again (recomputed) in the
    backward, so the (rows x vocab) matrix is never materialised. Only the log-sum-exp of each
    row is saved. Under autocast the matmuls run in the autocast dtype; the softmax statistics
    are float32. `ops` computes the log-sum-exp and the logits' gradient from a chunk's logits
    (`kernels.step`: the twin in torch, or one Triton kernel each, which read the logits once
    in their compute dtype and never write a float32 copy of them).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, ops):
        dtype = _compute_dtype(h)
        device = h.device.type
        losses = torch.empty(h.shape[0], dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        lse = torch.empty_like(losses)
        with torch.autocast(device, enabled=False):
            w = weight.to(dtype)
            for s in range(0, h.shape[0], chunk):
                logits = h[s : s + chunk].to(dtype) @ w.T
                lse[s : s + chunk] = ops.ce_lse(logits)
                target_logit = logits.gather(1, targets[s : s + chunk, None]).squeeze(1)  # widened exactly
                torch.sub(lse[s : s + chunk], target_logit, out=losses[s : s + chunk])
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.dtype, ctx.ops = chunk, dtype, ops
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        h, weight, targets, lse = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        dh = torch.empty_like(h)
        dweight = lse.new_zeros(weight.shape)  # float32 accumulator
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, h.shape[0], chunk):
                hc = h[s : s + chunk].to(dtype)
                # The chunk's (chunk x vocab) logit gradients, the largest transient of a step,
                # computed in float32 and rounded once into the compute dtype.
                dlogits = ctx.ops.ce_grad(hc @ w.T, lse[s : s + chunk], targets[s : s + chunk], grad_losses[s : s + chunk], dtype)
                dh[s : s + chunk] = (dlogits @ w).to(h.dtype)
                dweight += dlogits.T @ hc
        return dh, dweight.to(weight.dtype), None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                         ops: StepOps = twin.OPS) -> torch.Tensor:
    """Per-row losses (float32) of a tied-decoder CE, never materialising all logits at once."""
    return LinearCrossEntropy.apply(h, weight, targets, max(1, chunk), ops)
