"""Decay branches: `gpn-scale train CONFIG --branch-from CKPT` starts a run from another run's
checkpoint (its weights, optimiser and schedule state, step, data position and RNG states) into a
run directory of its own, with its own schedule after that step: the warmup-stable-decay recipe,
where one run trains through the stable phase and each token budget is a short decay from one of
its checkpoints (`train.keep_steps` keeps them).

The parent is only read: no lease, no universal conversion, nothing written under its directory
(a branch on another world size needs the parent's universal form converted beforehand with
`gpn-scale ckpt to-universal CKPT`). The branch's config may differ from the checkpoint's only in
`config.BRANCHABLE` (schedule and length, checkpointing, eval, logging, run.*) and what a resume
may change; anything else is refused naming the first key that differs.

Where it came from is `run.dir/branch.json` (below), written when the branch starts and kept
while it runs and resumes, and a `branch` event in its `metrics.jsonl` at the starting step.
Rerunning the command (or `--resume auto` in the branch's directory) resumes from the branch's
own newest checkpoint, or, before it has one, starts from the recorded checkpoint again (the
same one, even where CKPT names a run whose newest checkpoint has moved on since), refusing one
whose files changed since.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from data_prep.errors import UserError
from gpn_scale.storage import atomic, checkpoints, manifest

BRANCH_FILE = "branch.json"


@dataclass(frozen=True)
class Origin:
    """`run.dir/branch.json`: the checkpoint a branch started from."""

    source: str  # --branch-from as given, made absolute (a checkpoint, or a run directory for its newest)
    checkpoint: str  # the checkpoint directory it resolved to, absolute
    step: int  # its optimiser step, where the branch starts
    manifest_xxh3_128: str  # the hash of its manifest.json, which lists every file's size and hash


def named_checkpoint(path: Path) -> bool:
    """Whether `path` names one checkpoint (rather than a run directory or its checkpoints/)."""
    return (path / checkpoints.TRAINER_STATE).is_file() or path.name.startswith("step_")


def parent_run_dir(source: str | Path) -> Path:
    """The directory of the run `source` belongs to, absolute: RUN for RUN/checkpoints/step_N,
    RUN/checkpoints or RUN; a checkpoint outside a `checkpoints/` directory: the directory holding it."""
    path = Path(source).resolve()
    if named_checkpoint(path):
        path = path.parent
    return path.parent if path.name == "checkpoints" else path


def check_target(run_dir: str | Path, source: str) -> None:
    """Preflight, on every rank: CKPT exists, and run.dir is neither the parent's directory nor
    inside it (nor holds it)."""
    if not Path(source).is_dir():
        raise UserError(f"--branch-from {source}: no such directory (expected a checkpoint directory, "
                        "RUN/checkpoints/step_N, or a run directory for its newest checkpoint)")
    parent, run = parent_run_dir(source), Path(run_dir).resolve()
    if run == parent or parent in run.parents:
        where = "the parent run's directory" if run == parent else f"inside the parent run's directory {parent}"
        raise UserError(f"--branch-from {source}: run.dir {run_dir} is {where}; a branch writes into a directory of "
                        "its own and nothing into its parent's: choose another run.dir")
    if run in parent.parents:
        raise UserError(f"--branch-from {source}: run.dir {run_dir} holds the parent run ({parent}); choose another "
                        "run.dir")


def check_run_dir(run_dir: str | Path, source: str, total_steps: int) -> None:
    """Preflight, on every rank: a run.dir that holds something holds this branch, unfinished (to
    resume), or an earlier start of it that saved nothing; not another run or another branch."""
    run_dir = Path(run_dir)
    recorded = read_origin(run_dir)
    source_now, where = str(Path(source).resolve()), f"--branch-from {source}: run.dir {run_dir}"
    if recorded is not None and recorded.source != source_now:
        raise UserError(f"{where} holds a branch from {recorded.source} ({BRANCH_FILE}), not from {source_now}; "
                        "choose another run.dir")
    own = checkpoints.committed(run_dir / "checkpoints")
    if recorded is None and own:
        raise UserError(f"{where} holds a run that is not a branch ({own[0]}, no {BRANCH_FILE}); choose another "
                        "run.dir")
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        status = None
    if (isinstance(status, dict) and status.get("status") == "finished" and type(status.get("step")) is int
            and status["step"] >= total_steps):
        raise UserError(f"{where} holds this branch, finished at step {status['step']} (train.total_steps="
                        f"{total_steps}); choose another run.dir for a new branch")


def resolve(source: str, warn) -> Path:
    """Rank 0: the complete, intact checkpoint `source` names (or a run directory's newest one that
    verifies), absolute. Nothing is written (no lease: a checkpoint the parent's rotation may remove
    while it is read is one it has not kept; branch from its train.keep_steps ones)."""
    path = Path(source).resolve()
    if named_checkpoint(path):
        problem = checkpoints.verify(path)
        if problem:
            raise UserError(f"--branch-from {source}: {problem}")
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    rejected: list = []
    tag = checkpoints.newest_complete(root, warn=warn, rejected=rejected)
    if tag is None:
        listed = "; ".join(f"{t}: {why}" for t, why in rejected)
        raise UserError(f"--branch-from {source}: no complete checkpoint there" + (f" ({listed})" if listed else "")
                        + " (expected a checkpoint directory, a run directory or its checkpoints/)")
    return root / tag


def origin_of(source: str, tag_dir: Path, step: int) -> Origin:
    return Origin(str(Path(source).resolve()), str(tag_dir), step,
                  manifest.file_hash(tag_dir / checkpoints.MANIFEST))


def read_origin(run_dir: Path) -> Origin | None:
    """The branch record of run_dir, or None where it is not a branch."""
    path = run_dir / BRANCH_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        origin = Origin(**raw)
        if not all(isinstance(getattr(origin, k), str) for k in ("source", "checkpoint", "manifest_xxh3_128")) \
                or type(origin.step) is not int:
            raise TypeError
    except (UnicodeDecodeError, ValueError, TypeError):
        raise UserError(f"{path}: not the branch record gpn-scale train writes (source, checkpoint, step, "
                        "manifest_xxh3_128)") from None
    return origin


def write_origin(run_dir: Path, origin: Origin) -> None:
    atomic.write_text(run_dir / BRANCH_FILE, json.dumps(asdict(origin), indent=1) + "\n")


def check_unchanged(origin: Origin) -> Path:
    """The recorded checkpoint, to start the branch from again: still complete and the same files
    (its manifest hashes as it did when the branch first started)."""
    tag_dir = Path(origin.checkpoint)
    problem = checkpoints.verify(tag_dir) if tag_dir.is_dir() else "no longer there"
    if problem is None and manifest.file_hash(tag_dir / checkpoints.MANIFEST) != origin.manifest_xxh3_128:
        problem = "its files changed since the branch started from it (its manifest hashes differently)"
    if problem:
        raise UserError(f"--branch-from: {tag_dir}, which this branch started from ({BRANCH_FILE}), cannot be used "
                        f"again: {problem}; choose another run.dir for a new branch")
    return tag_dir
