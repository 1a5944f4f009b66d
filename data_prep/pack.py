"""Packing: documents' tokens concatenated in order and cut into fixed windows.

The tail shorter than a window is dropped at the end of each work unit (per split), never carried
into the next unit: that keeps every unit self-contained, so the output does not depend on which
worker or node prepared which unit.
"""

from __future__ import annotations

from itertools import chain

import numpy as np


class Packer:
    def __init__(self, seq_len: int, dtype: np.dtype):
        self.seq_len = seq_len
        self.dtype = dtype
        self._pending: list[np.ndarray] = []
        self._pending_len = 0

    def add(self, docs: list[list[int]]) -> np.ndarray:
        """Append documents (already carrying BOS/EOS); return the windows completed, (n, seq_len)."""
        flat = np.fromiter(chain.from_iterable(docs), dtype=self.dtype, count=sum(map(len, docs)))
        self._pending.append(flat)
        self._pending_len += len(flat)
        n = self._pending_len // self.seq_len
        if n == 0:
            return np.empty((0, self.seq_len), self.dtype)
        joined = np.concatenate(self._pending)
        cut = n * self.seq_len
        self._pending = [joined[cut:]]
        self._pending_len = len(joined) - cut
        return joined[:cut].reshape(n, self.seq_len)

    def finish(self) -> int:
        """Drop the tail; return how many tokens it held."""
        dropped, self._pending, self._pending_len = self._pending_len, [], 0
        return dropped
