"""GPN+M training throughput on one GPU against Transformer++ and the naive loop, and the kernels' own figures.

    PYTHONPATH=. python bench/gpu.py --out bench_gpu.json                 # CUDA: bf16, T 2048, 130M models
    PYTHONPATH=. python bench/gpu.py --device cpu --out /tmp/smoke.json    # tiny configs, Triton interpreter

Rows (`--models`, all by default), each a training step (forward, backward, AdamW) on random
tokens, timed after one untimed step (three with CUDA graphs: run, capture forward, capture
backward), with torch.cuda.max_memory_allocated as the peak:
  gpn_m_triton  GPN+M (--gpn, 130M 1L) with the fused core, the Triton kernels and its time
                loops captured as CUDA graphs (kernels/graph.py), the memory in its step form
  gpn_m_chunk   the same with the memory in its chunk form (memory_form: chunk, docs/core.md)
  gpn_m_eager   the same launched step by step from Python (cuda_graphs: false)
  gpn_m_torch   the same with the step in plain torch (the kernels' twins), step by step
  naive         the same model with the naive autograd time loop, run at --naive-seq-len and
                reported as tokens/s "extrapolated" to --seq-len: a sequential loop's cost per
                token does not shrink with T, and at T 2048 its graph would not fit
  transformer   Transformer++ (--transformer, 12L 130M) with torch SDPA, timed eager and then
                with its blocks compiled as `model.compile: true` trains them (compile_blocks;
                --no-compile: eager only; the default on CPU, where compiling takes tens of
                seconds); the row, and so the ratio table, use the faster of the two, and say
                which. Where compile is unavailable or fails, the row is eager and says why
Each row's batch fills the GPU: one probe step at batch 2 measures the memory per sequence,
and the batch is what fits in --fill of the free memory (`--batch name=N` sets it).

Kernel figures: the memory-step kernels' achieved bandwidth (bytes they must move / time)
against a device-to-device copy measured in the same run, and the TFLOP/s of the step's
GEMMs at the GPN+M batch. Overlap figures (`overlap_figures`): what bench/schedule.py's rule
for kernels on two streams assumes, measured: a copy's bandwidth on a share of the SMs, and
M's traffic beside the projection GEMM on two streams against the two one after the other. A ratio table comes last; --out writes everything as JSON.

Imports only torch, triton, numpy and yaml (through gpn_scale.config) besides the source tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import NamedTuple

import torch

MODELS = ("gpn_m_triton", "gpn_m_chunk", "gpn_m_eager", "gpn_m_torch", "naive", "transformer")
TARGETS = {"gpn_m_triton / transformer": 0.5, "gpn_m_chunk / transformer": 0.5, "gpn_m_triton / naive": 20.0,
           "memory kernel / copy": 0.7}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--gpn", help="GPN+M model config (default: gpn_m_130m_1l on CUDA, gpn_m_tiny on CPU)")
    p.add_argument("--transformer", help="Transformer++ config (default: transformer_130m / transformer_tiny)")
    p.add_argument("--seq-len", type=int, help="default: 2048 on CUDA, 16 on CPU")
    p.add_argument("--naive-seq-len", type=int, help="default: 128 on CUDA, 8 on CPU")
    p.add_argument("--batch", action="append", default=[], metavar="NAME=N", help="fix a row's batch (repeatable)")
    p.add_argument("--fill", type=float, default=0.8, help="share of free GPU memory a row's batch may use")
    p.add_argument("--steps", type=int, default=2, help="timed steps per row (>= 1), after one untimed step")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the transformer row under torch.compile and keep the faster (default: on CUDA only)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.gpn = args.gpn or ("gpn_m_130m_1l" if cuda else "gpn_m_tiny")
    args.transformer = args.transformer or ("transformer_130m" if cuda else "transformer_tiny")
    args.seq_len = args.seq_len or (2048 if cuda else 16)
    args.naive_seq_len = args.naive_seq_len or (128 if cuda else 8)
    args.compile = cuda if args.compile is None else args.compile
    if args.steps < 1:
        p.error("--steps: expected >= 1")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; expected a subset of {', '.join(MODELS)}")
    try:
        args.batch = {k: int(v) for k, _, v in (b.partition("=") for b in args.batch)}
    except ValueError:
        p.error("--batch: expected NAME=N with an integer N")
    if not cuda:  # CPU: batch 2 everywhere unless told, and Triton runs in its interpreter
        args.batch = {m: args.batch.get(m, 2) for m in MODELS}
    return args


# ---- timing ----------------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, warmup: bool = True) -> float:
    """Seconds per call of fn, the mean over `reps` calls (after one warm-up call)."""
    if warmup:
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


# ---- training-step rows ----------------------------------------------------------------------


def build(args, name):
    """(model config, seq_len, label) of a row."""
    from gpn_scale.config import model_config

    if name == "transformer":
        cfg = model_config(args.transformer)
        return cfg, args.seq_len, f"Transformer++ {cfg.n_layers}L (torch SDPA"  # run_row closes it with the mode
    cfg = model_config(args.gpn)
    if name == "naive":  # plain autograd: no segment recomputation
        return dataclasses.replace(cfg, core="naive", recompute_every=0), args.naive_seq_len, f"GPN+M {cfg.n_layers}L naive loop"
    kernel, graphs = ("torch", False) if name == "gpn_m_torch" else ("triton", name in ("gpn_m_triton", "gpn_m_chunk"))
    form = "chunk" if name == "gpn_m_chunk" else "step"
    label = (f"GPN+M {cfg.n_layers}L fused, {kernel} kernels, {form} form"
             + (", CUDA graphs" if graphs and args.device.startswith("cuda") else ""))
    return dataclasses.replace(cfg, core="fused", kernel=kernel, cuda_graphs=graphs, memory_form=form), args.seq_len, label


def train_step_fn(model, opt, tokens, device, bf16: bool):
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens).loss
        loss.backward()
        opt.step()
        return loss

    return step


class CompileTiming(NamedTuple):
    """The transformer row's two timings and which one the row reports."""

    used: str  # "eager" or "compiled"
    eager_s: float
    compiled_s: float | None  # None: not run or failed (see note)
    note: str


