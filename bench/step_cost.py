"""GPU cost of one time step of GPN+M's fused core, counted on any device: launches, bytes, FLOPs, and a roofline for one H200.

    PYTHONPATH=. python bench/step_cost.py                           # gpn_m_130m_1l, batch 32, bf16, Triton kernels, chunk form
    PYTHONPATH=. python bench/step_cost.py --kernel torch --batch 256 --json step_cost.json
    PYTHONPATH=. python bench/step_cost.py --config gpn_m_tiny d_state=96   # any configs/models/*.yaml, key=value overrides
    PYTHONPATH=. python bench/step_cost.py --device cuda              # the same count on a GPU
    PYTHONPATH=. python bench/step_cost.py memory_form=step           # the memory's step form (default: as on a GPU, chunk)
    PYTHONPATH=. python bench/step_cost.py --config transformer_130m  # the Transformer++ baseline alone
    PYTHONPATH=. python bench/step_cost.py --batch 4,8,16,32,64,128,256,512   # what each batch buys
    PYTHONPATH=. python bench/step_cost.py --config transformer_130m --batch 256 --contexts 2048,8192,32768,131072
    PYTHONPATH=. python bench/step_cost.py --config bench/gpt2_124m.yaml --hardware h100 --baseline-seq-len 1024 --batch 64

A GPN+M step is a strictly sequential chain of kernels, repeated T times forward and again in the
reverse sweep, so its speed on a GPU is set by what each step launches. This script runs a
training window (forward, then backward) of the model built from a config with a counter on the
launch path and no timing:

- every Triton launch (the JIT's `run`, or the interpreter's on CPU, where TRITON_INTERPRET=1 is
  set for `--kernel triton`): kernel name, grid size, and the bytes of its tensor arguments, an
  argument whose contents changed counting as written, the others as read;
- every torch op that launches a device kernel (a TorchDispatchMode; views, allocations and
  metadata ops launch nothing and are skipped), classed as GEMM (with its FLOPs), cast (a copy
  that changes the dtype), copy, or other, with the bytes of its tensor inputs and outputs.
Torch ops a Triton launcher runs inside its launch (the interpreter's host copies) are not counted.

Per time step: the window is run at T = 1 and T = C + 1 (C = `core_chunk`; `--steps`) and the
counts subtracted and divided by C: what runs once per window (embedding, input projection,
decoder launches, weight casts) drops out, the per-token share of its data (the decoder's rows)
staying in the bytes and FLOPs, and what runs once per chunk (the recomputed projection, the
weight gradients, the chunk form's algebra and its writes of M and dL/dM) is spread over the
chunk's steps, as the steps of a chunk are averaged (the chunk form's per-step work grows with
the step's place in its chunk). What dropped out is shown as "once per window". Batch: launch counts do not change with the batch and bytes, FLOPs and
grids grow linearly with it, so on CPU the window is measured at two small batches
(`--measure-batches`, default 2,3) and each kernel's figures are extrapolated linearly to
`--batch`; on CUDA it is measured at `--batch` itself. The CUDA graphs are switched off: the count
is what a graph captures, launched one by one.

The roofline (constants in `H200`) gives each step's kernels max(bytes / bandwidth, FLOPs / peak),
scaled up by 132 / programs for a Triton grid smaller than the GPU, plus a cost per launch: with
graph replay a gap per kernel on the device; eager, the same or, where the host is slower than
the device, launches x the host's cost per launch (the kernels of a step depend on each other,
but the host queues them ahead). The memory's launches (those of kernels/memory and
kernels/memory_chunk: the memory kernels and the chunk form's torch algebra) are summed apart:
their bytes per token are what moving M costs as implemented. The floor beside the estimate is
M's traffic alone as each form is designed (float32, H x d_k x d_v per sequence): the step form
reads and writes M twice per step forward (once more read per later layer) and five times backward
(rebuild: read and write; step backward: read M and dM, write dM; three more per later layer);
the chunk form reads M_c once per step each way (once more per later layer), and per chunk writes
M once forward, and backward reads M_c once (the rebuild), dL/dM twice and writes it once; with
`memory_reads=compute` under bf16 the per-step reads are of a bf16 copy of M_c, made once per chunk
each way (M_c read, the half-size copy written).

The schedule (bench/schedule.py): every launch of the windows is a node with its roofline time,
its shares of the bandwidth, the arithmetic and the SMs, and its stream; the step's estimate is the
critical path of the launches on their streams, each after a graph's launch gap, kernels that run
at once sharing the device so that nothing is used beyond 100%. On one stream that is the launches'
times and gaps one after another. Launches are extrapolated to `--batch` one by one.

The baseline (`--baseline`, default transformer_130m) is Transformer++ counted the same way and
then as a tuned implementation runs it: one window of `--baseline-seq-len` tokens forward and
backward at the measured batches, attention replaced by FlashAttention-2's causal costs (forward
2 B H T^2 D FLOPs, QK^T and PV over half the square, backward 2.5 times that; bytes Q, K, V read
and O written forward, Q, K, V, O, dO read and dQ, dK, dV written backward, bf16, plus the row
statistics in float32; timed as a GEMM), and every run of launches between two GEMMs or attention
calls fused into one kernel that reads what comes from outside the run once and writes what is
read after it (`fuse_elementwise`, torch.compile's fusion). Its tokens/s is B T over the window's
time with a graph's gap per launch; printed beside it, the same window as launched (eager) and the
bound of its GEMMs and attention alone. Every ratio GPN+M prints is against the tuned count.
`--contexts` gives it at longer windows holding as many tokens per step (what is not attention is
linear in the tokens, attention is FlashAttention's at the context). `--config bench/gpt2_124m.yaml
--hardware h100 --baseline-seq-len 1024` is the calibration against published GPT-2 runs.

Imports only torch and triton besides the source tree (and yaml, through gpn_scale.config); run it from the
repository's root with PYTHONPATH=. (bench/schedule.py is imported as bench.schedule).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.schedule import Node, critical_path, wave_share
from kernels import launches as triton_launches

PHASES = ("forward", "backward")
KINDS = ("gemm", "triton", "cast", "copy", "other")


@dataclass(frozen=True)
class Hardware:
    """One GPU's roofline. Bandwidth and bf16 rate are what an H200 achieves (a device-to-device
    copy, a large dense bf16 GEMM; bench/gpu.py measures both), not datasheet peaks; fp32 is the
    datasheet's CUDA-core peak (torch's fp32 GEMMs do not use TF32 by default); the launch costs
    are typical values, to be replaced by measured ones."""

    name: str = "H200"
    sms: int = 132
    bytes_per_s: float = 4.3e12
    flops_per_s: dict = field(default_factory=lambda: {"bfloat16": 790e12, "float16": 790e12, "float32": 67e12,
                                                        "float64": 34e12})
    eager_launch_s: float = 6e-6  # host time per launch from Python (torch op or Triton launcher)
    graph_launch_s: float = 1.5e-6  # device gap per kernel of a replayed CUDA graph


H200 = Hardware()
# The H100 SXM has the H200's compute and 3.35 TB/s (datasheet) of HBM3 against 4.8: the same 90%
# of it achieved by a copy as on the H200. Used to calibrate the baseline against published H100 runs.
H100 = Hardware(name="H100", bytes_per_s=3.0e12)
HARDWARE = {"h200": H200, "h100": H100}


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
    stream: int = 0  # the stream it was launched on (kernels/streams: 0 the main one, 1 the side one)
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
        # The streams: on CPU the stand-in's (kernels/streams), observed; elsewhere one stream is
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
        """The stand-in's fork, record, wait or join (kernels.streams.CpuLanes.observer)."""
        from kernels.streams import MAIN, SIDE

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
        from kernels.streams import CPU_STREAMS_ENV, cpu_lanes

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


