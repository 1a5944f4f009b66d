"""Per-step predicted states s^p_t and memory decays gamma_t of a GPN / GPN+M on held-out windows,
recorded through the model's `StepHooks` (the naive core; analysis never trains)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpn_scale.eval.heldout import model_device
from gpn_scale.models import GPN, StepHooks


def has_state(model) -> bool:
    """Whether the model carries one state vector per token (GPN, GPN+M): the analyses' subject."""
    return isinstance(model, GPN)


def has_memory(model) -> bool:
    return has_state(model) and model.config.memory


class Recorder(StepHooks):
    def __init__(self):
        self.predictions, self.decays = [], []

    def decay(self, gamma):
        self.decays.append(gamma.detach().float().cpu())

    def prediction(self, c):
        self.predictions.append(c.detach().float().cpu())
        return c


@dataclass
class Trace:
    predictions: torch.Tensor  # (N, T, d) s^p_t: the state each token is decoded from
    decays: torch.Tensor | None  # (N, T, H) gamma_t of each memory write; None without memory


@torch.no_grad()
def record(model, windows: torch.Tensor, batch: int = 16) -> Trace:
    model.eval()
    predictions, decays = [], []
    for start in range(0, len(windows), batch):
        rec = Recorder()
        model(windows[start : start + batch].to(model_device(model)), hooks=rec)
        predictions.append(torch.stack(rec.predictions, 1))
        if rec.decays:
            decays.append(torch.stack(rec.decays, 1))
    return Trace(torch.cat(predictions), torch.cat(decays) if decays else None)
