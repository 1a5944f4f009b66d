"""The decisions the training loop makes after each optimiser step, each small enough to test
alone: how the run ends (`Outcome`), whether it diverged (`Audit`), and what is due (`due`)."""

from __future__ import annotations

import enum
import math


class Outcome(enum.Enum):
    """How a run ended; its value is what `status.json` says."""

    FINISHED = "finished"
    PREEMPTED = "preempted"  # SIGTERM / SIGUSR1: checkpointed, exit 75
    INTERRUPTED = "interrupted"  # SIGINT: checkpointed, exit 130
    DIVERGED = "diverged"  # non-finite loss or gradient norm: nothing saved after it, exit 3
    FAILED = "failed"  # an error (2 for bad input) or a crash: status.json gives the reason


class Audit:
    """Counts steps in a row whose loss or gradient norm is not finite; more than `patience` of
    them is divergence. Every rank sees the same mean loss and global norm, so all decide alike."""

    def __init__(self, patience: int):
        self.patience = patience
        self.nonfinite = 0
        self.reason: str | None = None

    @property
    def clean(self) -> bool:
        """Whether the last step was finite (only then is the state worth a checkpoint)."""
        return self.nonfinite == 0

    def observe(self, loss: float, grad_norm: float | None) -> bool:
        """True when the run has diverged (`reason` says how)."""
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        self.nonfinite = 0 if finite else self.nonfinite + 1
        if self.nonfinite > self.patience:
            self.reason = f"loss {loss}, grad norm {grad_norm}"
        return self.reason is not None

    def at_end(self) -> bool:
        """True when the run stopped within the patience but on a non-finite step."""
        if self.nonfinite and self.reason is None:
            self.reason = f"{self.nonfinite} non-finite step(s) at the end"
        return self.reason is not None


def due(step: int, every: int, before: int) -> bool:
    """Whether a periodic action (eval, save) falls on `step`: every `every` steps (0: never),
    and not at `before` or later, where the run's end does it anyway."""
    return bool(every) and step % every == 0 and step < before
