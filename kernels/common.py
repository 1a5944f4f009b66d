"""What every kernel family shares: the norms' epsilons and the reference's rms.

The eps values are the model's (docs/model.md, "Building blocks"); the kernels take them as
arguments, so the reference, Triton and C++ implementations use one number each.
"""

from __future__ import annotations

import math

import torch

RMS_EPS = 1e-6
L2_EPS = 1e-12

_SCALAR_TENSORS: dict = {}


def scalar_tensors(like: torch.Tensor, *values: float) -> tuple[torch.Tensor, ...]:
    """0-dim tensors of `values` with like's dtype and device, made once."""
    key = (like.dtype, like.device, values)
    if key not in _SCALAR_TENSORS:
        _SCALAR_TENSORS[key] = tuple(torch.tensor(v, dtype=like.dtype, device=like.device) for v in values)
    return _SCALAR_TENSORS[key]


def rms(x: torch.Tensor, out=None) -> torch.Tensor:
    """sqrt(mean(x^2) + 1e-6) over the last axis, keepdim.

    As hypot(|x| / sqrt(n), sqrt(1e-6)) with tensor constants: three ops, where the obvious
    x.pow(2).mean().add(eps).sqrt() is five, and in-place ops with Python scalars cost hidden
    copies on CPU.
    """
    inv_sqrt_n, sqrt_eps = scalar_tensors(x, 1.0 / math.sqrt(x.shape[-1]), math.sqrt(RMS_EPS))
    return torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True) * inv_sqrt_n, sqrt_eps, out=out)
