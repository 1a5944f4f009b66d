"""Learning-rate schedules (`train.schedule`: cosine, wsd, constant), `train.keep_steps` and decay
branches (`gpn-scale train --branch-from`): real DeepSpeed on one CPU rank, real MDS windows.

The branch's key property: a parent trained with warmup-stable-decay, branched at a kept stable-phase
checkpoint into a shorter run whose decay starts exactly there, ends bit for bit where that shorter
run ends when trained from scratch (the stable phase has the same learning rate in both, and the
data order depends on the seed and the global batch, never on total_steps), while the parent's
directory stays byte for byte as it was.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gpn_scale.storage import safe_load
from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.train.optim import lr_factor
from support.mds_fixture import write_windows
from support.train_runs import CONFIG, error_line, losses, samples, train

# ---- lr_factor: the schedules' shapes ----------------------------------------------------------


def test_cosine_is_unchanged():
    """The default schedule, as before the other schedules came: linear warm-up, then the cosine."""
    warmup, total, floor = 10, 100, 0.1
    for s in range(total + 1):
        expected = ((s + 1) / warmup if s < warmup else
                    floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (total - warmup)))))
        assert lr_factor(s, warmup, total, floor) == expected  # bit for bit
        assert lr_factor(s, warmup, total, floor, "cosine", None, "linear") == expected


def test_constant_is_the_warm_up_then_the_peak():
    assert [lr_factor(s, 4, 10, 0.1, "constant") for s in range(10)] == [0.25, 0.5, 0.75, 1.0] + [1.0] * 6


@pytest.mark.parametrize("shape", ["linear", "1-sqrt"])
def test_wsd_warms_up_holds_then_decays_over_its_last_steps_to_the_floor(shape):
    """Scheduler step s is the update of optimiser step s + 1: with total 20 and decay 5, steps 16-20
    (s = 15 ... 19) decay, the last one reaching lr x min_lr_ratio."""
    warmup, total, decay, floor = 4, 20, 5, 0.1
    f = [lr_factor(s, warmup, total, floor, "wsd", decay, shape) for s in range(total)]
    assert f[:warmup] == [0.25, 0.5, 0.75, 1.0]  # warm-up ends at the peak
    assert f[warmup:total - decay] == [1.0] * (total - decay - warmup)  # stable up to the decay's start
    progress = [k / decay for k in range(1, decay + 1)]
    shaped = ([1 - (1 - floor) * p for p in progress] if shape == "linear"
              else [floor + (1 - floor) * (1 - math.sqrt(p)) for p in progress])
    assert f[total - decay:] == pytest.approx(shaped, rel=1e-15)
    assert f[total - 1] == pytest.approx(floor, rel=1e-15) and f[total - decay] < 1.0  # the first decay step is below
    assert all(a > b for a, b in zip(f[total - decay - 1:], f[total - decay:]))  # decreasing through the decay
    assert lr_factor(total, warmup, total, floor, "wsd", decay, shape) == pytest.approx(floor, rel=1e-15)  # and stays


def test_one_minus_sqrt_falls_faster_first_than_linear():
    one_minus_sqrt, linear = (lr_factor(15, 4, 20, 0.0, "wsd", 5, shape) for shape in ("1-sqrt", "linear"))
    assert one_minus_sqrt == pytest.approx(1 - math.sqrt(0.2)) and linear == pytest.approx(0.8)


def test_decay_steps_or_a_fraction_of_total_steps():
    from gpn_scale.train.config import load_train_config

    def decay(*overrides):
        return load_train_config(CONFIG, ["run.dir=unused", "data.train=unused", "train.total_steps=100",
                                          "train.warmup_steps=10", *overrides]).train.decay_length()

    assert decay() is None and decay("train.schedule=constant") is None
    assert decay("train.schedule=wsd") == 20  # the default fraction, 0.2
    assert decay("train.schedule=wsd", "train.decay_fraction=0.25") == 25
    assert decay("train.schedule=wsd", "train.decay_fraction=0.125") == 13  # to the nearest step, half up
    assert decay("train.schedule=wsd", "train.decay_steps=90") == 90  # up to total - warm-up
    assert decay("train.schedule=wsd", "train.decay_fraction=0.9") == 90
    t = load_train_config(CONFIG, ["run.dir=unused", "data.train=unused", "train.adam_eps=1e-6"]).train
    assert t.adam_eps == 1e-6 and t.keep_steps == []


@pytest.mark.parametrize("overrides, message", [
    (["train.schedule=wsd", "train.decay_steps=91"], "train.decay_steps: expected in [1, total_steps - warmup_steps = 90], got 91"),
    (["train.schedule=wsd", "train.decay_steps=0"], "train.decay_steps: expected in [1, total_steps - warmup_steps = 90], got 0"),
    (["train.schedule=wsd", "train.decay_fraction=0.95"], "train.decay_fraction: 0.95 of total_steps=100 is 95 decay steps"),
    (["train.schedule=wsd", "train.decay_fraction=0"], "train.decay_fraction: expected a number in (0, 1], got 0"),
    (["train.decay_steps=5"], "train.decay_steps: only train.schedule=wsd has a decay phase (schedule is cosine)"),
    (["train.schedule=wsd", "train.decay_shape=cosine"], "train.decay_shape: expected one of linear, 1-sqrt, got 'cosine'"),
    (["train.schedule=true"], "train.schedule: expected one of cosine, wsd, constant, got True"),
    (["train.keep_steps=50"], "train.keep_steps: expected a list, got int 50"),
    (["train.keep_steps=[50, 101]"], "train.keep_steps: expected optimiser steps in [1, total_steps=100], got 101"),
    (["train.adam_eps=0"], "train.adam_eps: expected a finite number > 0, got 0.0"),
])
def test_schedule_keys_are_checked_naming_the_key(overrides, message):
    from data_prep.errors import UserError
    from gpn_scale.train.config import load_train_config

    with pytest.raises(UserError) as e:
        load_train_config(CONFIG, ["run.dir=unused", "data.train=unused", "train.total_steps=100",
                                   "train.warmup_steps=10", *overrides])
    assert str(e.value).startswith("command-line override: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


# ---- runs: keep_steps and decay branches -------------------------------------------------------

WARMUP, PARENT_TOTAL, PARENT_DECAY, KEPT = 2, 8, 2, 4  # the parent: stable from step 3 to 6, decays at 7-8
BRANCH_TOTAL = 6  # the branch from step 4: decays at 5-6, as the same config trained from scratch
RUN = ("data.val=null", "train.micro_batch=2", "train.grad_accum=2", f"train.warmup_steps={WARMUP}",
       "train.schedule=wsd", "train.decay_shape=1-sqrt", "train.min_lr_ratio=0.05", "train.adam_eps=1e-7",
       "zero.stage=2", "precision=fp32")
BRANCH = (*RUN, f"train.total_steps={BRANCH_TOTAL}", f"train.decay_steps={BRANCH_TOTAL - KEPT}", "train.save_every=100")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 200, 32, 512)
    return root


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under `directory`, with a file's bytes (None for a directory)."""
    return {str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(directory.rglob("*"))}


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return safe_load.load(run_dir / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt")["module"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def parent(data, tmp_path_factory):
    """The parent: wsd, a checkpoint every 2 steps, only the newest kept, and step 4 kept besides."""
    run = tmp_path_factory.mktemp("runs") / "parent"
    train(data, run, 1, *RUN, f"train.total_steps={PARENT_TOTAL}", f"train.decay_steps={PARENT_DECAY}",
          "train.save_every=2", "train.keep_last=1", f"train.keep_steps=[{KEPT}]")
    return run


def test_a_kept_step_survives_rotation(parent):
    assert sorted(p.name for p in (parent / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000008"]
    lr = {r["step"]: r["lr"] for r in read_jsonl(parent / "metrics.jsonl") if "lr" in r}
    peak = 6e-4
    assert [lr[s] for s in range(1, 7)] == [peak / 2, peak, peak, peak, peak, peak]  # warm-up, then stable
    assert lr[7] < peak and lr[8] == pytest.approx(0.05 * peak, rel=1e-12)  # the decay's last step at the floor
    optimizer = safe_load.load(parent / "checkpoints" / "step_00000008" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert [g["eps"] for g in optimizer["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]] == [1e-7] * 2


@pytest.fixture(scope="module")
def runs(data, parent):
    """The parent's branch from step 4 and the branch's config trained from scratch; the parent's
    files before any branch ran."""
    root = parent.parent
    before = snapshot(parent)
    kept = parent / "checkpoints" / f"step_{KEPT:08d}"
    proc = train(data, root / "branch", 1, *BRANCH, "--branch-from", str(kept))
    train(data, root / "scratch", 1, *BRANCH)
    return {"parent": parent, "kept": kept, "before": before, "branch": root / "branch", "scratch": root / "scratch",
            "branch_proc": proc}


def test_a_branch_ends_bit_for_bit_where_its_config_from_scratch_ends(runs):
    branch, scratch = runs["branch"], runs["scratch"]
    assert_same_weights(weights(branch, BRANCH_TOTAL), weights(scratch, BRANCH_TOTAL))
    assert sorted(losses(branch)) == [5, 6]  # the branch's own records begin after the step it started from
    assert {s: losses(scratch)[s] for s in (5, 6)} == losses(branch)
    # the data order is the seed's and the global batch's, not total_steps': the same windows at steps 5-6
    assert samples(branch) == samples(scratch)[KEPT:]
    lr = {r["step"]: r["lr"] for r in read_jsonl(branch / "metrics.jsonl") if "lr" in r}
    assert lr[6] == pytest.approx(0.05 * 6e-4, rel=1e-12) and lr[5] < 6e-4


def test_a_branch_records_where_it_came_from_and_writes_nothing_into_its_parent(runs):
    branch, kept = runs["branch"], runs["kept"]
    assert snapshot(runs["parent"]) == runs["before"]  # no lease, no conversion, no status: nothing
    record = json.loads((branch / "branch.json").read_text())
    from gpn_scale.storage.manifest import file_hash

    assert record == {"source": str(kept), "checkpoint": str(kept), "step": KEPT,
                      "manifest_xxh3_128": file_hash(kept / "manifest.json")}
    [event] = [r for r in read_jsonl(branch / "metrics.jsonl") if r.get("event") == "branch"]
    assert event["step"] == KEPT and event["branch"] == record
    assert event["changes"]["train.total_steps"] == {"checkpoint": PARENT_TOTAL, "now": BRANCH_TOTAL}
    assert f"branched from {kept} at step {KEPT}" in runs["branch_proc"].stdout


def test_a_stopped_branch_rerun_ends_where_the_uninterrupted_one_does(data, runs, tmp_path):
    """Its first start is refused (a model key differs from the parent's: one line, exit 2), which
    leaves a directory with a failed status and no checkpoint; the corrected command starts from
    the parent, stops at step 5 (its own checkpoint), and run again resumes from that to the end."""

    run, kept = tmp_path / "branch", str(runs["kept"])
    line = error_line(train(data, run, 1, *BRANCH, "model.d_ffn=96", "--branch-from", kept, expect=2))
    assert line == (f"error: --branch-from {kept}: a branch may differ from its parent only in schedule, length, "
                    f"checkpoint, eval, logging and run settings; model.d_ffn is 128 in {kept}, 96 here"), line
    assert json.loads((run / "status.json").read_text())["status"] == "failed"
    train(data, run, 1, *BRANCH, "train.stop_at_step=5", "--branch-from", kept)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000005"]
    proc = train(data, run, 1, *BRANCH, "--branch-from", kept)
    assert f"resumed from {run / 'checkpoints' / 'step_00000005'} at step 5" in proc.stdout
    assert_same_weights(weights(run, BRANCH_TOTAL), weights(runs["branch"], BRANCH_TOTAL))
    assert losses(run) == losses(runs["branch"])
    assert snapshot(runs["parent"]) == runs["before"]


def cli(capsys, *argv) -> str:
    """`gpn-scale train ...` in this process (refused before any trainer starts): its one error line."""
    from gpn_scale.cli import main

    assert main(["train", str(CONFIG), *map(str, argv)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_refusals_are_one_line(data, runs, capsys):
    parent, kept = runs["parent"], runs["kept"]
    common = (f"data.train={data / 'train'}", *BRANCH)
    assert cli(capsys, f"run.dir={parent}", *common, "--branch-from", kept) == (
        f"error: --branch-from {kept}: run.dir {parent} is the parent run's directory; a branch writes into a "
        "directory of its own and nothing into its parent's: choose another run.dir")
    inside = cli(capsys, f"run.dir={parent / 'branches' / 'b'}", *common, "--branch-from", parent)
    assert f"is inside the parent run's directory {parent}" in inside
    assert "not both" in cli(capsys, f"run.dir={parent.parent / 'x'}", *common, "train.decay_fraction=0.5",
                             "--branch-from", kept)
    assert cli(capsys, f"run.dir={parent.parent / 'x'}", *common, "train.schedule=linear") == (
        "error: command-line override: train.schedule: expected one of cosine, wsd, constant, got 'linear'")
    assert "--resume auto or nothing" in cli(capsys, f"run.dir={parent.parent / 'x'}", *common, "--branch-from", kept,
                                              "--resume", "none")
    # a finished branch, a branch from another checkpoint, a run that is not a branch: each is not this branch
    branch, scratch = runs["branch"], runs["scratch"]
    assert cli(capsys, f"run.dir={branch}", *common, "--branch-from", kept) == (
        f"error: --branch-from {kept}: run.dir {branch} holds this branch, finished at step 6 (train.total_steps=6); "
        "choose another run.dir for a new branch")
    assert cli(capsys, f"run.dir={branch}", *common, "--branch-from", parent).startswith(
        f"error: --branch-from {parent}: run.dir {branch} holds a branch from {kept} (branch.json), not from {parent}")
    assert cli(capsys, f"run.dir={scratch}", *common, "--branch-from", kept).startswith(
        f"error: --branch-from {kept}: run.dir {scratch} holds a run that is not a branch (step_00000006, no branch.json)")
    assert snapshot(parent) == runs["before"] and not (parent.parent / "x").exists()
