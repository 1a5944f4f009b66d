"""Graph capture of the fused core's time loops.

The fused core's forward is T steps of a fixed sequence of kernels (GEMM, elementwise group,
memory kernel, ...), its reverse sweep the same backwards; launched from Python, each step
costs more in dispatch and launch latency than on the GPU. `Graphed` captures a whole loop once
per input signature and replays it: the first call of a signature runs eagerly (compiling the
Triton kernels, initialising cuBLAS), the second captures, later calls copy their inputs into
the graph's static inputs and replay.

What a graph returns lives in the graph's memory and is overwritten by its next replay: callers
consume it, or copy what they keep, before calling again. The fused core's forward graph returns
its saved buffers, which the backward graph reads in place: they are `fixed` arguments, read
where they were at capture, never copied.

Capture goes through a `GraphFactory`: `CudaGraphs` on CUDA; `CpuGraphs`, a stand-in with a
CUDA graph's semantics, lets the test suite run the graph path on CPU (switched on by the
environment variable GPN_SCALE_CPU_GRAPHS=1, for tests only: it is slower than no graphs).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref
from typing import Any, Callable, Protocol

import torch

CPU_GRAPHS_ENV = "GPN_SCALE_CPU_GRAPHS"


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphFactory(Protocol):
    """Captures `fn(*args)`; returns the graph and fn's outputs, which every replay rewrites."""

    def capture(self, fn: Callable, args: tuple) -> tuple[Graph, Any]: ...


class CudaGraphs:
    """torch.cuda.CUDAGraph: kernels recorded once, replayed without Python."""

    def capture(self, fn, args):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        # thread_local: other threads (data loaders, loggers) may use CUDA while the autograd
        # thread captures the backward.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn(*args)
        return graph, out


class CpuGraph:
    """What a CUDA graph does to the memory its caller sees, on CPU.

    Capture records fn and the buffers it reads (`args`: the static inputs and the fixed
    arguments, read wherever they are at replay time); it runs nothing that the caller can see:
    the outputs it returns hold NaN until the first replay. Replay runs fn again on those buffers
    and writes the results into the same output tensors, overwriting whatever a caller kept of the
    previous replay. Outputs that alias an input stay the input.
    """

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.out = fn(*args)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors(args)}
        for t in _tensors(self.out):
            if t.is_floating_point() and t.untyped_storage().data_ptr() not in inputs:
                t.data.fill_(float("nan"))

    def replay(self) -> None:
        _copy_into(self.out, self.fn(*self.args))


class CpuGraphs:
    def capture(self, fn, args):
        graph = CpuGraph(fn, args)
        return graph, graph.out


def factory_for(device_type: str) -> GraphFactory | None:
    """How loops on a device are captured: CUDA graphs on CUDA, the CPU stand-in on CPU when
    GPN_SCALE_CPU_GRAPHS=1 (tests), else None (loops run eagerly)."""
    if device_type == "cuda":
        return CudaGraphs()
    if device_type == "cpu" and os.environ.get(CPU_GRAPHS_ENV) == "1":
        return CpuGraphs()
    return None


