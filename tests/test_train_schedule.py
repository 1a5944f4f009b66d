"""Learning-rate schedules (`train.schedule`: cosine, wsd, constant) and their keys, and
`train.keep_steps` through a real run (DeepSpeed on one CPU rank)."""

from __future__ import annotations

import math

import pytest

from gpn_scale.storage import safe_load
from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.train.optim import lr_factor
from mds_fixture import write_windows
from test_train import CONFIG, train

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
    from gpn_scale.errors import UserError
    from gpn_scale.train.config import load_train_config

    with pytest.raises(UserError) as e:
        load_train_config(CONFIG, ["run.dir=unused", "data.train=unused", "train.total_steps=100",
                                   "train.warmup_steps=10", *overrides])
    assert str(e.value).startswith("command-line override: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


# ---- a run with keep_steps -----------------------------------------------------------------------

WARMUP, PARENT_TOTAL, PARENT_DECAY, KEPT = 2, 8, 2, 4  # the parent: stable from step 3 to 6, decays at 7-8
RUN = ("data.val=null", "train.micro_batch=2", "train.grad_accum=2", f"train.warmup_steps={WARMUP}",
       "train.schedule=wsd", "train.decay_shape=1-sqrt", "train.min_lr_ratio=0.05", "train.adam_eps=1e-7",
       "zero.stage=2", "precision=fp32")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 200, 32, 512)
    return root


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
