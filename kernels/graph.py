"""CUDA-graph capture of the fused core's time loops.

The fused core's forward is T steps of a fixed sequence of kernels (GEMM, elementwise group,
memory kernel, ...), its reverse sweep the same backwards; launched from Python, each step
costs more in dispatch and launch latency than on the GPU. `Graphed` captures a whole loop once
per input signature and replays it: the first call of a signature runs eagerly (compiling the
Triton kernels, initialising cuBLAS), the second captures, later calls copy their inputs into
the graph's static inputs and replay.

What a graph returns lives in the graph's memory pool and is overwritten by its next replay:
callers consume it (or clone what they keep) before calling again. The fused core's forward
graph returns its saved buffers, which the backward graph reads in place: they are `fixed`
arguments, the same objects at every call, never copied.
"""

from __future__ import annotations

import warnings
import weakref

import torch


def signature(*xs) -> tuple:
    """Shapes, strides and dtypes of tensors (None kept as None): what a graph is specialised to."""
    return tuple(None if x is None else (tuple(x.shape), x.stride(), x.dtype, x.device) for x in xs)


class Graphed:
    """`fn(*fixed, *copied)` captured as one CUDA graph per key and replayed.

    If a capture fails (an op that cannot be captured), the key falls back to eager calls with a
    warning naming the error, and `stats` counts it; running out of memory is raised as it is.
    """

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name
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
        if any(a is not b for a, b in zip(fixed, fixed_then)):
            raise RuntimeError(f"{self.name}: a fixed argument changed between replays of a CUDA graph")
        for s, x in zip(static, copied):
            if s is not None:
                s.copy_(x)
        graph.replay()
        self.stats["replayed"] += 1
        self.replays[key] = self.replays.get(key, 0) + 1
        return out

    def _capture(self, key, fixed, copied):
        static = tuple(None if x is None else x.clone() for x in copied)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            # thread_local: other threads (data loaders, loggers) may use CUDA while the
            # autograd thread captures the backward.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.fn(*fixed, *static)
        except torch.cuda.OutOfMemoryError:  # not a capture problem: the caller decides (smaller batch)
            raise
        except RuntimeError as e:
            warnings.warn(f"{self.name}: CUDA graph capture failed, running eagerly: {str(e).splitlines()[0]}", RuntimeWarning)
            self.entries[key] = "eager"
            self.stats["failed"] += 1
            return None
        self.stats["captured"] += 1
        entry = self.entries[key] = (graph, fixed, static, out)
        return entry


class CoreGraphs:
    """The graphed forward and backward loops of one model's fused core."""

    def __init__(self, forward_fn, backward_fn):
        self.forward = Graphed(forward_fn, "fused core forward")
        self.backward = Graphed(backward_fn, "fused core backward")


_PER_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def core_graphs(model, forward_fn, backward_fn) -> CoreGraphs:
    """The model's graphs, made on first use; they (and their memory pools) go with the model."""
    graphs = _PER_MODEL.get(model)
    if graphs is None:
        graphs = _PER_MODEL[model] = CoreGraphs(forward_fn, backward_fn)
    return graphs


def graphs_of(model) -> CoreGraphs | None:
    """The model's graphs, if its fused core has run with them."""
    return _PER_MODEL.get(model)


def release(model) -> None:
    """Drop the model's graphs and their memory pools (before retrying at another shape)."""
    _PER_MODEL.pop(model, None)
