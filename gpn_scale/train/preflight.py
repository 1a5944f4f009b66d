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

from gpn_scale.storage import checkpoints, outputs
from gpn_scale.data import mds_index
from gpn_scale.errors import UserError
from gpn_scale.train import branch
from gpn_scale.train.carry import training_layout
from gpn_scale.train.config import TrainConfig
from gpn_scale.train.data import resolve_location


@dataclass(frozen=True)
class DataInfo:
    seq_len: int | None  # tokens per window, from the MDS index
    samples: int | None
    vocab_size: int | None  # of the tokenizer that made it (the prep's stats.json), when known
    eos_id: int | None = None  # the tokenizer's EOS, from the same stats.json, when known


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
    vocab = eos = None
    root = mds_index.prep_root(Path(location))  # OUT for OUT/{split} and for the streams' OUT/streams/{split}
    stats_path = None if root is None else root / "stats.json"
    if stats_path is not None:
        try:
            stats = json.loads(stats_path.read_text())
            vocab = int(stats["vocab_size"])
            eos = None if stats.get("eos_id") is None else int(stats["eos_id"])
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{stats_path}: unreadable (expected the prep's stats.json with vocab_size)") from None
    return DataInfo(index.seq_len, index.samples, vocab, eos)


def check_run_dir(run_dir: Path, config_file: Path | None) -> None:
    """run.dir is new, empty, a training run (to resume, or to start anew beside no checkpoints) or
    a sweep point's directory; it may hold the config file the run is started from."""
    inside = config_file is not None and config_file.resolve().parent == run_dir.resolve()
    outputs.check_resumable(run_dir, "run.dir", "train", (outputs.TRAINING_RUN, outputs.SWEEP_POINT),
                            allowed=(config_file.name,) if inside else ())


def check(cfg: TrainConfig, resume: str, config_file: Path | None = None, world: int | None = None,
          branch_from: str | None = None) -> DataInfo | None:
    """Everything that can be checked before the run starts; returns what the training data holds.
    `config_file`: the YAML the run is started from (run.dir may hold it); `world`: the ranks
    (default: torchrun's WORLD_SIZE, else 1); `branch_from`: a decay branch's parent checkpoint
    (or run), which run.dir must be outside of."""
    if branch_from is not None:
        branch.check_target(cfg.run.dir, branch_from)
    check_run_dir(Path(cfg.run.dir), config_file)
    if branch_from is not None:
        branch.check_run_dir(cfg.run.dir, branch_from, cfg.train.total_steps)
    model_vocab = cfg.model.get("vocab_size")
    infos = {}
    for split, location in (("train", cfg.data.train), ("val", cfg.data.val)):
        if location is None:
            continue
        info = infos[split] = data_info(location, split)
        if info is None:
            continue
        if info.samples == 0:
            raise UserError(f"data.{split}: {location}: no samples (an empty prep output)")
        if info.vocab_size is not None and model_vocab is not None and info.vocab_size > model_vocab:
            raise UserError(f"data.{split}: {location} was tokenized with a vocabulary of {info.vocab_size} "
                            f"(stats.json), more than the model's vocab_size {model_vocab}")
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
