"""JSON-lines files that a crash cannot corrupt for good: metrics.jsonl and samples.jsonl.

Writers append each record as one whole line in one write(2); readers skip a torn line (the
disk filled, the process died mid-write); a resumed run drops the records it will write again,
after keeping the file as it was.

Every line is strict JSON (RFC 8259), which has no NaN or Infinity: a non-finite number is
written as null and named, with what it was, under the record's `nonfinite`
(`{"step": 7, "loss": null, ..., "nonfinite": {"loss": "nan"}}`). A record is one object keyed by
`step` (an integer >= 0) whose other values are numbers or null, except the structured fields
below; a reader refuses one that is not, in one line naming the file, the line and the field.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path

from data_prep.errors import UserError

# Fields of a record that are not a number (or null), and what they hold.
STRUCTURED = {"event": str, "changes": dict, "nonfinite": dict, "samples": list, "branch": dict}


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def check_record(path: Path, line_no: int, record: dict) -> dict:
    """`record` (line `line_no` of `path`, from 1) if its fields have the types records hold;
    a one-line UserError naming the field otherwise (a file edited by hand or written by another tool)."""
    where = f"{path}: line {line_no}"
    step = record.get("step", 0)
    if type(step) is not int or step < 0:
        raise UserError(f"{where}: step: expected an integer >= 0, got {step!r}")
    for key, value in record.items():
        kind = STRUCTURED.get(key)
        if kind is not None:
            if not isinstance(value, kind):
                raise UserError(f"{where}: {key}: expected a JSON {'string' if kind is str else kind.__name__}, "
                                f"got {value!r}")
        elif value is not None and type(value) not in (int, float):
            raise UserError(f"{where}: {key}: expected a number or null, got {value!r}")
    return record


def _records(path: Path) -> list[tuple[str, dict | None]]:
    """(line, its record or None when torn) of every non-empty line, the records checked."""
    out = []
    for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if line:
            record = _parse(line)
            out.append((line, record if record is None else check_record(path, line_no, record)))
    return out


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (metrics.jsonl, samples.jsonl). A line cut short (the disk
    filled, the process died mid-write) is skipped: every record is one whole line."""
    if not path.is_file():
        return []
    return [r for _, r in _records(path) if r is not None]


def truncate_jsonl(path: Path, after_step: int) -> Path | None:
    """Drop the records of steps after `after_step` (a resumed run writes them again) and any torn
    line. Whenever something is dropped, the file as it was is kept beside it first, as
    `NAME.before_step_N` (`.1`, `.2`, ... if that exists): history is never lost. Returns that copy."""
    if not path.is_file():
        return None
    records = _records(path)
    kept = [line for line, r in records if r is not None and r.get("step", 0) <= after_step]
    if len(kept) == len(records):
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
        data = (json.dumps(strict(record), allow_nan=False) + "\n").encode()
        written = os.write(self.fd, data)
        if written != len(data):  # a short write: the disk is full
            raise OSError(errno.ENOSPC, f"short write to metrics ({written} of {len(data)} bytes)")

    def close(self) -> None:
        os.close(self.fd)


def strict(record: dict) -> dict:
    """`record` with every non-finite float (at any depth) replaced by null and named, as `nan`,
    `inf` or `-inf`, under `nonfinite` (dotted for a nested field): strict JSON keeps no NaN."""
    found: dict[str, str] = {}

    def clean(value, name: str):
        if isinstance(value, float) and not math.isfinite(value):
            found[name] = str(value)
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{name}.{k}" if name else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{name}.{i}") for i, v in enumerate(value)]
        return value

    out = clean(record, "")
    if found:
        out["nonfinite"] = found
    return out
