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
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
