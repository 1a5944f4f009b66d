"""Carried-state training (`train.carry_state`): every batch slot reads one long stream window after
window, and the recurrent state the model ends a window with is where it starts the next.

The prep's streams (`gpn-scale prep --streams S`, data_prep/document_streams.py) hold S streams of K
windows each, sample `k * S + i` being window k of stream i. A run with a global batch of G
(S a multiple of G) has G slots; slot j reads streams j, j + G, j + 2G, ... one after another,
each from its first window to its last, so step t reads, in slot j, window t mod K of stream
j + G * ((t // K) mod (S / G)). After S / G * K steps every window has been read once and the
order starts again. A stream's last window ends where the prep cut it, mid-document as a rule, so
each stream's first window (t mod K = 0) is read from the empty state, in every round: no state
passes from one stream to the next.

Slots are dealt to ranks in contiguous blocks, and within a rank to its micro-batches in order:
rank r's micro-batch m holds slots r * G/W + m * b ... + b - 1 (W ranks, b windows per
micro-batch). The state of each micro-batch stays on its rank between steps, detached: gradients
stop at the window boundary (truncated backpropagation through time). A checkpoint holds it per
block of slots (`carry_slots_A-B.pt`, named by the slots it holds, not by the rank), so a run
resumed at another world size finds the states of its own slots, whichever ranks wrote them.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from data_prep.document_streams import DESCRIPTOR, StreamLayout
from gpn_scale.storage import manifest, safe_load
from data_prep.errors import UserError

_FILE = re.compile(r"carry_slots_(\d{6})-(\d{6})\.pt")


# ---- a state is a nest of tuples of (batch, ...) tensors, or None --------------------------------


def _map(state, fn):
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return fn(state)
    return tuple(_map(x, fn) for x in state)


def _cat(states: list):
    """The states of consecutive slot blocks joined along the batch."""
    first = states[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(states)
    return tuple(_cat([s[i] for s in states]) for i in range(len(first)))


def plain(state):
    """A model's state (NamedTuples of tensors) as plain tuples of detached tensors: what the
    restricted unpickler loads, and what every family's forward takes back."""
    return _map(state, torch.Tensor.detach)


def rows(state, start: int, stop: int):
    return _map(state, lambda t: t[start:stop])


# ---- the stream layout ----------------------------------------------------------------------


def training_layout(location: str, global_batch: int) -> StreamLayout:
    """data.train's streams, checked against the run's global batch."""
    if "://" in location:
        raise UserError(f"data.train: {location}: train.carry_state reads the prep's streams from a local "
                        "directory (a shared filesystem), not a URL")
    try:
        layout = StreamLayout.read(location)
    except UserError as e:
        raise UserError(f"data.train: {e}; train.carry_state needs OUT/streams/train") from None
    if layout.streams % global_batch:
        raise UserError(f"data.train: {layout.streams} streams ({Path(location) / DESCRIPTOR}) are not a multiple of the "
                        f"global batch {global_batch}: with train.carry_state each batch slot reads whole streams; set "
                        f"train.global_batch to a divisor of {layout.streams}, or prepare a multiple of it")
    return layout


