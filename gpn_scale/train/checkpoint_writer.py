"""The trainer's side of its checkpoints: writing DeepSpeed's sharded checkpoints so that each is
either complete or ignored, rotating them, and on resume converting one to the universal form and
loading it back into the engine; the `gpn-scale ckpt` tools. The layout, and reading it (a model
for evaluation or export, a run's trainer state), are `gpn_scale.storage.checkpoints`'.

A directory without a manifest (a crash mid-save, on any rank) or whose files no longer match
it (truncated, corrupted) is skipped by `--resume auto` with a one-line warning.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from gpn_scale.storage import atomic, leases, manifest, safe_load
from gpn_scale.storage.checkpoints import DERIVED, MANIFEST, TRAINER_STATE, UNIVERSAL, read_trainer_state, step_of, tags, verify
from data_prep.errors import UserError
from data_prep.helptext import HelpFormatter
from gpn_scale.train import optim
from gpn_scale.train.config import TrainSection

LATEST = "latest"


# DeepSpeed's per-rank files (zero_pp_rank_{r}_mp_rank_00_optim_states.pt, and at ZeRO-3 the
# model states too) and the trainer's rng_rank{r}.pt carry the rank that wrote them.
_WRITER = re.compile(r"(?:pp_rank_|rng_rank)(\d+)")


def files_of(tag_dir: Path) -> list[str]:
    """The files its manifest lists: every file under tag_dir but the manifest and the universal
    form (`checkpoints.DERIVED`), relative, sorted."""
    return manifest.files_under(tag_dir, besides=DERIVED)


def writer_rank(name: str, world: int) -> int:
    """The rank that wrote a checkpoint file; rank 0 for the files only it writes (the model
    states at ZeRO 0-2, trainer_state.json)."""
    found = _WRITER.search(Path(name).name)
    return int(found.group(1)) % world if found else 0


class HashingSaves:
    """DeepSpeed's checkpoint engine (torch.save, one file per call) with each file hashed as it is
    written (`manifest.write_hashed`), so a save's manifest needs no second pass over its tens of
    GB. Everything but `save` is the wrapped engine's."""

    def __init__(self, inner):
        self._inner = inner
        self._written: dict[Path, dict] = {}

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def save(self, state_dict, path: str) -> None:
        zipfile = self._inner.zipfile_serialization
        self._written[Path(path).resolve()] = manifest.write_hashed(
            Path(path), lambda f: torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile))

    def take(self, tag_dir: Path) -> dict[str, dict]:
        """The entries of the files written under tag_dir, by their names there; forgotten here."""
        root = tag_dir.resolve()
        mine = {p: e for p, e in self._written.items() if p.is_relative_to(root)}
        for p in mine:
            del self._written[p]
        return {str(p.relative_to(root)): e for p, e in mine.items()}


