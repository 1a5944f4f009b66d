"""Counting what a training window launches, with no timing: every Triton launch and every torch op
that launches a device kernel, with its bytes, FLOPs, grid, stream and place in the data flow;
then per time step (two window lengths subtracted) and per batch (two batches extrapolated).
bench/step_cost.py's docstring says what is counted and why; bench/roofline.py times it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import launches as triton_launches

PHASES = ("forward", "backward")
KINDS = ("gemm", "triton", "cast", "copy", "other")




@dataclass
class Launch:
    """One device kernel launch."""

    phase: str
    kind: str
    name: str  # Triton kernel or aten op
    dtype: str  # a GEMM's operand dtype, a cast's "src->dst", else the first tensor's
    programs: int  # Triton grid size; 0 for torch ops (their grids are the library's)
    read: int  # bytes
    written: int
    flops: int
    # Triton: (bytes, contents changed) per tensor argument; `settle_writes` sets read and written
    args: tuple = ()
    memory: bool = False  # launched by the memory's code (kernels/memory, kernels/memory_chunk)
    # the storages it reads and writes, (storage address, bytes) each: its place in the window's
    # data flow (`dataflow`), which the tuned baseline's fusion and the schedule follow
    reads: tuple = ()
    writes: tuple = ()
    stream: int = 0  # the stream it was launched on (kernels/side_streams: 0 the main one, 1 the side one)
    waits: tuple = ()  # launches of the window (indices) it waits for: events, forks and joins
    shape: tuple = ()  # a GEMM's (batch, m, n): its output tiles, the SMs it occupies


# ---- the counter -----------------------------------------------------------------------------

_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "_reshape_alias",
              "alias", "lift_fresh", "set_", "resize_", "detach", "_local_scalar_dense", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}
_GEMM_OPERANDS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
_OVERWRITES = {"copy_", "fill_", "zero_"}  # in-place ops that do not read their self
_INDEXED = {"gather", "index", "embedding", "index_put_"}  # ops that touch only the indexed elements of a tensor
# ops that take a tensor for its dtype, device (and shape) only: they write their output, read nothing
_METADATA_ONLY = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of t's distinct elements: a broadcast (stride 0) dimension is read once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else min(size, 1)
    return n * t.element_size()


def _place(t: torch.Tensor) -> tuple[int, int]:
    """(the address of t's storage, t's bytes): which data a launch touches, and how much of it."""
    return t.untyped_storage().data_ptr(), _nbytes(t)


def _rescaled(places: list, total: int) -> list:
    """`places` with their bytes scaled to sum to `total` (an indexed op touches a share of each)."""
    whole = sum(n for _, n in places)
    return [(ptr, n * total / whole) for ptr, n in places] if whole else places


def _indexed_bytes(name, args, out) -> tuple[int, int]:
    """(read, written) of an op that touches only the elements its integer indices name: those
    elements and the indices, not the whole tensor (the cross-entropy's gather of one logit per
    row reads one element of the row, not the vocabulary)."""
    if name == "index_put_":  # self[indices] = values (or += with accumulate)
        self, indices, values = args[:3]
        idx = [i for i in indices if i is not None]
        touched = math.prod(torch.broadcast_shapes(*(i.shape for i in idx))) * math.prod(self.shape[len(indices):])
        touched *= self.element_size()
        accumulate = len(args) > 3 and bool(args[3])
        return sum(map(_nbytes, idx)) + _nbytes(values) + (touched if accumulate else 0), touched
    # gather(self, dim, index), index(self, indices), embedding(weight, indices): the output's
    # elements, read from the source, and the indices
    indices = args[2] if name == "gather" else args[1]
    picked = sum(_nbytes(t) for t in triton_launches.tensors(out))
    return picked + sum(map(_nbytes, triton_launches.tensors(indices))), picked


MEMORY_MODULES = ("kernels.memory.", "kernels.memory_chunk.")


def _from_memory_code() -> bool:
    """Whether the torch op being dispatched was called from the memory's code."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(MEMORY_MODULES):
            return True
        frame = frame.f_back
    return False


