"""Bad input as one line: the error type every command raises for it, and reading the project's
text files (configs, manifests, states, indexes, metrics) so that a file that cannot be read, is
not UTF-8 or is not the JSON it should be is a `UserError` naming it, never a decoder's traceback.
The standard library only: data_prep and every package of gpn_scale import it."""

from __future__ import annotations

import json
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (a file, a config field, a flag).

    The CLI prints these as one line, `error: <message>`, and exits with status 2; the message
    names the file or field and what was expected. Anything else is a bug and keeps its traceback.
    `every_rank`: every process of a distributed run raises the same one (the config, the
    preflight, rank 0's resume choice), so only rank 0 prints it.
    """

    every_rank = False


def read_text(path: str | Path, shown: str | Path | None = None) -> str:
    """The file's text; `shown`: the name errors give it (default the path). FileNotFoundError is
    left to the caller, which knows what a missing file means there."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UserError(f"{shown or path}: cannot read ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{shown or path}: not UTF-8 text (at byte offset {e.start})") from None


def read_json(path: str | Path, shown: str | Path | None = None):
    """The file's JSON value (any type: the caller checks its shape)."""
    text = read_text(path, shown)
    try:
        return json.loads(text)
    except ValueError as e:
        raise UserError(f"{shown or path}: not valid JSON ({e})") from None
