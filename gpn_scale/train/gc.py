"""Python's cyclic garbage collector on the training loop's schedule (as torchtitan's
`GarbageCollection` and llm-foundry's scheduled collector), not on its own thresholds.

A step of the recurrent models makes tens of thousands of short-lived objects (the fused core's
per-step views and their lists), which reference counting frees; each still counts toward the
collector's thresholds, and the collections they trigger walk every object of the process
(torch's and DeepSpeed's included): about a tenth of a CPU step. So automatic collection is off
while the loop runs, and a full collection every `every` steps frees what reference cycles there
are at a bounded, predictable cost.
"""

from __future__ import annotations

import gc

COLLECT_EVERY = 100  # steps


class GarbageCollection:
    def __init__(self, every: int = COLLECT_EVERY):
        if every < 1:
            raise ValueError(f"every: expected a positive number of steps, got {every}")
        self.every = every
        self.was_enabled = gc.isenabled()
        gc.disable()

    def step(self, step: int) -> None:
        """After optimiser step `step` (counted from 1)."""
        if step % self.every == 0:
            gc.collect()

    def close(self) -> None:
        """Automatic collection as it was before."""
        if self.was_enabled:
            gc.enable()

    def __enter__(self) -> "GarbageCollection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