def _gemm_flops(name, args) -> tuple[int, str, tuple]:
    a, b = (args[i] for i in _GEMM_OPERANDS[name])
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2:]
    return 2 * batch * m * k * b.shape[-1], str(a.dtype).removeprefix("torch."), (batch, m, b.shape[-1])


class LaunchCounter(TorchDispatchMode):
    """Within `with LaunchCounter() as c:`, c.launches lists every kernel launch, tagged with c.phase."""

    def __init__(self):
        super().__init__()
        self.launches: list[Launch] = []
        self.phase = "forward"
        self._watch = None
        # The streams: on CPU the stand-in's (kernels/side_streams), observed; elsewhere one stream is
        # recorded (CUDA's events cannot be seen from here).
        self.lanes = None
        self._last: dict[int, int] = {}  # stream -> its last launch
        self._waits: dict[int, set] = defaultdict(set)  # stream -> launches its next launch waits for

    def _append(self, launch: Launch) -> None:
        stream = self.lanes.current if self.lanes is not None else 0
        launch.stream, launch.waits = stream, tuple(sorted(self._waits.pop(stream, ())))
        self._last[stream] = len(self.launches)
        self.launches.append(launch)

    def stream_event(self, kind: str, token):
        """The stand-in's fork, record, wait or join (kernels.side_streams.CpuLanes.observer)."""
        from kernels.side_streams import MAIN, SIDE

        add = lambda stream, launch: launch is not None and self._waits[stream].add(launch)  # noqa: E731
        if kind == "record":
            return self._last.get(self.lanes.current)
        if kind == "wait":
            add(self.lanes.current, token)
        elif kind == "fork":
            add(SIDE, self._last.get(MAIN))
        elif kind == "join":
            add(MAIN, self._last.get(SIDE))
        return None

    # torch ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if triton_launches.in_launch() or func.is_view or name in _NO_LAUNCH:
            return out
        reads, writes = [], []
        for i, a in enumerate(func._schema.arguments):
            value = kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) and not a.kwarg_only else None
            for t in triton_launches.tensors(value):
                mutates = a.alias_info is not None and a.alias_info.is_write
                if mutates:
                    writes.append(t)
                if not mutates or not (a.is_out or name in _OVERWRITES):
                    reads.append(t)
        writes += [t for t in triton_launches.tensors(out) if not any(t is m for m in writes)]
        read, written = sum(map(_nbytes, reads)), sum(map(_nbytes, writes))
        reads, writes = [_place(t) for t in reads], [_place(t) for t in writes]
        if name in _INDEXED:
            read, written = _indexed_bytes(name, args, out)
            # the indexed tensor's share is the elements touched: scale its entries to the totals
            reads = _rescaled(reads, read)
            writes = _rescaled(writes, written)
        elif name in _METADATA_ONLY:
            read, reads = 0, []
        inputs = triton_launches.tensors(args)
        dtype = str(inputs[0].dtype).removeprefix("torch.") if inputs else ""
        flops, kind, shape = 0, "other", ()
        if name in _GEMM_OPERANDS:
            kind = "gemm"
            flops, dtype, shape = _gemm_flops(name, args)
        elif name in ("_to_copy", "copy_", "clone", "_copy_from"):
            src = args[1] if name == "copy_" else args[0]
            dst = triton_launches.tensors(out)[0]
            kind = "cast" if src.dtype != dst.dtype else "copy"
            dtype = f"{src.dtype}->{dst.dtype}".replace("torch.", "") if kind == "cast" else str(dst.dtype).removeprefix("torch.")
        self._append(Launch(self.phase, kind, name, dtype, 0, read, written, flops, memory=_from_memory_code(),
                            reads=tuple(reads), writes=tuple(writes), shape=shape))
        return out

    # Triton launches (kernels/launches.py: the torch ops a launch runs itself are not counted)
    def _on_triton(self, x) -> None:
        dtype = str(x.tensors[0].dtype).removeprefix("torch.") if x.tensors else ""
        self._append(Launch(self.phase, "triton", x.name, dtype, x.programs, 0, 0, 0,
                            tuple(zip(map(_place, x.tensors), x.changed)), x.module.startswith(MEMORY_MODULES)))

    def __enter__(self):
        from kernels.side_streams import CPU_STREAMS_ENV, cpu_lanes

        if os.environ.get(CPU_STREAMS_ENV) == "1":
            self.lanes = cpu_lanes()
            self.lanes.observer = self
        self._watch = triton_launches.watching(self._on_triton, load=True)
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        if self.lanes is not None:
            self.lanes.observer = None
        self._watch.__exit__(None, None, None)
        return super().__exit__(*exc)


