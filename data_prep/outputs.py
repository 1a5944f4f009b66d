"""Where commands write: a new or empty directory, or the command's own earlier (resumable) output.

No command writes into a directory that is not its own. Each kind of directory gpn-scale writes is
known by entries only that kind writes (its *signature*); a command that resumes (prep, train,
sweep, demo) accepts an existing directory only when it is its own kind, and the commands that
make something new (convert, export, eval, analyze) only a new or empty one, which they fill
under a temporary name beside it and rename into place once complete (`new_directory`). The
check runs before any work, so a refusal costs seconds and writes nothing:

    error: --out runs/a: holds a training run (gpn-scale train's status.json); prep writes into a new or
    empty directory or its own earlier output (prep.json): choose another --out

Standard library only: the trainer, the data prep and the inference commands all use it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import UserError


@dataclass(frozen=True)
class Kind:
    """A kind of directory gpn-scale writes (or knows), recognised by its signature."""

    name: str  # "a training run"
    writer: str  # "gpn-scale train"
    signature: tuple[str, ...]  # glob patterns relative to the directory; any one match recognises it

    def found_in(self, path: Path) -> str | None:
        """The first entry of `path` that matches the signature, relative to it, or None."""
        for pattern in self.signature:
            for match in sorted(path.glob(pattern)):
                return str(match.relative_to(path))
        return None


PREP = Kind("a prep output", "gpn-scale prep", ("prep.json", "units", "prep*.lock", ".tmp"))
SWEEP = Kind("a sweep", "gpn-scale sweep", ("*/point.json",))
SWEEP_POINT = Kind("a sweep point", "gpn-scale sweep", ("point.json",))
TRAINING_RUN = Kind("a training run", "gpn-scale train", ("status.json", "trainer.lock", "checkpoints/step_*",
                                                          "checkpoints/latest", "metrics.jsonl", "samples.jsonl"))
DEMO = Kind("a demo", "gpn-scale demo", ("corpus/pydoc-topics-*.parquet",))
NATIVE = Kind("a native checkpoint", "gpn-scale convert / export --to native", ("model.safetensors", "model.yaml"))
HF = Kind("a Hugging Face model", "gpn-scale export --to hf", ("config.json",))
REFERENCE = Kind("a reference checkpoint", "gpn-scale export --to reference", ("checkpoint.pkl",))
EVALUATION = Kind("an evaluation", "gpn-scale eval", ("metrics.json", "loss_by_position.csv", "lambada_examples.jsonl"))
ANALYSIS = Kind("an analysis", "gpn-scale analyze", ("report.json", "report.md"))
LM_EVAL = Kind("lm-evaluation-harness results", "gpn-scale lm-eval", ("results_*.json", "*/results_*.json"))
MDS = Kind("an MDS dataset", "MosaicML Streaming", ("index.json", "*/index.json"))

# In the order they are told apart: a kind whose directories also match a later one's signature first
# (a demo holds a report.md, a sweep point trains into its own directory).
KINDS = (PREP, SWEEP, SWEEP_POINT, TRAINING_RUN, DEMO, NATIVE, HF, REFERENCE, EVALUATION, ANALYSIS, LM_EVAL, MDS)


def identify(path: Path) -> tuple[Kind, str] | None:
    """Which kind of directory `path` is, and the entry that shows it; None for anything else."""
    for kind in KINDS:
        entry = kind.found_in(path)
        if entry is not None:
            return kind, entry
    return None


def _entries(path: Path) -> list[str]:
    try:
        return sorted(p.name for p in path.iterdir())
    except OSError as e:
        raise UserError(f"{path}: cannot list ({e.strerror})") from None


def _not_a_directory(path: Path, flag: str) -> UserError:
    return UserError(f"{flag} {path}: exists and is not a directory; choose another {flag}")


def check_resumable(path: str | Path, flag: str, command: str, own: tuple[Kind, ...],
                    allowed: tuple[str, ...] = ()) -> bool:
    """Refuse (UserError, one line) a `path` that exists and is neither empty nor one of `own`;
    `allowed` names entries that may be there besides (e.g. the config file a run is started from).
    Returns whether it holds an earlier output of the command (something to resume)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return False
    if not path.is_dir():
        raise _not_a_directory(path, flag)
    if not _entries(path):
        return False
    found = identify(path)
    if found is not None and found[0] in own:
        return True
    mine = " or ".join(f"({kind.signature[0]})" for kind in own)
    what = f"{command} writes into a new or empty directory or its own earlier output {mine}"
    others = [name for name in _entries(path) if name not in allowed]
    if found is None and not others:
        return False
    if found is None:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UserError(f"{flag} {path}: holds files that are not {command}'s ({shown}); {what}: choose another {flag}")
    kind, entry = found
    raise UserError(f"{flag} {path}: holds {kind.name} ({kind.writer}'s {entry}); {what}: choose another {flag}")


def check_new(path: str | Path, flag: str, command: str) -> None:
    """Refuse (UserError, one line) a `path` that exists and is not an empty directory."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise _not_a_directory(path, flag)
    if not _entries(path):
        return
    found = identify(path)
    held = f"holds {found[0].name} ({found[0].writer}'s {found[1]})" if found else "is not empty"
    raise UserError(f"{flag} {path}: {held}; {command} writes a new directory and overwrites nothing: "
                    f"choose another {flag}")


@contextmanager
def new_directory(path: str | Path, flag: str, command: str) -> Iterator[Path]:
    """Fill a new directory: yields a staging directory beside `path`, renamed to `path` only when
    the block completes (removed if it fails), so `path` is either absent or complete. `path` is
    checked again here (another process may have made it since the command's first check)."""
    path = Path(path)
    check_new(path, flag, command)
    staging = path.parent / f".{path.name}.partial-{os.getpid()}"
    if staging.exists():  # left by an earlier crashed command of this process id: never complete
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
        check_new(path, flag, command)
        if path.exists():
            path.rmdir()  # empty (checked just now)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_new_file(path: str | Path, flag: str) -> None:
    """Refuse (UserError, one line) a file output that exists already."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        what = "a directory" if path.is_dir() else "a file"
        raise UserError(f"{flag} {path}: {what} of that name exists; nothing is overwritten: choose another {flag}")
