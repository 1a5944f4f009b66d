"""A second stream beside the fused core's main one, ordered by events.

The reverse sweep's once-per-chunk weight gradients (GEMMs over the chunk's rows) need nothing of
the next chunk's sweep, so they can run on a side stream while the main stream goes on. `Lanes`
is what the core asks for that:

    lanes.fork()            # the side stream waits for everything issued on the main one so far
    with lanes.side(): ...  # launches on the side stream
    event = lanes.record()  # the current stream's position
    lanes.wait(event)       # the current stream waits for it
    lanes.join()            # the main stream waits for everything issued on the side one

Implementations, by device (`lanes_for`):

- `CudaLanes`: a torch.cuda side stream and events; under CUDA graph capture the fork and the
  join are the graph's fork and join, so a replay runs both branches concurrently.
- `CpuLanes` (GPN_SCALE_CPU_STREAMS=1; tests and bench/step_cost.py): the stand-in. CPU ops run
  when they are called, in program order, so results are exactly those of one stream; what it
  adds is a GPU's ordering rule, checked. Every torch op launched on one stream that touches a
  storage another stream wrote, or writes one another stream read or wrote, must be ordered after
  that launch by a fork, an event wait or a join; otherwise it raises `StreamRaceError` naming
  both launches and the storage (vector clocks, as race detectors keep them). A fresh output is a
  new allocation: at the address of memory its own stream made and another stream still used, it
  is the reuse CUDA's caching allocator would make, and a race too. Torch ops and
  Triton launches (the interpreter's) are seen between fork and join, the C++ CPU kernels are not:
  the checks run with the torch twins or Triton's kernels. `observer` lets a launch counter see
  the streams.
- `OneLane`: no side stream (CPU by default): `side()` runs on the main stream, events do nothing.

Safe use of memory across the streams, as CUDA's caching allocator needs it: a tensor made on the
main stream and read on the side one is kept alive until the main stream has waited for the side
stream's event after its last use; tensors made on the side stream stay there.
"""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import launches

CPU_STREAMS_ENV = "GPN_SCALE_CPU_STREAMS"
MAIN, SIDE = 0, 1


class Lanes(Protocol):
    concurrent: bool

    def fork(self) -> None: ...
    def side(self) -> contextlib.AbstractContextManager: ...
    def record(self): ...
    def wait(self, event) -> None: ...
    def join(self) -> None: ...


class OneLane:
    """Everything on one stream: the single-stream schedule."""

    concurrent = False  # whether the side stream can run beside the main one

    def fork(self) -> None:
        pass

    def side(self):
        return contextlib.nullcontext()

    def record(self):
        return None

    def wait(self, event) -> None:
        pass

    def join(self) -> None:
        pass


class CudaLanes:
    """A side stream of the current device, made on first use (outside a graph's capture: the
    first call of a graphed loop runs eagerly)."""

    concurrent = True

    def __init__(self):
        self.stream = None

    def fork(self) -> None:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())

    def side(self):
        return torch.cuda.stream(self.stream)

    def record(self):
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event) -> None:
        torch.cuda.current_stream().wait_event(event)

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


class StreamRaceError(RuntimeError):
    """A launch on one stream touched data of another stream's launch without an event between them."""


