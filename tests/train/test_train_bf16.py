"""`precision=bf16` through the engine (DeepSpeed on CPU, autocast with the state and M in float32):
every family trains and resumes bitwise, and the loss curve tracks the fp32 one."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.mds_fixture import write_windows
from support import ROOT

LONG = 100
# bf16 vs fp32 on the tiny GPN+M, 100 steps: the largest gap of the 10-step mean losses, relative
# (measured: see docs/train.md, 'Precision').
CURVE_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_windows(root / "train", 400, 32, 512)
    return root


# A variant is a family's tiny config with overrides: GPN+M also in the memory's chunk form.
VARIANTS = {"gpn_m": ("gpn_m", ()), "gpn_m_chunk": ("gpn_m", ("model.memory_form=chunk", "model.core_chunk=4")),
            "gpn_m_chunk_bf16_reads": ("gpn_m", ("model.memory_form=chunk", "model.core_chunk=4", "model.memory_reads=compute")),
            "transformer": ("transformer", ()), "gdn": ("gdn", ())}


def start(data, variant, run_dir, *overrides, resume=False) -> subprocess.Popen:
    """A one-process run (one thread); its output (the report on stdout, warnings on stderr) goes to a file
    beside the run."""
    family, extra = VARIANTS[variant]
    overrides = (*extra, *overrides)
    cmd = [sys.executable, "-m", "gpn_scale", "train", str(ROOT / "configs" / "train" / f"{family}_tiny.yaml"),
           f"run.dir={run_dir}", f"data.train={data / 'train'}", "data.val=null", "zero.stage=2", *overrides]
    log = Path(f"{run_dir}.{'resume' if resume else 'train'}.log")
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd + (["--resume", "auto"] if resume else []), stdout=err, stderr=subprocess.STDOUT,
                                text=True, env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    proc.log = log
    return proc


def finish(proc: subprocess.Popen) -> str:
    proc.wait(timeout=900)
    output = proc.log.read_text()
    assert proc.returncode == 0, output[-5000:]
    return output


def train(data, family, run_dir, *overrides, resume=False) -> str:
    return finish(start(data, family, run_dir, *overrides, resume=resume))


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


FAMILIES = ("gpn_m", "gpn_m_chunk", "transformer", "gdn")
RESUME_STEPS = ("train.total_steps=6", "train.save_every=3", "precision=bf16")


@pytest.fixture(scope="module")
def bf16_runs(data, tmp_path_factory):
    """An uninterrupted 6-step bf16 run per family, saving at step 3."""
    root = tmp_path_factory.mktemp("bf16")
    for pair in (FAMILIES[:2], FAMILIES[2:]):  # two at a time: one thread each (each picks its own free port)
        procs = [start(data, family, root / family, *RESUME_STEPS) for family in pair]
        for family, proc in zip(pair, procs):
            assert "ZeRO-2, bf16" in finish(proc), family
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_resume_bitwise(data, bf16_runs, tmp_path, family):
    """A copy of the uninterrupted run without its step-6 checkpoint resumes from step 3 in a new
    process and must repeat steps 4-6 bit for bit."""
    ref, run = bf16_runs / family, tmp_path / "run"
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    metrics = run / "metrics.jsonl"  # steps 4-6 must come from the resumed run, not the copy
    metrics.write_text("".join(l + "\n" for l in metrics.read_text().splitlines() if json.loads(l)["step"] <= 3))
    output = train(data, family, run, *RESUME_STEPS, resume=True)
    assert "resum" in output and "step_00000003" in output, output[-3000:]
    assert sorted(losses(run)) == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(ref)  # bitwise


@pytest.mark.slow
def test_bf16_loss_curve_tracks_fp32(data, tmp_path):
    """bf16 against fp32 over 100 steps, with the memory in its step form, in its chunk form, and
    in its chunk form with M_c read in bf16 (each bf16 curve held to the same fp32 one)."""
    steps = [f"train.total_steps={LONG}", f"train.save_every={LONG}", "train.warmup_steps=20", "train.lr=3e-3"]
    runs = (("gpn_m", "fp32"), ("gpn_m", "bf16"), ("gpn_m_chunk", "bf16"), ("gpn_m_chunk_bf16_reads", "bf16"))
    for pair in (runs[:2], runs[2:]):  # two at a time, one thread each
        procs = [start(data, v, tmp_path / f"{v}_{p}", *steps, f"precision={p}") for v, p in pair]
        for proc in procs:
            finish(proc)
    fp32 = losses(tmp_path / "gpn_m_fp32")

    def means(curve):
        return [sum(curve[s] for s in range(i, i + 10)) / 10 for i in range(1, LONG + 1, 10)]

    assert means(fp32)[-1] < 0.8 * means(fp32)[0]  # the run learns, so the curves compare something
    for variant in ("gpn_m", "gpn_m_chunk", "gpn_m_chunk_bf16_reads"):
        bf16 = losses(tmp_path / f"{variant}_bf16")
        assert sorted(bf16) == list(range(1, LONG + 1))
        assert bf16 != fp32  # bf16 is in effect
        gaps = [abs(b - f) / f for b, f in zip(means(bf16), means(fp32))]
        print(f"{variant} bf16 vs fp32, 10-step means: largest relative gap {max(gaps):.4f}, final losses "
              f"{bf16[LONG]:.4f} / {fp32[LONG]:.4f}")
        assert max(gaps) < CURVE_TOLERANCE, variant