def difference(short: dict[Key, Tally], long: dict[Key, Tally], steps: tuple[int, int]):
    """(per step, once per window) from the tallies of windows of steps[0] and steps[1] steps."""
    t0, t1 = steps
    per_step, fixed = {}, {}
    for key in short.keys() | long.keys():
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
    from gpn_scale.errors import read_json

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
    for key in x0.keys() | x1.keys():
        p, q = x0.get(key, Tally()), x1.get(key, Tally())
        if p.count != q.count:
            raise SystemExit(f"error: {key.name} ({key.phase}): {p.count:g} launches per step at batch {b0}, {q.count:g} at "
                             f"{b1}; launch counts must not depend on the batch (measure at --batch directly)")
        line = lambda f: getattr(p, f) + (getattr(q, f) - getattr(p, f)) * (batch - b0) / (b1 - b0)  # noqa: E731
        out[key] = Tally(p.count, line("read"), line("written"), line("flops"), round(line("programs")), line("memory"))
    return out


# ---- the roofline ----------------------------------------------------------------------------


def kernel_seconds(key: Key, t: Tally, hw: Hardware) -> float:
    """Device time of a tally's launches at the roofline; a Triton grid smaller than the GPU
    leaves SMs idle, so it gets bandwidth and FLOPs in proportion to its programs."""
    peak = hw.flops_per_s.get(key.dtype, hw.flops_per_s["float32"])
    per = max((t.read + t.written) / hw.bytes_per_s, t.flops / peak)
    fill = min(1.0, t.programs / hw.sms) if t.programs else 1.0
    return per / fill


@dataclass
class PhaseCost:
    launches: dict  # kind -> launches per step
    read_bytes: float
    written_bytes: float
    flops: float
    min_programs: int  # smallest Triton grid among the step's launches (0: none)
    device_s: float  # the kernels' time at the roofline
    eager_s: float
    graph_s: float


def phase_cost(per_step: dict[Key, Tally], phase: str, hw: Hardware) -> PhaseCost:
    rows = {k: t for k, t in per_step.items() if k.phase == phase}
    launches = {kind: sum(t.count for k, t in rows.items() if k.kind == kind) for kind in KINDS}
    n = sum(launches.values())
    device = sum(kernel_seconds(k, t, hw) for k, t in rows.items())
    grids = [t.programs for t in rows.values() if t.programs and t.count]
    return PhaseCost(launches, sum(t.read for t in rows.values()), sum(t.written for t in rows.values()),
                     sum(t.flops for t in rows.values()), min(grids, default=0), device,
                     max(device + n * hw.graph_launch_s, n * hw.eager_launch_s), device + n * hw.graph_launch_s)


def memory_floor(cfg, hw: Hardware, dtype: str = "fp32") -> dict | None:
    """M's traffic alone per token as the config's memory form is designed (bytes, forward and
    backward; the module docstring) and the tokens/s it allows."""
    if not cfg.memory:
        return None
    m = cfg.n_heads * cfg.d_key * cfg.d_val * 4  # float32, whatever the compute dtype
    later = cfg.n_layers - 1
    low = cfg.memory_form == "chunk" and cfg.memory_reads == "compute" and dtype == "bf16"
    if cfg.memory_form == "chunk":
        C = cfg.core_chunk
        if low:  # the per-step reads in bf16, from a copy made once per chunk each way (M_c read, half of it written)
            fwd, bwd = m * ((1 + later) / 2 + 2.5 / C), m * ((1 + later) / 2 + 5.5 / C)
        else:
            fwd, bwd = m * (1 + later + 1 / C), m * (1 + later + 4 / C)
    else:
        fwd, bwd = m * (2 + later), m * (5 + 3 * later)
    return dict(form=cfg.memory_form, m_bytes=m, reads="bf16" if low else "float32", forward_bytes_per_token=fwd,
                backward_bytes_per_token=bwd, tokens_per_s=hw.bytes_per_s / (fwd + bwd))


