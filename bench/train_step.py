"""One training step (forward + backward) of GPN / GPN+M: the naive autograd loop against the fused core.

    PYTHONPATH=. python bench/train_step.py                       # the small GPN+M, CPU, < 3 min
    PYTHONPATH=. python bench/train_step.py --config 130m-1l --batch 1 --seq-len 2048 --cores fused
    PYTHONPATH=. python bench/train_step.py --config configs/models/gpn_m_130m_1l.yaml --device cuda --dtype bf16 --batch 32 --seq-len 2048
    PYTHONPATH=. python bench/train_step.py d_state=512 n_layers=2  # key=value overrides the config

Each core runs in a fresh process, so that one core's allocations cannot hide or inflate the
other's peak, and the processes take turns: one timed step of each per round, so that a slow
spell of a shared machine slows every core alike. Time: the fastest of `--steps` timed steps,
after one untimed first step; the ratio line also gives the spread of the per-round ratios. Peak
memory: on CUDA, torch.cuda.max_memory_allocated above what was allocated before the first
step; on CPU (where torch's allocator keeps no statistics and tracemalloc cannot see it), the
process's peak resident set (ru_maxrss) above its resident set before the first step. Before
that, the kernels the fused core uses are loaded and one step on a 2-token window has run (a
process's first backward allocates ~40 MB once: threads, BLAS buffers, for either core), and
the heap's free pages have been returned (malloc_trim), so the step's gradients still count.

Both cores run under the training loop's garbage-collection policy (gpn_scale/train/gc.py).

Imports only torch (and the model package, which imports only torch, numpy and kernels/).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import torch

from gpn_scale.models import GPN, GPNConfig
from gpn_scale.train.gc import GarbageCollection
from kernels import resolve

PRESETS = {
    # The small GPN+M of the fused core's issue: d 256, F 512, H 4, dk 32, dv 64, V 1024, E 128.
    "small": dict(family="gpn_m", vocab_size=1024, d_state=256, d_emb=128, d_ffn=512, n_layers=1, n_heads=4, d_key=32, d_val=64),
    # configs/models/gpn_m_130m_1l.yaml
    "130m-1l": dict(family="gpn_m", vocab_size=32000, d_state=2496, d_emb=768, d_ffn=6656, n_layers=1, n_heads=15, d_key=128,
                    d_val=256, recompute_every=128),
}


def _scalar(text: str):
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip("'\"")


def load_config(name: str, overrides: list[str]) -> GPNConfig:
    """A preset name or a flat YAML file (configs/models/*.yaml), then key=value overrides."""
    if name in PRESETS:
        fields = dict(PRESETS[name])
    else:
        try:
            import yaml

            with open(name) as f:
                fields = yaml.safe_load(f)
        except ImportError:  # the model configs are flat `key: value  # comment` lines
            fields = {}
            with open(name) as f:
                for line in f:
                    line = line.split("#", 1)[0].strip()
                    if line:
                        key, _, value = line.partition(":")
                        fields[key.strip()] = _scalar(value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: override {item!r}: expected key=value")
        fields[key] = _scalar(value)
    known = set(GPNConfig.field_names())
    unknown = sorted(set(fields) - known)
    if unknown:
        raise SystemExit(f"error: {name}: unknown config keys {unknown}")
    try:
        return GPNConfig(**fields)
    except ValueError as exc:
        raise SystemExit(f"error: {name}: {exc}") from None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim), so that the
    resident set is what is in use; elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_core(args, cfg: GPNConfig) -> None:
    """A worker: one core in this process, driven over stdin/stdout one JSON line at a time.

    After the untimed first step it reports its loss, time and peak memory; then it runs one
    timed step per "step" line it reads, until "done".
    """
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = GPN(dataclasses.replace(cfg, core=args.core)).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    collector = GarbageCollection()  # as the training loop runs its steps

    def step(window=tokens):
        model.zero_grad(set_to_none=True)
        with autocast:
            loss = model(window).loss
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return loss.item()

    kernel = resolve(cfg.kernel, device.type) if args.core == "fused" else "-"  # loaded now: code is not a step's memory
    # A step on a 2-token window first: what a process's first backward allocates once (the
    # autograd engine's threads, the BLAS library's buffers: ~40 MB on CPU, for either core)
    # is not a step's memory either. What it freed (the gradients) goes back to the system, so
    # that the measured step's own allocations count even where they reuse it.
    step(tokens[:, :2])
    model.zero_grad(set_to_none=True)
    if not cuda:
        _return_free_heap()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    t0 = time.perf_counter()
    loss = step()
    first = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - before
    print(json.dumps(dict(core=args.core, kernel=kernel, loss=loss, first_s=first, peak_bytes=peak)), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        t0 = time.perf_counter()
        step()
        print(json.dumps(dict(step_s=time.perf_counter() - t0)), flush=True)
    collector.close()


class Worker:
    """A worker process (`run_core`) seen from the parent."""

    def __init__(self, core: str, argv: list[str]):
        self.core, self.times, self.error = core, [], None
        self.proc = subprocess.Popen([sys.executable, __file__, "--core", core, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.result = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line)
        self.proc.wait()
        stderr = self.proc.stderr.read()
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        oom = "out of memory" in stderr.lower() or self.proc.returncode in (-9, 137)
        self.error = "out of memory" if oom else tail
        return None

    def step(self):
        if self.error is None:
            self.proc.stdin.write("step\n")
            self.proc.stdin.flush()
            out = self._read()
            if out is not None:
                self.times.append(out["step_s"])

    def close(self) -> dict:
        if self.error is None:
            self.proc.stdin.close()
            self.proc.wait()
        if self.error is not None:
            return dict(core=self.core, error=self.error)
        times = self.times or [self.result["first_s"]]
        return dict(self.result, step_s=min(times), times=times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--config", default="small", help=f"a preset ({', '.join(PRESETS)}) or a model YAML file")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast, state and M stay float32")
    parser.add_argument("--cores", default="naive,fused", help="comma-separated cores to compare")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds after the first step (0: time the first)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (0: torch's default); on a shared machine idle OpenMP threads stall against other load")
    parser.add_argument("--core", help=argparse.SUPPRESS)  # set in the worker processes
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)

    if args.core:
        run_core(args, cfg)
        return 0

    passed = list(argv if argv is not None else sys.argv[1:])
    workers = [Worker(core, passed) for core in args.cores.split(",")]
    for _ in range(args.steps):  # in turns: a slow spell of a shared machine hits every core alike
        for w in workers:
            w.step()
    results = [w.close() for w in workers]

    threads = args.threads or torch.get_num_threads()
    print(f"config: {args.config} {cfg.family} d={cfg.d_state} F={cfg.d_ffn} layers={cfg.n_layers}"
          + (f" H={cfg.n_heads} dk={cfg.d_key} dv={cfg.d_val}" if cfg.memory else "")
          + f" V={cfg.vocab_size} E={cfg.d_emb}; batch {args.batch}, T {args.seq_len}; {args.device} {args.dtype}"
          + (f", {threads} thread(s)" if args.device == "cpu" else ""))
    memory = "max_memory_allocated" if args.device.startswith("cuda") else "peak RSS growth"
    print(f"{'core':6s} {'kernel':6s} {'step (s)':>9s} {'first (s)':>9s} {'peak MB':>9s}  loss   "
          f"[fastest of {args.steps} step(s), cores in turns; {memory}, one process per core]")
    for r in results:
        if "error" in r:
            print(f"{r['core']:6s} failed: {r['error']}")
        else:
            print(f"{r['core']:6s} {r['kernel']:6s} {r['step_s']:9.3f} {r['first_s']:9.3f} {r['peak_bytes'] / 2**20:9.1f}  {r['loss']:.4f}")
    done = {r["core"]: r for r in results if "error" not in r}
    if "naive" in done and "fused" in done:
        n, f = done["naive"], done["fused"]
        rounds = sorted(a / b for a, b in zip(n["times"], f["times"]))
        spread = f" (rounds: {rounds[0]:.2f}x .. {rounds[-1]:.2f}x)" if len(rounds) > 1 else ""
        print(f"naive / fused: time {n['step_s'] / f['step_s']:.2f}x{spread}, "
              f"peak memory {n['peak_bytes'] / max(f['peak_bytes'], 1):.2f}x")
    return 0 if len(done) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
