"""Packing: documents' tokens concatenated in order and cut into fixed windows.

The tail shorter than a window is dropped at the end of each work unit (per split), never carried
into the next unit: that keeps every unit self-contained, so the output does not depend on which
worker or node prepared which unit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Packer:
    def __init__(self, seq_len: int, dtype: np.dtype):
        self.seq_len = seq_len
        self.dtype = dtype
        self._pending: list[np.ndarray] = []
        self._pending_len = 0

    def add(self, tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Append token sequences in order (documents with their BOS/EOS, arrays or lists); return
        the windows completed, (n, seq_len)."""
        self._pending += [np.asarray(t, dtype=self.dtype) for t in tokens]
        self._pending_len += sum(len(t) for t in tokens)
        n = self._pending_len // self.seq_len
        if n == 0:
            return np.empty((0, self.seq_len), self.dtype)
        joined = np.concatenate(self._pending)  # the one copy of the documents' tokens
        cut = n * self.seq_len
        self._pending = [joined[cut:].copy()]  # the tail alone, not a view keeping `joined` alive
        self._pending_len = len(joined) - cut
        return joined[:cut].reshape(n, self.seq_len)

    def finish(self) -> int:
        """Drop the tail; return how many tokens it held."""
        dropped, self._pending, self._pending_len = self._pending_len, [], 0
        return dropped