def settle_writes(windows: list[list[Launch]]) -> None:
    """Read and written bytes of the Triton launches. An argument is written when a launch of
    the same kernel changed it in any of the windows: a write can leave an element as it was
    (a buffer that already held the same values), so one launch's comparison is not enough."""
    written = defaultdict(set)
    for launches in windows:
        for x in launches:
            written[x.name].update(i for i, (_, changed) in enumerate(x.args) if changed)
    for launches in windows:
        for x in launches:
            if x.kind == "triton":
                x.writes = tuple(place for i, (place, _) in enumerate(x.args) if i in written[x.name])
                x.reads = tuple(place for i, (place, _) in enumerate(x.args) if i not in written[x.name])
                x.written, x.read = sum(n for _, n in x.writes), sum(n for _, n in x.reads)


# ---- measuring -------------------------------------------------------------------------------


@dataclass
class Tally:
    """The launches of one (phase, kind, name, dtype) in a window, or per step."""

    count: float = 0
    read: float = 0
    written: float = 0
    flops: float = 0
    programs: float = 0  # the smallest grid among them (Triton)
    memory: float = 0  # bytes (read and written) of those launched by the memory's code


SUMMED = ("count", "read", "written", "flops", "memory")  # the fields that add up over launches and steps

class Key(NamedTuple):
    """What launches are tallied by."""

    phase: str
    kind: str
    name: str
    dtype: str


def tally(launches: list[Launch]) -> dict[Key, Tally]:
    out: dict[Key, Tally] = defaultdict(Tally)
    for x in launches:
        t = out[Key(x.phase, x.kind, x.name, x.dtype)]
        t.count += 1
        t.read += x.read
        t.written += x.written
        t.flops += x.flops
        t.memory += (x.read + x.written) if x.memory else 0
        if x.programs:
            t.programs = min(t.programs or x.programs, x.programs)
    return dict(out)


def window(model, batch: int, steps: int, dtype: str, device: torch.device, counted: bool = True,
           carried: bool = False) -> list[Launch]:
    """The launches of one forward and backward of a window of random tokens; `carried`: started
    from the (detached) state an uncounted window before it ended with, as train.carry_state runs."""
    gen = torch.Generator().manual_seed(batch * 1000 + steps)
    tokens = torch.randint(0, model.config.vocab_size, (batch, steps), generator=gen).to(device)
    model.zero_grad(set_to_none=True)  # gradients assigned, not accumulated: the same ops every window
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    state = None
    if carried:
        with torch.no_grad(), autocast:
            state = model(tokens).state.detach()
    counter = LaunchCounter()
    with counter if counted else contextlib.nullcontext():
        counter.phase = "forward"
        with autocast:
            loss = model(tokens, state=state).loss
        counter.phase = "backward"
        loss.backward()
    return counter.launches  # none when not counted


def first_seen(a: dict, b: dict) -> list:
    """The keys of two tallies in the order their launches were first seen, not a set's: a set of
    string keys iterates in an order hashed anew in every process, and the float sums over the
    tallies (each phase's time) would round differently from run to run."""
    return list(a) + [k for k in b if k not in a]