def _tensors(x):
    """The tensors in a nest of tuples, lists, dicts and dataclasses, in order."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name))


def _copy_into(old, new) -> None:
    """Writes the tensors of `new` into those of `old`, a nest of the same structure."""
    old_t, new_t = list(_tensors(old)), list(_tensors(new))
    if len(old_t) != len(new_t):
        raise RuntimeError(f"CPU graph: a replay returned {len(new_t)} tensors, the capture {len(old_t)}")
    for o, n in zip(old_t, new_t):
        if o is not n:
            o.data.copy_(n)  # behind autograd's back, as a replay is: no version counter moves


def signature(*xs) -> tuple:
    """Shapes, strides and dtypes of tensors (None kept as None): what a graph is specialised to."""
    return tuple(None if x is None else (tuple(x.shape), x.stride(), x.dtype, x.device) for x in xs)


def _same(then, now) -> bool:
    """Whether a fixed argument is what the graph was captured with: tensors (and anything that
    holds them) must be the same objects, since the graph reads their memory; plain values
    (a config, a number) may be equal copies."""
    if then is now:
        return True
    if any(True for _ in _tensors(then)) or any(True for _ in _tensors(now)):
        return False
    try:
        return type(then) is type(now) and hash(then) == hash(now) and then == now
    except TypeError:  # unhashable: mutable, so only the same object is the same
        return False


class Graphed:
    """`fn(*fixed, *copied)` captured as one graph per key and replayed.

    If a capture fails (an op that cannot be captured), the key falls back to eager calls with a
    warning naming the error, and `stats` counts it; running out of memory is raised as it is.
    """

    def __init__(self, fn, name: str, factory: GraphFactory):
        self.fn, self.name, self.factory = fn, name, factory
        self.entries: dict = {}
        self.replays: dict = {}  # per key: how many times its graph has run (0 before it has one)
        self.stats = {"eager": 0, "captured": 0, "replayed": 0, "failed": 0}

    def __call__(self, key, fixed: tuple, copied: tuple):
        entry = self.entries.get(key)
        if entry is None or entry == "eager":
            self.entries[key] = entry or "warm"
            self.stats["eager"] += 1
            return self.fn(*fixed, *copied)
        if entry == "warm":
            entry = self._capture(key, fixed, copied)
            if entry is None:
                return self(key, fixed, copied)
        graph, fixed_then, static, out = entry
        for i, (then, now) in enumerate(zip(fixed_then, fixed)):
            if not _same(then, now):
                raise RuntimeError(f"{self.name}: fixed argument {i} is not the one its graph was captured with "
                                   f"({type(now).__name__}); pass the same buffers, or run without graphs")
        for s, x in zip(static, copied):
            if s is not None:
                s.copy_(x)
        graph.replay()
        self.stats["replayed"] += 1
        self.replays[key] = self.replays.get(key, 0) + 1
        return out

    def _capture(self, key, fixed, copied):
        static = tuple(None if x is None else x.clone() for x in copied)
        try:
            graph, out = self.factory.capture(self.fn, (*fixed, *static))
        except torch.cuda.OutOfMemoryError:  # not a capture problem: the caller decides (smaller batch)
            raise
        except RuntimeError as e:
            warnings.warn(f"{self.name}: graph capture failed, running eagerly: {str(e).splitlines()[0]}", RuntimeWarning)
            self.entries[key] = "eager"
            self.stats["failed"] += 1
            return None
        self.stats["captured"] += 1
        entry = self.entries[key] = (graph, fixed, static, out)
        return entry


class CoreGraphs:
    """The graphed forward and backward loops of one model's fused core."""

    def __init__(self, forward_fn, backward_fn, factory: GraphFactory):
        self.forward = Graphed(forward_fn, "fused core forward", factory)
        self.backward = Graphed(backward_fn, "fused core backward", factory)

    def summary(self) -> str:
        """e.g. "forward 1 eager, 1 captured, 22 replayed, 0 failed; backward ..."."""
        return "; ".join(f"{g.name.split()[-1]} " + ", ".join(f"{n} {k}" for k, n in g.stats.items())
                         for g in (self.forward, self.backward))


_PER_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def core_graphs(model, forward_fn, backward_fn, factory: GraphFactory) -> CoreGraphs:
    """The model's graphs, made on first use; they (and their memory pools) go with the model."""
    graphs = _PER_MODEL.get(model)
    if graphs is None:
        graphs = _PER_MODEL[model] = CoreGraphs(forward_fn, backward_fn, factory)
    return graphs


def graphs_of(model) -> CoreGraphs | None:
    """The model's graphs, if its fused core has run with them."""
    return _PER_MODEL.get(model)


def release(model) -> None:
    """Drop the model's graphs and their memory pools (before retrying at another shape)."""
    _PER_MODEL.pop(model, None)