def fastest(eager_s: float, compiled_s: float | None, note: str) -> CompileTiming:
    """The faster of eager and compiled: a baseline as fast as a user would run it."""
    used = "compiled" if compiled_s is not None and compiled_s < eager_s else "eager"
    return CompileTiming(used, eager_s, compiled_s, note)


def compiled_step_s(model, opt, tokens, device, steps: int, bf16: bool) -> tuple[float | None, str]:
    """Seconds per training step of the model with its blocks compiled, in place, as the trainer
    compiles them (after one untimed step that compiles), or None and one line saying why it could
    not run."""
    from gpn_scale.models.blocks import compile_blocks

    if not hasattr(torch, "compile"):
        return None, f"torch {torch.__version__} has no torch.compile; eager used"
    try:
        compile_blocks(model)
        step = train_step_fn(model, opt, tokens, device, bf16)
        step()
        sync(device)
        return timed(step, device, steps, warmup=False), "eager and compiled timed"
    except Exception as e:  # the eager figure stands; say why there is no compiled one
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return None, f"torch.compile failed ({type(e).__name__}: {first[:200]}); eager used"


def probe_batch(args, model, opt, cfg, T, device) -> int:
    """The batch that fills `--fill` of the free memory, from one step at batch 2."""
    for p in model.parameters():  # allocate the optimizer state first: it is not per sequence
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    train_step_fn(model, opt, torch.randint(0, cfg.vocab_size, (2, T), device=device), device, True)()
    sync(device)
    per_seq = max(1, (torch.cuda.max_memory_allocated(device) - base - grads) // 2)
    opt.zero_grad(set_to_none=True)
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    batch = max(1, int(args.fill * (free - grads) // per_seq))
    return batch // 8 * 8 if batch >= 16 else batch


def run_row(args, name, device) -> dict:
    from gpn_scale.models import build_model
    from kernels.graph import graphs_of, release

    cfg, T, label = build(args, name)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    batch = args.batch.get(name) or probe_batch(args, model, opt, cfg, T, device)
    while True:
        tokens = torch.randint(0, cfg.vocab_size, (batch, T), device=device)
        step = train_step_fn(model, opt, tokens, device, bf16=cuda)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            # Untimed: compiles kernels, allocates the optimizer state; with CUDA graphs the
            # second step captures the forward loop and the third the backward loop.
            for _ in range(3 if getattr(cfg, "cuda_graphs", False) and cuda else 1):
                loss = step().detach()
            sync(device)
            sec = timed(step, device, args.steps, warmup=False)
            break
        except torch.cuda.OutOfMemoryError:  # the probe's linear estimate was optimistic
            if batch == 1:
                raise
            del tokens, step
            opt.zero_grad(set_to_none=True)
            release(model)  # graphs captured at this batch hold memory
            batch //= 2
            print(f"{name}: out of memory, retrying at batch {batch}", flush=True)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    compile_timing = None
    if name == "transformer":
        compiled_s, note = None, "compile not requested (--compile; on by default on CUDA only)"
        if args.compile:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            compiled_s, note = compiled_step_s(model, opt, tokens, device, args.steps, bf16=cuda)
        compile_timing = fastest(sec, compiled_s, note)
        if compiled_s is None and args.compile:
            print(f"{name}: {note}", flush=True)
        if compile_timing.used == "compiled":
            sec, peak = compiled_s, torch.cuda.max_memory_allocated(device) if cuda else None
        label += f", {compile_timing.used})"
    row = dict(name=name, label=label, batch=batch, seq_len=T, step_s=sec, tokens_per_s=batch * T / sec,
               peak_bytes=peak, loss=loss.item(), params=sum(p.numel() for p in model.parameters()))
    if compile_timing is not None:
        row["compile"] = compile_timing._asdict()
    if name == "naive":
        row["extrapolated_to_seq_len"] = args.seq_len
    graphs = graphs_of(model)
    if graphs is not None:  # how the loops ran: eager, captured, replayed, failed captures
        row["cuda_graphs"] = dict(forward=graphs.forward.stats, backward=graphs.backward.stats)
    del model, opt, tokens, step
    if cuda:
        torch.cuda.empty_cache()
    return row


# ---- kernel figures --------------------------------------------------------------------------


def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy of a large buffer (read + write counted)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 22)  # 1 GiB / 16 MiB of float32
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    sec = timed(lambda: dst.copy_(src), device, 20 if device.type == "cuda" else 3)
    return 2 * src.numel() * src.element_size() / sec


def memory_kernel_figures(cfg, batch, device) -> dict:
    """Achieved bandwidth of the memory-step kernels at the model's shapes: the bytes each
    must move (M in and out, and the per-step vectors) over its time."""
    import kernels.memory.triton as K
    from kernels.memory.reference import read_factors

    B, H, dk, dv = batch, cfg.n_heads, cfg.d_key, cfg.d_val
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    M, k, v, q, gate = r(B, H, dk, dv), r(B, H, dk).abs(), r(B, H, dv), r(B, H, dk).abs(), r(B, H * dv)
    k, q = k / k.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True)
    beta, decay = torch.rand(B, H, device=device, generator=g), torch.rand(B, H, device=device, generator=g)
    M_t, e, o, _ = K.memory_step(M, k, v, beta, decay, q, gate)
    f, dM, dy, delta = read_factors(o, gate), torch.randn_like(M), torch.randn_like(gate), beta[..., None] * e
    m_bytes, kv = M.numel() * 4, (B * H * (dk + dv)) * 4
    reps = 20 if device.type == "cuda" else 1
    cases = {
        # write + read: M in, M_t out; k, q, v in; e, o out; gate in, y out
        "memory_step (fwd)": (lambda: K.memory_step(M, k, v, beta, decay, q, gate), 2 * m_bytes + 2 * kv + 4 * B * H * dv * 4),
        "decay_and_write": (lambda: K.decay_and_write(M, k, delta, decay), 2 * m_bytes + kv),
        # M_prev and dM in, dM_prev out; the vectors and the read factors
        "memory_step_backward": (lambda: K.memory_step_backward(M, M_t, k, beta, decay, e, delta, q, f, dM, dy),
                                 3 * m_bytes + 2 * kv + 10 * B * H * dv * 4),
    }
    cases.update(chunk_kernel_cases(cfg, batch, device, M, k, v, beta, decay, q, gate))
    out = {}
    for name, (fn, nbytes) in cases.items():
        sec = timed(fn, device, reps)
        out[name] = dict(seconds=sec, bytes=nbytes, bytes_per_s=nbytes / sec)
    out["batch"], out["m_bytes"] = batch, m_bytes
    return out


def chunk_kernel_cases(cfg, batch, device, M, k, v, beta, decay, q, gate) -> dict:
    """The chunk form's per-step kernels at the middle step of a chunk of core_chunk steps, with
    the bytes each must move: M_c read once, and the chunk's rows the step reads."""
    import kernels.memory_chunk.triton as KC
    from kernels.memory.reference import read_factors
    from kernels.memory_chunk import algebra

    B, H, dk, dv, n = batch, cfg.n_heads, cfg.d_key, cfg.d_val, cfg.core_chunk
    j = n // 2
    g = torch.Generator(device=device).manual_seed(1)
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    keys = unit(torch.rand(n, B, H, dk, device=device, generator=g))
    values, queries = torch.randn(n, B, H, dv, device=device, generator=g), unit(torch.rand(1, n, B, H, dk, device=device, generator=g))
    betas, decays = torch.rand(n, B, H, device=device, generator=g), torch.rand(n, B, H, device=device, generator=g)
    r = algebra.rebuild(M, keys, values, betas, decays, queries)
    dM = torch.randn_like(M)
    K, D = keys.clone(), r.delta.clone()
    read_grads = torch.randn(1, n, B, H, dv, device=device, generator=g)
    r_k, co = KC.algebra(dM, K, betas, decays, D, r.e, r.reads, queries)
    o = r.reads[0][j].reshape(B, -1)
    f, dy, phi = read_factors(o, gate), torch.randn_like(gate), torch.zeros(B, H, device=device)
    m_bytes, row = M.numel() * 4, B * H * 4
    return {
        # M_c in; the chunk's j keys and deltas; the step's vectors
        f"chunk step {j} of {n} (fwd)": (lambda: KC.step(M, K, D, decays, j, k, v, beta[:, :], q, gate),
                                         m_bytes + j * row * (dk + dv) + row * (4 * dk + 6 * dv)),
        # M_c in; deltas of rows <= j, read gradients and queries of rows >= j, every key
        f"chunk step {j} of {n} backward": (lambda: KC.step_backward(M, K, D, r, co, j, betas[j], r.e[j], values[j], queries, o, f, dy,
                                                                      read_grads, phi),
                                            m_bytes + row * ((j + 1) * dv + (n - j) * (dv + dk) + n * dk + 12 * dv)),
        "chunk dM products": (lambda: KC.dm_products(dM, K, D), m_bytes + row * n * 2 * (dk + dv)),
        # once per chunk: dM_end's products, then the C x C algebra (keys, deltas, queries, U0, V0 in;
        # U, V and the C x C matrices out), and after the sweep the carry's rows and weights
        "chunk algebra": (lambda: KC.algebra(dM, K, betas, decays, D, r.e, r.reads, queries),
                          m_bytes + row * n * (4 * (dk + dv) + dk + 7 * n)),
        "chunk finish": (lambda: KC.finish(K, r_k, co, betas, queries, read_grads), row * n * (4 * (dk + dv) + 3 * n)),
    }


def gemm_figures(cfg, batch, device) -> dict:
    """TFLOP/s of the three per-step GEMMs of the fused core (layer 0) at the GPN+M batch."""
    from gpn_scale.models import build_model
    from gpn_scale.models.core import fuse_weights

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        model = build_model(cfg)
    layers, fg_W, _ = fuse_weights(model)
    shapes = {"projection": layers[0].W.shape, "W2 + W_o": layers[0].W2o.shape, "fuse gate": fg_W.shape}
    out = {}
    for name, (k, n) in shapes.items():
        x, w = torch.randn(batch, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        sec = timed(lambda: x @ w, device, 50 if device.type == "cuda" else 2)
        out[name] = dict(m=batch, k=k, n=n, seconds=sec, tflops=2 * batch * k * n / sec / 1e12)
    return out


def _strided_copy():
    """A Triton copy whose programs loop over the buffer (program p copies blocks p, p + grid, ...),
    so that its grid, not the buffer, says how many SMs it holds. Made after TRITON_INTERPRET is set."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, iters, BLOCK: tl.constexpr):
        pid, grid = tl.program_id(0), tl.num_programs(0)
        for i in range(iters):
            offs = (i * grid + pid) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    def run(src, dst, grid: int, block: int):
        n = src.numel()
        # 8 warps, 8K elements a block: each program keeps enough loads in flight to draw on its SM's share
        copy[(grid,)](src, dst, n, -(-n // (grid * block)), BLOCK=block, num_warps=8 if src.is_cuda else 4)

    return run


def overlap_figures(cfg, batch, device, copy_bps: float) -> dict:
    """What bench/schedule.py's overlap rule assumes, measured.

    - `by_sm_share`: a streaming copy whose grid holds 1/8, 1/4, 1/2, 1 and 4 times the GPU's SMs
      (one program per SM at most at a time): its bandwidth against the full copy's. The rule gives
      a kernel bandwidth in proportion to the SMs it holds; where a fraction of the SMs already
      reaches most of the bandwidth, a memory kernel beside a GEMM loses less than the rule says.
    - `beside_gemm`: a copy the size of M at this batch (one memory kernel's traffic) and the step's
      projection GEMM, each alone, then the two issued on two streams at once. The rule makes a GEMM
      whose tiles fill the GPU leave the copy only its last wave's SMs (about the serial sum);
      `serial_s / together_s` is the overlap the hardware gives. On CPU there is one stream: the
      two run one after the other and `concurrent` is false.
    """
    from gpn_scale.models import build_model
    from gpn_scale.models.core import fuse_weights

    cuda = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    reps = 20 if cuda else 1
    copy, block = _strided_copy(), 8192 if cuda else 256
    n = (1 << 28) if cuda else (1 << 12)
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    by_share = {}
    for programs in sorted({max(1, sms // 8), max(1, sms // 4), max(1, sms // 2), sms, 4 * sms}):
        sec = timed(lambda: copy(src, dst, programs, block), device, reps)
        bps = 2 * n * 4 / sec
        by_share[f"{programs / sms:g}"] = dict(programs=programs, seconds=sec, bytes_per_s=bps, of_copy=bps / copy_bps)

    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device("meta"):
        W = fuse_weights(build_model(cfg))[0][0].W
    x, w = torch.randn(batch, W.shape[0], device=device, dtype=dtype), torch.randn(*W.shape, device=device, dtype=dtype)
    m_elems = batch * cfg.n_heads * cfg.d_key * cfg.d_val if cfg.memory else batch * cfg.d_state
    m_src = torch.empty(m_elems if cuda else min(m_elems, 1 << 12), device=device)
    m_dst = torch.empty_like(m_src)
    gemm = lambda: x @ w  # noqa: E731
    move = lambda: copy(m_src, m_dst, 4 * sms, block)  # noqa: E731
    if cuda:
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def together():
            here = torch.cuda.current_stream(device)
            s1.wait_stream(here)
            s2.wait_stream(here)
            with torch.cuda.stream(s1):
                gemm()
            with torch.cuda.stream(s2):
                move()
            here.wait_stream(s1)
            here.wait_stream(s2)
    else:
        def together():
            gemm()
            move()
    gemm_s, copy_s = timed(gemm, device, reps), timed(move, device, reps)
    together_s = timed(together, device, reps)
    beside = dict(batch=batch, gemm_shape=[batch, *W.shape], copy_bytes=2 * m_src.numel() * 4, gemm_s=gemm_s, copy_s=copy_s,
                  serial_s=gemm_s + copy_s, together_s=together_s, gain=(gemm_s + copy_s) / together_s, concurrent=cuda)
    return dict(sms=sms, by_sm_share=by_share, beside_gemm=beside)


# ---- report ----------------------------------------------------------------------------------


def ratios(rows: dict, kernel: dict | None, copy_bps: float | None) -> list[tuple[str, float, float | None]]:
    out = []
    tps = {n: r["tokens_per_s"] for n, r in rows.items()}
    for ours, other in (("gpn_m_triton", "transformer"), ("gpn_m_chunk", "transformer"), ("gpn_m_chunk", "gpn_m_triton"),
                        ("gpn_m_triton", "naive"), ("gpn_m_triton", "gpn_m_eager"), ("gpn_m_triton", "gpn_m_torch")):
        if ours in tps and other in tps:
            key = f"{ours} / {other}"
            mode = f" ({rows[other]['compile']['used']})" if "compile" in rows[other] else ""  # eager or compiled baseline
            out.append((f"{key}{mode} tokens/s", tps[ours] / tps[other], TARGETS.get(key)))
    if kernel and copy_bps:
        names = ["memory_step (fwd)", "memory_step_backward"] + [n for n in kernel if n.startswith("chunk step")]
        for name in names:
            out.append((f"{name} / copy bandwidth", kernel[name]["bytes_per_s"] / copy_bps, TARGETS["memory kernel / copy"]))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # the Triton kernels run in the interpreter; set before they are defined
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_num_threads(1)
    t_start = time.perf_counter()
    rows, failed = {}, {}
    for name in args.models:
        try:
            r = rows[name] = run_row(args, name, device)
        except Exception as e:  # one row's failure must not cost the others' figures
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{name:13s} failed: {failed[name]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        print(f"{name:13s} batch {r['batch']:4d} x T {r['seq_len']:5d}  {r['step_s']:8.3f} s/step  "
              f"{r['tokens_per_s']:11.0f} tok/s  peak {(r['peak_bytes'] or 0) / 2**30:6.2f} GiB  loss {r['loss']:.3f}", flush=True)

    from gpn_scale.config import model_config

    gpn_cfg = model_config(args.gpn)
    kbatch = rows["gpn_m_triton"]["batch"] if "gpn_m_triton" in rows else args.batch.get("gpn_m_triton", 8)
    if device.type == "cpu":
        gpn_cfg = dataclasses.replace(gpn_cfg, core_chunk=4)  # the interpreter: a short chunk
    copy_bps = copy_bandwidth(device)
    kernel = memory_kernel_figures(gpn_cfg, kbatch, device) if gpn_cfg.memory else None
    gemms = gemm_figures(gpn_cfg, kbatch, device)
    overlap = overlap_figures(gpn_cfg, kbatch, device, copy_bps)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"\ndevice: {device_name}; GPN+M config {args.gpn}, Transformer++ config {args.transformer}; "
          f"{'bf16 autocast' if device.type == 'cuda' else 'float32'}")
    print(f"\n{'row':13s} {'what':44s} {'batch':>5s} {'T':>5s} {'tok/s':>11s} {'peak GiB':>8s}")
    for r in rows.values():
        note = f"  (measured at T {r['seq_len']}, extrapolated to T {r['extrapolated_to_seq_len']})" if r["name"] == "naive" else ""
        if "compile" in r:  # both timings, so the choice can be checked
            c, tok = r["compile"], r["batch"] * r["seq_len"]
            note = f"  (eager {tok / c['eager_s']:.0f} tok/s, " + (f"compiled {tok / c['compiled_s']:.0f} tok/s)" if c["compiled_s"] else f"{c['note']})")
        peak = f"{r['peak_bytes'] / 2**30:8.2f}" if r["peak_bytes"] is not None else f"{'-':>8s}"
        print(f"{r['name']:13s} {r['label']:44s} {r['batch']:5d} {r['seq_len']:5d} {r['tokens_per_s']:11.0f} {peak}{note}")
    for name, error in failed.items():
        print(f"{name:13s} failed: {error}")
    print(f"\ncopy bandwidth (device to device, read + write): {copy_bps / 1e9:.1f} GB/s")
    if kernel:
        print(f"memory kernels at batch {kernel['batch']} ({kernel['m_bytes'] / 2**20:.0f} MiB of M):")
        for k in (n for n in kernel if isinstance(kernel[n], dict)):
            print(f"  {k:28s} {kernel[k]['seconds'] * 1e6:10.1f} us  {kernel[k]['bytes_per_s'] / 1e9:8.1f} GB/s"
                  f"  ({kernel[k]['bytes_per_s'] / copy_bps:.0%} of copy)")
    print(f"a copy holding a share of the {overlap['sms']} SMs (bench/schedule.py's rule: bandwidth in proportion):")
    for share, c in overlap["by_sm_share"].items():
        print(f"  {share:>6s} of the SMs ({c['programs']:4d} programs)  {c['bytes_per_s'] / 1e9:8.1f} GB/s  ({c['of_copy']:.0%} of copy)")
    o = overlap["beside_gemm"]
    print(f"M's traffic ({o['copy_bytes'] / 2**20:.0f} MiB) beside the projection GEMM {o['gemm_shape']}: alone {o['copy_s'] * 1e6:.1f} us"
          f" + {o['gemm_s'] * 1e6:.1f} us, {'on two streams' if o['concurrent'] else 'one after the other (one stream)'}"
          f" {o['together_s'] * 1e6:.1f} us: serial / together {o['gain']:.2f}")
    print(f"step GEMMs at batch {kbatch}:")
    for k, gm in gemms.items():
        print(f"  {k:12s} ({gm['m']} x {gm['k']}) @ ({gm['k']} x {gm['n']})  {gm['seconds'] * 1e6:9.1f} us  {gm['tflops']:7.2f} TFLOP/s")

    wall = time.perf_counter() - t_start
    graphs = {n: r["cuda_graphs"] for n, r in rows.items() if "cuda_graphs" in r}
    for n, g in graphs.items():
        print(f"{n}: CUDA graphs forward {g['forward']}, backward {g['backward']}")
    print(f"bench wall time: {wall:.0f} s")

    table = ratios(rows, kernel, copy_bps)
    print(f"\n{'ratio':50s} {'value':>8s} {'target':>8s}")
    for key, value, target in table:
        verdict = "" if target is None else ("  meets" if value >= target else "  misses")
        print(f"{key:50s} {value:8.3g} {'>= ' + format(target, 'g') if target else '':>8s}{verdict}")
    result = dict(device=device_name, args={k: v for k, v in vars(args).items()}, rows=rows, failed=failed, copy_bytes_per_s=copy_bps,
                  memory_kernels=kernel, gemms=gemms, overlap=overlap, ratios=[dict(name=k, value=v, target=t) for k, v, t in table],
                  wall_s=wall)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
