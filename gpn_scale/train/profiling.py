"""Looking inside a run (docs/train.md, 'Looking inside a run'): a torch.profiler trace of chosen
optimiser steps (`profile.steps`), and on CUDA the allocator's history dumped as a memory snapshot
at a chosen step and at an out-of-memory (`profile.memory_snapshot_step`). Each rank writes its own
files into `run.dir/profile/`.

Traces are Chrome trace JSON (`rank{r}.{ms}.pt.trace.json`, torch.profiler's
`tensorboard_trace_handler`): https://ui.perfetto.dev and chrome://tracing open them, and so does
TensorBoard's profiler plugin (`tensorboard --logdir run.dir/profile`). Snapshots are the pickles
https://pytorch.org/memory_viz reads (`torch.cuda.memory._dump_snapshot`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

PROFILE_DIR = "profile"
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept (the newest): enough for many steps of a large model


def profile_dir(run_dir: Path) -> Path:
    return Path(run_dir) / PROFILE_DIR


def memory_snapshot_refusal(memory_snapshot_step: int | None, cuda: bool) -> str | None:
    """Why `profile.memory_snapshot_step` cannot be honoured here (it records CUDA's allocator), or None."""
    if memory_snapshot_step is None or cuda:
        return None
    return (f"profile.memory_snapshot_step: {memory_snapshot_step} records CUDA's allocator, and this run has no CUDA "
            "device (it trains on the CPU); remove it, or set profile.memory_snapshot_step=null")


def section(name: str):
    """A named range in the trace (data_wait, forward, backward, optimizer_step); nearly free when no
    profiler records."""
    return torch.profiler.record_function(name)


class StepProfiler:
    """Traces optimiser steps `first`..`last` of this launch on this rank: `begin(step)` before a
    step runs, `end(step)` after it. A launch that starts after `first` (a resume) traces the steps
    of the range it runs; one that ends inside it (a stop, a divergence) writes what it recorded at
    `close()`."""

    def __init__(self, steps: list[int], run_dir: Path, rank: int, cuda: bool):
        self.first, self.last = steps if steps else (None, None)
        self.out = profile_dir(run_dir)
        self.rank = rank
        self.cuda = cuda
        self.profiler = None
        self.step_range = None

    def begin(self, step: int) -> None:
        if self.profiler is None:
            if self.first is None or not self.first <= step <= self.last:
                return
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            self.out.mkdir(parents=True, exist_ok=True)
            if not self.cuda:  # torch built for CUDA on a machine without a GPU: no "gpuGetDeviceCount failed" line
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True,
                                    on_trace_ready=tensorboard_trace_handler(str(self.out),
                                                                             worker_name=f"rank{self.rank}"))
            self.profiler.start()
        # each optimiser step a `ProfilerStep#N` range in the trace, N the run's step (as torch's scheduled
        # profiler names its steps)
        self.step_range = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.step_range.__enter__()

    def end(self, step: int) -> None:
        if self.profiler is None:
            return
        self.step_range.__exit__(None, None, None)
        self.step_range = None
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stops recording and writes the trace (on_trace_ready)."""
        if self.profiler is not None:
            if self.step_range is not None:  # a step that did not end (the run stopped inside it)
                self.step_range.__exit__(None, None, None)
                self.step_range = None
            profiler, self.profiler = self.profiler, None
            profiler.stop()


class MemorySnapshots:
    """CUDA's allocator history, recorded from the launch's start (`start()`) to its end, dumped at
    the end of optimiser step `step` and, whatever the step, at an out-of-memory: `oom(step)`."""

    def __init__(self, step: int | None, run_dir: Path, rank: int):
        self.step = step
        self.out = profile_dir(run_dir)
        self.rank = rank
        self.recording = False

    def start(self) -> None:
        if self.step is None or not torch.cuda.is_available():
            return
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self.recording = True

    def _dump(self, name: str) -> Path | None:
        if not self.recording:
            return None
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"memory_rank{self.rank}_{name}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def after_step(self, step: int) -> Path | None:
        return self._dump(f"step{step}") if step == self.step else None

    def oom(self, step: int) -> None:
        """At an out-of-memory in optimiser step `step`: the snapshot, named on stderr (the error follows)."""
        with contextlib.suppress(Exception):  # the error the run ends with matters more than the dump
            path = self._dump(f"oom_step{step}")
            if path is not None:
                print(f"rank {self.rank}: out of memory in step {step}: memory snapshot {path}", file=sys.stderr,
                      flush=True)

    def close(self) -> None:
        if self.recording:
            self.recording = False
            torch.cuda.memory._record_memory_history(enabled=None)