def weight_floor(costs: dict, batch: int, floor: dict | None, hw: Hardware) -> dict | None:
    """The step's batch-independent bytes (the per-step tallies extrapolated to batch 0: the loop's
    weights read by the step GEMMs each way, the weight gradients spread over the chunk) and the
    tokens/s they leave at `batch` beside M's floor: B / (those bytes + B x M's bytes per token) at
    the bandwidth."""
    if len(costs) < 2:
        return None
    at_zero = extrapolate({b: c[0] for b, c in costs.items()}, 0)
    fixed = sum(t.read + t.written for t in at_zero.values())
    m = (floor["forward_bytes_per_token"] + floor["backward_bytes_per_token"]) if floor else 0
    return dict(bytes_per_step=fixed, seconds=fixed / hw.bytes_per_s,
                tokens_per_s=batch * hw.bytes_per_s / (fixed + batch * m))


def peak_memory(cfg, batch: int, seq_len: int, params: int) -> dict:
    """Bytes per GPU of a training step of GPN+M, from docs/core.md's "Memory and time trade-offs":
    what the forward keeps per token, M at every chunk's start, the backward's one chunk of work,
    and the weights with their gradients and Adam's two moments in float32 (ZeRO 0; ZeRO shards
    the last three over the data-parallel ranks)."""
    d, H, dk, dv, L, C = cfg.d_state, cfg.n_heads, cfg.d_key, cfg.d_val, cfg.n_layers, cfg.core_chunk
    f32, tokens = 4, batch * seq_len
    m = H * dk * dv * f32 * batch
    per_token = (2 * d + (L - 1) * (d + 1) + 3 * H) * f32  # u, P; later layers' inputs and rms; the write's gates
    if cfg.memory_form == "chunk":
        per_token += (L + 2) * H * dv * f32  # each step's reads, the write's error and delta
        chunk_m = 4 * m  # M_c, its copy in the reads' dtype, dL/dM in two buffers
    else:
        chunk_m = (C + 2) * m  # the chunk's rebuilt M's, dL/dM in two buffers
    n_rows = 2 * H * dk + 2 * H * dv + 2 * H + 2 * cfg.d_ffn + d  # layer 0's fused projection
    # projections, second-GEMM rows, their gradients: two workspaces, used in turn on a GPU (the
    # weight gradients of one chunk run on a side stream beside the next chunk's sweep)
    chunk_rows = 2 * C * batch * (2 * n_rows + 2 * (cfg.d_ffn + H * dv) + 4 * d) * f32
    logits = 2 * cfg.ce_chunk * cfg.vocab_size * f32
    parts = dict(saved=tokens * per_token, m_per_chunk=math.ceil(seq_len / C) * m, backward_chunk=chunk_m + chunk_rows,
                 logits=logits, weights_and_optimizer=params * 16)
    return dict(parts, total=sum(parts.values()))


# ---- the baseline: Transformer++ counted the same way -----------------------------------------

_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
              "_efficient_attention_forward"}
_ATTENTION_BWD = {name + "_backward" for name in _ATTENTION} | {"_flash_attention_backward", "_efficient_attention_backward"}


def flash_attention(phase: str, batch: int, heads: int, seq: int, head_dim: int) -> Tally:
    """FlashAttention-2's causal costs for one layer (the module docstring): FLOPs of the two
    matrix products over the causal half, 2.5 times that backward; bytes of its inputs and
    outputs in bf16 and its float32 row statistics."""
    qkv = batch * heads * seq * head_dim * 2  # one of Q, K, V, O in bf16
    rows = batch * heads * seq * 4
    fwd_flops = 2 * batch * heads * seq * seq * head_dim
    if phase == "forward":
        return Tally(1, 3 * qkv, qkv + rows, fwd_flops)
    return Tally(1, 5 * qkv + 2 * rows, 3 * qkv, 2.5 * fwd_flops)


@dataclass
class Flow:
    """A launch's place in its window's data flow: the versions of storages it reads and writes,
    with their bytes. Every write makes a new version of its storage; a read reads the latest."""

    reads: dict
    writes: dict


def dataflow(launches: list[Launch]) -> list[Flow]:
    """The launches' flows, in order. A storage read before any launch wrote it (a parameter, the
    input) is read at a version of its own; an allocator's reuse of an address is a new write, so
    it starts a new version as any write does."""
    latest, flows, fresh = {}, [], iter(range(1 << 62))
    for x in launches:
        reads, writes = {}, {}
        for ptr, n in x.reads:
            if n:
                v = latest.setdefault(ptr, next(fresh))
                reads[v] = max(reads.get(v, 0), n)
        for ptr, n in x.writes:
            if n:
                v = latest[ptr] = next(fresh)
                writes[v] = n
        flows.append(Flow(reads, writes))
    return flows


UNFUSED = ("gemm", "attention")  # what a compiler leaves as library calls; everything else it fuses


def fuse_elementwise(launches: list[Launch], results: set) -> list[Launch]:
    """The window as torch.compile runs it: every run of launches between two GEMMs or attention
    calls, within a phase, becomes one kernel (norm + rotary + casts, SwiGLU's activation, the
    cross-entropy's passes), which reads once what the run reads from outside it and writes only
    what is read after the run or is a result of the window (`results`: the storages of the
    gradients). Its FLOPs are its ops'; GEMMs and attention stay as they are."""
    flows = dataflow(launches)
    last_read = {}
    for i, f in enumerate(flows):
        for v in f.reads:
            last_read[v] = i
    latest = {}
    for x, f in zip(launches, flows):
        for (ptr, n), v in zip(((p, n) for p, n in x.writes if n), f.writes):
            latest[ptr] = v
    final = {latest[p] for p in results if p in latest}
    out, i = [], 0
    while i < len(launches):
        if launches[i].kind in UNFUSED:
            out.append(launches[i])
            i += 1
            continue
        j = i
        while j < len(launches) and launches[j].kind not in UNFUSED and launches[j].phase == launches[i].phase:
            j += 1
        made, outside = {}, {}
        for f in flows[i:j]:
            for v, n in f.reads.items():
                if v not in made:
                    outside[v] = max(outside.get(v, 0), n)
            made.update(f.writes)
        written = sum(n for v, n in made.items() if last_read.get(v, -1) >= j or v in final)
        x = launches[i]
        out.append(Launch(x.phase, "fused", "elementwise", "mixed", 0, sum(outside.values()), written,
                          sum(y.flops for y in launches[i:j])))
        i = j
    return out


