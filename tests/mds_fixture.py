"""Small MDS datasets in the prep's format (column `tokens`, fixed-length uint16 windows)."""

from pathlib import Path

import numpy as np


def write_windows(out: Path, n: int, seq_len: int, vocab: int, seed: int = 0) -> Path:
    from streaming import MDSWriter

    rng = np.random.default_rng(seed)
    # A learnable stream: a repeating pattern with noise, so losses fall when training works.
    base = rng.integers(0, vocab, size=64)
    with MDSWriter(out=str(out), columns={"tokens": f"ndarray:uint16:{seq_len}"}, size_limit=1 << 14) as w:
        for i in range(n):
            window = base[(np.arange(seq_len) + i) % len(base)].copy()
            noise = rng.random(seq_len) < 0.1
            window[noise] = rng.integers(0, vocab, size=noise.sum())
            w.write({"tokens": window.astype(np.uint16)})
    return out
