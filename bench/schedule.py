"""How long kernels take on the streams they are launched on: a dependency graph's critical path
under an overlap rule that does not let kernels share what they cannot.

A node is one kernel launch: its time alone on the GPU (the roofline's, `seconds`), what share of
the GPU's memory bandwidth, of its arithmetic rate and of its SMs it occupies while it runs alone,
its stream, and the nodes of other streams it waits for (events). Each stream runs its nodes in
order, each after a launch gap (a replayed CUDA graph's per-kernel gap); a node starts when its
stream's previous node has ended, the gap has passed and every node it waits for has ended.

The overlap rule. Kernels that run at once share the device: whenever a set S of them runs,
each progresses at a common fraction lam of its speed alone, the largest lam <= 1 with

    lam * sum(bandwidth share) <= 1,  lam * sum(compute share) <= 1,  lam * sum(SM share) <= 1,

so no resource is used beyond 100%: the bytes of every kernel in S, GEMMs' included, go through
one memory bus, their FLOPs through one set of arithmetic units, their thread blocks onto one set
of SMs. Two kernels together therefore never take less than the largest of (sum of bytes) /
bandwidth, (sum of FLOPs) / rate and each one's own time. A kernel's SM share is the SMs its grid
occupies averaged over its waves: a grid of at least one full wave (a GEMM whose tiles fill the
GPU, a Triton grid of more programs than SMs) leaves a concurrent kernel only the SMs its last,
partial wave frees. That is the CUDA programming guide's concurrent-kernel rule (blocks of a
second kernel are scheduled only onto SMs with room left) with each block taking a whole SM, as a
GEMM's or a bandwidth-bound kernel's blocks nearly do on Hopper (shared memory and registers).

Where it may still be optimistic: the SM share is averaged over a kernel's waves, while the SMs a
last wave frees are free only during that wave; the common lam assumes the hardware shares
bandwidth in proportion to demand; two kernels that each reach the roofline alone also contend
for L2 and for the memory's row buffers, which no count here sees. Concurrent-kernel studies
measure overlap gains well below the fluid bound, and FlashAttention-3's overlap of softmax with
GEMMs is one kernel scheduling its own warps, not two kernels sharing SMs.

One stream: every node waits for the one before it, so the time is the sum of the nodes' times
and gaps, exactly what a serial count gives.

The last part turns bench/counter.py's launches of a training window into nodes, timed by
bench/roofline.py: the step's schedule as the code launches it, and what-ifs of more overlap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from bench.counter import Key, Launch, PHASES, Tally
from bench.roofline import Hardware, kernel_seconds


@dataclass(frozen=True)
class Node:
    """One kernel launch. Shares are of the whole GPU while the kernel runs alone, in [0, 1]."""

    name: str
    stream: int
    seconds: float  # alone
    bandwidth: float = 0.0  # bytes / (seconds x the device's bandwidth)
    compute: float = 0.0  # FLOPs / (seconds x its dtype's rate)
    sms: float = 1.0  # its grid's SMs, averaged over its waves
    waits: tuple[int, ...] = ()  # indices of earlier nodes (on other streams) it must follow
    gap: float = 0.0  # launch gap before it on its stream


def wave_share(blocks: int, sms: int) -> float:
    """The SMs a grid of `blocks` occupies averaged over its waves: 1 for whole waves, less when
    the last wave is partial (or the grid smaller than the GPU)."""
    if blocks <= 0:
        return 1.0
    return blocks / (math.ceil(blocks / sms) * sms)


def critical_path(nodes: list[Node]) -> float:
    """The time from the first node's start to the last node's end, streams in parallel under the
    overlap rule of the module docstring."""
    if not nodes:
        return 0.0
    for i, n in enumerate(nodes):
        if any(not 0 <= w < i for w in n.waits):
            raise ValueError(f"node {i} ({n.name}) waits for {n.waits}: only earlier nodes can be waited for")
    queues: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        queues.setdefault(n.stream, []).append(i)
    head = {s: 0 for s in queues}  # index into each stream's queue
    free_at = {s: 0.0 for s in queues}  # when each stream's last node ended
    end: dict[int, float] = {}
    left: dict[int, float] = {}  # running node -> remaining fraction of its work
    now = 0.0

    def ready_time(s: int) -> float | None:
        """When the head of stream s can start (None: it waits for a node still running or queued)."""
        i = queues[s][head[s]]
        if any(w not in end for w in nodes[i].waits):
            return None
        return max([free_at[s] + nodes[i].gap] + [end[w] for w in nodes[i].waits])

    while len(end) < len(nodes):
        running_streams = {nodes[i].stream for i in left}
        # start every head that is ready now
        starts = {}
        for s in queues:
            if head[s] < len(queues[s]) and s not in running_streams:
                t = ready_time(s)
                if t is not None:
                    starts[s] = t
        for s, t in starts.items():
            if t <= now:
                i = queues[s][head[s]]
                if nodes[i].seconds <= 0:
                    end[i], free_at[s] = now, now
                    head[s] += 1
                else:
                    left[i] = 1.0
        if any(t <= now for t in starts.values()) and not left:
            continue  # zero-time nodes ended: look for the next ready heads
        if not left:
            pending = [t for t in starts.values() if t > now]
            if not pending:
                raise ValueError("the streams' waits form a cycle")
            now = min(pending)
            continue
        lam = min([1.0] + [1.0 / total for total in (sum(nodes[i].bandwidth for i in left),
                                                     sum(nodes[i].compute for i in left),
                                                     sum(nodes[i].sms for i in left)) if total > 0])
        # the next event: a running node ends, or a stream's head becomes ready
        to_end = {i: left[i] * nodes[i].seconds / lam for i in left}
        step = min([*to_end.values()] + [t - now for t in starts.values() if t > now])
        now += step
        for i, t in to_end.items():
            if t <= step * (1 + 1e-12):
                del left[i]
                s = nodes[i].stream
                end[i], free_at[s] = now, now
                head[s] += 1
            else:
                left[i] -= step * lam / nodes[i].seconds
    return max(end.values())


# ---- the step's launches as nodes, on the streams they were launched on --------------------------

GEMM_TILE = (128, 128)  # a GEMM's output tile per thread block (cuBLAS's on Hopper are this or larger)


def launches_at(pair: tuple[list[Launch], list[Launch]], batches: tuple[int, int], batch: int) -> list[Launch]:
    """One window's launches at `batch` from the same window at two batches: the same launches in
    the same order, bytes, FLOPs, grids and GEMM shapes linear in the batch."""
    (b0, w0), (b1, w1) = sorted(zip(batches, pair))
    if len(w0) != len(w1) or any((x.name, x.phase, x.stream, x.waits) != (y.name, y.phase, y.stream, y.waits)
                                 for x, y in zip(w0, w1)):
        raise SystemExit(f"error: the window launches differently at batch {b0} and {b1}: measure at --batch directly")
    f = (batch - b0) / (b1 - b0)
    line = lambda p, q: p + (q - p) * f  # noqa: E731
    return [dataclasses.replace(x, read=line(x.read, y.read), written=line(x.written, y.written),
                                flops=line(x.flops, y.flops), programs=round(line(x.programs, y.programs)),
                                shape=tuple(round(line(p, q)) for p, q in zip(x.shape, y.shape)))
            for x, y in zip(w0, w1)]


def launch_node(x: Launch, hw: Hardware):
    """A launch as a node of the schedule (bench/schedule.py): its time alone, its shares of the
    device. A Triton grid takes its programs' share of the SMs (all of them from one wave up); a
    GEMM its output tiles' share averaged over its waves; other torch ops the whole GPU."""
    seconds = kernel_seconds(Key(x.phase, x.kind, x.name, x.dtype), Tally(1, x.read, x.written, x.flops, x.programs), hw)
    peak = hw.flops_per_s.get(x.dtype, hw.flops_per_s["float32"])
    if x.programs:
        sms = min(1.0, x.programs / hw.sms)
    elif x.shape:
        batch, m, n = x.shape
        sms = wave_share(batch * math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1]), hw.sms)
    else:
        sms = 1.0
    share = lambda v: v / seconds if seconds else 0.0  # noqa: E731
    return Node(x.name, x.stream, seconds, share((x.read + x.written) / hw.bytes_per_s), share(x.flops / peak), sms,
                gap=hw.graph_launch_s)