@dataclass
class BaselineCount:
    """Transformer++'s window counted at the measured batches, at `seq_len`: per batch, the tallies
    of everything but attention as launched (`eager`) and fused (`tuned`), and the attention calls
    per phase, whose costs come from `flash_attention` at any context."""

    config: str
    seq_len: int
    heads: int
    head_dim: int
    eager: dict  # batch -> {Key: Tally}
    tuned: dict
    attention_calls: dict  # phase -> attention launches per window


def baseline_tallies(args) -> BaselineCount:
    """Transformer++'s training window (--baseline) counted at the measured batches, as launched
    and as a compiler fuses it; attention's own launches are set apart (FlashAttention's costs
    replace them)."""
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    cfg = model_config(args.baseline)
    if getattr(cfg, "family", None) != "transformer":
        raise SystemExit(f"error: --baseline {args.baseline}: expected a transformer config, got family {cfg.family!r}")
    torch.manual_seed(0)
    model = build_model(cfg).to(args.device)
    device, T = torch.device(args.device), args.baseline_seq_len
    eager, tuned, calls = {}, {}, {}
    for b in args.measure_batches:
        launches = window(model, b, T, args.dtype, device)
        results = {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
        for x in launches:
            if x.name in _ATTENTION or x.name in _ATTENTION_BWD:
                x.kind = "attention"
        calls = {p: sum(1 for x in launches if x.kind == "attention" and x.phase == p) for p in PHASES}
        eager[b] = tally([x for x in launches if x.kind != "attention"])
        tuned[b] = tally([x for x in fuse_elementwise(launches, results) if x.kind != "attention"])
    return BaselineCount(args.baseline, T, cfg.n_heads, cfg.d_model // cfg.n_heads, eager, tuned, calls)


def baseline_window(count: BaselineCount, batch: int, hw: Hardware, seq_len: int | None = None) -> dict:
    """The baseline's window of `batch` x `seq_len` tokens (default: as counted) on the roofline:
    tokens/s tuned (fused, the comparison every GPN+M ratio uses), eager (as launched) and the
    bound of its GEMMs and attention alone. What is not attention is linear in the tokens beside
    a part once per window (the weights), so another context is the counted window's tallies at
    the same number of tokens; attention is FlashAttention-2's at the context itself."""
    T = seq_len or count.seq_len
    tokens = batch * T
    same_tokens = tokens / count.seq_len  # the counted context's batch holding as many tokens
    attention = {}
    for p in PHASES:
        fa = flash_attention(p, batch, count.heads, T, count.head_dim)
        n = count.attention_calls[p]
        attention[Key(p, "attention", "flash_attention", "bfloat16")] = Tally(n, n * fa.read, n * fa.written, n * fa.flops)

    def timed(at):
        window_tally = {**extrapolate(at, same_tokens), **attention}
        seconds = sum(kernel_seconds(k, t, hw) for k, t in window_tally.items())
        n = sum(t.count for t in window_tally.values())
        core_s = sum(kernel_seconds(k, t, hw) for k, t in window_tally.items() if k.kind in UNFUSED)
        return dict(launches=n, bytes=sum(t.read + t.written for t in window_tally.values()),
                    flops=sum(t.flops for t in window_tally.values()), device_s=seconds,
                    graph_s=seconds + n * hw.graph_launch_s, core_s=core_s)

    tuned, eager = timed(count.tuned), timed(count.eager)
    return dict(config=count.config, seq_len=T, batch=batch, hardware=hw.name, launches=tuned["launches"],
                bytes=tuned["bytes"], flops=tuned["flops"], device_s=tuned["device_s"], graph_s=tuned["graph_s"],
                tokens_per_s=tokens / tuned["graph_s"], eager=dict(launches=eager["launches"], bytes=eager["bytes"],
                graph_s=eager["graph_s"], tokens_per_s=tokens / eager["graph_s"]),
                gemm_attention_s=tuned["core_s"], gemm_attention_tokens_per_s=tokens / tuned["core_s"])


# ---- the schedule: kernels on their streams ----------------------------------------------------

GEMM_TILE = (128, 128)  # a GEMM's output tile per thread block (cuBLAS's on Hopper are this or larger)


def launches_at(pair: tuple[list[Launch], list[Launch]], batches: tuple[int, int], batch: int) -> list[Launch]:
    """One window's launches at `batch` from the same window at two batches: the same launches in
    the same order, bytes, FLOPs, grids and GEMM shapes linear in the batch."""
    (b0, w0), (b1, w1) = sorted(zip(batches, pair))
    if len(w0) != len(w1) or any((x.name, x.phase, x.stream, x.waits) != (y.name, y.phase, y.stream, y.waits)
                                 for x, y in zip(w0, w1)):
        raise SystemExit(f"error: the window launches differently at batch {b0} and {b1}: measure at --batch directly")
    f = (batch - b0) / (b1 - b0)
    line = lambda p, q: p + (q - p) * f  # noqa: E731
    return [dataclasses.replace(x, read=line(x.read, y.read), written=line(x.written, y.written),
                                flops=line(x.flops, y.flops), programs=round(line(x.programs, y.programs)),
                                shape=tuple(round(line(p, q)) for p, q in zip(x.shape, y.shape)))
            for x, y in zip(w0, w1)]


def launch_node(x: Launch, hw: Hardware):
    """A launch as a node of the schedule (bench/schedule.py): its time alone, its shares of the
    device. A Triton grid takes its programs' share of the SMs (all of them from one wave up); a
    GEMM its output tiles' share averaged over its waves; other torch ops the whole GPU."""
    seconds = kernel_seconds(Key(x.phase, x.kind, x.name, x.dtype), Tally(1, x.read, x.written, x.flops, x.programs), hw)
    peak = hw.flops_per_s.get(x.dtype, hw.flops_per_s["float32"])
    if x.programs:
        sms = min(1.0, x.programs / hw.sms)
    elif x.shape:
        batch, m, n = x.shape
        sms = wave_share(batch * math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1]), hw.sms)
    else:
        sms = 1.0
    share = lambda v: v / seconds if seconds else 0.0  # noqa: E731
    return Node(x.name, x.stream, seconds, share((x.read + x.written) / hw.bytes_per_s), share(x.flops / peak), sms,
                gap=hw.graph_launch_s)


