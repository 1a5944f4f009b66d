"""Replacing a small file so that a reader (or a crash) sees the old content or the new, never a
mix: write a sibling, fsync it, rename it over. Standard library only (native checkpoints use it)."""

from __future__ import annotations

import os
from pathlib import Path


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half-written sibling stays behind
        tmp.unlink(missing_ok=True)
        raise
    return path
