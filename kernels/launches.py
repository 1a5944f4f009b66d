"""Triton launches seen from the host: the kernel, its grid, its tensor arguments and which of them
it changed. The streams' CPU stand-in (kernels/side_streams.py) checks them against the other stream;
bench/step_cost.py counts them.

    with watching(on_launch):     # on_launch(TritonLaunch) after every launch
        ...

One patch of Triton's launchers (`JITFunction.run`, and the interpreter's, which `triton.jit`
builds under TRITON_INTERPRET=1) serves every watcher at once: the arguments are copied once
before the launch and compared after it, and `in_launch()` is true meanwhile, so the torch ops a
launch runs itself (the interpreter's host copies, which write every argument back, and the copies
made here) are not taken for the kernel's own by a TorchDispatchMode that asks.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class TritonLaunch:
    name: str  # the kernel's
    module: str  # where it is defined
    programs: int  # the grid's size
    tensors: list  # its tensor arguments, in order
    changed: list  # per tensor: whether the launch changed its contents


_watchers: list[Callable] = []
_patched: list = []
_inside = False


def in_launch() -> bool:
    """Whether a watched Triton launch is running now (its own torch ops are not its accesses)."""
    return _inside


@contextlib.contextmanager
def watching(on_launch: Callable[[TritonLaunch], None], load: bool = False):
    """Calls on_launch after every Triton launch within the block (watchers may nest). `load`:
    import Triton if nothing has yet (a counter that must not miss the first kernel's launches);
    otherwise a process that has not imported Triton launches no Triton kernel to watch."""
    if load or not _patched:
        for cls in _kernel_classes(load):
            if all(cls is not c for c, _ in _patched):
                _patched.append((cls, cls.run))
                cls.run = _watched(cls.run)
    _watchers.append(on_launch)
    try:
        yield
    finally:
        _watchers.remove(on_launch)
        if not _watchers:
            for cls, run in reversed(_patched):
                cls.run = run
            _patched.clear()


def _watched(original):
    def run(fn, *args, grid, warmup, **kwargs):
        global _inside
        if warmup or _inside:
            return original(fn, *args, grid=grid, warmup=warmup, **kwargs)
        _inside = True
        try:
            if callable(grid):
                grid = grid({**dict(zip(fn.arg_names, args)), **kwargs})
            grid = (grid,) if isinstance(grid, int) else tuple(grid)
            args_t = tensors(list(args) + list(kwargs.values()))
            before = [t.clone() for t in args_t]
            result = original(fn, *args, grid=grid, warmup=warmup, **kwargs)
            changed = [not (bool(((t == b) | (t.isnan() & b.isnan())).all()) if t.is_floating_point() else torch.equal(t, b))
                       for t, b in zip(args_t, before)]
        finally:
            _inside = False
        launch = TritonLaunch(fn.__name__, getattr(getattr(fn, "fn", None), "__module__", ""), math.prod(grid), args_t,
                              changed)
        for on_launch in list(_watchers):
            on_launch(launch)
        return result

    return run


def _kernel_classes(load: bool) -> list:
    """The classes whose `run` launches a Triton kernel, where Triton is imported (or `load`)."""
    if load:
        try:
            import triton.runtime.jit  # noqa: F401
            import triton.runtime.interpreter  # noqa: F401
        except ImportError:  # no Triton: nothing to watch
            return []
    classes = []
    if "triton.runtime.jit" in sys.modules:
        classes.append(sys.modules["triton.runtime.jit"].JITFunction)
    if "triton.runtime.interpreter" in sys.modules:
        classes.append(sys.modules["triton.runtime.interpreter"].InterpretedFunction)
    return classes


def tensors(x) -> list:
    """The tensors in a nest of lists and tuples, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors(y)]
    return []
