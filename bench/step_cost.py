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
    PYTHONPATH=. python bench/step_cost.py --token-batch 262144 --gpus 1,8,64 --windows 128,256,512,2048   # per optimiser step

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

Per optimiser step (`--token-batch`, `--gpus`, `--windows`, `--zero`; bench/update.py): a global batch
of that many tokens on N GPUs in windows of W with the state carried runs B = tokens / (W N) per GPU
(refused unless whole and >= 1), and one optimiser step takes W x the step at B, plus the
once-per-window work at B (the window of T0 steps less T0 steps' share, on the schedule, or its
launches at the host's cost where larger), plus AdamW's update as DeepSpeed's ZeRO runs it, plus the
gradients' ring all-reduce over `Hardware`'s interconnect, none of it overlapped (the loop's
gradients finish with its last chunk); tokens/s per GPU beside Transformer++ at its window with the
same token batch (its all-reduce hidden under its backward but for the last bucket), with GPN+M's
peak memory at that B and W. `--json` then holds {"reports": ..., "per_optimiser_step": ...}.

This script is the command line and the report; the parts other scripts can use are modules
beside it: bench/counter.py (the launch counter, per step and per batch), bench/roofline.py (the
hardware, each kernel's time, the floors and the peak memory), bench/baseline.py (Transformer++
as a tuned implementation runs it), bench/schedule.py (the critical path on the streams, and
the step's launches as its nodes) and bench/update.py (the optimiser step, the all-reduce, the
once-per-window part). Imports only torch and triton besides the source tree (and yaml,
through gpn_scale.config); run it from the repository's root with PYTHONPATH=. (the modules are
imported as bench.counter and so on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import defaultdict

import torch

from bench.baseline import BaselineCount, baseline_tallies, baseline_window
from bench.counter import KINDS, PHASES, Tally, costs_of, extrapolate, load_launches, measure, save_launches
from bench.roofline import HARDWARE, Hardware, kernel_seconds, memory_floor, peak_memory, phase_cost, weight_floor
from bench.schedule import overlap_what_if, scheduled_step
from bench import update


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
    p.add_argument("--token-batch", type=int, help="per optimiser step: a global batch of this many tokens on each of "
                   "--gpus GPU counts in windows of each of --windows, state carried, B = token batch / (W N) per GPU "
                   "(bench/update.py); beside Transformer++ at --baseline-seq-len with the same token batch")
    p.add_argument("--gpus", default="1,8", help="with --token-batch: the GPU counts N, comma-separated")
    p.add_argument("--windows", default="2048", help="with --token-batch: the window lengths W, comma-separated")
    p.add_argument("--zero", type=int, choices=[0, 1, 2], default=2,
                   help="with --token-batch: DeepSpeed's ZeRO stage the optimiser step runs under (the recipes': 2)")
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
    args.gpus = ints("--gpus", args.gpus, range(1, 9))
    args.windows = ints("--windows", args.windows, range(1, 13))
    if args.token_batch is not None and args.token_batch < 1:
        p.error(f"--token-batch: expected a positive number of tokens, got {args.token_batch}")
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


def check_plan(args) -> None:
    """Refuse, in one line and before any counting, a --token-batch that leaves some (N, W) (and the
    baseline's window) without a whole batch per GPU."""
    if args.token_batch is None:
        return
    windows = list(args.windows) + ([] if args.baseline == "none" else [args.baseline_seq_len])
    for n in args.gpus:
        for w in windows:
            update.per_gpu_batch(args.token_batch, w, n)


def per_optimiser_step(args, cfg, model, runs: dict, costs: dict, count: BaselineCount | None, hw: Hardware) -> dict:
    """Per (N, W): one optimiser step of --token-batch tokens on N GPUs in windows of W, the state
    carried, B = tokens / (W N) per GPU (bench/update.py): W time steps at B, the once-per-window
    work at B, the optimiser step and the all-reduce, and tokens/s per GPU; beside it Transformer++
    at its window with the same token batch, its all-reduce overlapped layer by layer."""
    from gpn_scale.models.model_spec import matrices_decay

    steps = tuple(args.steps)
    groups = matrices_decay(model)
    decay, no_decay = sum(p.numel() for p in groups.decay), sum(p.numel() for p in groups.no_decay)
    params = decay + no_decay
    fixed_launches = sum(t.count for t in costs[min(costs)][1].values())
    schedules, windows, optimizer, allreduce, transformer, entries = {}, {}, {}, {}, {}, []
    for n in args.gpus:
        optimizer[n] = update.optimizer_cost(decay, no_decay, n, args.zero, hw)
        allreduce[n] = update.allreduce_cost(params * update.F32, n, hw)  # float32 gradients
        if count is not None:
            bt = update.per_gpu_batch(args.token_batch, count.seq_len, n)
            base = baseline_window(count, bt, hw)
            tparams = count.decay_params + count.no_decay_params
            opt = update.optimizer_cost(count.decay_params, count.no_decay_params, n, args.zero, hw)
            ar = update.allreduce_cost(tparams * update.F32, n, hw)
            exposed = update.exposed_allreduce(ar["seconds"], base["phases_s"]["backward"],
                                               count.last_bucket_params / tparams)
            seconds = base["graph_s"] + opt["seconds"] + exposed
            transformer[n] = dict(config=count.config, window=count.seq_len, batch=bt, window_s=base["graph_s"],
                                  backward_s=base["phases_s"]["backward"], optimizer=opt, allreduce=ar,
                                  allreduce_exposed_s=exposed, last_bucket_share=count.last_bucket_params / tparams,
                                  seconds=seconds, tokens_per_s_per_gpu=args.token_batch / n / seconds,
                                  tokens_per_s_per_gpu_windows_alone=base["tokens_per_s"])
        for w in args.windows:
            b = update.per_gpu_batch(args.token_batch, w, n)
            if b not in schedules:
                schedules[b] = scheduled_step(runs, steps, b, hw)
                windows[b] = update.once_per_window(schedules[b], fixed_launches, hw)
            step_s = schedules[b]["seconds"]
            seconds = update.optimiser_step_time(step_s, w, windows[b]["seconds"], optimizer[n]["seconds"],
                                                 allreduce[n]["seconds"])
            tps = args.token_batch / n / seconds
            pm = peak_memory(cfg, b, w, params) if cfg.memory else None
            entries.append(dict(gpus=n, window=w, batch=b, step_s=step_s, windows_s=w * step_s,
                                once_per_window_s=windows[b]["seconds"], optimizer_s=optimizer[n]["seconds"],
                                allreduce_s=allreduce[n]["seconds"], seconds=seconds, tokens_per_s_per_gpu=tps,
                                tokens_per_s_per_gpu_steps_alone=b / step_s,
                                peak_memory_bytes=pm and pm["total"],
                                over_baseline=tps / transformer[n]["tokens_per_s_per_gpu"] if n in transformer else None))
    return dict(token_batch=args.token_batch, zero=args.zero, hardware=hw.name, params=params, carried_state=True,
                gpus=list(args.gpus), windows=list(args.windows), once_per_window={str(b): v for b, v in windows.items()},
                optimizer={str(n): v for n, v in optimizer.items()}, allreduce={str(n): v for n, v in allreduce.items()},
                transformer={str(n): v for n, v in transformer.items()}, entries=entries)


def print_per_optimiser_step(t: dict) -> None:
    print(f"\nper optimiser step: {t['token_batch']} tokens on N GPUs in windows of W, the state carried, "
          f"B = tokens / (W N) per GPU, no accumulation; {t['hardware']} roofline, ZeRO {t['zero']} (bench/update.py); "
          f"time = W x step + once per window + optimiser + all-reduce (GPN+M: none of it overlapped)")
    for b, w in t["once_per_window"].items():
        print(f"  once per window at batch {b}: {w['launches']:g} launches, scheduled {w['scheduled_s'] * 1e3:.2f} ms, "
              f"at the host's cost per launch {w['host_s'] * 1e3:.2f} ms -> {w['seconds'] * 1e3:.2f} ms")
    for n, o in t["optimizer"].items():
        a = t["allreduce"][n]
        print(f"  N {n}: optimiser (AdamW, float32, {o['share']:.3g} of the weights per GPU) {o['bytes'] / 1e9:.2f} GB, "
              f"{o['launches']} launches, {o['seconds'] * 1e3:.2f} ms; all-reduce of {a['grad_bytes'] / 1e6:.0f} MB of "
              f"gradients: {a['bytes_per_gpu'] / 1e6:.0f} MB per GPU at {a['bus_bytes_per_s'] / 1e9:.0f} GB/s "
              f"({a['link']}) {a['seconds'] * 1e3:.2f} ms")
        if n in t["transformer"]:
            x = t["transformer"][n]
            print(f"  N {n}: {x['config']} at {x['window']} (batch {x['batch']}): window {x['window_s'] * 1e3:.1f} ms "
                  f"(backward {x['backward_s'] * 1e3:.1f}), optimiser {x['optimizer']['seconds'] * 1e3:.2f} ms, "
                  f"all-reduce {x['allreduce']['seconds'] * 1e3:.2f} ms of which exposed "
                  f"{x['allreduce_exposed_s'] * 1e3:.2f} (last bucket {x['last_bucket_share']:.0%}) -> "
                  f"{x['tokens_per_s_per_gpu'] / 1e3:.1f}K tok/s per GPU")
    print(f"{'N':>4s} {'W':>6s} {'B':>6s} {'step us':>9s} {'W steps ms':>10s} {'window ms':>9s} {'optim ms':>8s} "
          f"{'all-red ms':>10s} {'total ms':>9s} {'tok/s/GPU':>10s} {'peak GB':>8s} {'Transformer++':>14s} {'ratio':>6s}")
    for e in t["entries"]:
        x = t["transformer"].get(str(e["gpus"]))
        peak = f"{e['peak_memory_bytes'] / 1e9:8.1f}" if e["peak_memory_bytes"] else f"{'-':>8s}"
        print(f"{e['gpus']:4d} {e['window']:6d} {e['batch']:6d} {e['step_s'] * 1e6:9.1f} {e['windows_s'] * 1e3:10.2f} "
              f"{e['once_per_window_s'] * 1e3:9.2f} {e['optimizer_s'] * 1e3:8.2f} {e['allreduce_s'] * 1e3:10.2f} "
              f"{e['seconds'] * 1e3:9.2f} {e['tokens_per_s_per_gpu'] / 1e3:9.1f}K {peak} "
              + (f"{x['tokens_per_s_per_gpu'] / 1e3:13.1f}K {e['over_baseline']:6.3f}" if x else f"{'-':>14s} {'-':>6s}"))


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
    check_plan(args)
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
    if args.token_batch is not None:
        args.per_optimiser_step = per_optimiser_step(args, cfg, model, runs, costs, count, hw)
    return reports


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernel == "triton" and args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    from data_prep.errors import UserError
    from kernels.side_streams import CPU_STREAMS_ENV

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
    table = getattr(args, "per_optimiser_step", None)
    if table:
        print_per_optimiser_step(table)
    if args.json:
        out = results[0] if len(results) == 1 else results
        with open(args.json, "w") as f:
            json.dump(out if table is None else dict(reports=out, per_optimiser_step=table), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