def phase_nodes(window: list[Launch], phase: str, hw: Hardware, moved=None) -> list[Node]:
    """The launches of one phase of a window as schedule nodes, their waits within the phase (the
    forward has ended before the backward starts). `moved(x)`: launches put on stream 1 instead,
    with no waits at all (`overlap_what_if`)."""
    index, nodes = {}, []
    for i, x in enumerate(window):
        if x.phase != phase:
            continue
        index[i] = len(nodes)
        node = launch_node(x, hw)
        if moved is None:
            node = dataclasses.replace(node, waits=tuple(index[w] for w in x.waits if w in index))
        else:
            node = dataclasses.replace(node, stream=1 if moved(x) else 0)
        nodes.append(node)
    return nodes


def scheduled_step(runs: dict, steps: tuple[int, int], batch: int, hw: Hardware) -> dict:
    """Per phase, one time step's time on the schedule: the critical path of the window of
    steps[1] steps minus that of steps[0], over the difference; with graph replay's gaps."""
    batches = tuple(sorted(runs))
    out = {}
    for phase in PHASES:
        spans = []
        for i in range(2):
            if len(batches) == 1:
                window_launches = runs[batches[0]][i]
            else:
                window_launches = launches_at((runs[batches[0]][i], runs[batches[1]][i]), batches[:2], batch)
            spans.append(critical_path(phase_nodes(window_launches, phase, hw)))
        out[phase] = (spans[1] - spans[0]) / (steps[1] - steps[0])
    streams = {x.stream for pair in runs.values() for w in pair for x in w}
    return dict(phases=out, seconds=sum(out.values()), tokens_per_s=batch / sum(out.values()), streams=len(streams))


ONCE_PER_CHUNK_KERNELS = {"_gate_factors", "_chunk_carry_back", "_chunk_dm_products", "_ce_lse", "_ce_grad"}
MEMORY_STEP_KERNELS = ("_chunk_step", "_step_fwd", "_step_bwd", "_read_fwd", "_read_bwd", "_gated_rms", "_head_sums")


def _once_per_chunk(x: Launch, batch: int) -> bool:
    """Whether a launch of the reverse sweep is once-per-chunk work rather than a step's: a GEMM
    not of the step's B rows (the recomputed projection, the weight gradients), a Triton kernel of
    the chunk's, any torch op (the chunk algebra, the factors, the bias sums)."""
    if x.kind == "gemm":
        return x.shape[1] != batch
    return x.kind != "triton" or x.name in ONCE_PER_CHUNK_KERNELS


OVERLAPS = {
    "once-per-chunk work beside the sweep": lambda x, b: x.phase == "backward" and _once_per_chunk(x, b),
    "memory kernels beside the step's GEMMs": lambda x, b: x.kind == "triton" and x.name.startswith(MEMORY_STEP_KERNELS),
}


def overlap_what_if(runs: dict, steps: tuple[int, int], batch: int, hw: Hardware) -> dict:
    """What moving work to a second stream could buy, under the overlap rule: the step's time with
    the launches each overlap names (and with both) on stream 1 and no wait between the streams at
    all, so no data dependency holds them back. Optimistic, for planning, not a schedule the code
    could run: a real one waits for its inputs."""
    batches = tuple(sorted(runs))
    if len(batches) < 2:
        return {}

    def step_time(side) -> float:
        total = 0.0
        for phase in PHASES:
            spans = []
            for i in range(2):
                w = launches_at((runs[batches[0]][i], runs[batches[1]][i]), batches[:2], batch)
                spans.append(critical_path(phase_nodes(w, phase, hw, moved=lambda x: side(x, batch))))
            total += (spans[1] - spans[0]) / (steps[1] - steps[0])
        return total

    bounds = {name: step_time(side) for name, side in OVERLAPS.items()}
    bounds["both"] = step_time(lambda x, b: any(side(x, b) for side in OVERLAPS.values()))
    return {name: dict(seconds=t, tokens_per_s=batch / t) for name, t in bounds.items()}


# ---- report ----------------------------------------------------------------------------------


