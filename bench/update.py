"""What one optimiser step costs beyond its windows' time steps, and tokens/s per GPU for a global
token batch on N GPUs: the once-per-window work, AdamW's update and the gradients' all-reduce.

A training step on N GPUs with a global batch of `token_batch` tokens in windows of W runs
B = token_batch / (W N) sequences per GPU, one window each (no gradient accumulation: it would only
lower B), then one optimiser step. Its time per GPU:

    W x (one time step at B) + (the once-per-window work at B) + (the optimiser step) + (the all-reduce)

and tokens/s per GPU is token_batch / N over it.

- **One time step** is bench/step_cost.py's scheduled step (the windows of T = 1 and C + 1 steps,
  differenced, per launch extrapolated to B).
- **The once-per-window work** (the embedding, input projection, decoder and cross-entropy launches,
  the weights' fusion and casts, the gradients' unfolding) is the window of T0 = 1 step minus one
  step's share: on the schedule, span(T0) - T0 x step per phase. That window's one-step chunk also
  ran the once-per-chunk work, of which one step's share is only 1 / C, so the part keeps up to one
  chunk's once-per-chunk launches a window of whole chunks would not add: an overestimate by at most
  one chunk's once-per-chunk work. The fused core captures its loops in CUDA graphs; the work outside
  them is launched from Python one op at a time, so the part is the larger of its scheduled time and
  its launches at the host's cost per launch (`Hardware.eager_launch_s`).
- **The optimiser step**, as the training engine runs it (gpn_scale/train/engine.py, optim.py):
  torch's AdamW (foreach, the default on CUDA) over float32 weights (bf16 is autocast's compute
  dtype; the weights, their gradients and Adam's two moments are float32), wrapped by DeepSpeed's ZeRO
  at the config's stage (the recipes' is 2). AdamW's bytes per element are counted here by
  bench/counter.py's counter on torch's own `step` (`adamw_bytes`; an argument passed twice, the
  gradient in `addcmul_`, counts twice, as the counter counts any op). At ZeRO stage 1 or 2 each GPU
  updates its 1 / N share of the weights and DeepSpeed adds, per element of the share, the gradient
  norm (read), clipping's scale (read and written: it runs whenever `gradient_clipping` > 0) and the
  updated share copied into the model's weights (read and written), and for every parameter the
  gradient's copy into the reduction bucket (read and written); at stage 0 every GPU updates all of
  them, and the gradients are flattened for the all-reduce and back, their norm read by the engine and
  by DeepSpeed's clipping, and scaled. These passes are read off DeepSpeed 0.19's stage_1_and_2.py and
  engine.py (`ZERO_PASSES`), not counted. The step's time is its bytes at the bandwidth plus a graph's
  gap per launch, or its launches at the host's cost where that is larger.
- **The all-reduce** of the float32 gradients across N GPUs: a ring all-reduce moves 2 (N - 1) / N
  x the gradients' bytes per GPU (at ZeRO 1-2 the same bytes as a reduce-scatter of the gradients and
  an all-gather of the updated weights), at the bus bandwidth `link_efficiency` x the link's:
  NVLink within a node (N <= `gpus_per_node`); across nodes the rings' inter-node hops, each GPU's
  adapter carrying 1 / `gpus_per_node` of the data, at `gpus_per_node` x `nic_bytes_per_s` (and no
  more than NVLink). The bandwidth term alone: the rings' 2 (N - 1) latencies are not counted.
  **Overlap.** GPN+M: none. The fused core's reverse sweep produces its weights' gradients with its
  last chunk, after which only the input projection's and embedding's gradients remain, and the
  decoder's, ready before the sweep, are a small share; DeepSpeed's default reduction bucket (5e8
  elements) holds all of a 130M model, reduced when the backward has ended. Transformer++ as a tuned
  implementation runs it: each layer's gradients reduced while the layers below run their backward
  (DDP's or FSDP's buckets), all of it hidden under the backward except the last bucket (the tied
  embedding, complete only when the input's embedding backward ends, and the first block) and any
  excess of the rest over the backward's time; NCCL's own use of the SMs, which slows the backward
  beside it, is not counted.
"""

from __future__ import annotations

import functools

import torch

# DeepSpeed's passes over the float32 gradients and weights beside AdamW's own, bytes per element
# (the module docstring): per element of this GPU's share of the update, and per parameter.
ZERO_PASSES = {
    0: dict(per_shard=0, per_param=2 * 8 + 4 + 4 + 8),  # flatten and unflatten; norm (engine); clip: norm, scale
    1: dict(per_shard=4 + 8 + 8, per_param=8),  # norm, clip's scale, copy back; the bucket copy
    2: dict(per_shard=4 + 8 + 8, per_param=8),
}
F32 = 4


