"""Causal ablations the paper did not run (its limitation 3): held-out PPL when the model, at every
step, loses its mean direction or some of its memory reads.

- `ProjectOut(sbar)`: s^p_t <- s^p_t - (s^p_t . u) u with u = s-bar / |s-bar|, before it is decoded
  and grounded, so the state never carries the mean direction.
- `SilenceHeads(heads)`: those heads' normalised reads become 0, so nothing they read reaches the
  state while the other heads' reads keep their usual scale (zeroing before the read norm would
  rescale the survivors); silencing every head removes the memory read entirely.
"""

from __future__ import annotations

import torch

from gpn_scale.eval.heldout import evaluate_windows
from gpn_scale.models import StepHooks


class ProjectOut(StepHooks):
    def __init__(self, direction: torch.Tensor):
        self.u = direction / direction.norm()

    def prediction(self, c):
        u = self.u.to(c)
        return c - (c @ u)[:, None] * u


class SilenceHeads(StepHooks):
    def __init__(self, heads: list[int]):
        self.heads = list(heads)

    def read(self, o):
        o = o.clone()
        o[:, self.heads] = 0
        return o


def run_ablations(model, windows: torch.Tensor, sbar: torch.Tensor, slow: list[int], fast: list[int],
                  batch: int = 16) -> dict:
    """Loss and PPL of the intact model and of each ablation on the same windows (all on the naive
    core, so the deltas are the ablations' alone)."""
    arms = {"intact": StepHooks(), "sbar_projected_out": ProjectOut(sbar)}
    if model.config.memory:
        heads = list(range(model.config.n_heads))
        arms.update({"slow_pool_reads_zeroed": SilenceHeads(slow), "fast_pool_reads_zeroed": SilenceHeads(fast),
                     "memory_reads_off": SilenceHeads(heads)})
    results = {}
    for name, hooks in arms.items():
        r = evaluate_windows(model, windows, batch, hooks=hooks)
        results[name] = {"loss": r.loss, "ppl": r.ppl}
    base = results["intact"]
    for r in results.values():
        r["delta_loss"], r["delta_ppl"] = r["loss"] - base["loss"], r["ppl"] - base["ppl"]
    return results
