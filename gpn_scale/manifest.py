"""`manifest.json`: the size and sha256 of each file of a checkpoint directory, written last.

Shared by training checkpoints (`gpn_scale/train/checkpoint.py`) and native ones
(`gpn_scale/native.py`), which load without the trainer package: standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: str | Path, names: list[str]) -> Path:
    """Record the files `names` (relative to `directory`); atomically, after they are written."""
    directory = Path(directory)
    entries = {n: {"bytes": (directory / n).stat().st_size, "sha256": sha256(directory / n)} for n in sorted(names)}
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"files": entries}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    return directory / MANIFEST


def verify_manifest(directory: str | Path, required: tuple[str, ...] = ()) -> str | None:
    """None when `directory`'s files match its manifest, which lists every name in `required`;
    else what is wrong, in a few words (the caller names the directory)."""
    directory = Path(directory)
    try:
        entries = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name in required:
        if name not in entries:
            return f"{MANIFEST} does not list {name}"
    for rel, want in entries.items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {want['bytes']}"
        if sha256(path) != want["sha256"]:
            return f"{rel} does not match its sha256 (corrupted)"
    return None