@functools.cache
def adamw_bytes(weight_decay: bool) -> dict:
    """Bytes per element and launches of one step of torch's AdamW (foreach, float32), as the
    counter counts it: a group of two tensors, its first step (the moments' creation) not counted.
    `weight_decay`: the decayed group's extra pass over the weights."""
    from bench.counter import LaunchCounter

    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(96))]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1 if weight_decay else 0.0, foreach=True)
    optimizer.step()
    steps = {optimizer.state[p]["step"].untyped_storage().data_ptr() for p in params}
    with LaunchCounter() as counter:
        optimizer.step()
    # the step counters are host tensors off CUDA graphs (not `capturable`): no device launch
    device = [x for x in counter.launches if not x.name.startswith("_record_function")
              and not {ptr for ptr, _ in x.writes} <= steps]
    elements = sum(p.numel() for p in params)
    return dict(bytes_per_element=sum(x.read + x.written for x in device) / elements, launches=len(device),
                ops=[x.name for x in device])


def optimizer_cost(decay: int, no_decay: int, gpus: int, zero: int, hw) -> dict:
    """The optimiser step on one of `gpus` GPUs: AdamW over its share of `decay` decayed and `no_decay`
    other float32 parameters, and DeepSpeed's passes at ZeRO `zero` (the module docstring)."""
    if zero not in ZERO_PASSES:
        raise ValueError(f"zero: stages {sorted(ZERO_PASSES)} are counted, got {zero}")
    share = 1 / gpus if zero >= 1 else 1.0
    adam = {True: adamw_bytes(True), False: adamw_bytes(False)}
    passes = ZERO_PASSES[zero]
    params = decay + no_decay
    adamw = share * (decay * adam[True]["bytes_per_element"] + no_decay * adam[False]["bytes_per_element"])
    zero_bytes = share * params * passes["per_shard"] + params * passes["per_param"]
    groups = [g for g, n in ((True, decay), (False, no_decay)) if n]
    # ZeRO 1-2: one flat tensor per group, one launch per foreach op; DeepSpeed's passes, about one each
    launches = sum(adam[g]["launches"] for g in groups) + 4 * len(groups)
    device = (adamw + zero_bytes) / hw.bytes_per_s + launches * hw.graph_launch_s
    return dict(zero=zero, gpus=gpus, share=share, adamw_bytes=adamw, zero_bytes=zero_bytes, bytes=adamw + zero_bytes,
                launches=launches, seconds=max(device, launches * hw.eager_launch_s),
                adamw_bytes_per_element=adam[True]["bytes_per_element"])


def bus_bandwidth(gpus: int, hw) -> tuple[float, str]:
    """The bytes per second a ring all-reduce moves per GPU on `gpus` GPUs, and its bounding link."""
    if gpus <= hw.gpus_per_node:
        return hw.link_efficiency * hw.nvlink_bytes_per_s, "NVLink"
    return hw.link_efficiency * min(hw.nvlink_bytes_per_s, hw.gpus_per_node * hw.nic_bytes_per_s), "InfiniBand"


def allreduce_cost(grad_bytes: float, gpus: int, hw) -> dict:
    """The ring all-reduce of `grad_bytes` of gradients on each of `gpus` GPUs: 2 (N - 1) / N x the
    bytes per GPU, at the bus bandwidth (`bus_bandwidth`)."""
    moved = 2 * (gpus - 1) / gpus * grad_bytes
    rate, link = bus_bandwidth(gpus, hw)
    return dict(gpus=gpus, grad_bytes=grad_bytes, bytes_per_gpu=moved, bus_bytes_per_s=rate, link=link,
                seconds=moved / rate)


def exposed_allreduce(seconds: float, backward_s: float, last_share: float) -> float:
    """What a layer-by-layer all-reduce leaves after the backward: the last bucket (`last_share` of
    the bytes, ready when the backward ends) and whatever of the rest outlasts the backward."""
    return seconds * last_share + max(0.0, seconds * (1 - last_share) - backward_s)


def per_gpu_batch(token_batch: int, window: int, gpus: int) -> int:
    """B = token_batch / (W N) sequences per GPU: refused unless a whole number, at least 1."""
    from data_prep.errors import UserError

    if token_batch % (window * gpus) or token_batch < window * gpus:
        raise UserError(f"--token-batch {token_batch} on {gpus} GPU(s) in windows of {window}: "
                        f"{token_batch} / ({window} x {gpus}) = {token_batch / (window * gpus):g} sequences per GPU, "
                        "not a whole number >= 1")
    return token_batch // (window * gpus)


def once_per_window(schedule: dict, launches: float, hw) -> dict:
    """The once-per-window part from the step's schedule (`scheduled_step`'s `once_per_window`)
    and the window's once-per-window launches: the larger of its scheduled time and its launches at
    the host's cost (outside the core's CUDA graphs ops are launched one by one)."""
    scheduled = schedule["once_per_window"]["seconds"]
    host = launches * hw.eager_launch_s
    return dict(launches=launches, scheduled_s=scheduled, host_s=host, seconds=max(scheduled, host),
                phases=schedule["once_per_window"]["phases"])


def optimiser_step_time(step_s: float, window: int, window_s: float, optimizer_s: float, allreduce_s: float) -> float:
    """One optimiser step's time per GPU: W time steps, the once-per-window work, the optimiser,
    the all-reduce left exposed."""
    return window * step_s + window_s + optimizer_s + allreduce_s
