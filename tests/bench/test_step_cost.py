"""bench/step_cost.py on the tiny GPN+M: what it counts per time step against a count by hand
from the fused core's structure, and a stray dtype conversion in the loop must break that count."""

import dataclasses
import importlib.util
import json
import math
import sys

import pytest
import torch

import bench.counter as counting
from bench import baseline, roofline, schedule, update
from bench.counter import LaunchCounter
from support import ROOT
from support.triton_kernels import DEVICE, INTERPRET, interpreter  # noqa: F401  (Triton's interpreter on CPU)

_spec = importlib.util.spec_from_file_location("step_cost", ROOT / "bench" / "step_cost.py")
step_cost = importlib.util.module_from_spec(_spec)
sys.modules["step_cost"] = step_cost
_spec.loader.exec_module(step_cost)

STEPS = (2, 3)


def hand_count() -> dict[tuple[str, str], int]:
    """Launches per time step of GPN+M with one layer, read off the fused core's loop.

    Forward: the projection GEMM, post_projection, the memory step (_step_fwd, _gated_rms_fwd),
    the second GEMM, residual_rms, the fuse-gate GEMM, ground. Backward: the memory step again
    (M rebuilt inside the chunk), the fuse gate's GEMM (its input, dL/dg times the gate's factor,
    written by the step after's last residual_rms backward: no mul inside a chunk), residual_rms
    backward, the second GEMM, gate_grads, the memory backward (_gated_rms_bwd, _step_bwd, which
    writes dv into the chunk's projection-gradient rows, and the per-head sums of its column
    blocks, _head_sums, which write the write gates' gradients times their factors there too),
    the heads' l2n backward, the projection GEMM, residual_rms backward again, which writes the
    step's input gradient into its row of du (no copy) and the next step's fuse-gate input.

    Under bf16 the Triton groups and the memory kernels read the GEMMs' outputs and write their
    inputs in bf16, so the step GEMMs cast nothing, forward or backward; in any dtype nothing
    is copied and no torch elementwise op runs per step.
    """
    return {("forward", "gemm"): 3, ("forward", "triton"): 5, ("forward", "cast"): 0, ("forward", "copy"): 0,
            ("forward", "other"): 0,
            ("backward", "gemm"): 3, ("backward", "triton"): 9, ("backward", "cast"): 0,
            ("backward", "copy"): 0, ("backward", "other"): 0}


TRITON_KERNELS = {
    "forward": {"_post_projection": 1, "_step_fwd": 1, "_gated_rms_fwd": 1, "_residual_rms": 1, "_ground": 1},
    "backward": {"_step_fwd": 1, "_gated_rms_fwd": 1, "_residual_rms_bwd": 2, "_gate_grads": 1, "_gated_rms_bwd": 1,
                 "_step_bwd": 1, "_head_sums": 1, "_l2n_relu_bwd": 1},
}


def launches(per_step) -> dict[tuple[str, str], float]:
    out = {(p, k): 0 for p in counting.PHASES for k in counting.KINDS}
    for (phase, kind, _, _), t in per_step.items():
        out[(phase, kind)] += t.count
    return out


# Triton kernels launched once per window (the cross-entropy, per chunk of rows) or once per
# chunk of the reverse sweep (the SwiGLU's, predict gate's and fuse gate's factors, the reads' factors,
# layer 0's inputs formed again), outside the loop: no launch per step, their per-token bytes stay in
# the step's rows.
ONCE_PER_WINDOW = {"forward": {"_ce_lse"}, "backward": {"_ce_grad", "_gate_factors", "_read_factors", "_residual_rms"}}


def check_hand_count(per_step):
    assert launches(per_step) == hand_count()
    for phase, names in TRITON_KERNELS.items():
        assert {k[2]: t.count for k, t in per_step.items() if k[0] == phase and k[1] == "triton" and t.count} == names
        once = {k[2]: t for k, t in per_step.items() if k[0] == phase and k[1] == "triton" and not t.count}
        assert once.keys() == ONCE_PER_WINDOW[phase] and all(t.read > 0 for t in once.values())


@pytest.fixture(scope="module")
def tiny():
    """The tiny GPN+M (the memory's step form) under bf16 with the Triton kernels, counted at
    batches 2, 3 and 4."""
    with pytest.MonkeyPatch.context() as mp:
        if INTERPRET:
            mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("GPN_SCALE_CPU_STREAMS", "1")  # the core's side stream, in the stand-in the counter observes
        args = step_cost.parse_args(["--config", "gpn_m_tiny", "--device", DEVICE, "--batch", "4", "memory_form=step"])
        model, cfg = step_cost.build(args)
        costs = counting.step_costs(model, [2, 3, 4], STEPS, "bf16", torch.device(DEVICE))
    return model, cfg, costs