class CpuLanes:
    """The stand-in (module docstring). `observer`, if set, is told of every fork, record, wait
    and join (`observer.stream_event(kind, token)`) and asked for the launch a recorded event
    stands for; `current` is the stream launches go to now."""

    concurrent = True

    def __init__(self, check: bool = True):
        self.check, self.current, self.observer = check, MAIN, None
        self._clock = {MAIN: {MAIN: 0, SIDE: 0}, SIDE: {MAIN: 0, SIDE: 0}}
        self._history: dict[int, tuple] = {}  # storage -> (last write (stream, tick, op), {stream: (tick, op)} reads since)
        self._mode = None

    # ordering
    def _merge(self, into: int, clock: dict) -> None:
        self._clock[into] = {s: max(t, clock[s]) for s, t in self._clock[into].items()}

    def fork(self) -> None:
        # Everything before a fork was joined: ordered before everything after it.
        self._history.clear()
        self._merge(SIDE, self._clock[MAIN])
        self._tell("fork", None)
        if self.check and self._mode is None:
            self._mode = _Accesses(self)
            self._mode.__enter__()

    @contextlib.contextmanager
    def side(self):
        before, self.current = self.current, SIDE
        try:
            yield
        finally:
            self.current = before

    def record(self):
        token = self._tell("record", None)
        return dict(self._clock[self.current]), token

    def wait(self, event) -> None:
        clock, token = event
        self._merge(self.current, clock)
        self._tell("wait", token)

    def join(self) -> None:
        self._merge(MAIN, self._clock[SIDE])
        self._tell("join", None)
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _tell(self, kind: str, token):
        return None if self.observer is None else self.observer.stream_event(kind, token)

    # the check
    def access(self, op: str, reads: list, writes: list, fresh: list) -> None:
        """A launch on the current stream reading `reads`, writing `writes` (existing data) and
        `fresh` (new outputs): storage addresses."""
        s = self.current
        self._clock[s][s] += 1
        tick = self._clock[s][s]
        for ptr in reads:
            _, write, _ = self._history.get(ptr, (s, None, {}))
            self._ordered(op, ptr, write, "reads what", "wrote")
        for ptr in writes:
            self._unordered_uses(op, ptr, "overwrites what")
        for ptr in fresh:
            # CUDA's allocator hands a freed block only to the stream that made it, as soon as the
            # host frees it: a block of this stream's that another stream still used is a race;
            # one another stream made is an address the CPU's allocator shares, not a reuse.
            alloc, _, _ = self._history.get(ptr, (s, None, {}))
            if alloc == s:
                self._unordered_uses(op, ptr, "reuses the memory of what")
        for ptr in reads:
            alloc, write, reads_since = self._history.get(ptr, (s, None, {}))
            self._history[ptr] = (alloc, write, {**reads_since, s: (tick, op)})
        for ptr in writes:
            alloc, _, _ = self._history.get(ptr, (s, None, {}))
            self._history[ptr] = (alloc, (s, tick, op), {})
        for ptr in fresh:
            self._history[ptr] = (s, (s, tick, op), {})

    def _unordered_uses(self, op, ptr, verb) -> None:
        _, write, reads_since = self._history.get(ptr, (self.current, None, {}))
        self._ordered(op, ptr, write, verb, "wrote")
        for r_stream, (r_tick, r_op) in reads_since.items():
            self._ordered(op, ptr, (r_stream, r_tick, r_op), verb, "read")

    def _ordered(self, op, ptr, then, verb, past) -> None:
        if then is None:
            return
        stream, tick, other = then
        if stream != self.current and self._clock[self.current][stream] < tick:
            raise StreamRaceError(f"stream {self.current}: {op} {verb} {other} on stream {stream} {past} "
                                  f"(storage {ptr:#x}) with no event between them")


class _Accesses(TorchDispatchMode):
    """Tells the stand-in what each torch op and each Triton launch reads and writes. A Triton
    launch (Triton's interpreter on CPU) reads its tensor arguments and writes those whose
    contents it changed; the torch ops the interpreter runs inside a launch (its host copies,
    which write back every argument) are not the kernel's accesses and are not told."""

    _ALLOCATE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}  # memory, no kernel
    _SKIP = {"detach", "alias", "lift_fresh", "_unsafe_view", "_reshape_alias", "_local_scalar_dense", "set_", "resize_"}

    def __init__(self, lanes: CpuLanes):
        super().__init__()
        self.lanes, self._watch = lanes, None

    def __enter__(self):
        self._watch = launches.watching(self._on_triton)
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._watch.__exit__(None, None, None)
        return super().__exit__(*exc)

    def _on_triton(self, x: launches.TritonLaunch) -> None:
        self.lanes.access(x.name, [_ptr(t) for t in x.tensors], [_ptr(t) for t, c in zip(x.tensors, x.changed) if c], [])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if launches.in_launch() or func.is_view or name in self._SKIP:
            return out
        if name in self._ALLOCATE:
            self.lanes.access(name, [], [], [_ptr(out)] if _ptr(out) else [])
            return out
        reads, writes = [], []
        for i, a in enumerate(func._schema.arguments):
            value = kwargs[a.name] if a.name in kwargs else args[i] if i < len(args) and not a.kwarg_only else None
            for t in launches.tensors(value):
                (writes if a.alias_info is not None and a.alias_info.is_write else reads).append(_ptr(t))
        touched = set(reads) | set(writes)  # an output in an input's storage (_unsafe_view, out=) is no new allocation
        fresh = [_ptr(t) for t in launches.tensors(out) if _ptr(t) not in touched]
        self.lanes.access(name, [p for p in reads if p], [p for p in writes if p], [p for p in fresh if p])
        return out


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


_CPU_LANES: CpuLanes | None = None


def cpu_lanes() -> CpuLanes:
    """The process's stand-in: one, so that a launch counter can observe the streams a model uses."""
    global _CPU_LANES
    if _CPU_LANES is None:
        _CPU_LANES = CpuLanes()
    return _CPU_LANES


def lanes_for(device_type: str) -> Lanes:
    """CUDA's streams on CUDA; on CPU the checking stand-in when GPN_SCALE_CPU_STREAMS=1, else one
    stream."""
    if device_type == "cuda":
        return CudaLanes()
    if device_type == "cpu" and os.environ.get(CPU_STREAMS_ENV) == "1":
        return cpu_lanes()
    return OneLane()