def hash_own_files(tag_dir: Path, rank: int, world: int, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every rank, once all ranks' files are written: the manifest entries of the files this rank
    wrote, so a save's hashing is spread over the ranks like its writing. `known`: entries hashed
    while writing (HashingSaves, save_rng); the rest are read back (still in the page cache)."""
    known = known or {}
    unknown = [n for n in files_of(tag_dir) if writer_rank(n, world) == rank and n not in known]
    return {**manifest.hash_files(tag_dir, unknown), **known}


def write_manifest(tag_dir: Path) -> None:
    """The files of tag_dir (`files_of`), hashed here, in the format native checkpoints share."""
    manifest.write_manifest(tag_dir, files_of(tag_dir))


def commit(root: Path, tag: str, keep_last: int, verified: set[str], reports: list[dict[str, dict]],
           keep_steps=frozenset()) -> None:
    """Rank 0, after every rank finished writing `tag` and hashing its files (`reports`, one per
    rank, from hash_own_files): manifest, then `latest`, then pruning.

    Pruning removes only what is older than `tag`: the `keep_last - 1` newest older checkpoints
    that verify are kept with it, and a checkpoint goes only once `keep_last` verified ones newer
    than it exist. Newer directories (left by a run that resumed from an earlier step) stay until
    this run's saves replace them. One a reader holds (`gpn_scale.storage.leases`) stays too, beyond
    `keep_last`, until a save after the reader is done. One of the steps in `keep_steps`
    (`train.keep_steps`) is never removed; among the newest it counts toward `keep_last` like any.

    `verified`: the tags this process has verified or written itself (the caller keeps it; `tag`
    is added). Only the others are hashed again, so a save does not re-read the checkpoints
    before it.
    """
    entries = {name: entry for report in reports for name, entry in report.items()}
    unreported = [n for n in files_of(root / tag) if n not in entries]  # e.g. a file no rank's name claims
    manifest.write_entries(root / tag, {**entries, **manifest.hash_files(root / tag, unreported)})
    atomic.write_text(root / LATEST, tag)
    verified.add(tag)
    older = [t for t in tags(root) if step_of(t) < step_of(tag)]
    kept = 1
    for old in older:
        if kept < keep_last and (old in verified or verify(root / old) is None):
            verified.add(old)
            kept += 1
        elif kept >= keep_last and step_of(old) not in keep_steps and leases.remove_unless_read(root, old):
            verified.discard(old)


def write_trainer_state(tag_dir: Path, state: dict) -> None:
    atomic.write_text(tag_dir / TRAINER_STATE, json.dumps(state, indent=1))


def save_rng(tag_dir: Path, rank: int) -> dict[str, dict]:
    """Write this rank's RNG states; {file name: manifest entry}.

    RNG format 2: plain tuples, lists and numbers, and one uint8 tensor, so the file names no NumPy
    global (format 1 held NumPy's state tuple with its uint32 key array; it still loads)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, key.tolist(), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    file = f"rng_rank{rank}.pt"
    return {file: manifest.write_hashed(tag_dir / file, lambda f: torch.save(state, f))}


def load_rng(tag_dir: Path, rank: int) -> bool:
    """Restore this rank's RNG states; False when the checkpoint has none for this rank."""
    path = tag_dir / f"rng_rank{rank}.pt"
    if not path.is_file():
        return False
    state = safe_load.load(path)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    return True


def converted(tag_dir: Path) -> Path | None:
    """The universal form converted before, where it is complete and intact (to be reused)."""
    out = tag_dir / UNIVERSAL
    return out if (out / MANIFEST).is_file() and manifest.verify_manifest(out) is None else None


def to_universal(tag_dir: Path, workers: int = 1) -> Path:
    """Convert a DeepSpeed ZeRO checkpoint to its world-size-independent (universal) form, or reuse
    the one converted before if it verifies against its manifest (one that does not is derived
    data, converted again from the verified checkpoint)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = converted(tag_dir)
    if out is not None:
        safe_load.check_checkpoint(out)
        return out
    out = tag_dir / UNIVERSAL
    safe_load.check_checkpoint(tag_dir, besides=DERIVED)  # before DeepSpeed loads any of its files
    shutil.rmtree(out, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=workers, num_merge_workers=workers,
        keep_temp_folder=False, strict=True, inject_missing_state=True,  # plain models carry no version tag
    )
    with safe_load.restricted(tag_dir):  # ds_to_universal's torch.load calls, in its worker processes too
        ds_to_universal(args)
    write_manifest(out)
    return out


def load_engine(engine, load_dir: Path, tag: str, t: TrainSection) -> str | None:
    """DeepSpeed's load of the model, optimiser and schedule states (native or universal form),
    then the optimiser settings of this run's config (`optim.apply_settings`); the loaded path, or
    None where DeepSpeed found nothing to load.

    At ZeRO-3 DeepSpeed's universal load
    (`DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`) gives
    every parameter group the first group's hyperparameters (apply_settings sets each group's
    weight decay again) and one shared `step` tensor for all groups' states. torch's AdamW
    increments each group's counter in place, so with two groups (decay, no decay) every update
    would advance it twice and use the bias corrections of later steps (all but the first group's
    first update): each state gets a counter of its own here.
    """
    with safe_load.restricted(load_dir / tag):  # DeepSpeed's own torch.load calls, restricted
        path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_lr_scheduler_states=True)
    if path is None:
        return None
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO's wrapper holds torch's AdamW
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    optim.apply_settings(engine.optimizer, engine.lr_scheduler, t)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="gpn-scale ckpt", description="Checkpoint tools.")
    sub = ap.add_subparsers(dest="verb", required=True)
    conv = sub.add_parser("to-universal", formatter_class=HelpFormatter,
                          help="convert a checkpoint so it loads at any world size")
    conv.add_argument("checkpoint", help="a checkpoint directory (run.dir/checkpoints/step_...)")
    ver = sub.add_parser("verify", formatter_class=HelpFormatter,
                         help="check a checkpoint (or all under a run's checkpoints/) against manifests")
    ver.add_argument("path", help="a checkpoint directory, a run directory or its checkpoints/")
    args = ap.parse_args(argv)
    path = Path(args.checkpoint if args.verb == "to-universal" else args.path)
    if args.verb == "to-universal":
        problem = verify(path)
        if problem:
            raise UserError(f"{path}: {problem}")
        print(f"wrote {to_universal(path)}")
        return 0
    if (path / MANIFEST).exists() or path.name.startswith("step_"):
        targets = [path]
    else:  # a run directory, or its checkpoints/
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        targets = [root / t for t in tags(root)]
    if not targets:
        raise UserError(f"{path}: no checkpoints there (expected a checkpoint directory, a run directory or its "
                        "checkpoints/)")
    bad = 0
    for t in targets:
        problem = verify_all(t)
        bad += problem is not None
        print(f"{t}: {problem or 'ok'}")
    return 1 if bad else 0


def verify_all(tag_dir: Path) -> str | None:
    """What `ckpt verify` checks: the manifest (every file listed, each intact), trainer_state.json,
    then that every pickle file is one plain zip that torch's restricted unpickler loads; the same
    for a universal form that has its manifest (one without is an unfinished conversion, which is
    redone when needed). A native checkpoint: its manifest (safetensors holds no pickle)."""
    from gpn_scale.storage.native import CONFIG, WEIGHTS

    if (tag_dir / WEIGHTS).is_file():
        return manifest.verify_manifest(tag_dir, required=(WEIGHTS, CONFIG))
    problem = verify(tag_dir)
    if problem is None:
        try:
            read_trainer_state(tag_dir)
        except UserError as e:
            return str(e)
        problem = safe_load.checkpoint_problem(tag_dir, besides=DERIVED)
    universal = tag_dir / UNIVERSAL
    if problem is None and (universal / MANIFEST).is_file():
        in_universal = manifest.verify_manifest(universal) or safe_load.checkpoint_problem(universal)
        if in_universal:
            return f"{UNIVERSAL}/: {in_universal}"
    return problem
