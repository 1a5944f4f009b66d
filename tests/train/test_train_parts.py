"""The trainer's parts, in-process: the optimiser's contract through a real DeepSpeed engine (one
gloo rank in this process), the loop's decisions, the metrics, and checkpoint manifests."""

import hashlib
import json
import math
import os
import socket

import pytest
import torch

from gpn_scale.storage import manifest
from gpn_scale.config import model_config
from gpn_scale.models import MODEL_FAMILIES, build_model
from gpn_scale.train import checkpoint_writer as ckpt
from gpn_scale.train import loop, optim
from gpn_scale.train.config import load_train_config
from gpn_scale.train.engine import deepspeed_config
from gpn_scale.train.metrics import (RunClock, RunSummary, StepMetrics, clock_time, duration, flops_per_token,
                                     progress_line, summary_line)
from support import ROOT

TINY = {"gpn": "gpn_tiny", "gpn_m": "gpn_m_tiny", "transformer": "transformer_tiny", "gdn": "gdn_tiny"}


def train_config(*overrides):
    return load_train_config("gpn_m_tiny", ["run.dir=unused", "data.train=unused", *overrides])


@pytest.fixture(scope="module")
def one_rank():
    """The process group `gpn-scale train` makes without a launcher, in this process; the
    environment variables it sets are restored afterwards (subprocess tests inherit them), and so
    is torch.nn.functional.linear, which a ZeRO-3 engine replaces for the rest of the process
    (DeepSpeed's memory-efficient linear: torch.jit.script of a Linear fails under it)."""
    import deepspeed  # noqa: F401  (the accelerator is chosen on import)

    from gpn_scale.train import distributed

    saved, linear = dict(os.environ), torch.nn.functional.linear
    distributed.init()
    yield distributed.device()
    torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
    torch.nn.functional.linear = linear


def tiny_engine(device, *overrides, grad_accum=1, universal=False):
    """A DeepSpeed engine over the tiny GPN+M with the trainer's optimiser, schedule and config,
    and what AdamW receives at each call (a step pre-hook): the squared norm of its gradients and
    its learning rate. ZeRO 1-2 call it once per parameter group, each holding one flat partition."""
    import deepspeed

    cfg = train_config(*overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    optimizer, scheduler = optim.build(MODEL_FAMILIES[model.config.family].param_groups(model), cfg.train)
    seen = []

    def record(opt, args, kwargs):
        grads = [p.grad.double().flatten() for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen.append((float(torch.linalg.vector_norm(torch.cat(grads))) ** 2, opt.param_groups[0]["lr"]))

    optimizer.register_step_pre_hook(record)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(cfg, grad_accum, universal=universal))
    return engine, seen


def batch(i):
    return torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("stage", [0, 2])
def test_the_update_receives_the_clipped_gradient(one_rank, stage):
    torch.manual_seed(0)
    reference = build_model(model_config("gpn_m_tiny"))  # plain autograd, no DeepSpeed
    reference(batch(0)).loss.backward()
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])))
    assert norm > 0.1
    for clip, expected in ((1e-3, 1e-3), (0.0, norm)):  # 0: DeepSpeed does not clip
        engine, seen = tiny_engine(one_rank, f"train.grad_clip={clip}", f"zero.stage={stage}")
        engine.backward(engine(batch(0).to(one_rank)).loss)
        engine.step()
        assert math.sqrt(sum(n2 for n2, _ in seen)) == pytest.approx(expected, rel=1e-4), (clip, norm)


