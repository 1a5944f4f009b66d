"""`precision=bf16` through the engine (DeepSpeed on CPU, autocast with the state and M in float32):
every family trains and resumes bitwise, and the loss curve tracks the fp32 one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mds_fixture import write_windows

ROOT = Path(__file__).resolve().parent.parent
LONG = 200
# bf16 vs fp32 on the tiny GPN+M, 200 steps: the largest gap of the 10-step mean losses, relative
# (measured: see docs/train.md, 'Precision').
CURVE_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 400, 32, 512)
    return root


def train(data, family, run_dir, *overrides, resume=False):
    cmd = [sys.executable, "-m", "gpn_scale", "train", str(ROOT / "configs" / "train" / f"{family}_tiny.yaml"),
           f"run.dir={run_dir}", f"data.train={data / 'train'}", "data.val=null", "zero.stage=2", *overrides]
    proc = subprocess.run(cmd + (["--resume", "auto"] if resume else []), capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpn_m", "transformer", "gdn"])
def test_bf16_resume_bitwise(data, tmp_path, family):
    """An uninterrupted 6-step run saves at step 3; a copy of it without its step-6 checkpoint
    resumes from step 3 in a new process and must repeat steps 4-6 bit for bit."""
    steps = ["train.total_steps=6", "train.save_every=3", "precision=bf16"]
    proc = train(data, family, tmp_path / "ref", *steps)
    assert "ZeRO-2, bf16" in proc.stderr
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000006")
    metrics = tmp_path / "run" / "metrics.jsonl"  # steps 4-6 must come from the resumed run, not the copy
    metrics.write_text("".join(l + "\n" for l in metrics.read_text().splitlines() if json.loads(l)["step"] <= 3))
    proc = train(data, family, tmp_path / "run", *steps, resume=True)
    assert "resum" in proc.stderr and "step_00000003" in proc.stderr, proc.stderr[-3000:]
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")  # bitwise


@pytest.mark.slow
def test_bf16_loss_curve_tracks_fp32(data, tmp_path):
    steps = [f"train.total_steps={LONG}", f"train.save_every={LONG}", "train.warmup_steps=20", "train.lr=3e-3"]
    train(data, "gpn_m", tmp_path / "fp32", *steps, "precision=fp32")
    train(data, "gpn_m", tmp_path / "bf16", *steps, "precision=bf16")
    fp32, bf16 = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    assert sorted(bf16) == list(range(1, LONG + 1))
    assert bf16 != fp32  # bf16 is in effect

    def means(curve):
        return [sum(curve[s] for s in range(i, i + 10)) / 10 for i in range(1, LONG + 1, 10)]

    gaps = [abs(b - f) / f for b, f in zip(means(bf16), means(fp32))]
    print(f"bf16 vs fp32, 10-step means: largest relative gap {max(gaps):.4f}, final losses {bf16[LONG]:.4f} / {fp32[LONG]:.4f}")
    assert means(fp32)[-1] < 0.8 * means(fp32)[0]  # the run learns, so the curves compare something
    assert max(gaps) < CURVE_TOLERANCE
