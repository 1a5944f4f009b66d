"""The Transformer++ baseline counted as a tuned implementation runs it: attention as
FlashAttention-2's causal costs, each run of launches between GEMMs fused as torch.compile fuses
it, with a graph's gap per launch; and as launched (eager), and its GEMMs and attention alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.counter import Key, Launch, PHASES, Tally, extrapolate, tally, window
from bench.roofline import Hardware, kernel_seconds

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
    decay_params: int = 0  # the optimiser's groups (gpn_scale.models.model_spec.matrices_decay)
    no_decay_params: int = 0
    last_bucket_params: int = 0  # the tied embedding and the first block: their gradients complete last


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
    from gpn_scale.models.model_spec import matrices_decay

    groups = matrices_decay(model)
    last = sum(p.numel() for p in model.layers[0].parameters()) + model.embedding.numel()
    return BaselineCount(args.baseline, T, cfg.n_heads, cfg.d_model // cfg.n_heads, eager, tuned, calls,
                         sum(p.numel() for p in groups.decay), sum(p.numel() for p in groups.no_decay), last)


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
        phases = {p: sum(kernel_seconds(k, t, hw) + t.count * hw.graph_launch_s for k, t in window_tally.items()
                         if k.phase == p) for p in PHASES}
        return dict(launches=n, bytes=sum(t.read + t.written for t in window_tally.values()),
                    flops=sum(t.flops for t in window_tally.values()), device_s=seconds,
                    graph_s=seconds + n * hw.graph_launch_s, core_s=core_s, phases=phases)

    tuned, eager = timed(count.tuned), timed(count.eager)
    return dict(config=count.config, seq_len=T, batch=batch, hardware=hw.name, launches=tuned["launches"],
                bytes=tuned["bytes"], flops=tuned["flops"], device_s=tuned["device_s"], graph_s=tuned["graph_s"],
                phases_s=tuned["phases"],
                tokens_per_s=tokens / tuned["graph_s"], eager=dict(launches=eager["launches"], bytes=eager["bytes"],
                graph_s=eager["graph_s"], tokens_per_s=tokens / eager["graph_s"]),
                gemm_attention_s=tuned["core_s"], gemm_attention_tokens_per_s=tokens / tuned["core_s"])