def test_the_update_uses_the_schedule_of_its_optimizer_step(one_rank):
    """With 2 micro-batches per update the schedule moves once per update, not per micro-batch."""
    lr, warmup, total, floor = 1e-3, 2, 6, 0.1
    engine, seen = tiny_engine(one_rank, f"train.lr={lr}", f"train.warmup_steps={warmup}",
                               f"train.total_steps={total}", f"train.min_lr_ratio={floor}", "zero.stage=1",
                               grad_accum=2)
    used = []
    for i in range(2 * total):
        engine.backward(engine(batch(i).to(one_rank)).loss)
        engine.step()
        used.append({rate for _, rate in seen})  # one rate for every group of an update
        seen.clear()
    assert used[0::2] == [set()] * total  # no update after the first micro-batch of each step
    expected = [lr * (s + 1) / warmup if s < warmup else
                lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
                for s in range(total)]
    assert [rate for [rate] in used[1::2]] == pytest.approx(expected, rel=1e-12)


def test_a_zero3_universal_resume_updates_as_the_uninterrupted_run(one_rank, tmp_path):
    """Loaded from the universal form at ZeRO-3 (as a resume on another world size loads it), the
    next updates equal the uninterrupted engine's bit for bit: the same masters, Adam moments and
    step counts (one per parameter group, each advanced once per update)."""
    engine, _ = tiny_engine(one_rank, "zero.stage=3")
    for i in range(2):
        engine.backward(engine(batch(i).to(one_rank)).loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path), tag="step_2", save_latest=False)
    ckpt.to_universal(tmp_path / "step_2")
    resumed, _ = tiny_engine(one_rank, "zero.stage=3", universal=True)
    assert ckpt.load_engine(resumed, tmp_path, f"step_2/{ckpt.UNIVERSAL}", train_config("zero.stage=3").train)
    for i in range(2, 5):
        losses = []
        for e in (engine, resumed):
            loss = e(batch(i).to(one_rank)).loss
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        assert losses[0] == losses[1], i
    states = [e.optimizer.optimizer.state for e in (engine, resumed)]
    masters = [e.optimizer.fp32_partitioned_groups_flat for e in (engine, resumed)]
    assert len(masters[0]) == len(masters[1]) == 2  # decay, no decay
    for ours, theirs in zip(*masters):
        assert torch.equal(ours, theirs)
        assert float(states[0][ours]["step"]) == float(states[1][theirs]["step"]) == 5
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(states[0][ours][moment], states[1][theirs][moment]), moment


def test_adam_state_reads_alike_from_every_zero_stage(one_rank, tmp_path):
    """`checkpoints.read_adam_state` (what `export --to reference` maps into the paper's optimiser
    state): the same moments per parameter from a ZeRO-0 checkpoint (torch's AdamW state, its
    parameters by group order) and from ZeRO-2 and -3 ones (flat partitions, through the universal
    form), and the ZeRO-0 ones are the optimiser's own."""
    from gpn_scale.storage.checkpoints import read_adam_state

    read = {}
    for stage in (0, 2, 3):
        engine, _ = tiny_engine(one_rank, f"zero.stage={stage}")
        for i in range(2):
            engine.backward(engine(batch(i).to(one_rank)).loss)
            engine.step()
        engine.save_checkpoint(str(tmp_path / f"zero{stage}"), tag="step_2", save_latest=False)
        torch.manual_seed(0)
        model = build_model(model_config("gpn_m_tiny"))
        read[stage] = read_adam_state(tmp_path / f"zero{stage}" / "step_2", model)
        if stage == 0:
            own = engine.optimizer.state
            for name, p in engine.module.named_parameters():
                assert torch.equal(read[0].exp_avg[name], own[p]["exp_avg"]), name
                assert torch.equal(read[0].exp_avg_sq[name], own[p]["exp_avg_sq"]), name
    names = {n for n, _ in model.named_parameters()}
    for stage in (0, 2, 3):
        assert read[stage].step == 2 and set(read[stage].exp_avg) == set(read[stage].exp_avg_sq) == names
        for name in names:
            torch.testing.assert_close(read[stage].exp_avg[name], read[0].exp_avg[name], rtol=1e-5, atol=1e-8)
            # the squares of gradients reduced in another order: twice their rounding, more where a gradient's
            # terms cancel; a moment read from the wrong place is off by orders of magnitude
            torch.testing.assert_close(read[stage].exp_avg_sq[name], read[0].exp_avg_sq[name], rtol=1e-4, atol=1e-12)
    assert not any(p.name.startswith("gpn-scale-adam") for p in tmp_path.rglob("*"))  # its conversion is gone