def sample_at(layout: StreamLayout, step: int, slot: int, global_batch: int) -> int:
    """The sample slot `slot` reads at step `step` (0-based)."""
    rounds = layout.streams // global_batch
    k = step % layout.windows_per_stream
    stream = slot + global_batch * ((step // layout.windows_per_stream) % rounds)
    return k * layout.streams + stream


# ---- the loader and the states ----------------------------------------------------------------


class StreamBatches:
    """This rank's micro-batches of stream windows, in the slots' order, with the position (the
    steps read) saved and restored as `ShuffledBatches`' is. Each batch says which micro-batch of
    the step it is, for `CarriedStates`, and whether its windows are their streams' first
    (`stream_start`: they are read from the empty state)."""

    def __init__(self, location: str, micro_batch: int, grad_accum: int, world: int, rank: int):
        from gpn_scale.storage.mds_datasets import open_dataset
        from gpn_scale.train.batches import indexed_dataset_class

        self.global_batch = micro_batch * grad_accum * world
        self.layout = training_layout(location, self.global_batch)
        self.dataset = open_dataset(indexed_dataset_class(), local=location, remote=None, shuffle=False,
                                    batch_size=micro_batch)
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.first_slot = rank * micro_batch * grad_accum
        self.step, self.micro = 0, 0

    def slots(self, micro: int) -> range:
        start = self.first_slot + micro * self.micro_batch
        return range(start, start + self.micro_batch)

    def state_dict(self) -> dict:
        if self.micro:
            raise RuntimeError("stream position saved in the middle of a step")
        return {"kind": "streams", "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "streams":
            raise UserError("train.carry_state: the checkpoint was trained on shuffled windows, not on streams; "
                            "a carried-state run starts from its own checkpoints or from none")
        self.step, self.micro = int(state["step"]), 0

    def __next__(self) -> dict:
        ids = [sample_at(self.layout, self.step, j, self.global_batch) for j in self.slots(self.micro)]
        items = [self.dataset[i] for i in ids]
        batch = {"tokens": torch.stack([x["tokens"] for x in items]), "sample_id": torch.tensor(ids),
                 "micro": self.micro, "stream_start": self.step % self.layout.windows_per_stream == 0}
        self.micro += 1
        if self.micro == self.grad_accum:
            self.step, self.micro = self.step + 1, 0
        return batch


class CarriedStates:
    """The state each of this rank's micro-batches ended its last window with (None before the
    first), and its save and load as blocks of slots."""

    def __init__(self, loader: StreamBatches):
        self.loader = loader
        self.states: list = [None] * loader.grad_accum

    def get(self, micro: int):
        return self.states[micro]

    def put(self, micro: int, state) -> None:
        self.states[micro] = plain(state)

    def _block(self) -> range:
        return range(self.loader.slots(0).start, self.loader.slots(self.loader.grad_accum - 1).stop)

    def save(self, tag_dir: Path) -> dict[str, dict]:
        """This rank's states as one file; {file name: manifest entry}."""
        if any(s is None for s in self.states):
            raise RuntimeError("carried state saved before every micro-batch ran")
        block = self._block()
        name = f"carry_slots_{block.start:06d}-{block.stop:06d}.pt"
        joined = _map(_cat(self.states), lambda t: t.cpu())
        record = {"format": 1, "first_slot": block.start, "slots": len(block), "state": joined}
        return {name: manifest.write_hashed(tag_dir / name, lambda f: torch.save(record, f))}

    def load(self, tag_dir: Path, device: torch.device) -> None:
        """This rank's slots from whichever files hold them (each read by the restricted unpickler)."""
        block = self._block()
        pieces = []
        for path in sorted(tag_dir.iterdir()):
            m = _FILE.fullmatch(path.name)
            if m is None:
                continue
            start, stop = int(m[1]), int(m[2])
            lo, hi = max(start, block.start), min(stop, block.stop)
            if lo >= hi:
                continue
            record = safe_load.load(path)
            if not isinstance(record, dict) or record.get("first_slot") != start or record.get("slots") != stop - start:
                raise UserError(f"{path}: not the carried state of slots {start}-{stop}")
            pieces.append((lo, rows(record["state"], lo - start, hi - start)))
        pieces.sort(key=lambda p: p[0])
        covered = [p[0] for p in pieces]
        want, at = [], block.start
        for lo, piece in pieces:
            if lo != at:
                break
            want.append(piece)
            at += _batch(piece)
        if at != block.stop:
            raise UserError(f"{tag_dir}: no carried state for slots {at}-{block.stop} (train.carry_state; files "
                            f"carry_slots_*.pt starting at {covered or 'none'})")
        joined = _map(_cat(want), lambda t: t.to(device))
        b = self.loader.micro_batch
        self.states = [_map(rows(joined, m * b, (m + 1) * b), torch.Tensor.clone) for m in range(self.loader.grad_accum)]


def _batch(state) -> int:
    while not isinstance(state, torch.Tensor):
        state = next(x for x in state if x is not None)
    return state.shape[0]