def report(args, cfg, batch: int, costs: dict, hw: Hardware, baseline: dict | None, runs: dict, params: int) -> dict:
    per_step = extrapolate({m: c[0] for m, c in costs.items()}, batch)
    fixed = costs[min(costs)][1]
    phases = {p: phase_cost(per_step, p, hw) for p in PHASES}
    eager = sum(c.eager_s for c in phases.values())
    serial = sum(c.graph_s for c in phases.values())
    schedule = scheduled_step(runs, tuple(args.steps), batch, hw)
    graph = schedule["seconds"]
    memory = {p: sum(t.memory for k, t in per_step.items() if k.phase == p) / batch for p in PHASES}
    memory_s = sum(kernel_seconds(k, Tally(t.count, t.memory, 0, 0, t.programs), hw) for k, t in per_step.items() if t.memory)
    rows = [dict(k._asdict(), **dataclasses.asdict(t), seconds=kernel_seconds(k, t, hw))
            for k, t in sorted(per_step.items(), key=lambda kv: (PHASES.index(kv[0].phase), KINDS.index(kv[0].kind), kv[0][2:]))]
    floor = memory_floor(cfg, hw, args.dtype)
    return dict(config=args.config, overrides=args.overrides, batch=batch, seq_len=args.seq_len, dtype=args.dtype, kernel=args.kernel,
                device=args.device, steps=list(args.steps), measured_batches=args.measure_batches,
                hardware=dataclasses.asdict(hw), phases={p: dataclasses.asdict(c) for p, c in phases.items()},
                kernels=rows, once_per_window={p: sum(t.count for k, t in fixed.items() if k.phase == p) for p in PHASES},
                tokens_per_s=dict(eager=batch / eager, graph=batch / graph, serial=batch / serial), schedule=schedule,
                memory_floor=floor, weight_floor=weight_floor(costs, batch, floor, hw),
                overlap_what_if=overlap_what_if(runs, tuple(args.steps), batch, hw),
                peak_memory=peak_memory(cfg, batch, args.seq_len, params) if cfg.memory else None,
                graph_over_floor=(batch / graph) / floor["tokens_per_s"] if floor else None,
                memory_form=cfg.memory_form if cfg.memory else None, chunk=cfg.core_chunk,
                memory_bytes_per_token=memory, memory_kernels_us=memory_s * 1e6, baseline=baseline,
                over_baseline=None if baseline is None else dict(
                    tuned=(batch / graph) / baseline["tokens_per_s"],
                    eager=(batch / graph) / baseline["eager"]["tokens_per_s"],
                    gemm_attention=(batch / graph) / baseline["gemm_attention_tokens_per_s"]))


def print_report(r: dict, hw: Hardware) -> None:
    MB = 1e6
    measured = r["measured_batches"]
    how = (f"measured at batch {measured[0]} and {measured[1]}, extrapolated linearly" if len(measured) == 2
           else f"measured at batch {measured[0]}")
    print(f"step cost: {' '.join([r['config'], *r['overrides']])}, batch {r['batch']} ({how}), {r['dtype']}, "
          f"kernel {r['kernel']}, counted on {r['device']}")
    t0, t1 = r["steps"]
    spread = (f"the {t1 - t0} steps of a whole chunk averaged, its once-per-chunk work spread over them"
              if t1 - t0 == r["chunk"] else "once-per-chunk launches drop out when the windows are one chunk")
    print(f"per time step: (window of T={t1} minus T={t0}) / {t1 - t0}: {spread}; once-per-window launches drop out, "
          f"their per-token bytes and FLOPs stay; launch counts do not change with the batch, bytes, FLOPs and grids "
          f"grow linearly with it")
    head = f"{'phase':9s} {'launches':>8s} " + " ".join(f"{k:>6s}" for k in KINDS) + \
        f" {'read MB':>9s} {'write MB':>9s} {'GFLOP':>8s} {'min grid':>13s} {'roofline us':>11s}"
    print(head)
    totals = defaultdict(float)
    for p in PHASES:
        c = r["phases"][p]
        n = sum(c["launches"].values())
        grid = f"{c['min_programs']:d} ({c['min_programs'] / hw.sms:.2f}x)" if c["min_programs"] else "-"
        print(f"{p:9s} {n:8g} " + " ".join(f"{c['launches'][k]:6g}" for k in KINDS)
              + f" {c['read_bytes'] / MB:9.1f} {c['written_bytes'] / MB:9.1f} {c['flops'] / 1e9:8.2f} {grid:>13s}"
              f" {c['device_s'] * 1e6:11.1f}")
        for k in ("read_bytes", "written_bytes", "flops", "device_s"):
            totals[k] += c[k]
        for k in KINDS:
            totals[k] += c["launches"][k]
    grids = [r["phases"][p]["min_programs"] for p in PHASES if r["phases"][p]["min_programs"]]
    grid = f"{min(grids):d} ({min(grids) / hw.sms:.2f}x)" if grids else "-"
    print(f"{'total':9s} {sum(totals[k] for k in KINDS):8g} " + " ".join(f"{totals[k]:6g}" for k in KINDS)
          + f" {totals['read_bytes'] / MB:9.1f} {totals['written_bytes'] / MB:9.1f} {totals['flops'] / 1e9:8.2f} {grid:>13s}"
          f" {totals['device_s'] * 1e6:11.1f}")
    print(f"once per window (not in the rows above): forward {r['once_per_window']['forward']:g} launches, "
          f"backward {r['once_per_window']['backward']:g}")
    print("\nper kernel, per step (min grid: the smallest Triton grid, in programs):")
    print(f"{'phase':9s} {'kind':6s} {'name':28s} {'dtype':18s} {'launches':>8s} {'read MB':>9s} {'write MB':>9s} "
          f"{'GFLOP':>8s} {'min grid':>8s} {'roofline us':>11s}")
    for k in (k for k in r["kernels"] if k["count"]):
        print(f"{k['phase']:9s} {k['kind']:6s} {k['name']:28s} {k['dtype']:18s} {k['count']:8g} {k['read'] / MB:9.2f} "
              f"{k['written'] / MB:9.2f} {k['flops'] / 1e9:8.3f} {int(k['programs']) or '-':>8} {k['seconds'] * 1e6:11.2f}")
    for p in PHASES:
        rest = [k for k in r["kernels"] if k["phase"] == p and not k["count"]]
        print(f"{p:9s} {'':6s} {'once-per-window ops, per token':47s} {0:8g} {sum(k['read'] for k in rest) / MB:9.2f} "
              f"{sum(k['written'] for k in rest) / MB:9.2f} {sum(k['flops'] for k in rest) / 1e9:8.3f} {'-':>8s} "
              f"{sum(k['seconds'] for k in rest) * 1e6:11.2f}")
    tps = r["tokens_per_s"]
    print(f"\nroofline, one {hw.name} ({hw.bytes_per_s / 1e12:.1f} TB/s, {hw.flops_per_s['bfloat16'] / 1e12:.0f} TFLOP/s bf16, "
          f"{hw.flops_per_s['float32'] / 1e12:.0f} fp32; per launch {hw.eager_launch_s * 1e6:g} us eager, "
          f"{hw.graph_launch_s * 1e6:g} us in a graph): a step of batch {r['batch']} takes "
          f"{r['batch'] / tps['eager'] * 1e6:.1f} us eager, {r['batch'] / tps['graph'] * 1e6:.1f} us replayed: "
          f"{tps['eager'] / 1e3:.1f}K tok/s eager, {tps['graph'] / 1e3:.1f}K tok/s with CUDA graphs")
    sch = r["schedule"]
    print(f"schedule: the step's launches on the {sch['streams']} stream{'s' * (sch['streams'] > 1)} they run on, "
          f"overlapping where they may (bench/schedule.py): forward {sch['phases']['forward'] * 1e6:.1f} us + backward "
          f"{sch['phases']['backward'] * 1e6:.1f} us; each kernel's time one after another, as counted per kernel: "
          f"{r['batch'] / tps['serial'] * 1e6:.1f} us ({tps['serial'] / 1e3:.1f}K tok/s)")
    f = r["memory_floor"]
    if f:
        mem = r["memory_bytes_per_token"]
        print(f"memory ({r['memory_form']} form, chunk {r['chunk']}): its launches move {mem['forward'] / MB:.2f} MB per token "
              f"forward + {mem['backward'] / MB:.2f} MB backward = {(mem['forward'] + mem['backward']) / MB:.2f} MB "
              f"({r['memory_kernels_us']:.1f} us of the step at the roofline)")
        print(f"M-traffic floor of the {f['form']} form: M {f['m_bytes'] / MB:.3g} MB per sequence (float32"
              + (", its per-step reads from a bf16 copy" if f["reads"] == "bf16" else "") + "), "
              f"{f['forward_bytes_per_token'] / MB:.3g} MB per token forward + {f['backward_bytes_per_token'] / MB:.3g} MB "
              f"backward -> {f['tokens_per_s'] / 1e3:.1f}K tok/s; graph estimate / floor: {r['graph_over_floor']:.2f}")
    if r["overlap_what_if"]:
        print("with launches on a second stream and no wait between the streams (optimistic, for planning: "
              + "; ".join(f"{name}: {o['seconds'] * 1e6:.1f} us, {o['tokens_per_s'] / 1e3:.1f}K tok/s"
                          for name, o in r["overlap_what_if"].items()) + ")")
    w = r["weight_floor"]
    if w:
        print(f"weight floor: {w['bytes_per_step'] / MB:.1f} MB per step whatever the batch (the loop's weights, read "
              f"each way; the weight gradients) = {w['seconds'] * 1e6:.1f} us; with M's bytes: {w['tokens_per_s'] / 1e3:.1f}K "
              f"tok/s at batch {r['batch']}")
    pm = r["peak_memory"]
    if pm:
        print(f"peak memory, batch {r['batch']} x {r['seq_len']}: {pm['total'] / 1e9:.1f} GB ("
              + ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.1f}" for k, v in pm.items() if k != "total")
              + "); an H200 holds 141 GB")
    b = r["baseline"]
    if b:
        print("baseline " + baseline_line(b))
        o = r["over_baseline"]
        print(f"GPN estimate / Transformer++ (tuned): {o['tuned']:.3f} (against it as launched, eager: {o['eager']:.3f}; "
              f"against its GEMMs and attention alone: {o['gemm_attention']:.3f})")


