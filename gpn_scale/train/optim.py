"""The optimiser and its schedule: AdamW with decoupled weight decay on matrices, a linear
warm-up, then `train.schedule`: a cosine (the paper's), warmup-stable-decay (wsd) or constant.
Gradient clipping is DeepSpeed's (`gradient_clipping` in the engine's config), applied to the
global norm before every update."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from gpn_scale.train.config import TrainSection

if TYPE_CHECKING:
    from gpn_scale.models.model_spec import ParamGroups


def lr_factor(step: int, warmup: int, total: int, min_ratio: float, schedule: str = "cosine",
              decay_steps: int | None = None, decay_shape: str = "1-sqrt") -> float:
    """The learning rate's multiplier at scheduler step `step` (the update of optimiser step
    `step + 1` uses it). Linear warm-up to 1 over `warmup` steps, then:

    - cosine: to `min_ratio` at `total` (the paper's schedule);
    - constant: 1 to the end;
    - wsd (warmup-stable-decay): 1 until the last `decay_steps` optimiser steps, which decay to
      `min_ratio`, the last step (`step = total - 1`) reaching it: linearly, or as 1 - sqrt of the
      decay's progress (Hagele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
      Training Durations").
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "constant":
        return 1.0
    if schedule != "wsd":
        raise ValueError(f"schedule: expected cosine, wsd or constant, got {schedule!r}")
    decay_start = total - decay_steps  # optimiser steps decay_start + 1 ... total decay
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if decay_shape == "linear":
        return 1 - (1 - min_ratio) * progress
    if decay_shape == "1-sqrt":
        return min_ratio + (1 - min_ratio) * (1 - math.sqrt(progress))
    raise ValueError(f"decay_shape: expected linear or 1-sqrt, got {decay_shape!r}")


def schedule_of(t: TrainSection):
    """The run's `lr_factor` as a function of the scheduler step."""
    warmup, total, floor, schedule = t.warmup_steps, t.total_steps, t.min_lr_ratio, t.schedule
    decay, shape = t.decay_length(), t.decay_shape
    return lambda s: lr_factor(s, warmup, total, floor, schedule, decay, shape)


def build(groups: ParamGroups, t: TrainSection) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the model family's groups (`ModelSpec.param_groups`: the paper's recipe, every
    tensor of two or more dimensions decays, the embedding too; vectors and scalars do not), in the
    order [decayed, not decayed] (resuming re-applies the settings by position), and its
    per-optimiser-step schedule (DeepSpeed steps it once per update, not per micro-batch)."""
    settings = [{"params": groups.decay, "weight_decay": t.weight_decay}, {"params": groups.no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(settings, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(t))
    return optimizer, scheduler


def apply_settings(optimizer: torch.optim.Optimizer, scheduler, t: TrainSection) -> None:
    """After a resume (or at a decay branch's start): the checkpoint restored the hyperparameters
    as they were saved; this run's config decides them (a change got past the resume check:
    recorded, and either safe or allowed; a branch's schedule is its own). The scheduler keeps
    this run's schedule (`build`'s; a checkpoint holds its step, not its function). Unchanged
    values come out bit for bit as loaded."""
    groups = optimizer.param_groups  # [decay, no decay], as build made them
    scheduler.base_lrs = [t.lr] * len(groups)
    factor = schedule_of(t)(scheduler.last_epoch)
    for group, decay in zip(groups, (t.weight_decay, 0.0)):
        group.update(lr=t.lr * factor, initial_lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps, weight_decay=decay)
    # what get_last_lr() reports (the next update's rate, logged as its `lr`): the checkpoint's
    # would be the saved schedule's, not this run's
    scheduler._last_lr = [group["lr"] for group in groups]
