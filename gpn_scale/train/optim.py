"""The optimiser and its schedule: AdamW with decoupled weight decay on matrices, a linear
warm-up then a cosine. Gradient clipping is DeepSpeed's (`gradient_clipping` in the engine's
config), applied to the global norm before every update."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from gpn_scale.train.config import TrainSection

if TYPE_CHECKING:
    from gpn_scale.models.spec import ParamGroups


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine to `min_ratio` at `total` (the paper's schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build(groups: ParamGroups, t: TrainSection) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the model family's groups (`ModelSpec.param_groups`: the paper's recipe, every
    tensor of two or more dimensions decays, the embedding too; vectors and scalars do not), in the
    order [decayed, not decayed] (resuming re-applies the settings by position), and its
    per-optimiser-step schedule (DeepSpeed steps it once per update, not per micro-batch)."""
    settings = [{"params": groups.decay, "weight_decay": t.weight_decay}, {"params": groups.no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(settings, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, t.total_steps, t.min_lr_ratio))
    return optimizer, scheduler


def apply_settings(optimizer: torch.optim.Optimizer, scheduler, t: TrainSection) -> None:
    """After a resume: the checkpoint restored the hyperparameters as they were saved; this run's
    config decides them (a change got past the resume check: recorded, and either safe or
    allowed). Unchanged values come out bit for bit as loaded."""
    groups = optimizer.param_groups  # [decay, no decay], as build made them
    scheduler.base_lrs = [t.lr] * len(groups)
    factor = lr_factor(scheduler.last_epoch, t.warmup_steps, t.total_steps, t.min_lr_ratio)
    for group, decay in zip(groups, (t.weight_decay, 0.0)):
        group.update(lr=t.lr * factor, initial_lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=decay)
