"""Held-out perplexity over every position of every window, and the loss at each position.

Position 1 of a window is predicted from the empty state, as in the paper; a recurrent model's loss
falls along the window as its state fills, so the per-position curve is kept beside the mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HeldOut:
    loss: float  # mean CE over all positions (nats)
    tokens: int
    per_position: np.ndarray  # (T,) mean CE at each position of the window

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate_windows(model, windows: torch.Tensor, batch: int = 16, **forward) -> HeldOut:
    """Mean CE of `model` over (N, T) windows, each from the empty state; `forward` goes to the model
    call (e.g. `hooks=` for an ablation)."""
    model.eval()
    sums = torch.zeros(windows.shape[1], dtype=torch.float64)
    for start in range(0, len(windows), batch):
        tokens = windows[start : start + batch].to(model_device(model))
        sums += model(tokens, **forward).token_losses.double().sum(0).cpu()
    n = len(windows)
    return HeldOut(float(sums.sum() / (n * windows.shape[1])), n * windows.shape[1], (sums / n).numpy())