def test_the_engines_load_goes_through_the_restricted_unpickler(one_rank, tmp_path):
    """DeepSpeed's engine.load_checkpoint, called as the trainer calls it (ckpt.load_engine, without
    the check every command makes first), on an optimiser state whose second central directory
    Python's zipfile does not see: torch's restricted unpickler refuses it, and nothing runs."""
    from support.gadgets import plant_second_directory
    from data_prep.errors import UserError

    engine, _ = tiny_engine(one_rank, "zero.stage=1")
    engine.save_checkpoint(str(tmp_path), tag="step_1", save_latest=False)
    planted = tmp_path / "step_1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    plant_second_directory(planted, tmp_path / "marker")
    with pytest.raises(UserError, match="restricted unpickler refused a file: .*posix.system"):
        ckpt.load_engine(engine, tmp_path, "step_1", train_config("zero.stage=1").train)
    assert not (tmp_path / "marker").exists()


# Vectors and scalars: never decayed. Every tensor of two or more dimensions is (embedding included).
NO_DECAY = {
    "gpn": {"decode_norm_w", "fuse_norm_w", "fg_norm_w", "fg_gate_b", "layers.0.ffn_norm_w", "layers.0.pg_norm_w",
            "layers.0.pg_gate_b"},
    "gpn_m": {"decode_norm_w", "fuse_norm_w", "fg_norm_w", "fg_gate_b", "write_norm_w", "write_W_k_b", "write_A_log",
              "write_dt_bias", "layers.0.ffn_norm_w", "layers.0.pg_norm_w", "layers.0.pg_gate_b",
              "layers.0.read_norm_w", "layers.0.read_W_q_b", "layers.0.read_out_norm_w"},
    "transformer": {"start", "norm.weight", *(f"layers.{i}.{n}.weight" for i in (0, 1) for n in ("mixer_norm", "mlp_norm"))},
    "gdn": {"start", "norm.weight", *(f"layers.{i}.{n}" for i in (0, 1) for n in (
        "mixer_norm.weight", "mlp_norm.weight", "mixer.A_log", "mixer.dt_bias", "mixer.o_norm_w"))},
}
DECAY = {
    "gpn": {"embedding", "decode_proj_k", "fuse_proj_k", "fg_gate_k", "layers.0.ffn_w1_k", "layers.0.ffn_w2_k",
            "layers.0.pg_gate_k"},
    "gpn_m": {"embedding", "decode_proj_k", "fuse_proj_k", "fg_gate_k", "write_W_k_k", "write_W_v_k", "write_W_beta_k",
              "write_W_a_k", "layers.0.ffn_w1_k", "layers.0.ffn_w2_k", "layers.0.pg_gate_k", "layers.0.read_W_q_k",
              "layers.0.read_W_gate_k", "layers.0.read_W_o_k"},
    "transformer": {"embedding", *(f"layers.{i}.{n}.weight" for i in (0, 1) for n in (
        "mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))},
    "gdn": {"embedding", *(f"layers.{i}.mixer.conv_weight" for i in (0, 1)), *(f"layers.{i}.{n}.weight" for i in (0, 1) for n in (
        "mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.b_proj", "mixer.a_proj", "mixer.g_proj", "mixer.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))},
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_weight_decay_goes_to_exactly_the_matrices(family):
    model = build_model(model_config(TINY[family]))
    optimizer, _ = optim.build(MODEL_FAMILIES[family].param_groups(model), train_config("train.weight_decay=0.1").train)
    name_of = {id(p): n for n, p in model.named_parameters()}
    by_decay = {}
    for group in optimizer.param_groups:
        by_decay.setdefault(group["weight_decay"], set()).update(name_of[id(p)] for p in group["params"])
    assert by_decay == {0.1: DECAY[family], 0.0: NO_DECAY[family]}


def test_the_audit_stops_after_the_patience():
    audit = loop.Audit(patience=1)
    assert not audit.observe(3.0, 1.0) and audit.clean
    assert not audit.observe(float("nan"), 1.0) and not audit.clean  # one tolerated
    assert not audit.observe(3.0, 1.0) and audit.clean  # the count restarts
    assert not audit.observe(3.0, float("inf"))
    assert audit.observe(float("inf"), None) and audit.reason == "loss inf, grad norm None"
    tail = loop.Audit(patience=2)
    tail.observe(float("nan"), 1.0)
    assert tail.at_end() and tail.reason == "1 non-finite step(s) at the end"
    assert not loop.Audit(patience=0).at_end()


def test_periodic_actions_skip_the_end_and_zero():
    assert [s for s in range(1, 13) if loop.due(s, 4, 12)] == [4, 8]
    assert not any(loop.due(s, 0, 12) for s in range(1, 13))


def test_elapsed_and_eta_leave_out_the_first_step():
    now = [100.0]
    clock = RunClock(stop_at=10, now=lambda: now[0])
    now[0] = 160.0  # step 1 ends: a minute of kernel builds
    assert clock.eta(1) is None and clock.elapsed() == 60.0
    now[0] = 166.0  # steps 2-4: 2 s each
    assert clock.eta(4) == pytest.approx(6 * 2.0)
    assert [duration(s) for s in (5, 59.6, 720, 3600 + 5 * 60 + 30)] == ["5s", "60s", "12m", "1h05m"]


def test_progress_line_for_a_log_file():
    m = StepMetrics(step=100, loss=3.21, lr=1e-3, grad_norm=1.0, tokens=10, tokens_per_s=12345.6, step_time_s=0.1,
                    peak_mem_bytes=3 * 2**30, elapsed_s=725.0, eta_s=1440.0, mfu=None)
    assert progress_line(m, 300) == "step 100/300 | loss 3.2100 | 12,346 tok/s | 3.0 GiB | 12m elapsed, ETA 24m"


def test_summary_line_for_the_end_of_a_run():
    s = RunSummary(step=300, train_loss=3.21, val_loss=3.3, val_ppl=math.exp(3.3), val_step=300, tokens=300 * 4096,
                   step_seconds=100.0, wall_seconds=3600 + 5 * 60 + 12.4)
    assert summary_line(s) == "train loss 3.2100 (step 300) | val loss 3.3000, PPL 27.11 (step 300) | 12,288 tok/s | wall time 1h05m12s"
    resumed_at_the_end = RunSummary(step=300, train_loss=None, val_loss=None, val_ppl=None, val_step=None, tokens=0,
                                    step_seconds=0.0, wall_seconds=4.0)
    assert summary_line(resumed_at_the_end) == ("train loss - | val loss - (not evaluated in this run) | - tok/s | "
                                                "wall time 4s")
    assert [clock_time(s) for s in (0.4, 59.6, 61, 3599, 3600)] == ["0s", "1m00s", "1m01s", "59m59s", "1h00m00s"]


def _gpn_params(V, E, d, F, L, H, dk, dv, memory):
    """Counted from the model's parameter table (docs/model.md): shared, per layer, memory."""
    shared = V * E + d + d * E + E + E * d + (d + d * d + d)  # embedding, decode, fuse, ground gate
    layer = (d + d * 2 * F + F * d) + (d + d * d + d)  # FFN, predict gate
    if not memory:
        return shared + L * layer
    write = d + (d * H * dk + H * dk) + d * H * dv + 2 * d * H + 2 * H
    read = d + (d * H * dk + H * dk) + d * H * dv + H * dv + H * dv * d
    return shared + write + L * (layer + read)


def test_flops_per_token_is_the_hand_count():
    T = 32
    cases = {  # family: (tiny model's parameters counted by hand, FLOPs no parameter accounts for, forward)
        "gpn": (_gpn_params(512, 32, 64, 128, 1, 0, 0, 0, False), 0),
        # the memory: one write (M^T k, then decay and rank-1 update: 4 per cell) and one read (2) per layer
        "gpn_m": (_gpn_params(512, 32, 64, 128, 1, 4, 16, 16, True), (4 + 2 * 1) * 4 * 16 * 16),
        # 2 layers of q.k and weights.v over (T + 1) / 2 keys on average, 2 FLOPs per key and feature each
        "transformer": (512 * 64 + 64 + 2 * (2 * 64 + 4 * 64 * 64 + 3 * 64 * 128) + 64, 2 * 4 * 64 * (T + 1) / 2),
        # per layer: q, k (2 heads x 16), v (2 x 32) projections, depthwise conv of 4 over their 128
        # channels, beta / decay projections and A_log / dt_bias per head, output gate and norm, output
        "gdn": (512 * 64 + 64 + 2 * (64 + 2 * 32 * 64 + 64 * 64 + 128 * 4 + 2 * (2 * 64) + 2 * 2 + 64 * 64 + 32
                                    + 64 * 64 + 64 + 3 * 64 * 128) + 64, 2 * (4 + 2) * 2 * 16 * 32),
    }
    for family, (params, extra) in cases.items():
        model = build_model(model_config(TINY[family]))
        assert flops_per_token(model, T) == 6 * params + 3 * extra, family


def test_manifest_detects_corruption_and_still_reads_sha256(tmp_path):
    for name, size in (("a.pt", 5_000_000), ("sub/b.json", 10)):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(os.urandom(size))
    manifest.write_manifest(tmp_path, ["a.pt", "sub/b.json"])
    entries = json.loads((tmp_path / manifest.MANIFEST).read_text())["files"]
    assert set(entries["a.pt"]) == {"bytes", "xxh3_128"}
    assert manifest.verify_manifest(tmp_path) is None
    data = bytearray((tmp_path / "a.pt").read_bytes())
    data[4_321_000] ^= 1
    (tmp_path / "a.pt").write_bytes(bytes(data))
    assert manifest.verify_manifest(tmp_path) == "a.pt does not match its xxh3_128 hash (corrupted)"

    # A checkpoint written before xxh3: its sha256 manifest still verifies, and still catches a change.
    old = {n: {"bytes": (tmp_path / n).stat().st_size, "sha256": hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}
           for n in ("a.pt", "sub/b.json")}
    (tmp_path / manifest.MANIFEST).write_text(json.dumps({"files": old}))
    assert manifest.verify_manifest(tmp_path) is None
    (tmp_path / "sub/b.json").write_bytes(b"0123456789")
    assert manifest.verify_manifest(tmp_path) == "sub/b.json does not match its sha256 hash (corrupted)"


def test_each_rank_hashes_the_files_it_wrote(tmp_path):
    """DeepSpeed's and the trainer's file names at ZeRO-3 on 3 ranks: each rank's share is what it
    wrote, the shares cover the checkpoint once, and the manifest is made from the ranks' reports. A
    universal form beside them has a manifest of its own: no rank reports it."""
    names = ["trainer_state.json", "mp_rank_00_model_states.pt",
             *(f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(3) for kind in ("model", "optim")),
             *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)), *(f"rng_rank{r}.pt" for r in range(3))]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "universal" / "zero").mkdir(parents=True)
    (tmp_path / "universal" / "zero" / "fp32.pt").write_bytes(b"converted")
    reports = [ckpt.hash_own_files(tmp_path, rank, 3) for rank in range(3)]
    assert sorted(reports[1]) == ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_rank1.pt",
                                  "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert sorted(n for r in reports for n in r) == sorted(names)
    assert {"trainer_state.json", "mp_rank_00_model_states.pt"} < set(reports[0])

    reports[2]["rng_rank2.pt"]["xxh3_128"] = "reported"  # the manifest takes the ranks' word for their files
    del reports[1]["rng_rank1.pt"]  # a file no report names is hashed by rank 0
    ckpt.commit(tmp_path.parent, tmp_path.name, keep_last=1, verified=set(), reports=reports)
    entries = json.loads((tmp_path / manifest.MANIFEST).read_text())["files"]
    assert sorted(entries) == sorted(names) and entries["rng_rank2.pt"]["xxh3_128"] == "reported"
    assert entries["rng_rank1.pt"]["xxh3_128"] == manifest.file_hash(tmp_path / "rng_rank1.pt")


def test_files_are_hashed_as_they_are_written(tmp_path):
    """torch.save through write_hashed (DeepSpeed's format and torch's zip format) writes the bytes a
    plain torch.save writes, and the entry is the read-back hash of the file; the engine wrapper
    reports the files it wrote under a checkpoint, by their names there, once."""
    state = {"big": torch.randn(600_000), "small": [torch.arange(3), 7]}  # 2.4 MB: hashed beside the write
    for zipfile in (False, True):
        entry = manifest.write_hashed(tmp_path / "hashed.pt",
                                      lambda f: torch.save(state, f, _use_new_zipfile_serialization=zipfile))
        assert entry == manifest.hash_files(tmp_path, ["hashed.pt"])["hashed.pt"]
        assert torch.equal(torch.load(tmp_path / "hashed.pt")["big"], state["big"])
    torch.save(state, tmp_path / "plain.pt", _use_new_zipfile_serialization=False)
    manifest.write_hashed(tmp_path / "legacy.pt", lambda f: torch.save(state, f, _use_new_zipfile_serialization=False))
    assert (tmp_path / "legacy.pt").read_bytes() == (tmp_path / "plain.pt").read_bytes()

    class Inner:  # DeepSpeed's TorchCheckpointEngine's fields, as the wrapper reads them
        zipfile_serialization = False
        name = "torch"

    saves = ckpt.HashingSaves(Inner())
    (tmp_path / "step_1" / "sub").mkdir(parents=True)
    saves.save(state, str(tmp_path / "step_1" / "sub" / "a.pt"))
    saves.save(state, str(tmp_path / "other.pt"))
    assert saves.name == "torch"
    taken = saves.take(tmp_path / "step_1")
    assert taken == manifest.hash_files(tmp_path / "step_1", ["sub/a.pt"])
    assert saves.take(tmp_path / "step_1") == {}

    # What a rank hashed while writing is taken as is, not read back.
    rng = ckpt.save_rng(tmp_path / "step_1", 0)
    assert rng == manifest.hash_files(tmp_path / "step_1", ["rng_rank0.pt"])
    known = {"rng_rank0.pt": {"bytes": 1, "xxh3_128": "as written"}}
    report = ckpt.hash_own_files(tmp_path / "step_1", 0, 1, known)
    assert report["rng_rank0.pt"]["xxh3_128"] == "as written" and set(report) == {"rng_rank0.pt", "sub/a.pt"}


def test_checkpoint_bench_prints_its_ratio(tmp_path):
    import re
    import subprocess
    import sys

    root = ROOT
    proc = subprocess.run([sys.executable, str(root / "bench" / "ckpt.py"), "--gb", "0.004", "--files", "2", "--rounds", "1",
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^ratio \(hashed save \+ manifest \+ verify\) / save: \d+\.\d{3} ", proc.stdout, re.M), proc.stdout
    assert list(tmp_path.iterdir()) == []  # cleans up after itself


# Started together, each opens the same MDS split once both are ready; Streaming's scan for a
# free shared-memory prefix is slowed (the real scan, then a pause), so that two scans overlap
# whenever nothing orders them; each stays registered until both have opened. Also what the
# process imported, and (one of them) the package in full afterwards.
_OPEN_TOGETHER = """
import json, sys, time
from pathlib import Path
from gpn_scale.storage.mds_datasets import dataset_class, open_dataset
cls = dataset_class()
heavy = sorted(m for m in ("transformers", "torchvision", "sklearn", "streaming.text") if m in sys.modules)
import streaming.base.shared.prefix as prefix
scan = prefix._check_and_find
prefix._check_and_find = lambda *a, **k: (scan(*a, **k), time.sleep(0.1))[0]
def together(step, deadline=time.time() + 60):
    (Path(sys.argv[2]) / f"{step}_{sys.argv[3]}").touch()
    while len(list(Path(sys.argv[2]).glob(f"{step}_*"))) < 2:
        if time.time() > deadline:
            sys.exit(f"the other process did not get to {step}")
        time.sleep(0.005)
together("ready")
dataset = open_dataset(local=sys.argv[1], shuffle=False, batch_size=1)
together("opened")
report = dict(prefix=dataset._shm_prefix_int, heavy=heavy)
if sys.argv[3] == "a":
    from streaming import MDSWriter, StreamingDataset
    import streaming
    report.update(same=StreamingDataset is cls is type(dataset),
                  full=callable(MDSWriter) and streaming.base.StreamingDataLoader.__name__ == "StreamingDataLoader")
print(json.dumps(report))
"""


def test_datasets_opened_at_once_on_a_node_get_their_own_shared_memory(tmp_path):
    """Two jobs opening a Streaming dataset at the same moment (sweep points, a training and an
    evaluation) register different shared-memory prefixes; unordered, both scans find the same
    free one and the second to create it fails with FileExistsError. Opening one imports none
    of Streaming's other datasets (and transformers, scikit-learn, torchvision with them), and
    the whole package is still there, with the same class, when asked for."""
    import subprocess
    import sys

    from support import ROOT
    from support.mds_fixture import write_windows

    write_windows(tmp_path / "split", 8, 4, 16)
    (tmp_path / "sync").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN_TOGETHER, str(tmp_path / "split"), str(tmp_path / "sync"), name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for name in ("a", "b")]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    failed = [err[-1500:] for _, err, code in results if code != 0]
    assert not failed, "\n".join(failed)
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _, _ in results]
    assert reports[0]["prefix"] != reports[1]["prefix"]
    assert reports[0]["heavy"] == reports[1]["heavy"] == [] and reports[0]["same"] and reports[0]["full"], reports


_RANK_OF_A_JOB = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
import streaming.base.shared.prefix as prefix
from gpn_scale.storage.mds_datasets import open_dataset
dist.init_process_group("gloo")
scan = prefix._check_and_find
def scan_recorded(*a, **k):
    (Path(sys.argv[2]) / f"scanned_{os.environ['RANK']}").touch()
    return scan(*a, **k)
prefix._check_and_find = scan_recorded
(Path(sys.argv[2]) / f"opening_{os.environ['RANK']}").touch()
dataset = open_dataset(local=sys.argv[1], shuffle=False, batch_size=1)
print(json.dumps(dict(prefix=dataset._shm_prefix_int)), flush=True)
dist.barrier()
"""


def test_a_jobs_ranks_attach_to_their_leaders_prefix_while_another_job_registers(tmp_path):
    """A 2-rank job opens a dataset while another job's leader holds the node's lock and then
    registers a prefix. The job's rank 1 scans for a free prefix as its rank 0 does: scanning
    before rank 0 holds the lock, it would find free the prefix the other job then takes, and
    fail to attach ('shared memory registered does not match local leader'); it waits for rank
    0 to hold the lock, and both find the same prefix."""
    import fcntl
    import subprocess
    import sys
    import time

    from support import ROOT
    from gpn_scale.storage.mds_datasets import dataset_class, lock_path, release
    from support.mds_fixture import write_windows

    write_windows(tmp_path / "job", 8, 4, 16)
    write_windows(tmp_path / "other", 8, 4, 16, seed=1)
    (tmp_path / "sync").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    base.update(PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    lock = os.open(lock_path(), os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the other job's leader, opening its dataset
    try:
        ranks = [subprocess.Popen([sys.executable, "-c", _RANK_OF_A_JOB, str(tmp_path / "job"), str(tmp_path / "sync")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r))) for r in (0, 1)]
        # Until both ranks are opening the dataset, and rank 1 has scanned, where it scans without waiting
        deadline, sync = time.time() + 120, tmp_path / "sync"
        while not all((sync / f"opening_{r}").exists() for r in (0, 1)) and time.time() < deadline:
            assert all(r.poll() is None for r in ranks), [r.communicate() for r in ranks]
            time.sleep(0.05)
        deadline = time.time() + 5
        while not (sync / "scanned_1").exists() and time.time() < deadline:
            time.sleep(0.05)
        other = dataset_class()(local=str(tmp_path / "other"), shuffle=False, batch_size=1)  # registers a prefix
    finally:
        os.close(lock)
    try:
        results = [r.communicate(timeout=120) + (r.returncode,) for r in ranks]
    finally:
        release(other)
    failed = [err[-1500:] for _, err, code in results if code != 0]
    assert not failed, "\n".join(failed)
    prefixes = {json.loads(out.strip().splitlines()[-1])["prefix"] for out, _, _ in results}
    assert len(prefixes) == 1 and other._shm_prefix_int not in prefixes


def test_a_short_wait_for_the_nodes_lock_is_quiet_and_a_long_one_is_said(capsys, monkeypatch):
    """Another job holds the node's lock for the second or two it takes to open a dataset: waiting
    for it adds no line to a command's output (a refusal stays one line when two jobs start
    together); a wait past QUIET_WAIT_S is said on stderr."""
    import fcntl
    import threading
    import time

    from gpn_scale.storage import mds_datasets

    monkeypatch.delenv("RANK", raising=False)

    def hold(seconds):
        fd = os.open(mds_datasets.lock_path(), os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.set()
        time.sleep(seconds)
        os.close(fd)

    for seconds, quiet_wait, said in ((0.5, 10.0, False), (0.5, 0.1, True)):
        monkeypatch.setattr(mds_datasets, "QUIET_WAIT_S", quiet_wait)
        held = threading.Event()
        other = threading.Thread(target=hold, args=(seconds,))
        other.start()
        held.wait()
        began = time.monotonic()
        with mds_datasets.registering():
            waited = time.monotonic() - began
        other.join()
        err = capsys.readouterr().err
        assert waited > 0.3  # it did wait for the other holder
        assert ("another process on this node is opening a Streaming dataset" in err) is said, err


def test_datasets_read_one_after_another_give_their_shared_memory_back(tmp_path):
    """Streaming keeps each dataset's shared memory, and each new dataset attaches to every prefix
    registered on the node before it: read in turn without `mds_datasets.reading`, a process's open
    files grow with the square of the datasets it opened (the suite once ran out of them). With
    other datasets still registered (a training beside an evaluation, earlier tests in a suite),
    a read's scan past their prefixes leaves nothing open either."""
    import os

    from gpn_scale.storage.mds_datasets import open_dataset, reading, release
    from support.mds_fixture import write_windows

    split = write_windows(tmp_path / "split", 4, 8, 64)

    def open_files():
        return len(os.listdir("/proc/self/fd"))

    def kept(n):
        return [open_dataset(local=str(split), shuffle=False, batch_size=1) for _ in range(n)]

    others = kept(3)  # registered, and held, while the reads below scan past them
    with reading(local=str(split), shuffle=False, batch_size=1) as ds:
        ds[0]
    before = open_files()
    for _ in range(6):
        with reading(local=str(split), shuffle=False, batch_size=1) as ds:
            ds[0]
    assert open_files() <= before + 2
    leaked = kept(6)  # the leak `reading` prevents
    assert open_files() > before + 12
    for ds in others + leaked:
        release(ds)
