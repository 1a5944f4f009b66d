"""One GPU's roofline, and the floors and memory a step is held to: each kernel's time alone as
max(bytes / bandwidth, FLOPs / rate), scaled for a grid smaller than the GPU; M's traffic as each
memory form is designed; the weights re-read whatever the batch; the peak memory per GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.counter import KINDS, Key, Tally, extrapolate


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
    # The interconnect, for the gradients' all-reduce (bench/update.py), datasheet figures per GPU and
    # direction: NVLink 4 on the H100 / H200 SXM is 18 links, 900 GB/s both directions together
    # (NVIDIA's H100 and H200 datasheets), 450 GB/s each way, to every GPU of a node of 8 through
    # NVSwitch; across nodes each GPU has one 400 Gb/s InfiniBand NDR adapter (ConnectX-7, as in a
    # DGX H100 / H200: 8 x 400 Gb/s = 400 GB/s per node), 50 GB/s each way.
    gpus_per_node: int = 8
    nvlink_bytes_per_s: float = 450e9
    nic_bytes_per_s: float = 50e9
    # The share of those figures a large NCCL all-reduce is assumed to reach (its bus bandwidth over
    # the link's): an assumption, not a measurement here; bench/gpu.py does not time collectives.
    link_efficiency: float = 0.8


H200 = Hardware()
# The H100 SXM has the H200's compute and 3.35 TB/s (datasheet) of HBM3 against 4.8: the same 90%
# of it achieved by a copy as on the H200. Used to calibrate the baseline against published H100 runs.
H100 = Hardware(name="H100", bytes_per_s=3.0e12)
HARDWARE = {"h200": H200, "h100": H100}

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
    kept_m = m  # M at a chunk's start, as the forward keeps it
    if cfg.memory_form == "chunk":
        per_token += (L + 2) * H * dv * f32  # each step's reads, the write's error and delta
        chunk_m = 3 * m  # the window's last M, dL/dM in two buffers
        if cfg.memory_reads == "compute":
            kept_m = m // 2  # only the bf16 copy its steps read
    else:
        chunk_m = (C + 2) * m  # the chunk's rebuilt M's, dL/dM in two buffers
    n_rows = 2 * H * dk + 2 * H * dv + 2 * H + 2 * cfg.d_ffn + d  # layer 0's fused projection
    keep = cfg.core_projections == "keep"
    if keep:  # every step's projections, in the GEMMs' bf16
        per_token += 2 * (n_rows + (L - 1) * (H * dk + H * dv + 2 * cfg.d_ffn + d))
    # projections (unless kept), second-GEMM rows, their gradients: two workspaces, used in turn on
    # a GPU (the weight gradients of one chunk run on a side stream beside the next chunk's sweep)
    chunk_rows = 2 * C * batch * ((1 if keep else 2) * n_rows + 2 * (cfg.d_ffn + H * dv) + 4 * d) * f32
    logits = 2 * cfg.ce_chunk * cfg.vocab_size * f32
    parts = dict(saved=tokens * per_token, m_per_chunk=math.ceil(seq_len / C) * kept_m, backward_chunk=chunk_m + chunk_rows,
                 logits=logits, weights_and_optimizer=params * 16)
    return dict(parts, total=sum(parts.values()))


