"""Sweeps: the sizing rule, the plan, the scaling-law fit, and a small sweep run and collected."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.errors import UserError
from gpn_scale.sweep import sizing
from gpn_scale.sweep.fit import fit_power_law
from gpn_scale.sweep.spec import load_spec, plan, write_point
from gpn_scale.train.config import load_train_config
from support.mds_fixture import write_windows
from support.sweep_spec import write_spec
from support import ROOT


@pytest.mark.parametrize("family", sorted(sizing.RULES))
def test_sizing_rule_lands_within_3_percent_of_every_target(family):
    for target, vocab in ((4e4, 512), (2e7, 32000), (1.3e8, 32000), (1.3e9, 32000)):
        model, n = sizing.size(family, target, vocab)
        assert abs(n - target) / target < 0.03, (family, target, n, model)
        assert model["vocab_size"] == vocab
    small, n = sizing.size(family, 4e4, 512)
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    built = build_model(model_config(small))  # the meta-device count is the real model's
    assert sum(p.numel() for p in built.parameters()) == n


def test_sizing_rule_grows_the_width_and_refuses_targets_below_its_smallest_model():
    small, _ = sizing.size("gpn_m_1l", 2e7, 32000)
    big, _ = sizing.size("gpn_m_1l", 1.3e9, 32000)
    assert big["d_state"] > small["d_state"] and big["d_ffn"] > small["d_ffn"]
    with pytest.raises(UserError, match="below the smallest model"):
        sizing.size("transformer", 1e4, 32000)
    with pytest.raises(UserError, match="family: expected one of"):
        sizing.size("mamba", 1e6, 512)


def test_fit_of_no_more_points_than_parameters_has_no_interval():
    x = np.array([1e5, 4e5, 1.6e6])
    y = 1.7 + 40 * x ** -0.34 + np.array([0.01, -0.01, 0.005])
    three = fit_power_law(x, y, bootstrap=50)
    # Every resample with 3 distinct x is the 3 points again: a percentile interval would have width 0.
    assert three.interval is None and "3 points" in three.interval_warning
    assert three.to_dict()["interval_95"] is None and three.to_dict()["interval_warning"] == three.interval_warning
    assert three(x) == pytest.approx(y, abs=0.02)  # the point fit itself is still reported
    four = fit_power_law(np.append(x, 6.4e6), np.append(y, 1.7 + 40 * 6.4e6 ** -0.34 - 0.01), bootstrap=50)
    lo, hi = four.interval["alpha"]
    assert four.interval_warning is None and lo < hi


def test_fit_recovers_a_known_law_and_its_interval_covers_it():
    x = np.geomspace(1e5, 3.2e6, 6)
    exact = fit_power_law(x, 1.7 + 40 * x ** -0.34, bootstrap=100)
    assert (exact.E, exact.A, exact.alpha) == pytest.approx((1.7, 40, 0.34), rel=1e-6)
    noisy_y = 1.7 + 40 * x ** -0.34 + np.random.default_rng(1).normal(0, 0.005, len(x))
    noisy = fit_power_law(noisy_y * 0 + x, noisy_y, bootstrap=300)
    lo, hi = noisy.interval["alpha"]
    assert lo < 0.34 < hi and lo < noisy.alpha < hi
    flat = fit_power_law(x, np.full(len(x), 3.0), bootstrap=50)  # no improvement with x: A = 0, E = the loss
    assert flat.A == 0 and flat.E == pytest.approx(3.0)
    assert exact.warning is None and noisy.warning is None
    # Loss falling faster and faster with x (early training) is no power law: flagged, and E stays >= 0.
    accelerating = fit_power_law(x, 6.5 - 0.5 * np.arange(len(x)) ** 1.5, bootstrap=50)
    assert accelerating.warning and accelerating.E >= 0
    with pytest.raises(ValueError, match="3 distinct"):
        fit_power_law([1, 1, 2], [3, 3, 2])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 200, 32, 512)
    write_windows(root / "val", 8, 32, 512, seed=1)
    return root


def test_plan_sizes_schedules_and_writes_each_point(tmp_path, data):
    spec, out = load_spec(write_spec(tmp_path, data, tokens_per_param=[0.05, 0.1], seeds=[0, 1]))
    points = plan(spec)
    assert len(points) == 2 * 3 * 2 * 2 and len({p.name for p in points}) == len(points)
    for p in points:
        assert abs(p.params - p.target_params) / p.target_params < 0.03
        assert p.steps == math.ceil(p.tokens_per_param * p.params / (32 * 4)) and p.tokens == p.steps * 128
        assert p.lr == pytest.approx(3e-3 * (p.params / 6e4) ** -0.5)
    run_dir = write_point(spec, points[0], out)
    cfg = load_train_config(run_dir / "train.yaml")
    assert cfg.run.dir == str(run_dir) and cfg.model.family == "gpn_m" and cfg.seed == points[0].seed
    assert cfg.train.total_steps == points[0].steps and cfg.train.global_batch == 4 and cfg.train.lr == points[0].lr
    assert cfg.data.train == str(data / "train")
    assert json.loads((run_dir / "point.json").read_text())["params"] == points[0].params


@pytest.mark.parametrize("bad, message", [
    ({"families": ["mamba"]}, "families: 'mamba' is not one of"),
    ({"params": []}, "params: expected a non-empty list"),
    ({"global_batch": 0}, "global_batch: expected a positive integer"),
    ({"lr": {"base": 1e-3, "warmup": 3}}, "lr.warmup: unknown key"),
    ({"tokens_per_params": [1]}, "tokens_per_params: unknown key"),
    ({"tokens_per_param": [float("nan")]}, "tokens_per_param: expected finite positive numbers, got nan"),
    ({"lr": {"base": float("inf")}}, "lr.base: expected a finite number, got inf"),  # any float field of a spec
])
def test_bad_specs_are_one_line_errors(tmp_path, data, bad, message):
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(write_spec(tmp_path, data, **bad)),
                           "--dry-run"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_slurm_backend_dry_run_prints_one_sbatch_per_point_chained(tmp_path, data):
    spec = write_spec(tmp_path, data, slurm={"sbatch_args": ["--time=01:00:00"], "chain": True})
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(spec), "--backend", "slurm", "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    sbatch = [line for line in proc.stdout.splitlines() if line.startswith("+ sbatch")]
    assert len(sbatch) == 6 and all("launchers/slurm/train.sbatch" in s and "--time=01:00:00" in s for s in sbatch)
    assert "--dependency" not in sbatch[0] and all("--dependency=afterany:" in s for s in sbatch[1:])
    assert not (tmp_path / "sweep").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_local_sweep_runs_every_point_and_collect_fits_and_plots(tmp_path, data):
    spec = write_spec(tmp_path, data)
    run = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(spec)], capture_output=True, text=True,
                         cwd=ROOT, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "sweep"
    again = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(spec)], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already finished") == 6

    collect = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", "collect", str(out)], capture_output=True,
                             text=True, cwd=ROOT, timeout=300)
    assert collect.returncode == 0, collect.stderr
    import csv

    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 6 and all(r["status"] == "finished" for r in rows)
    for r in rows:
        metrics = [json.loads(l) for l in (out / r["name"] / "metrics.jsonl").read_text().splitlines()]
        assert float(r["val_loss"]) == [m for m in metrics if "val_loss" in m][-1]["val_loss"]
        assert int(r["tokens"]) == int(json.loads((out / r["name"] / "point.json").read_text())["tokens"])
        assert float(r["flops"]) > 6 * int(r["params"]) * int(r["tokens"]) * 0.99
    fits = json.loads((out / "fits.json").read_text())
    for family in ("gpn_m_1l", "transformer"):
        for key in ("L(N)", "L(C)"):
            fit = fits[family][key]
            assert fit["points"] == 3 and fit["interval_95"] is None and fit["interval_warning"]
    assert "95% n/a" in collect.stdout and "warning: 3 points" in collect.stdout
    for png in ("loss_vs_params.png", "loss_vs_compute.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_collect_names_a_metrics_record_of_the_wrong_type(tmp_path, data, capsys):
    from gpn_scale.cli import main

    spec, out = load_spec(write_spec(tmp_path, data))
    run_dir = write_point(spec, plan(spec)[0], out)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2, "tokens": 128}\n{"step": "three", "loss": 6.1}\n')
    assert main(["sweep", "collect", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {run_dir / 'metrics.jsonl'}: line 2: step: expected an integer >= 0, got 'three'\n"
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": "6.2"}\n')
    assert main(["sweep", "collect", str(out)]) == 2
    assert capsys.readouterr().err == f"error: {run_dir / 'metrics.jsonl'}: line 1: loss: expected a number or null, got '6.2'\n"


def test_a_wsd_plan_trains_each_size_once_and_branches_its_smaller_budgets(tmp_path, data):
    spec, out = load_spec(write_spec(tmp_path, data, schedule="wsd", decay_fraction=0.25,
                                     tokens_per_param=[0.2, 0.05, 0.1], warmup_fraction=0.1))
    points = plan(spec)
    assert len(points) == 2 * 3 * 3
    for i in range(0, len(points), 3):
        trunk, *branches = points[i:i + 3]
        assert trunk.tokens_per_param == 0.2 and trunk.branch_of is None and [b.tokens_per_param for b in branches] == [0.05, 0.1]
        assert trunk.keep_steps == sorted(b.branch_step for b in branches)
        smallest = branches[0].steps
        for p in (trunk, *branches):
            assert p.decay_steps == max(1, round(0.25 * p.steps)) and p.warmup_steps == max(1, round(0.1 * smallest))
        for b in branches:
            assert b.branch_of == trunk.name and b.branch_step == b.steps - b.decay_steps < trunk.steps - trunk.decay_steps
            assert b.trained_steps() == b.decay_steps
    # each point's config is its own WSD schedule: a branch's agrees with its trunk's up to its branch step
    trunk_cfg = load_train_config(write_point(spec, points[0], out) / "train.yaml").train
    branch_cfg = load_train_config(write_point(spec, points[1], out) / "train.yaml").train
    assert (trunk_cfg.schedule, branch_cfg.schedule) == ("wsd", "wsd") and trunk_cfg.keep_steps == points[0].keep_steps
    assert (branch_cfg.total_steps, branch_cfg.decay_steps) == (points[1].steps, points[1].decay_steps)
    assert trunk_cfg.warmup_steps == branch_cfg.warmup_steps and trunk_cfg.lr == branch_cfg.lr

    dry = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(write_spec(tmp_path, data, schedule="wsd",
                          decay_fraction=0.25, tokens_per_param=[0.2, 0.05, 0.1], warmup_fraction=0.1)), "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    # per size the FLOPs per token are one number: the saving is the share of tokens not trained again
    trained = sum(p.trained_steps() for p in points)
    separate = sum(p.steps for p in points)
    assert f"({1 - trained / separate:.0%} saved)" in dry.stdout, dry.stdout
    assert f"--branch-from {out / points[0].name / 'checkpoints' / f'step_{points[1].branch_step:08d}'}" in dry.stdout
    assert not out.joinpath("sweep.jsonl").exists()


def test_a_wsd_budget_whose_decay_would_start_inside_the_warmup_is_refused(tmp_path, data):
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(write_spec(
        tmp_path, data, schedule="wsd", decay_fraction=0.5, tokens_per_param=[0.02, 0.2], warmup_fraction=0.9)),
        "--dry-run"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith("error: tokens_per_param: 0.02 is ") and \
        "would start inside the warm-up" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _final_val_losses(out: Path) -> dict:
    losses = {}
    for metrics in sorted(out.glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[metrics.parent.name] = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    return losses


@pytest.mark.slow
def test_a_wsd_sweep_branches_beside_its_trunk_and_an_interrupted_one_resumes_to_the_same_losses(tmp_path, data):
    import signal
    import time

    def spec(name):
        return write_spec(tmp_path / name, data, families=["gpn_m_1l"], params=["40e3"], tokens_per_param=[0.1, 0.2],
                          schedule="wsd", decay_fraction=0.25, warmup_fraction=0.1, out=str(tmp_path / name / "sweep"),
                          overrides={"train.save_every": 4})
    for name in ("whole", "interrupted"):
        (tmp_path / name).mkdir()
    sweep = [sys.executable, "-m", "gpn_scale", "sweep", "--slots", "2"]
    whole = subprocess.run(sweep + [str(spec("whole"))], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    out = tmp_path / "whole" / "sweep"
    trunk, branch = plan(load_spec(spec("whole"))[0])
    origin = json.loads((out / branch.name / "branch.json").read_text())
    assert origin["step"] == branch.branch_step and Path(origin["checkpoint"]) == \
        out / trunk.name / "checkpoints" / f"step_{branch.branch_step:08d}"
    assert (out / trunk.name / "checkpoints" / f"step_{branch.branch_step:08d}" / "manifest.json").is_file()
    rows = [json.loads(line) for line in (out / branch.name / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(branch.branch_step + 1, branch.steps + 1))  # the branch trains its decay alone
    events = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    start = {e["point"]: e["time"] for e in events if e["event"] == "start"}
    end = {e["point"]: e["time"] for e in events if e["event"] == "end"}
    assert start[branch.name] < end[trunk.name]  # it ran beside its trunk, from the kept checkpoint

    # Ctrl-C once the trunk is under way: the points checkpoint and stop; the rerun resumes them
    proc = subprocess.Popen(sweep + [str(spec("interrupted"))], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    cut = tmp_path / "interrupted" / "sweep" / trunk.name / "checkpoints" / f"step_{branch.branch_step:08d}"
    deadline = time.time() + 300
    while not (cut / "manifest.json").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "rerun the same command to resume" in output, output[-3000:]
    again = subprocess.run(sweep + [str(spec("interrupted"))], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from" in (tmp_path / "interrupted" / "sweep" / trunk.name / "train.log").read_text()
    assert _final_val_losses(tmp_path / "interrupted" / "sweep") == _final_val_losses(out)