def difference(short: dict[Key, Tally], long: dict[Key, Tally], steps: tuple[int, int]):
    """(per step, once per window) from the tallies of windows of steps[0] and steps[1] steps."""
    t0, t1 = steps
    per_step, fixed = {}, {}
    for key in first_seen(short, long):
        a, b = short.get(key, Tally()), long.get(key, Tally())
        diff = Tally(**{f: (getattr(b, f) - getattr(a, f)) / (t1 - t0) for f in SUMMED}, programs=b.programs)
        if diff.count or diff.read or diff.written or diff.flops:
            per_step[key] = diff
        rest = Tally(**{f: getattr(a, f) - t0 * getattr(diff, f) for f in SUMMED}, programs=a.programs)
        if rest.count:
            fixed[key] = rest
    return per_step, fixed


def measure(model, batches: list[int], steps: tuple[int, int], dtype: str, device, warm: bool = True,
            carried: bool = False) -> dict:
    """Per batch, the launches of a window of steps[0] and of steps[1] steps, their writes settled.

    `warm`: one window first, uncounted, which compiles the kernels and makes the constants that
    are made once (not needed when this model has already run windows of these shapes)."""
    if warm:
        window(model, batches[0], steps[0], dtype, device, counted=False)
    runs = {b: [window(model, b, T, dtype, device, carried=carried) for T in steps] for b in batches}
    settle_writes([w for pair in runs.values() for w in pair])
    return runs


def costs_of(runs: dict, steps: tuple[int, int]) -> dict:
    """Per batch, (per step, once per window) tallies from `measure`'s windows."""
    return {b: difference(tally(short), tally(long), steps) for b, (short, long) in runs.items()}


def step_costs(model, batches: list[int], steps: tuple[int, int], dtype: str, device, warm: bool = True,
               carried: bool = False):
    """Per batch, (per step, once per window) tallies from windows of steps[0] and steps[1] steps."""
    return costs_of(measure(model, batches, steps, dtype, device, warm, carried), steps)


def save_launches(path: str, runs: dict, steps) -> None:
    """`measure`'s windows as JSON, for `--launches` to report from again without counting."""
    with open(path, "w") as f:
        json.dump(dict(steps=list(steps), windows={str(b): [[dataclasses.asdict(x) for x in w] for w in pair]
                                                   for b, pair in runs.items()}), f)


def load_launches(path: str) -> tuple[dict, tuple[int, int]]:
    from data_prep.errors import read_json

    data = read_json(path)

    def launch(d):
        d = {k: tuple(tuple(e) if isinstance(e, list) else e for e in v) if isinstance(v, list) else v for k, v in d.items()}
        d["args"] = tuple((tuple(place), changed) for place, changed in d["args"])
        return Launch(**d)

    return {int(b): [[launch(d) for d in w] for w in pair] for b, pair in data["windows"].items()}, tuple(data["steps"])


def extrapolate(at: dict[int, dict[Key, Tally]], batch: int) -> dict[Key, Tally]:
    """Tallies at `batch` from those at two batches: counts equal, the rest linear in the batch."""
    if len(at) == 1:
        (measured, tallies), = at.items()
        if batch != measured:
            raise SystemExit(f"error: counted at batch {measured} alone, asked for {batch:g}: measure two batches "
                             "(--measure-batches) to extrapolate")
        return tallies
    (b0, x0), (b1, x1) = sorted(at.items())
    out = {}
    for key in first_seen(x0, x1):
        p, q = x0.get(key, Tally()), x1.get(key, Tally())
        if p.count != q.count:
            raise SystemExit(f"error: {key.name} ({key.phase}): {p.count:g} launches per step at batch {b0}, {q.count:g} at "
                             f"{b1}; launch counts must not depend on the batch (measure at --batch directly)")
        line = lambda f: getattr(p, f) + (getattr(q, f) - getattr(p, f)) * (batch - b0) / (b1 - b0)  # noqa: E731
        out[key] = Tally(p.count, line("read"), line("written"), line("flops"), round(line("programs")), line("memory"))
    return out