def test_launches_per_step_match_the_hand_count(tiny):
    _, _, costs = tiny
    for batch in (2, 3, 4):
        check_hand_count(costs[batch][0])


def test_gemm_flops_and_memory_traffic_per_step_match_the_model(tiny):
    _, cfg, costs = tiny
    B, (per_step, _) = 4, costs[4]
    d, F, H, dk, dv, E, V = cfg.d_state, cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.d_val, cfg.d_emb, cfg.vocab_size
    N = 2 * H * dk + 2 * H * dv + 2 * H + 2 * F + d  # layer 0's fused projection: k, q, gate, v, beta, a, FFN W1, predict gate
    K2 = F + H * dv  # FFN W2 and the read's W_o
    loop = d * N + K2 * d + d * d  # the step's three GEMMs, multiply-adds per row
    window = E * d + d * E + E * V  # per token outside the loop: input projection, decoder, logits
    flops = {p: sum(t.flops for k, t in per_step.items() if k[0] == p) for p in counting.PHASES}
    assert flops["forward"] == 2 * B * (loop + window)
    # Backward: the input-gradient GEMMs of the step, the chunk's recomputed projection and fuse
    # gate, the weight gradients over the chunk's rows; outside: logits recomputed, their two
    # gradients, and both gradients of the decoder and of the input projection.
    assert flops["backward"] == 2 * B * (loop + (d * N + d * d) + loop + 3 * E * V + 2 * d * E + 2 * E * d)
    # The memory kernels move M (float32) and a few vectors per (sequence, head).
    m = B * H * dk * dv * 4
    fwd, bwd = per_step[("forward", "triton", "_step_fwd", "float32")], per_step[("backward", "triton", "_step_bwd", "float32")]
    assert m <= fwd.read < 1.5 * m and m <= fwd.written < 1.5 * m
    assert 2 * m <= bwd.read < 2.5 * m and m <= bwd.written < 1.5 * m
    # Grids: the per-row groups split a row of n into column blocks of a power of two, n / 9 or
    # less (9 blocks a row: 2 x 132 programs at batch 32) but at least 32 columns, or one head;
    # the memory step's backward splits M's columns into blocks as its forward does, its
    # per-head sums one program per (sequence, head).
    rows = lambda n, least=32: B * math.ceil(n / min(n, max(least, 2 ** int(math.log2(max(n // 9, 1))))))  # noqa: E731
    grids = {("forward", "_post_projection"): max(rows(F), rows(2 * H, 1)), ("forward", "_residual_rms"): rows(d),
             ("forward", "_ground"): rows(d), ("forward", "_gated_rms_fwd"): rows(H * dv),
             ("backward", "_residual_rms_bwd"): rows(d), ("backward", "_gate_grads"): rows(max(F, d)),
             ("backward", "_gated_rms_bwd"): rows(H * dv), ("backward", "_l2n_relu_bwd"): rows(H, 1),
             ("backward", "_head_sums"): B * H}
    assert {(k[0], k[2]): t.programs for k, t in per_step.items() if (k[0], k[2]) in grids} == grids
    assert bwd.programs == fwd.programs
    for phase in counting.PHASES:
        smallest = min([fwd.programs] + [n for (p, _), n in grids.items() if p == phase])
        assert roofline.phase_cost(per_step, phase, roofline.H200).min_programs == smallest == 2 * B  # d = 64: 2 blocks of 32


def test_batch_extrapolation_equals_a_direct_count(tiny):
    _, _, costs = tiny
    direct = costs[4][0]
    scaled = counting.extrapolate({2: costs[2][0], 3: costs[3][0]}, 4)
    assert scaled.keys() == direct.keys()
    for key, t in direct.items():
        s = scaled[key]
        assert (s.count, s.programs) == (t.count, t.programs), key
        assert (s.read, s.written, s.flops) == pytest.approx((t.read, t.written, t.flops), rel=1e-9, abs=1e-6), key


def test_a_stray_cast_in_the_step_gemm_breaks_the_count(tiny, monkeypatch):
    model, _, _ = tiny
    backend = model.backend(torch.device(DEVICE).type)
    assert backend.name == "triton"
    original = backend.step.mm  # the step GEMM the fused core calls

    def mm_with_round_trip(x, W, out=None, bias=None):
        return original(x.to(torch.float64).to(x.dtype), W, out=out, bias=bias)

    stray = dataclasses.replace(backend, step=dataclasses.replace(backend.step, mm=mm_with_round_trip))
    monkeypatch.setattr(model, "backend", lambda device_type: stray)
    per_step, _ = counting.step_costs(model, [2], STEPS, "bf16", torch.device(DEVICE), warm=False)[2]
    with pytest.raises(AssertionError):
        check_hand_count(per_step)
    assert launches(per_step)[("forward", "cast")] == hand_count()[("forward", "cast")] + 2 * 3


def test_indexed_and_metadata_only_ops_count_what_they_touch():
    """A gather, an index and an index_put_ (the cross-entropy's target logits) read and write the
    elements their indices name and the indices, not the whole tensor."""
    rows, vocab = 6, 1000
    logits, rows_at, targets = torch.randn(rows, vocab), torch.arange(rows), torch.randint(0, vocab, (rows,))
    with LaunchCounter() as counter:
        logits.gather(1, targets[:, None])
        logits[rows_at, targets] -= 1.0  # index, sub, index_put_
    got = {x.name: (x.read, x.written) for x in counter.launches}
    f32, i64 = 4, 8
    assert got["gather"] == (rows * (f32 + i64), rows * f32)
    assert got["index"] == (rows * (f32 + 2 * i64), rows * f32)
    assert got["index_put_"] == (rows * (f32 + 2 * i64), rows * f32)
    with LaunchCounter() as counter:
        logits.new_zeros((rows, 2))  # reads nothing of logits
    assert [(x.name, x.read, x.written) for x in counter.launches] == [("new_zeros", 0, rows * 2 * f32)]


@pytest.fixture(scope="module")
def tiny_chunk():
    """The tiny GPN+M in the memory's chunk form (chunks of 4) under bf16 with the Triton kernels,
    a whole chunk's steps counted (windows of 5 and 1 steps) at batches 2 and 3."""
    with pytest.MonkeyPatch.context() as mp:
        if INTERPRET:
            mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("GPN_SCALE_CPU_STREAMS", "1")  # the core's side stream, in the stand-in the counter observes
        args = step_cost.parse_args(["--config", "gpn_m_tiny", "--device", DEVICE, "memory_form=chunk", "core_chunk=4"])
        model, cfg = step_cost.build(args)
        runs = counting.measure(model, [2, 3], (1, 1 + cfg.core_chunk), "bf16", torch.device(DEVICE))
    return cfg, counting.costs_of(runs, (1, 1 + cfg.core_chunk)), runs


def test_chunk_form_reads_M_once_per_step_and_writes_it_once_per_chunk(tiny_chunk):
    """Per step the chunk form's kernels read M_c once each way (and the chunk's rows, which are
    a few vectors per step), the step form's kernels are gone, and what passes over M and dL/dM
    once per chunk is counted per step at 1 / chunk length."""
    cfg, costs, _ = tiny_chunk
    C, B = cfg.core_chunk, 3
    per_step, _ = costs[B]
    m = B * cfg.n_heads * cfg.d_key * cfg.d_val * 4
    triton = {(k.phase, k.name): t for k, t in per_step.items() if k.kind == "triton"}
    assert not {name for _, name in triton} & {"_step_fwd", "_step_bwd", "_head_sums", "_read_fwd", "_read_bwd"}
    for key in (("forward", "_chunk_step_fwd"), ("backward", "_chunk_step_bwd")):
        assert triton[key].count == 1, key
    for name in ("_chunk_dm_products", "_chunk_coefficients", "_chunk_finish", "_chunk_carry_back"):
        key = ("backward", name)
        assert triton[key].count == pytest.approx(1 / C), key
    # the chunk's C x C algebra and its carry's terms are the kernels': no decay products, triangular
    # solve or batched products in torch
    torch_algebra = {"linalg_solve_triangular", "cumprod", "eye", "bmm", "baddbmm_"}
    assert not {k.name for k in per_step if k.phase == "backward"} & torch_algebra
    fwd, bwd = triton[("forward", "_chunk_step_fwd")], triton[("backward", "_chunk_step_bwd")]
    # M_c read once; beyond it only the chunk's rows (keys, queries, deltas, read gradients), a
    # step's own vectors and rows of its C x C matrices
    dk, dv = cfg.d_key, cfg.d_val
    rows = B * cfg.n_heads * 4 * (C * 2 * (dk + dv) + 8 * dv + 4 * C * C)
    assert m <= fwd.read < m + rows and m / C <= fwd.written < m  # M written at the chunk's end alone
    assert m <= bwd.read < m + rows and bwd.written < m / 2  # no M-sized write
    carry = triton[("backward", "_chunk_carry_back")]
    assert carry.written == pytest.approx(m / C) and carry.read >= m / C  # dM_end in, dL/dM_c out, once per chunk
    assert triton[("backward", "_chunk_dm_products")].read >= m / C
    # the memory's launches are summed apart, and hold these kernels' bytes
    memory = sum(t.memory for t in per_step.values())
    assert memory >= fwd.read + fwd.written + bwd.read + bwd.written + carry.read + carry.written


def test_flash_attention_costs_are_the_stated_formula():
    B, H, T, D = 2, 3, 16, 8
    fwd, bwd = baseline.flash_attention("forward", B, H, T, D), baseline.flash_attention("backward", B, H, T, D)
    qkv, stats = B * H * T * D * 2, B * H * T * 4
    assert (fwd.read, fwd.written, fwd.flops) == (3 * qkv, qkv + stats, 2 * B * H * T * T * D)
    assert (bwd.read, bwd.written, bwd.flops) == (5 * qkv + 2 * stats, 3 * qkv, 5 * B * H * T * T * D)


def test_memory_floor_of_each_form_and_read_dtype_by_hand():
    """M's traffic per token as each form is designed: the step form's passes per step, the chunk
    form's one read per step and its per-chunk passes, and with bf16 reads half the per-step read
    plus the copy made once per chunk each way. Only bf16 training has a narrower copy to read."""
    from gpn_scale.models.gpn import GPNConfig

    base = dict(family="gpn_m", vocab_size=64, d_state=32, d_emb=16, d_ffn=32, n_layers=2, n_heads=3, d_key=4, d_val=8,
                core_chunk=8)
    m = 3 * 4 * 8 * 4
    floor = lambda dtype="bf16", **kw: roofline.memory_floor(GPNConfig(**{**base, **kw}), roofline.H200, dtype)
    step, chunk = floor(memory_form="step"), floor(memory_form="chunk")
    low = floor(memory_form="chunk", memory_reads="compute")
    assert (step["forward_bytes_per_token"], step["backward_bytes_per_token"]) == (3 * m, 8 * m)
    assert (chunk["forward_bytes_per_token"], chunk["backward_bytes_per_token"]) == (m * (2 + 1 / 8), m * (2 + 4 / 8))
    assert (low["forward_bytes_per_token"], low["backward_bytes_per_token"]) == (m * (1 + 2.5 / 8), m * (1 + 5.5 / 8))
    assert low["reads"] == "bf16" and chunk["reads"] == "float32"
    assert floor("fp32", memory_form="chunk", memory_reads="compute") == chunk
    assert low["tokens_per_s"] == pytest.approx(roofline.H200.bytes_per_s / (m * (2 + 8 / 8)))


def test_command_line_table_json_and_bad_config(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert step_cost.main(["--config", "gpn_m_tiny", "--kernel", "torch", "--device", "cpu", "--batch", "8,16", "core_chunk=4",
                           "--baseline", "transformer_tiny", "--baseline-seq-len", "16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "measured at batch 2 and 3, extrapolated linearly" in printed and "(window of T=5 minus T=1) / 4" in printed
    result, at16 = json.loads(out.read_text())  # one measurement, a report per batch
    assert at16["batch"] == 16 and "batch 16 (measured at batch 2 and 3" in printed
    assert at16["memory_bytes_per_token"]["forward"] == pytest.approx(result["memory_bytes_per_token"]["forward"], rel=0.2)
    assert result["batch"] == 8 and set(result["phases"]) == {"forward", "backward"}
    assert result["memory_floor"]["m_bytes"] == 4 * 4 * 16 * 16
    assert result["tokens_per_s"]["graph"] > 0 and result["tokens_per_s"]["eager"] > 0  # measured, not compared: a
    # test's verdict never depends on how fast this machine is at the moment
    base = result["baseline"]
    assert base["config"] == "transformer_tiny" and base["seq_len"] == 16 and base["tokens_per_s"] > 0
    assert result["over_baseline"]["tuned"] == pytest.approx(result["tokens_per_s"]["graph"] / base["tokens_per_s"])
    assert result["over_baseline"]["eager"] == pytest.approx(result["tokens_per_s"]["graph"] / base["eager"]["tokens_per_s"])
    assert "GPN estimate / Transformer++ (tuned)" in printed
    assert result["schedule"]["streams"] == 2  # the weight gradients' side stream
    assert step_cost.main(["--config", "transformer_tiny", "--baseline-seq-len", "16", "--contexts", "64"]) == 0  # alone
    printed = capsys.readouterr().out
    assert "transformer_tiny: a window of 32 x 16 tokens" in printed and "a window of 8 x 64 tokens" in printed
    assert step_cost.main(["--config", "no_such_model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no_such_model" in err[0]


def test_single_stream_schedule_is_the_serial_sum_of_its_launches(tiny_chunk_runs):
    """The launches on one stream: the scheduled step is their roofline times and graph gaps one
    after another, per step (the window of C + 1 steps minus the window of 1), and it is the
    per-kernel serial count; at each batch, extrapolated per launch."""
    cfg, runs = tiny_chunk_runs
    runs = {b: [[dataclasses.replace(x, stream=0, waits=()) for x in w] for w in pair] for b, pair in runs.items()}
    hw, steps = roofline.H200, (1, 1 + cfg.core_chunk)
    for batch in (3, 256):
        sch = schedule.scheduled_step(runs, steps, batch, hw)
        assert sch["streams"] == 1
        for phase in counting.PHASES:
            serial = []
            for i in range(2):
                window = schedule.launches_at((runs[2][i], runs[3][i]), (2, 3), batch)
                serial.append(sum(roofline.kernel_seconds(counting.Key(x.phase, x.kind, x.name, x.dtype),
                                                           counting.Tally(1, x.read, x.written, x.flops, x.programs), hw)
                                  + hw.graph_launch_s for x in window if x.phase == phase))
            assert sch["phases"][phase] == pytest.approx((serial[1] - serial[0]) / cfg.core_chunk, rel=1e-9)
            # the once-per-window part: the window of one step less one step's share
            once = sch["once_per_window"]["phases"][phase]
            assert once == pytest.approx(serial[0] - sch["phases"][phase], rel=1e-9) and once > 0
        # the count per kernel name (all its launches summed, timed at their smallest grid) differs
        # only where one kernel's launches differ in grid or in what binds them
        per_step = counting.extrapolate({b: c[0] for b, c in counting.costs_of(runs, steps).items()}, batch)
        tally_s = sum(roofline.phase_cost(per_step, p, hw).graph_s for p in counting.PHASES)
        assert sch["seconds"] == pytest.approx(tally_s, rel=0.01)
        # work moved to a second stream with no waits never takes longer than the one stream
        bounds = schedule.overlap_what_if(runs, steps, batch, hw)
        assert set(bounds) == set(schedule.OVERLAPS) | {"both"}
        assert all(0 < b["seconds"] <= sch["seconds"] * (1 + 1e-9) for b in bounds.values())


@pytest.fixture(scope="module")
def tiny_chunk_runs(tiny_chunk):
    cfg, _, runs = tiny_chunk
    return cfg, runs


def test_fusion_reads_what_comes_from_outside_once_and_writes_what_is_read_after():
    """A run of elementwise ops between two GEMMs is one kernel: it reads h (the first GEMM's
    output) once although three ops read it, writes g (read by the next GEMM) and s (read again
    after the second GEMM), and nothing of its other temporaries; a gradient (a result of the
    window) is written although nothing reads it."""
    a, w, w2 = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16, 8)
    grad = torch.zeros(16)
    with LaunchCounter() as counter:
        h = a @ w
        s = torch.sigmoid(h)
        g = s * h + h
        grad.add_(h.sum(0))
        y = g @ w2
        z = y.sum() + s.sum()
    del z
    fused = baseline.fuse_elementwise(counter.launches, results={grad.untyped_storage().data_ptr()})
    assert [x.kind for x in fused] == ["gemm", "fused", "gemm", "fused"]
    f32 = 4
    group = fused[1]
    assert group.read == 64 * 16 * f32 + 16 * f32  # h once, and the gradient it accumulates into
    assert group.written == 64 * 16 * f32 * 2 + 16 * f32  # g and s, and the gradient
    eager = sum(x.read for x in counter.launches[1:-3])
    assert eager > 3 * 64 * 16 * f32  # as launched, each op reads h or its temporaries again


def test_tuned_baseline_between_its_gemms_and_its_eager_count():
    """The tuned Transformer++ launches fewer kernels and takes less time than as launched, and no
    less than its GEMMs and attention alone; another context at as many tokens keeps every
    non-attention byte and FLOP, and attention's FLOPs grow with the context."""
    args = step_cost.parse_args(["--config", "transformer_tiny", "--baseline-seq-len", "16", "--device", "cpu"])
    args.baseline = "transformer_tiny"
    count = baseline.baseline_tallies(args)
    hw = roofline.H200
    b = baseline.baseline_window(count, 8, hw)
    assert b["launches"] < b["eager"]["launches"] and b["bytes"] < b["eager"]["bytes"]
    assert b["gemm_attention_s"] <= b["device_s"] and b["graph_s"] < b["eager"]["graph_s"]
    longer = baseline.baseline_window(count, 2, hw, seq_len=64)
    fa = lambda bb, T: sum(baseline.flash_attention(p, bb, count.heads, T, count.head_dim).flops * count.attention_calls[p]  # noqa: E731
                           for p in counting.PHASES)
    assert longer["flops"] - fa(2, 64) == pytest.approx(b["flops"] - fa(8, 16))
    assert fa(2, 64) == pytest.approx(4 * fa(8, 16))  # T^2 per sequence, a quarter of the sequences
    assert count.attention_calls == {"forward": 2, "backward": 2}  # one per layer each way


def test_peak_memory_is_the_documented_formula():
    """docs/core.md's per-token saved floats (u, P, later layers' inputs, the write's gates; the
    chunk form's reads, errors and deltas), M at every chunk's start, one chunk of backward work,
    the logits of one cross-entropy chunk and the weights with gradients and Adam's moments."""
    from gpn_scale.models.gpn import GPNConfig

    cfg = GPNConfig(family="gpn_m", vocab_size=64, d_state=32, d_emb=16, d_ffn=48, n_layers=2, n_heads=3, d_key=4,
                    d_val=8, core_chunk=8, memory_form="chunk", ce_chunk=16)
    B, T, params = 5, 20, 1000
    pm = roofline.peak_memory(cfg, B, T, params)
    m = 3 * 4 * 8 * 4 * B
    assert pm["saved"] == B * T * 4 * (2 * 32 + 1 * 33 + 3 * 3 + 4 * 3 * 8)
    assert pm["m_per_chunk"] == 3 * m  # chunks of 8 in 20 steps: 3
    n = 2 * 3 * 4 + 2 * 3 * 8 + 2 * 3 + 2 * 48 + 32
    assert pm["backward_chunk"] == 3 * m + 2 * 8 * B * (2 * n + 2 * (48 + 24) + 4 * 32) * 4  # two workspaces
    assert pm["logits"] == 2 * 16 * 64 * 4 and pm["weights_and_optimizer"] == 16 * params
    assert pm["total"] == sum(v for k, v in pm.items() if k != "total")
    step = roofline.peak_memory(dataclasses.replace(cfg, memory_form="step"), B, T, params)
    assert step["saved"] == B * T * 4 * (2 * 32 + 33 + 9) and step["backward_chunk"] - pm["backward_chunk"] == (8 + 2 - 3) * m
    low = roofline.peak_memory(dataclasses.replace(cfg, memory_reads="compute"), B, T, params)
    assert low["m_per_chunk"] == 3 * m // 2 and low["backward_chunk"] == pm["backward_chunk"]  # M_c kept as its bf16 copy
    keep = roofline.peak_memory(dataclasses.replace(cfg, core_projections="keep"), B, T, params)
    assert keep["saved"] - pm["saved"] == B * T * 2 * (n + (3 * 4 + 3 * 8 + 2 * 48 + 32))  # both layers' projections, bf16
    assert pm["backward_chunk"] - keep["backward_chunk"] == 2 * 8 * B * n * 4  # no workspace to recompute them into


def test_the_weight_gradients_run_on_the_side_stream_after_the_sweep(tiny_chunk_runs):
    """The count sees the fused core's streams: the side stream holds the weight gradients (GEMMs
    of d_in x d_out, the bias and dA_log sums and their accumulation), each chunk's first launch
    there waits for the sweep, the main stream waits for them before the chunk after the next;
    the schedule of both streams takes no longer than the same launches on one."""
    cfg, runs = tiny_chunk_runs
    hw, steps = roofline.H200, (1, 1 + cfg.core_chunk)
    long_window = runs[3][1]
    side = [x for x in long_window if x.stream == 1]
    assert side and all(x.phase == "backward" for x in side)
    gemms = {x.shape[1:] for x in side if x.kind == "gemm"}
    assert gemms and all(m in (cfg.d_state, cfg.d_ffn + cfg.n_heads * cfg.d_val) for m, _ in gemms)  # dW = X^T dY
    assert not any(x.kind == "triton" for x in side)  # the sweep's kernels stay on the main stream
    waits_side = [x for x in side if x.waits]
    waits_main = [x for x in long_window if x.stream == 0 and any(long_window[w].stream == 1 for w in x.waits)]
    assert waits_side and waits_main
    one = {b: [[dataclasses.replace(x, stream=0, waits=()) for x in w] for w in pair] for b, pair in runs.items()}
    for batch in (3, 256):
        two_s = schedule.scheduled_step(runs, steps, batch, hw)
        one_s = schedule.scheduled_step(one, steps, batch, hw)
        assert two_s["streams"] == 2 and one_s["streams"] == 1
        assert two_s["seconds"] <= one_s["seconds"] * (1 + 1e-9)


def test_a_carried_state_costs_nothing_per_step():
    """train.carry_state starts each window from the state the last one ended with: every step's
    launches, bytes and FLOPs are those of a window from the empty state (the window's own fixed
    cost loses the empty state's fills). The chunk form, windows of whole chunks."""
    args = step_cost.parse_args(["--config", "gpn_m_tiny", "--device", "cpu", "--batch", "2", "memory_form=chunk",
                                 "kernel=torch", "core_chunk=2"])
    model, _ = step_cost.build(args)
    empty, carried = (counting.step_costs(model, [2], (2, 4), "fp32", torch.device("cpu"), warm=not c, carried=c)[2]
                      for c in (False, True))
    assert empty[0] == carried[0]  # per step: the same tallies
    fills = {k: t for k, t in empty[1].items() if carried[1].get(k) != t}
    assert fills and all(k.phase == "forward" for k in fills)


def test_extrapolated_tallies_keep_the_order_the_launches_were_seen():
    """Each phase's time is a float sum over the tallies, so their order must not depend on the
    process (a set of string keys iterates in an order hashed anew each run): the same count
    gives the same JSON, digit for digit."""
    keys = [counting.Key("forward", "triton", f"k{i}", "float32") for i in range(40)]
    at2 = {k: counting.Tally(1, 10 + i, 5, 0, 2) for i, k in enumerate(keys)}
    at3 = {k: counting.Tally(1, 15 + i, 7, 0, 3) for i, k in enumerate(keys)}
    at3[counting.Key("backward", "gemm", "mm", "float32")] = counting.Tally(0, 1, 1, 1, 0)
    out = counting.extrapolate({3: at3, 2: at2}, 8)
    assert list(out) == keys + [counting.Key("backward", "gemm", "mm", "float32")]
    assert out[keys[3]].read == 13 + (18 - 13) * 6 and out[keys[3]].programs == 8


# ---- per optimiser step (bench/update.py) ---------------------------------------------------------


def test_allreduce_bytes_and_time_by_hand():
    """A ring all-reduce moves 2 (N - 1) / N x the gradients' bytes per GPU: nothing on one GPU;
    within a node over NVLink, across nodes over the adapters, at the stated efficiency."""
    hw, grads = roofline.H200, 516e6
    one = update.allreduce_cost(grads, 1, hw)
    assert one["bytes_per_gpu"] == 0 and one["seconds"] == 0
    eight = update.allreduce_cost(grads, 8, hw)
    assert eight["bytes_per_gpu"] == pytest.approx(2 * 7 / 8 * grads) and eight["link"] == "NVLink"
    assert eight["seconds"] == pytest.approx(2 * 7 / 8 * grads / (0.8 * 450e9))
    many = update.allreduce_cost(grads, 64, hw)
    assert many["link"] == "InfiniBand" and many["seconds"] == pytest.approx(2 * 63 / 64 * grads / (0.8 * 8 * 50e9))


def test_optimizer_step_is_adamw_over_the_share_and_zero_passes_by_hand():
    """torch's AdamW (foreach, float32) as the counter counts it: per element, the decay's pass over
    the weights (r + w), the first moment's lerp (m, g; m), the second's mul (v; v) and addcmul (v,
    g, g; v), sqrt, div and add over a temporary (r + w each) and the update's addcdiv (p, m, tmp;
    p), 4 bytes each; without decay one pass fewer. ZeRO 2 on 8 GPUs: AdamW and DeepSpeed's norm,
    clipping and copy back over an eighth, the bucket copy over every parameter."""
    decayed, plain = update.adamw_bytes(True), update.adamw_bytes(False)
    assert decayed["bytes_per_element"] == 4 * (2 + 3 + 2 + 4 + 2 + 2 + 2 + 4) == 84
    assert plain["bytes_per_element"] == 84 - 8 and (decayed["launches"], plain["launches"]) == (8, 7)
    hw, decay, no_decay = roofline.H200, 1_000_000, 10_000
    o = update.optimizer_cost(decay, no_decay, 8, 2, hw)
    P = decay + no_decay
    assert o["bytes"] == pytest.approx((84 * decay + 76 * no_decay) / 8 + (4 + 8 + 8) * P / 8 + 8 * P)
    assert o["seconds"] == pytest.approx(max(o["bytes"] / hw.bytes_per_s + o["launches"] * hw.graph_launch_s,
                                             o["launches"] * hw.eager_launch_s))
    whole = update.optimizer_cost(decay, no_decay, 8, 0, hw)  # ZeRO 0: every GPU updates everything
    assert whole["bytes"] == pytest.approx(84 * decay + 76 * no_decay + 32 * P)


def test_a_token_batch_that_leaves_no_whole_batch_per_gpu_is_one_line(capsys):
    """B = token batch / (W N) must be a whole number >= 1, the baseline's window included; refused
    before anything is counted."""
    for flags in (["--token-batch", "1000", "--gpus", "3", "--windows", "16"],
                  ["--token-batch", "64", "--gpus", "8", "--windows", "16"],  # B = 0.5
                  ["--token-batch", "256", "--gpus", "1", "--windows", "16", "--baseline-seq-len", "512"]):
        assert step_cost.main(["--config", "gpn_m_tiny", "--kernel", "torch", "--device", "cpu",
                               "--baseline", "transformer_tiny", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --token-batch") and "not a whole number" in err[0]


def test_per_optimiser_step_entries_are_the_documented_sums(tmp_path, capsys):
    """--token-batch on the tiny GPN+M: per (N, W), B = tokens / (W N), the step's time W x the
    scheduled step + the once-per-window part + the optimiser + the all-reduce (none of it
    overlapped), tok/s per GPU the GPU's tokens over it; the once-per-window part the larger of its
    schedule and its launches at the host's cost; Transformer++ beside it with its all-reduce
    hidden but for its last bucket. Nothing here depends on how fast this machine is."""
    out = tmp_path / "opt.json"
    tokens = 256
    assert step_cost.main(["--config", "gpn_m_tiny", "--kernel", "torch", "--device", "cpu", "core_chunk=4",
                           "--baseline", "transformer_tiny", "--baseline-seq-len", "16", "--token-batch", str(tokens),
                           "--gpus", "1,8", "--windows", "8,16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per optimiser step: 256 tokens on N GPUs" in printed
    data = json.loads(out.read_text())
    t, hw = data["per_optimiser_step"], roofline.H200
    assert data["reports"]["batch"] == 32 and t["zero"] == 2
    assert [(e["gpus"], e["window"], e["batch"]) for e in t["entries"]] == [(1, 8, 32), (1, 16, 16), (8, 8, 4), (8, 16, 2)]
    assert t["allreduce"]["1"]["seconds"] == 0 and t["allreduce"]["8"]["grad_bytes"] == 4 * t["params"]
    fixed = data["reports"]["once_per_window"]
    for b, w in t["once_per_window"].items():
        assert w["launches"] == pytest.approx(fixed["forward"] + fixed["backward"]) and w["launches"] > 0
        assert w["host_s"] == pytest.approx(w["launches"] * hw.eager_launch_s)
        assert w["seconds"] == max(w["scheduled_s"], w["host_s"]) and w["scheduled_s"] > 0
    for e in t["entries"]:
        n = str(e["gpus"])
        assert e["batch"] == tokens // (e["window"] * e["gpus"])
        assert e["once_per_window_s"] == t["once_per_window"][str(e["batch"])]["seconds"]
        assert e["optimizer_s"] == t["optimizer"][n]["seconds"] and e["allreduce_s"] == t["allreduce"][n]["seconds"]
        assert e["seconds"] == pytest.approx(e["window"] * e["step_s"] + e["once_per_window_s"] + e["optimizer_s"]
                                             + e["allreduce_s"])
        assert e["tokens_per_s_per_gpu"] == pytest.approx(tokens / e["gpus"] / e["seconds"])
        assert e["tokens_per_s_per_gpu"] < e["tokens_per_s_per_gpu_steps_alone"] and e["peak_memory_bytes"] > 0
        x = t["transformer"][n]
        assert x["batch"] == tokens // (16 * e["gpus"])
        ar = x["allreduce"]["seconds"]
        assert ar * x["last_bucket_share"] <= x["allreduce_exposed_s"] <= ar * (1 + 1e-12)
        assert x["seconds"] == pytest.approx(x["window_s"] + x["optimizer"]["seconds"] + x["allreduce_exposed_s"])
        assert e["over_baseline"] == pytest.approx(e["tokens_per_s_per_gpu"] / x["tokens_per_s_per_gpu"])
