"""Held-out windows of a `gpn-scale prep` output, its tokenizer, and the checks that a model fits them.

`--data` may name a prep output directory (its `val` split is used) or one of its split directories
(`OUT/val`, `OUT/train`); either way `stats.json` and the tokenizer copy sit in the output directory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from gpn_scale.storage import checkpoints, manifest
from data_prep.errors import UserError, read_json
from gpn_scale.eval.codec import Codec
from gpn_scale.storage.native import TokenizerSource, read_tokenizer
from data_prep.mds_index import prep_root
from gpn_scale.storage.mds_datasets import reading


@dataclass
class PrepOutput:
    split_dir: Path  # the MDS directory the windows are read from
    stats: dict | None  # the prep's stats.json, when the directory has one
    root: Path | None  # the prep output directory holding stats.json

    @property
    def tokenizer_path(self) -> Path | None:
        if self.stats is None:
            return None
        return self.root / self.stats["tokenizer"]["copy"]

    @property
    def tokenizer_sha256(self) -> str | None:
        return None if self.stats is None else self.stats["tokenizer"]["sha256"]

    def tokenizer_source(self) -> TokenizerSource | None:
        """The recorded tokenizer, framed as prep framed each document (BOS or not, its EOS)."""
        if self.stats is None:
            return None
        s = self.stats
        return TokenizerSource(self.tokenizer_path, bool(s.get("add_bos")), s.get("bos_id"), s.get("eos_id"))

    def unigram(self) -> np.ndarray | None:
        path = None if self.root is None else self.root / "unigram.npy"
        return np.load(path) if path is not None and path.is_file() else None


def open_prep_output(path: str | Path) -> PrepOutput:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such data directory (expected an MDS split or a `gpn-scale prep` output)")
    if (path / "stats.json").is_file() and (path / "val" / "index.json").is_file():
        split, root = path / "val", path
    elif (path / "index.json").is_file():
        split, root = path, prep_root(path)
    else:
        raise UserError(f"{path}: not an MDS directory (no index.json) nor a prep output with a val split")
    stats = None
    if root is not None:
        stats = read_json(root / "stats.json")
    return PrepOutput(split, stats, root)


def open_streams(path: str | Path) -> PrepOutput:
    """Held-out streams (`gpn-scale prep --streams`): a prep output's streams/val, or a streams split."""
    path = Path(path)
    for split in (path / "streams" / "val", path):
        if (split / "streams.json").is_file():
            root = prep_root(split)
            return PrepOutput(split, None if root is None else read_json(root / "stats.json"), root)
    raise UserError(f"--context: {path} holds no streams (expected a prep output made with --streams, or its "
                    f"streams/val)")


def read_windows(data: PrepOutput, limit: int | None = None) -> torch.Tensor:
    """The first `limit` windows (all when None) of the split, in order, as int64 (N, T)."""
    with reading(local=str(data.split_dir), shuffle=False, batch_size=1) as dataset:
        n = len(dataset) if limit is None else min(limit, len(dataset))
        if n == 0:
            raise UserError(f"{data.split_dir}: no windows")
        try:
            rows = [np.asarray(dataset[i]["tokens"], dtype=np.int64) for i in range(n)]
        except KeyError:
            raise UserError(f"{data.split_dir}: samples have no `tokens` column (not written by `gpn-scale prep`)") from None
    return torch.from_numpy(np.stack(rows))


def check_model_fits(model, data: PrepOutput, windows: torch.Tensor | None = None, trained_on: str | None = None):
    """One-line errors when the model and the data (or its tokenizer) do not belong together.

    trained_on: sha256 of the tokenizer the model was trained with, when the checkpoint records it.
    """
    vocab = model.config.vocab_size
    # A model's vocabulary may be padded beyond its tokenizer's; a larger tokenizer cannot be its own.
    if data.stats is not None and data.stats["vocab_size"] > vocab:
        raise UserError(f"{data.root / 'stats.json'}: tokenizer vocabulary {data.stats['vocab_size']} exceeds the "
                        f"model's vocab_size {vocab}; the data was made with another tokenizer")
    if trained_on and data.tokenizer_sha256 and trained_on != data.tokenizer_sha256:
        raise UserError(f"{data.root / 'stats.json'}: tokenizer sha256 {data.tokenizer_sha256[:12]}... differs from "
                        f"the one the model was trained with ({trained_on[:12]}...)")
    if windows is not None and int(windows.max()) >= vocab:
        raise UserError(f"{data.split_dir}: token id {int(windows.max())} is outside the model's vocabulary "
                        f"({vocab}); the data was made with another tokenizer")


def training_prep(checkpoint: str | Path) -> PrepOutput | None:
    """The prep output a training run read, when CKPT is a run or training checkpoint whose recorded
    training data is still there; None otherwise (e.g. a native checkpoint)."""
    path = checkpoints.training_checkpoint(checkpoint, verified=False)  # loading the model verified it
    if path is None:
        return None
    data = checkpoints.read_trainer_state(path).config.get("data")
    train_dir = data.get("train") if isinstance(data, dict) else None
    if isinstance(train_dir, list) and train_dir and isinstance(train_dir[0], dict):
        train_dir = train_dir[0].get("path")  # a mixture: its sources share one tokenizer (checked at the start)
    if not train_dir or not isinstance(train_dir, str):
        return None
    root = prep_root(Path(train_dir))  # OUT/train, or a carried-state run's OUT/streams/train
    return None if root is None else PrepOutput(Path(train_dir), read_json(root / "stats.json"), root)


def _sha256(path: Path) -> str | None:
    """The tokenizer file's sha256 (as prep's stats.json and Codec record it); None if unreadable."""
    try:
        return manifest.file_hash(path, "sha256")
    except OSError:
        return None


def choose_tokenizer(checkpoint: str | Path, given: str | None, data: PrepOutput | None, trained: PrepOutput | None,
                     model, flags: str = "--tokenizer FILE (a tokenizer.json or sentencepiece .model)",
                     ) -> tuple[Codec, TokenizerSource]:
    """The tokenizer for text in and out, and how the training data framed documents with it.

    The tokenizer is `given` (--tokenizer), else the one recorded with `data` (--data), else the
    one of the data the checkpoint was trained on (`trained`), else the one a native export keeps
    beside its weights. Its framing (BOS before a prompt or not, the EOS) is that of the first of
    those records whose tokenizer is this very file (sha256); with none, no BOS and no EOS
    recorded (`eos_id` None: the tokenizer's own, `codec.eos_id`). A tokenizer other than the
    training data's is refused. `flags`: what the command takes, for the error when nothing is
    recorded."""
    records = [r for r in (data.tokenizer_source() if data is not None else None,
                           trained.tokenizer_source() if trained is not None else None,
                           read_tokenizer(checkpoint)) if r is not None]
    if given:
        codec = Codec(given)
        same = [r for r in records if _sha256(r.path) == codec.sha256]
        source = replace(same[0], path=codec.path) if same else TokenizerSource(codec.path)
    elif records:
        source = records[0]
        codec = Codec(source.path)
    else:
        raise UserError(f"{checkpoint}: no tokenizer recorded with it; pass {flags}")
    if codec.vocab_size > model.config.vocab_size:
        raise UserError(f"{codec.path}: tokenizer vocabulary {codec.vocab_size} exceeds the model's vocab_size "
                        f"{model.config.vocab_size}")
    if trained is not None and trained.tokenizer_sha256 != codec.sha256:
        raise UserError(f"{codec.path}: not the tokenizer the model was trained with (sha256 differs from "
                        f"{trained.root / 'stats.json'})")
    return codec, source
