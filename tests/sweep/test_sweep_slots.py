"""Sweep points packed into the machine: `--slots 2` runs two points at once, each pinned to its
own cores, and a point whose process is killed mid-run is started again from its checkpoint while
the other goes on. (The `srun` job-step backend runs under the suite's slurmctld in
tests/launchers/test_launchers.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.mds_fixture import write_windows
from support.sweep_spec import write_spec
from support import ROOT


def write_slots_spec(tmp_path: Path, data: Path, tokens_per_param: float, save_every: int) -> Path:
    """Two sizes of GPN+M 1L, one budget each."""
    return write_spec(tmp_path, data, {"eval.batches": 1, "train.save_every": save_every}, families=["gpn_m_1l"],
                      params=["40e3", "60e3"], tokens_per_param=[tokens_per_param])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 400, 32, 512)
    write_windows(root / "val", 4, 32, 512, seed=1)
    return root


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]


def training_pid(train_yaml: Path) -> int | None:
    """The process training from `train_yaml` (the sweep starts it as the leader of its own process group)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(train_yaml).encode() in cmdline and b"train" in cmdline:
                return int(entry.name)
    return None


@pytest.mark.slow
def test_two_slots_run_points_at_once_and_a_killed_point_resumes_from_its_checkpoint(tmp_path, data):
    # 40K parameters x 0.3 tokens each at 128 tokens per step: ~95 steps, a checkpoint every 5
    spec = write_slots_spec(tmp_path, data, 0.3, save_every=5)
    out = tmp_path / "sweep"
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    sweep = subprocess.Popen([sys.executable, "-m", "gpn_scale", "sweep", str(spec), "--slots", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    victim = sorted(p.parent for p in out.glob("*/point.json")) if out.exists() else []
    deadline, killed_at = time.time() + 600, None
    while sweep.poll() is None and time.time() < deadline and killed_at is None:
        victim = sorted(p.parent for p in out.glob("*/point.json"))[:1]
        ckpt = victim[0] / "checkpoints" if victim else None
        if ckpt is not None and any((d / "manifest.json").is_file() for d in ckpt.glob("step_*")):
            pid = training_pid(victim[0] / "train.yaml")
            if pid is not None:
                os.killpg(pid, signal.SIGKILL)  # the point's process and whatever it started: gone at once
                killed_at = time.time()
        time.sleep(0.05)
    output, _ = sweep.communicate(timeout=600)
    assert killed_at is not None, "the point finished before it could be killed: nothing was tested\n" + output
    assert sweep.returncode == 0, output[-4000:]
    name = victim[0].name
    assert f"{name}: killed by SIGKILL; starting it again from its newest checkpoint" in output, output

    log = events(out)
    starts = [e for e in log if e["event"] == "start"]
    ends = [e for e in log if e["event"] == "end"]
    assert [e["attempt"] for e in starts if e["point"] == name] == [1, 2]
    assert [(e["exit"], e["attempt"]) for e in ends if e["point"] == name] == [(-signal.SIGKILL, 1), (0, 2)]
    # the second attempt resumed from a checkpoint the first one wrote, not from the start
    text = (victim[0] / "train.log").read_text()
    assert "resumed from" in text and "at step 0 " not in text.split("resumed from", 1)[1].splitlines()[0]
    # the two points ran at once: each started before the other's first attempt ended, on its own slot
    first = {e["point"]: e for e in starts if e["attempt"] == 1}
    first_end = {e["point"]: e for e in ends if e["attempt"] == 1}
    assert len(first) == 2 and {e["slot"] for e in first.values()} == {0, 1}
    assert max(e["time"] for e in first.values()) < min(e["time"] for e in first_end.values())
    for run in out.glob("*/status.json"):
        assert json.loads(run.read_text())["status"] == "finished"
    # the killed point ends where an uninterrupted run ends: the same step count and token count
    rows = [json.loads(line) for line in (victim[0] / "metrics.jsonl").read_text().splitlines()]
    point = json.loads((victim[0] / "point.json").read_text())
    assert max(r["step"] for r in rows if "loss" in r) == point["steps"]


def test_more_slots_than_cores_or_srun_outside_an_allocation_is_one_line(tmp_path, data):
    spec = write_slots_spec(tmp_path, data, 0.05, save_every=5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cores = len(os.sched_getaffinity(0))
    for args, message in (
            (["--slots", str(cores + 1)], f"--slots {cores + 1}: each point needs at least one core of its own"),
            (["--backend", "srun"], "--backend srun: not inside a SLURM allocation"),
            (["--slots", "0"], "--slots: expected >= 1, got 0"),
            (["--gpus-per-point", "1"], "--gpus-per-point 1: no GPU is visible here")):
        proc = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", str(spec), *args], capture_output=True,
                              text=True, cwd=ROOT, env=dict(env, CUDA_VISIBLE_DEVICES=""))
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").glob("*/metrics.jsonl"))