def phase_nodes(window: list[Launch], phase: str, hw: Hardware, moved=None) -> list[Node]:
    """The launches of one phase of a window as schedule nodes, their waits within the phase (the
    forward has ended before the backward starts). `moved(x)`: launches put on stream 1 instead,
    with no waits at all (`overlap_what_if`)."""
    index, nodes = {}, []
    for i, x in enumerate(window):
        if x.phase != phase:
            continue
        index[i] = len(nodes)
        node = launch_node(x, hw)
        if moved is None:
            node = dataclasses.replace(node, waits=tuple(index[w] for w in x.waits if w in index))
        else:
            node = dataclasses.replace(node, stream=1 if moved(x) else 0)
        nodes.append(node)
    return nodes


def scheduled_step(runs: dict, steps: tuple[int, int], batch: int, hw: Hardware) -> dict:
    """Per phase, one time step's time on the schedule: the critical path of the window of
    steps[1] steps minus that of steps[0], over the difference; with graph replay's gaps. Beside
    it the once-per-window part: the window of steps[0] steps less that many steps' share."""
    batches = tuple(sorted(runs))
    out, fixed = {}, {}
    for phase in PHASES:
        spans = []
        for i in range(2):
            if len(batches) == 1:
                window_launches = runs[batches[0]][i]
            else:
                window_launches = launches_at((runs[batches[0]][i], runs[batches[1]][i]), batches[:2], batch)
            spans.append(critical_path(phase_nodes(window_launches, phase, hw)))
        out[phase] = (spans[1] - spans[0]) / (steps[1] - steps[0])
        fixed[phase] = spans[0] - steps[0] * out[phase]
    streams = {x.stream for pair in runs.values() for w in pair for x in w}
    return dict(phases=out, seconds=sum(out.values()), tokens_per_s=batch / sum(out.values()), streams=len(streams),
                once_per_window=dict(phases=fixed, seconds=sum(fixed.values())))


