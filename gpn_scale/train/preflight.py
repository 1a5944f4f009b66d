"""Checks a training run makes before anything heavy starts (DeepSpeed, the process group, the
model): every rank makes them on its own, from files alone, so a bad path, a vocabulary the model
cannot embed or a run directory that is not free is an error in seconds, not after minutes of
startup or, worse, after all the steps have run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpn_scale.storage import checkpoints

from data_prep import outputs
from data_prep import mds_index
from data_prep.errors import UserError
from gpn_scale.train import branch
from gpn_scale.train.carry import training_layout
from gpn_scale.train.config import DataSource, TrainConfig, sources
from gpn_scale.train.batches import resolve_location


@dataclass(frozen=True)
class DataInfo:
    seq_len: int | None  # tokens per window, from the MDS index
    samples: int | None
    vocab_size: int | None  # of the tokenizer that made it (the prep's stats.json), when known
    eos_id: int | None = None  # the tokenizer's EOS, from the same stats.json, when known
    tokenizer_sha256: str | None = None  # the tokenizer file's, from the same stats.json, when known


def data_info(location: str, split: str) -> DataInfo | None:
    """What a local MDS directory holds, from its index.json and the prep's stats.json beside it;
    None for a remote location (its files are fetched later)."""
    if "://" in location:
        return None
    resolve_location(location, None, split)  # an MDS directory, or a one-line error
    try:
        index = mds_index.check(location, hashes=False)  # hashes: by the loader's leader, once per node
    except UserError as e:
        raise UserError(f"data.{split}: {e}") from None
    vocab = eos = sha256 = None
    root = mds_index.prep_root(Path(location))  # OUT for OUT/{split} and for the streams' OUT/streams/{split}
    stats_path = None if root is None else root / "stats.json"
    if stats_path is not None:
        try:
            stats = json.loads(stats_path.read_text())
            vocab = int(stats["vocab_size"])
            eos = None if stats.get("eos_id") is None else int(stats["eos_id"])
            tokenizer = stats.get("tokenizer")
            sha256 = tokenizer.get("sha256") if isinstance(tokenizer, dict) else None
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{stats_path}: unreadable (expected the prep's stats.json with vocab_size)") from None
    return DataInfo(index.seq_len, index.samples, vocab, eos, sha256)


def split_info(location: str | list[DataSource] | None, split: str) -> DataInfo | None:
    """data_info of data.train or data.val; for a mixture, of all its sources together (their
    samples summed), once they are found to share one window length and one tokenizer (a model
    reads every source's token ids as the same words). None when nothing local is known."""
    infos = []
    for i, source in enumerate(sources(location)):
        label = f"data.{split}" if isinstance(location, str) else f"data.{split}[{i}] ({source.name})"
        try:
            info = data_info(source.path, split)
        except UserError as e:
            raise UserError(str(e).replace(f"data.{split}:", f"{label}:", 1)) from None
        if info is not None and info.samples == 0:
            raise UserError(f"{label}: {source.path}: no samples (an empty prep output)")
        infos.append((label, source.path, info))
    known = [(label, path, info) for label, path, info in infos if info is not None]
    if not known:
        return None
    first_label, first_path, first = known[0]
    for label, path, info in known[1:]:
        if info.seq_len != first.seq_len:
            raise UserError(f"{label}: windows of {info.seq_len} tokens, {first_label}'s have {first.seq_len}: "
                            "the sources of a mixture are prepared with one --seq-len")
        for what, mine, theirs in (("tokenizer sha256", info.tokenizer_sha256, first.tokenizer_sha256),
                                   ("vocabulary size", info.vocab_size, first.vocab_size),
                                   ("EOS id", info.eos_id, first.eos_id)):
            if mine is not None and theirs is not None and mine != theirs:
                shown = (lambda v: f"{v[:12]}...") if what == "tokenizer sha256" else repr
                raise UserError(f"{label}: {path} was tokenized with another tokenizer than {first_label} "
                                f"({first_path}): {what} {shown(mine)} against {shown(theirs)} (each prep output's "
                                "stats.json); the sources of a mixture share one tokenizer")
    if len(infos) == 1:
        return first
    # the mixture's: every source's samples; the tokenizer facts of any source that records them
    recorded = next((info for _, _, info in known if info.vocab_size is not None), first)
    samples = None if len(known) < len(infos) else sum(info.samples for _, _, info in known)
    return DataInfo(first.seq_len, samples, recorded.vocab_size, recorded.eos_id, recorded.tokenizer_sha256)


def check_run_dir(run_dir: Path, config_file: Path | None) -> None:
    """run.dir is new, empty, a training run (to resume, or to start anew beside no checkpoints) or
    a sweep point's directory; it may hold the config file the run is started from."""
    inside = config_file is not None and config_file.resolve().parent == run_dir.resolve()
    outputs.check_resumable(run_dir, "run.dir", "train", (outputs.TRAINING_RUN, outputs.SWEEP_POINT),
                            allowed=(config_file.name,) if inside else ())


def _shown(location: str | list[DataSource]) -> str:
    return location if isinstance(location, str) else f"the mixture ({', '.join(s.name for s in location)})"


def check(cfg: TrainConfig, resume: str, config_file: Path | None = None, world: int | None = None,
          branch_from: str | None = None, warn=None) -> DataInfo | None:
    """Everything that can be checked before the run starts; returns what the training data holds.
    `config_file`: the YAML the run is started from (run.dir may hold it); `world`: the ranks
    (default: torchrun's WORLD_SIZE, else 1); `branch_from`: a decay branch's parent checkpoint
    (or run), which run.dir must be outside of; `warn`: prints a warning (once, by one process)."""
    if branch_from is not None:
        branch.check_target(cfg.run.dir, branch_from)
    check_run_dir(Path(cfg.run.dir), config_file)
    if branch_from is not None:
        branch.check_run_dir(cfg.run.dir, branch_from, cfg.train.total_steps)
    model_vocab = cfg.model.vocab_size
    infos = {}
    for split, location in (("train", cfg.data.train), ("val", cfg.data.val)):
        info = infos[split] = split_info(location, split)
        if info is None or info.vocab_size is None:
            continue
        if info.vocab_size > model_vocab:
            raise UserError(f"data.{split}: {_shown(location)} was tokenized with a vocabulary of {info.vocab_size} "
                            f"(stats.json), more than the model's vocab_size {model_vocab}: set model.vocab_size="
                            f"{info.vocab_size} or more")
        if split == "train" and info.vocab_size < model_vocab and warn is not None:
            warn(f"warning: model.vocab_size {model_vocab} is larger than the vocabulary of {info.vocab_size} that "
                 f"data.train was tokenized with (stats.json): {model_vocab - info.vocab_size} embedding rows are never "
                 "read (harmless; GPU kernels favour a multiple of 64 or 128)")
    if cfg.train.carry_state:  # the streams and the global batch they are dealt to
        t = cfg.train
        world = world or int(os.environ.get("WORLD_SIZE", "1"))
        training_layout(cfg.data.train, t.global_batch or t.micro_batch * (t.grad_accum or 1) * world)
    train, val = infos.get("train"), infos.get("val")
    if cfg.train.reset_on_eos and (train is None or train.eos_id is None):
        raise UserError(f"train.reset_on_eos: needs the EOS id, from the prep's stats.json beside data.train "
                        f"({cfg.data.train}); none there: train on a local prep output, or set train.reset_on_eos=false")
    if train and val and train.seq_len and val.seq_len and train.seq_len != val.seq_len:
        raise UserError(f"data.val: windows of {val.seq_len} tokens, data.train's have {train.seq_len}")
    if train and val and train.tokenizer_sha256 and val.tokenizer_sha256 and train.tokenizer_sha256 != val.tokenizer_sha256:
        raise UserError(f"data.val: tokenized with another tokenizer than data.train (sha256 {val.tokenizer_sha256[:12]}... "
                        f"against {train.tokenizer_sha256[:12]}..., each prep output's stats.json)")

    root = Path(cfg.run.dir) / "checkpoints"
    if resume == "none":
        complete = checkpoints.committed(root)
        if complete:
            raise UserError(f"run.dir {cfg.run.dir} already has checkpoints ({complete[0]}); pass --resume auto "
                            "to continue it, or choose another run.dir")
    elif resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise UserError(f"--resume {resume}: no such checkpoint directory")
        if path.resolve().parent != root.resolve():
            raise UserError(f"--resume {resume}: not a checkpoint of run.dir {cfg.run.dir}")
    return train
