"""JSON-lines files that a crash cannot corrupt for good: metrics.jsonl and samples.jsonl.

Writers append each record as one whole line in one write(2); readers skip a torn line (the
disk filled, the process died mid-write); a resumed run drops the records it will write again,
after keeping the file as it was.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (metrics.jsonl, samples.jsonl). A line cut short (the disk
    filled, the process died mid-write) is skipped: every record is one whole line."""
    if not path.is_file():
        return []
    return [r for r in map(_parse, path.read_text(errors="replace").splitlines()) if r is not None]


def truncate_jsonl(path: Path, after_step: int) -> Path | None:
    """Drop the records of steps after `after_step` (a resumed run writes them again) and any torn
    line. Whenever something is dropped, the file as it was is kept beside it first, as
    `NAME.before_step_N` (`.1`, `.2`, ... if that exists): history is never lost. Returns that copy."""
    if not path.is_file():
        return None
    lines = path.read_text(errors="replace").splitlines()
    kept = [line for line in lines if (r := _parse(line)) is not None and r.get("step", 0) <= after_step]
    if len(kept) == len([line for line in lines if line]):
        return None
    backup = path.with_name(f"{path.name}.before_step_{after_step}")
    n = 0
    while backup.exists():
        n += 1
        backup = path.with_name(f"{path.name}.before_step_{after_step}.{n}")
    shutil.copy2(path, backup)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return backup


class JsonLines:
    """Appends records to a JSON-lines file, each as one whole line in one write(2): a crash or a
    full disk leaves at worst one torn line at the end, which readers skip."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        written = os.write(self.fd, data)
        if written != len(data):  # a short write: the disk is full
            raise OSError(errno.ENOSPC, f"short write to metrics ({written} of {len(data)} bytes)")

    def close(self) -> None:
        os.close(self.fd)