def print_batches(results: list[dict]) -> None:
    """What each batch buys: GPN+M's estimate per GPU beside its floors, Transformer++'s, the ratio."""
    print("\nper batch (tokens/s per GPU; floors: the weight floor with M's bytes, M's bytes alone):")
    print(f"{'batch':>6s} {'GPN+M':>9s} {'weights+M':>10s} {'M floor':>9s} {'Transformer++':>14s} {'ratio':>6s} "
          f"{'peak GB':>8s}")
    for r in results:
        w, f, b, pm = r["weight_floor"], r["memory_floor"], r["baseline"], r["peak_memory"]
        cell = lambda v: f"{v / 1e3:8.1f}K" if v else f"{'-':>9s}"  # noqa: E731
        print(f"{r['batch']:6d} {cell(r['tokens_per_s']['graph'])} {cell(w and w['tokens_per_s']):>10s} "
              f"{cell(f and f['tokens_per_s'])} {cell(b and b['tokens_per_s']):>14s} "
              f"{(r['over_baseline'] or {}).get('tuned', float('nan')):6.3f} {pm['total'] / 1e9 if pm else float('nan'):8.1f}")


def baseline_line(b: dict) -> str:
    return (f"{b['config']}: a window of {b['batch']:g} x {b['seq_len']} tokens at the {b['hardware']} roofline, tuned "
            f"(elementwise work fused, FlashAttention-2): {b['launches']:g} launches, {b['bytes'] / 1e9:.1f} GB, "
            f"{b['flops'] / 1e12:.1f} TFLOP, {b['graph_s'] * 1e3:.1f} ms -> {b['tokens_per_s'] / 1e3:.1f}K tok/s "
            f"(as launched, eager: {b['eager']['launches']:g} launches, {b['eager']['tokens_per_s'] / 1e3:.1f}K; "
            f"GEMMs and attention alone: {b['gemm_attention_tokens_per_s'] / 1e3:.1f}K)")


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value model config overrides")
    p.add_argument("--config", default="gpn_m_130m_1l", help="a configs/models name or a model YAML file")
    p.add_argument("--batch", default="32", help="the batch to report, or several comma-separated (one measurement, "
                   "each extrapolated; --json then holds a list of reports)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="bf16: autocast (state and M stay float32)")
    p.add_argument("--kernel", choices=["triton", "torch"], default="triton", help="the fused core's step kernels")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", help="the two window lengths T whose difference, per step, is one step's cost (default: "
                   "1 and core_chunk + 1: a whole chunk's steps)")
    p.add_argument("--measure-batches", help="two batches to measure and extrapolate from (default: 2,3 on CPU, "
                   "--batch on CUDA)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--baseline", default="transformer_130m",
                   help="a Transformer++ config counted the same way, whose estimate the GPN's is compared with ('none': skip)")
    p.add_argument("--baseline-seq-len", type=int, default=2048, help="the baseline's window length")
    p.add_argument("--contexts", help="the baseline at these window lengths too, comma-separated, each at as many tokens "
                   "per step as --batch x --baseline-seq-len (e.g. 2048,8192,32768,131072)")
    p.add_argument("--seq-len", type=int, default=2048, help="the training window whose peak memory is estimated")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h200", help="the roofline's GPU")
    p.add_argument("--save-launches", help="write the counted windows' launches here (JSON)")
    p.add_argument("--launches", help="report from launches saved by --save-launches instead of counting (the same "
                   "config, overrides, dtype and kernel)")
    args = p.parse_args(argv)

    def ints(flag, text, n):
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if len(values) not in n or min(values) < 1:
            p.error(f"{flag}: expected {' or '.join(map(str, n))} comma-separated positive integers, got {text!r}")
        return values

    if args.steps is not None:
        args.steps = ints("--steps", args.steps, (2,))
        if args.steps[0] >= args.steps[1]:
            p.error(f"--steps: expected two lengths, the shorter first, got {args.steps}")
    args.contexts = ints("--contexts", args.contexts, range(1, 9)) if args.contexts else []
    args.batches = ints("--batch", args.batch, range(1, 13))
    args.batch = args.batches[0]
    if args.device != "cpu" and len(args.batches) > 1:
        p.error("--batch: one batch on a GPU (it is measured there, not extrapolated)")
    default = "2,3" if args.device == "cpu" else str(args.batch)
    args.measure_batches = ints("--measure-batches", args.measure_batches or default, (1, 2))
    if len(set(args.measure_batches)) != len(args.measure_batches) or (len(args.measure_batches) == 1 and args.measure_batches[0] != args.batch):
        p.error(f"--measure-batches: expected two different batches, or --batch ({args.batch}) alone")
    return args


