"""Looking inside a run (docs/train.md, 'Looking inside a run'): torch.profiler traces of chosen
steps (`profile.steps`), TensorBoard event files (`logging.tensorboard`), the data-wait time per
step, wandb's entity, group and tags, MFU's configured peak, and the memory snapshot's refusal on
a CPU. One tiny single-process training run (real DeepSpeed on the CPU) serves every check of
what a run writes.
"""

from __future__ import annotations

import glob
import importlib.util
import json
from pathlib import Path

import pytest

from gpn_scale.config import model_config
from data_prep.errors import UserError
from gpn_scale.models import build_model
from gpn_scale.train.config import load_train_config
from gpn_scale.train.metrics import MetricsLog, StepMetrics, data_wait_line, flops_per_token, peak_flops, scalars
from support.mds_fixture import write_windows
from support.train_runs import CONFIG, train
from support.wandb_records import _payloads
from support import ROOT

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
STEPS = 4
TAGS = ["observe", "tiny run"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run tracing steps 2-3, with wandb offline (entity, group, tags), a configured peak,
    and TensorBoard where the package is installed."""
    root = tmp_path_factory.mktemp("observe")
    write_windows(root / "train", 64, 32, 512)
    write_windows(root / "val", 4, 32, 512, seed=1)
    run_dir = root / "run"
    proc = train(root, run_dir, 1, f"train.total_steps={STEPS}", "train.save_every=100", "data.log_sample_ids=false",
                 "eval.batches=1", "profile.steps=[2, 3]", "logging.wandb=offline", "logging.wandb_entity=gpn-team",
                 "logging.wandb_group=observe-group", f"logging.wandb_tags={json.dumps(TAGS)}",
                 "logging.peak_tflops=0.001", f"logging.tensorboard={str(HAS_TENSORBOARD).lower()}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows, proc


def _steps(rows):
    return [r for r in rows if "loss" in r]


def test_profile_steps_write_one_chrome_trace_per_rank_holding_those_steps(run):
    run_dir, _, _ = run
    files = glob.glob(str(run_dir / "profile" / "rank0.*.pt.trace.json"))
    assert len(files) == 1, sorted(p.name for p in (run_dir / "profile").iterdir())
    trace = json.loads(Path(files[0]).read_text())
    events = trace["traceEvents"]
    assert len(events) > 100
    names = {e.get("name") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names, sorted(n for n in names if n and n.startswith("Profiler"))
    assert not {"ProfilerStep#1", "ProfilerStep#4"} & names  # only the steps asked for
    assert {"data_wait", "forward", "backward", "optimizer_step"} <= names
    assert "gpuGetDeviceCount" not in run[2].stderr  # kineto's complaint about a CPU machine, silenced


def test_a_launch_stopped_inside_the_range_writes_the_steps_it_ran(tmp_path):
    """A resume that starts inside profile.steps traces from its first step; a stop (preemption,
    divergence) inside the range writes the trace at close()."""
    import torch

    from gpn_scale.train.profiling import StepProfiler

    profiler = StepProfiler([2, 6], tmp_path, rank=3, cuda=False)
    for step in (3, 4):  # resumed at step 2: its first step is 3
        profiler.begin(step)
        torch.ones(8, 8).matmul(torch.ones(8, 8))
        profiler.end(step)
    profiler.begin(5)  # stopped during step 5
    profiler.close()
    (path,) = (tmp_path / "profile").glob("rank3.*.pt.trace.json")
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5", "aten::matmul"} <= names
    profiler.close()  # twice: nothing more
    assert len(list((tmp_path / "profile").iterdir())) == 1


def test_data_wait_is_in_every_steps_metrics(run):
    _, rows, _ = run
    steps = _steps(rows)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert 0 <= r["data_wait_s"] <= r["step_time_s"], r


def test_mfu_uses_the_configured_peak(run):
    _, rows, _ = run
    fpt = flops_per_token(build_model(model_config("gpn_m_tiny")), 32)
    for r in _steps(rows):
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / 1e9)  # 0.001 TFLOP/s, one rank
    assert peak_flops(2.5) == 2.5e12


def test_wandb_entity_group_and_tags_reach_the_run(run):
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir, rows, _ = run
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = []
    for payload in _payloads(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "run":
            records.append(record.run)
    assert records
    for r in records:
        assert (r.entity, r.run_group, list(r.tags)) == ("gpn-team", "observe-group", TAGS)


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_event_files_hold_the_metrics_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, rows, _ = run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "data_wait_s", "mfu", "val_loss"} <= tags, tags
    for tag in ("loss", "lr", "data_wait_s", "val_loss"):
        logged = {r["step"]: r[tag] for r in rows if tag in r}
        seen = {e.step: e.value for e in events.Scalars(tag)}
        assert seen.keys() == logged.keys() and logged
        for step, value in logged.items():  # TensorBoard keeps scalars as float32
            assert seen[step] == pytest.approx(value, rel=1e-6, abs=1e-12), (tag, step)


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_a_resume_replaces_the_steps_after_its_checkpoint_in_tensorboard(tmp_path):
    """As metrics.jsonl drops the records after the step a launch resumes from, TensorBoard's reader
    no longer shows the earlier launch's values of those steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def launch(start: int, losses: dict[int, float]) -> None:
        log = MetricsLog(tmp_path, {}, "disabled", "p", "n", start_step=start, total_steps=4, enabled=True,
                         tensorboard=True)
        for step, loss in losses.items():
            log.log({"step": step, "loss": loss})
        log.close()

    launch(0, {1: 4.0, 2: 3.0, 3: 2.0, 4: 1.0})  # then stopped; resumed from its step-2 checkpoint:
    launch(2, {3: 2.5, 4: 1.5})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 1.5)]


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed")
def test_tensorboard_without_the_package_is_refused_in_one_line():
    with pytest.raises(UserError) as e:
        load_train_config(CONFIG, ["run.dir=unused", "data.train=unused", "logging.tensorboard=true"])
    message = str(e.value)
    assert message.startswith("command-line override: logging.tensorboard: needs the tensorboard package")
    assert "pip install gpn-scale[tensorboard]" in message and "\n" not in message