# Triton kernels the reverse sweep launches over a chunk's rows (`_residual_rms` there: layer 0's inputs formed again)
ONCE_PER_CHUNK_KERNELS = {"_gate_factors", "_read_factors", "_residual_rms", "_chunk_carry_back", "_chunk_dm_products",
                          "_chunk_coefficients", "_chunk_finish", "_ce_lse", "_ce_grad"}
MEMORY_STEP_KERNELS = ("_chunk_step", "_step_fwd", "_step_bwd", "_read_fwd", "_read_bwd", "_gated_rms", "_head_sums")


def _once_per_chunk(x: Launch, batch: int) -> bool:
    """Whether a launch of the reverse sweep is once-per-chunk work rather than a step's: a GEMM
    not of the step's B rows (the recomputed projection, the weight gradients), a Triton kernel of
    the chunk's, any torch op (the chunk algebra, the factors, the bias sums)."""
    if x.kind == "gemm":
        return x.shape[1] != batch
    return x.kind != "triton" or x.name in ONCE_PER_CHUNK_KERNELS


OVERLAPS = {
    "once-per-chunk work beside the sweep": lambda x, b: x.phase == "backward" and _once_per_chunk(x, b),
    "memory kernels beside the step's GEMMs": lambda x, b: x.kind == "triton" and x.name.startswith(MEMORY_STEP_KERNELS),
}


def overlap_what_if(runs: dict, steps: tuple[int, int], batch: int, hw: Hardware) -> dict:
    """What moving work to a second stream could buy, under the overlap rule: the step's time with
    the launches each overlap names (and with both) on stream 1 and no wait between the streams at
    all, so no data dependency holds them back. Optimistic, for planning, not a schedule the code
    could run: a real one waits for its inputs."""
    batches = tuple(sorted(runs))
    if len(batches) < 2:
        return {}

    def step_time(side) -> float:
        total = 0.0
        for phase in PHASES:
            spans = []
            for i in range(2):
                w = launches_at((runs[batches[0]][i], runs[batches[1]][i]), batches[:2], batch)
                spans.append(critical_path(phase_nodes(w, phase, hw, moved=lambda x: side(x, batch))))
            total += (spans[1] - spans[0]) / (steps[1] - steps[0])
        return total

    bounds = {name: step_time(side) for name, side in OVERLAPS.items()}
    bounds["both"] = step_time(lambda x, b: any(side(x, b) for side in OVERLAPS.values()))
    return {name: dict(seconds=t, tokens_per_s=batch / t) for name, t in bounds.items()}