def gpn_config(args):
    """The config counted: core fused, the chosen kernels, loops launched one by one (a graph's
    replay launches nothing the counter could see), the memory in the form a GPU runs."""
    from gpn_scale.config import model_config, parse_overrides

    cfg = model_config(args.config, parse_overrides(args.overrides))
    if getattr(cfg, "family", None) not in ("gpn", "gpn_m"):
        raise SystemExit(f"error: {args.config}: family: step_cost counts the GPN / GPN+M fused core, got {cfg.family!r}")
    cfg = dataclasses.replace(cfg, core="fused", kernel=args.kernel, cuda_graphs=False)
    if cfg.memory:
        cfg = dataclasses.replace(cfg, memory_form=cfg.memory_form_on("cuda"))
    return cfg


def build(args):
    """The model of the config (`gpn_config`), on the device."""
    from gpn_scale.models import build_model

    cfg = gpn_config(args)
    torch.manual_seed(0)
    return build_model(cfg).to(args.device), cfg


def baseline_contexts(args, count: BaselineCount, batch: int, hw: Hardware) -> list[dict]:
    """The baseline at each of --contexts, as many tokens per step as `batch` windows of the counted length."""
    tokens = batch * count.seq_len
    return [baseline_window(count, tokens / T, hw, T) for T in args.contexts]


def run(args) -> list[dict]:
    """The reports of the command line's `args` (see parse_args), one per batch."""
    hw = HARDWARE[args.hardware]
    if args.threads:
        torch.set_num_threads(args.threads)
    from gpn_scale.config import model_config, parse_overrides

    if getattr(model_config(args.config, parse_overrides(args.overrides)), "family", None) == "transformer":
        args.baseline = args.config
        count = baseline_tallies(args)
        return [dict(config=args.config, baseline=baseline_window(count, b, hw),
                     contexts=baseline_contexts(args, count, b, hw)) for b in args.batches]
    model, cfg = build(args)
    params = sum(p.numel() for p in model.parameters())
    if args.launches:
        runs, steps = load_launches(args.launches)
        args.steps, args.measure_batches = list(steps), sorted(runs)
    else:
        if args.steps is None:
            args.steps = [1, cfg.core_chunk + 1]
        runs = measure(model, args.measure_batches, tuple(args.steps), args.dtype, torch.device(args.device))
        if args.save_launches:
            save_launches(args.save_launches, runs, args.steps)
    costs = costs_of(runs, tuple(args.steps))
    count = None if args.baseline == "none" else baseline_tallies(args)
    reports = []
    for b in args.batches:
        baseline = None if count is None else baseline_window(count, b, hw)
        r = report(args, cfg, b, costs, hw, baseline, runs, params)
        if count is not None:
            r["contexts"] = baseline_contexts(args, count, b, hw)
        reports.append(r)
    return reports


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernel == "triton" and args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    from gpn_scale.errors import UserError
    from kernels.streams import CPU_STREAMS_ENV

    # On CPU the fused core's streams as on a GPU, in the stand-in the counter observes (for this
    # command only: a caller's later models keep their one stream).
    before = os.environ.get(CPU_STREAMS_ENV)
    if args.device == "cpu":
        os.environ[CPU_STREAMS_ENV] = "1"
    try:
        results = run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if before is None:
            os.environ.pop(CPU_STREAMS_ENV, None)
        else:
            os.environ[CPU_STREAMS_ENV] = before
    for i, result in enumerate(results):
        if i:
            print()
        if "kernels" in result:
            print_report(result, HARDWARE[args.hardware])
        else:
            print(baseline_line(result["baseline"]))
        for c in result.get("contexts", []):
            print("  at another context: " + baseline_line(c))
    if len(results) > 1 and "kernels" in results[0]:
        print_batches(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if len(results) == 1 else results, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
