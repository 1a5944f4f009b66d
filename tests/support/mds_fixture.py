"""Small MDS datasets in the prep's format (column `tokens`, fixed-length uint16 windows)."""

import json
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


def write_streams(out: Path, streams: int, windows: int, seq_len: int, vocab: int, seed: int = 0,
                  eos: int | None = None) -> Path:
    """The prep's stream layout (data_prep/document_streams.py): window-major samples with their stream and
    window, and streams.json. Each stream repeats its own pattern, so a state carried from window to
    window knows where the next window begins. With `eos`, documents end (that token, found nowhere
    else) a third of the way into every window, and the even streams' at each window's last token
    too; the prep's stats.json with that EOS id goes two levels up (OUT of OUT/streams/train)."""
    from streaming import MDSWriter

    from data_prep.document_streams import StreamStats

    rng = np.random.default_rng(seed)
    period = 3 * seq_len // 2  # never a whole number of windows: each window starts elsewhere in it
    patterns = rng.integers(0, vocab, size=(streams, period))
    columns = {"tokens": f"ndarray:uint16:{seq_len}", "stream": "int32", "window": "int32"}
    with MDSWriter(out=str(out), columns=columns, size_limit=1 << 14) as w:
        for k in range(windows):
            for i in range(streams):
                window = patterns[i][(np.arange(seq_len) + k * seq_len) % period].copy()
                noise = rng.random(seq_len) < 0.1
                window[noise] = rng.integers(0, vocab, size=noise.sum())
                if eos is not None:
                    window[window == eos] = (eos + 1) % vocab
                    window[seq_len // 3] = eos
                    if i % 2 == 0:
                        window[-1] = eos
                w.write({"tokens": window.astype(np.uint16), "stream": i, "window": k})
    stats = StreamStats(streams, seq_len, windows, streams, streams * windows * seq_len, 0, windows * seq_len,
                        windows * seq_len)
    (out / "streams.json").write_text(json.dumps(stats.to_json()))
    if eos is not None:
        (out.parent.parent / "stats.json").write_text(json.dumps({"vocab_size": vocab, "eos_id": eos}))
    return out