def test_memory_snapshot_on_a_cpu_is_refused_in_one_line_before_anything_runs(tmp_path):
    from gpn_scale.train import engine

    write_windows(tmp_path / "train", 8, 32, 512)
    with pytest.raises(UserError) as e:
        engine.main([str(CONFIG), f"run.dir={tmp_path / 'run'}", f"data.train={tmp_path / 'train'}", "data.val=null",
                     "profile.memory_snapshot_step=2", "--check"])
    message = str(e.value)
    assert message.startswith("profile.memory_snapshot_step: 2 records CUDA's allocator, and this run has no CUDA")
    assert "\n" not in message and not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    (["profile.steps=[3]"], "profile.steps: expected [first, last], two optimiser steps with 1 <= first <= last, got [3]"),
    (["profile.steps=[3, 2]"], "profile.steps: expected [first, last]"),
    (["profile.steps=[0, 2]"], "profile.steps: expected [first, last]"),
    (["profile.steps=[2, 9]"], "profile.steps: step 9 is past train.total_steps=8, so it would never run"),
    (["profile.steps=2"], "profile.steps: expected a list, got int 2"),
    (["profile.memory_snapshot_step=0"], "profile.memory_snapshot_step: expected an optimiser step >= 1, got 0"),
    (["profile.memory_snapshot_step=9"], "profile.memory_snapshot_step: step 9 is past train.total_steps=8"),
    (["profile.trace=true"], "profile.trace: unknown key"),
    (["logging.tensorboard=maybe"], "logging.tensorboard: expected bool, got str 'maybe'"),
    (["logging.wandb_tags=a"], "logging.wandb_tags: expected a list, got str 'a'"),
    (["logging.wandb_tags=['a', '']"], "logging.wandb_tags: expected tags of 1 to 64 characters, got '' (item 1)"),
    ([f"logging.wandb_tags=[{'x' * 65}]"], "logging.wandb_tags: expected tags of 1 to 64 characters"),
    (["logging.wandb_tags=[a, a]"], "logging.wandb_tags: 'a' given twice"),
    (["logging.wandb_entity=' '"], "logging.wandb_entity: expected a non-empty name, got ' '"),
    (["logging.wandb_group=3"], "logging.wandb_group: expected str, got int 3"),
    (["logging.peak_tflops=0"], "logging.peak_tflops: expected a number of TFLOP/s per device > 0, got 0.0"),
])
def test_new_keys_are_checked_naming_the_key(overrides, message):
    with pytest.raises(UserError) as e:
        load_train_config(CONFIG, ["run.dir=unused", "data.train=unused", *overrides])
    assert str(e.value).startswith("command-line override: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_new_keys_default_to_off_and_are_resumable():
    from gpn_scale.train.config import config_changes

    cfg = load_train_config(CONFIG, ["run.dir=unused", "data.train=unused"])
    assert (cfg.profile.steps, cfg.profile.memory_snapshot_step) == ([], None)
    lg = cfg.logging
    assert (lg.tensorboard, lg.wandb_entity, lg.wandb_group, lg.wandb_tags) == (False, None, None, [])
    saved = cfg.to_dict()
    changed = load_train_config(CONFIG, ["run.dir=unused", "data.train=unused", "profile.steps=[1, 2]",
                                         "logging.wandb_tags=[a]", "logging.wandb_group=g"])
    safe, unsafe = config_changes(saved, changed)
    assert unsafe == [] and {k for k, _, _ in safe} == {"profile.steps", "logging.wandb_tags", "logging.wandb_group"}
    del saved["profile"]  # a checkpoint from before the section: new settings, not changes
    assert config_changes(saved, changed)[1] == []


def test_the_data_wait_line_follows_a_progress_line_when_the_loader_is_behind(tmp_path, capsys):
    assert data_wait_line(0.05, 1.0, 1, 4) is None
    assert data_wait_line(0.3, 1.0, 5, 8) == ("data wait 30% of the step time over steps 5-8 (0.3s of 1.0s): "
                                              "the loader is behind the model")
    log = MetricsLog(tmp_path, {}, "disabled", "p", "n", start_step=0, total_steps=2, enabled=True)
    for step, wait in ((1, 0.4), (2, 0.2)):
        log.progress(StepMetrics(step=step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens=step, tokens_per_s=10.0,
                                 step_time_s=1.0, peak_mem_bytes=2**30, elapsed_s=step, eta_s=None, mfu=None,
                                 data_wait_s=wait))
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 2/2 | loss 1.0000 | ")
    assert lines[1] == "data wait 30% of the step time over steps 1-2 (0.6s of 2.0s): the loader is behind the model"
    assert scalars({"step": 3, "loss": 2.5, "event": "branch", "mfu": None, "tokens": 7, "flag": True}) == {
        "loss": 2.5, "tokens": 7.0}


def test_the_run_reports_its_steps_on_the_console(run):
    _, rows, proc = run
    final = _steps(rows)[-1]
    assert f"step {STEPS}/{STEPS} | loss {final['loss']:.4f} | " in proc.stdout, proc.stdout[-3000:]


def test_every_logging_and_profile_key_has_a_row_in_the_config_table():
    import dataclasses

    from gpn_scale.train.config import LoggingSection, ProfileSection

    docs = (ROOT / "docs" / "train.md").read_text()
    rows = [line for line in docs.splitlines() if line.startswith("| `")]
    for section, cls in (("logging", LoggingSection), ("profile", ProfileSection)):
        for f in dataclasses.fields(cls):
            key = f"`{section}.{f.name}`"
            assert any(row.split(" | ")[0].count(key) for row in rows), key
    assert "## Looking inside a run" in docs
