"""Training batches of shuffled windows from the prep's MDS output through MosaicML Streaming
(`ShuffledBatches`), and what every reader of a training run's data shares: where a split is read
from (`resolve_location`) and each sample's id beside its tokens (`indexed_dataset_class`). A
carried-state run reads the prep's document streams instead (`gpn_scale.train.carry.StreamBatches`).

The global sample order is fixed by (shuffle seed, `num_canonical_nodes`, global batch) and does
not depend on the world size: streaming partitions each global batch across whichever ranks
exist. The loader's position is (epoch, samples consumed in the epoch, counted over all ranks);
it is saved with every checkpoint and given back to streaming on resume, also at another world
size.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from data_prep.errors import UserError
from gpn_scale.storage.mds_datasets import dataset_class, open_dataset, stream_class
from gpn_scale.train.config import DataSource

TOKENS = "tokens"  # the MDS column written by the prep


def resolve_location(location: str, cache: str | None, split_name: str) -> tuple[str, str | None]:
    """(local, remote) for StreamingDataset: local dirs are read in place, URLs through a cache."""
    if "://" not in location:
        path = Path(location)
        if not (path / "index.json").is_file():
            raise UserError(f"data.{split_name}: {location}: no MDS index.json there (expected the prep's OUT/{split_name})")
        return str(path), None
    if not cache:
        raise UserError(f"data.{split_name}: {location} is remote: set data.cache to a local directory for its shards")
    digest = hashlib.sha256(location.encode()).hexdigest()[:12]
    # streaming takes a shared filesystem as a plain-path remote, and rejects file:// URLs
    remote = location[len("file://"):] if location.startswith("file://") else location
    return str(Path(cache) / f"{split_name}-{digest}"), remote


def indexed_dataset_class():
    class IndexedDataset(dataset_class()):
        """Yields the sample's global index with its tokens, for the data-order audit log."""

        def get_item(self, idx: int):
            sample = super().get_item(idx)
            if TOKENS not in sample:
                raise UserError(f"MDS sample {idx} has no '{TOKENS}' column (columns: {', '.join(sample)})")
            return {TOKENS: torch.from_numpy(sample[TOKENS].astype(np.int64)), "sample_id": idx}

    return IndexedDataset


def where_to_read(location: str | list[DataSource], cache: str | None, split_name: str) -> dict:
    """StreamingDataset's keywords for a directory or URL (`local`, `remote`) or for a mixture's
    sources (`streams`: Streaming's own Stream per source, with its weight)."""
    if isinstance(location, str):
        local, remote = resolve_location(location, cache, split_name)
        return {"local": local, "remote": remote}
    streams = []
    for i, source in enumerate(location):
        try:
            local, remote = resolve_location(source.path, cache, split_name)
        except UserError as e:  # which source of the list
            raise UserError(str(e).replace(f"data.{split_name}:", f"data.{split_name}[{i}] ({source.name}):", 1)) from None
        weights = {k: getattr(source, k) for k in ("proportion", "repeat", "choose") if getattr(source, k) is not None}
        streams.append(stream_class()(local=local, remote=remote, **weights))
    return {"streams": streams}


class ShuffledBatches:
    """An endless iterator of micro-batches whose position can be saved and restored. A mixture's
    samples come from its sources in their weights, in one global order (Streaming's own mixing:
    which samples of each source an epoch takes, and their order, follow from the seed and the
    epoch alone); a sample's source follows from its id (`source_of`)."""

    def __init__(self, location: str | list[DataSource], cache: str | None, micro_batch: int, world_size: int, *,
                 shuffle: bool, seed: int, num_canonical_nodes: int, split_name: str = "train"):
        self.source_names = [s.name for s in location] if isinstance(location, list) else None
        self.dataset = open_dataset(
            indexed_dataset_class(), **where_to_read(location, cache, split_name), shuffle=shuffle,
            shuffle_seed=seed, num_canonical_nodes=num_canonical_nodes, batch_size=micro_batch,
        )
        # samples read from each source so far, over all ranks (`record_mix`); kept with the position
        self.source_samples = [0] * len(self.source_names) if self.source_names else None
        self.micro_batch, self.world_size = micro_batch, world_size
        self.seed, self.num_canonical_nodes = seed, num_canonical_nodes
        # Streaming derives its shuffle blocks from the node count of the first run: keep it.
        self.initial_nodes = max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
        self.epoch, self.sample_in_epoch = 0, 0
        self._iter = None

    def __len__(self) -> int:
        return len(self.dataset)

    def count_sources(self, sample_ids: list[int]) -> list[int]:
        """How many of these samples came from each source (in data.train's order): Streaming
        numbers the sources' samples one source after another."""
        source = np.searchsorted(self.dataset.sample_offset_per_stream, sample_ids, side="right") - 1
        return np.bincount(source, minlength=len(self.source_names)).tolist()

    def record_mix(self, step_counts: list[int]) -> dict[str, float]:
        """Adds a step's samples per source (over all ranks); returns each source's share of all the
        samples the run has read so far: the realised mix, against the configured weights."""
        self.source_samples = [a + int(b) for a, b in zip(self.source_samples, step_counts)]
        total = sum(self.source_samples)
        return {name: n / total for name, n in zip(self.source_names, self.source_samples)}

    def epoch_plan(self) -> list[tuple[str, int, int]]:
        """(name, samples held, samples drawn per epoch) for each source of a mixture."""
        return [(name, int(held), int(stream.choose)) for name, held, stream in
                zip(self.source_names, self.dataset.samples_per_stream, self.dataset.streams)]

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "sample_in_epoch": self.sample_in_epoch, "initial_nodes": self.initial_nodes}
        if self.source_samples is not None:
            state["source_samples"] = dict(zip(self.source_names, self.source_samples))
        return state

    def load_state_dict(self, state: dict) -> None:
        if "epoch" not in state:  # the engine refuses a carried-state checkpoint before this (_check_loader_kind)
            raise UserError(f"train.carry_state=false: the checkpoint's data position is {state}, not an epoch of "
                            "shuffled windows; resume it with train.carry_state=true")
        self.epoch, self.sample_in_epoch = state["epoch"], state["sample_in_epoch"]
        self.initial_nodes = state["initial_nodes"]
        if self.source_samples is not None:  # a source new to the run (a changed mixture) has read nothing yet
            read = state.get("source_samples") or {}
            self.source_samples = [int(read.get(name, 0)) for name in self.source_names]
        self._iter = None

    def _start_epoch(self):
        # Written in streaming's own resume format (never read back from its shared memory, which
        # other ranks may be writing at the same moment).
        self.dataset.load_state_dict({
            "epoch": self.epoch, "sample_in_epoch": self.sample_in_epoch, "shuffle_seed": self.seed,
            "num_canonical_nodes": self.num_canonical_nodes, "initial_physical_nodes": self.initial_nodes,
        })
        loader = DataLoader(self.dataset, batch_size=self.micro_batch, num_workers=0, drop_last=True)
        self._iter = iter(loader)

    def __next__(self) -> dict:
        if self._iter is None:
            self._start_epoch()
        try:
            batch = next(self._iter)
        except StopIteration:  # epoch over: the next one reshuffles with the epoch number
            self.epoch, self.sample_in_epoch = self.epoch + 1, 0
            self._start_epoch()
            batch = next(self._iter)
        self.sample_in_epoch += self.micro_batch * self.world_size
        return batch

