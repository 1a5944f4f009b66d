"""The held-out windows a training run scores at each evaluation.

They are the first `eval.batches` x `train.micro_batch` windows of `data.val` in the split's order
(all of them where it holds fewer), whatever the world size: each rank scores a contiguous block of them (the blocks
differ by one window at most), `train.micro_batch` at a time. Every rank runs the same number of
forwards, since ZeRO-3 gathers each layer's weights with all ranks together: a rank whose block is
done reads the split's first window again and counts none of it. The run's val_loss is the sum of
the windows' token losses over their tokens, summed across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from gpn_scale.storage.mds_datasets import open_dataset
from gpn_scale.train.batches import TOKENS, indexed_dataset_class, resolve_location


class ValWindows:
    def __init__(self, location: str, cache: str | None, windows: int, micro_batch: int, rank: int, world: int):
        local, remote = resolve_location(location, cache, "val")
        self.dataset = open_dataset(indexed_dataset_class(), local=local, remote=remote, shuffle=False,
                                    batch_size=micro_batch)
        self.total = min(windows, self.dataset.size)  # the windows scored, over all ranks
        self.ids = range(rank * self.total // world, (rank + 1) * self.total // world)  # this rank's block
        self.micro_batch = micro_batch
        self.forwards = math.ceil(math.ceil(self.total / world) / micro_batch)  # the same on every rank

    def _window(self, i: int) -> torch.Tensor:
        return torch.as_tensor(np.asarray(self.dataset[i][TOKENS]), dtype=torch.int64)

    def batches(self) -> Iterator[tuple[torch.Tensor, int]]:
        """(tokens (b, T), how many of its rows count), one per forward."""
        for k in range(self.forwards):
            ids = self.ids[k * self.micro_batch : (k + 1) * self.micro_batch]
            if len(ids):
                yield torch.stack([self._window(i) for i in ids]), len(ids)
            else:  # this rank's block is done: a forward all the same, counted for nothing
                yield self._window(0)[None], 0
