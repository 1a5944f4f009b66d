"""The README's main job, end to end, exactly as a user runs it (minus the venv)."""

import json
import os
import subprocess
import sys

import pytest


# Fewer steps than the demo's 300 (what the README's command runs): the same stages, in less of
# the suite's time; at 120 steps the model is already far below the unigram entropy.
STEPS = 120


@pytest.mark.slow
def test_demo_learns_well_below_the_unigram_entropy(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "demo", "--out", str(out), "--steps", str(STEPS)],
                          capture_output=True, text=True, timeout=3000, env=dict(os.environ, WANDB_MODE="disabled"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert f"report: {out / 'report.md'}" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["steps"] == STEPS
    assert report["heldout"]["loss"] < report["unigram_entropy"] - 1.0, report["heldout"]
    assert report["heldout"]["tokens"] == report["data"]["splits"]["val"]["windows"] * 128  # every held-out position
    assert (out / "report.md").read_text().count("held-out loss") == 1

    # The analysis of the trained model's states and memory, linked from the report.
    analysis = json.loads((out / "analysis" / "report.json").read_text())
    assert "[analysis/report.md](analysis/report.md)" in (out / "report.md").read_text()
    assert report["analysis"]["memory"]["half_lives"] == analysis["memory"]["half_lives"]
    assert len(analysis["memory"]["half_lives"]) == report["model"]["n_heads"]
    assert analysis["geometry"]["states"] == 32 * 128 and analysis["geometry"]["dead_dims"] == 0
    assert len(analysis["figures"]) == 8 and all((out / "analysis" / f).stat().st_size > 10_000 for f in analysis["figures"])
    abl = analysis["ablations"]
    assert abl["memory_reads_off"]["loss"] > abl["intact"]["loss"]  # a trained GPN+M uses its memory
    assert abl["sbar_projected_out"]["loss"] > abl["intact"]["loss"]

    # The run directory evaluates and generates on its own: the tokenizer is found through its training data.
    env = dict(os.environ, WANDB_MODE="disabled")
    ev = subprocess.run([sys.executable, "-m", "gpn_scale", "eval", str(out / "train"), "--data", str(out / "data"),
                         "--json", "--out", str(tmp_path / "eval")], capture_output=True, text=True, env=env, timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert json.loads(ev.stdout.splitlines()[-1])["ppl"] == pytest.approx(report["heldout"]["ppl"], rel=1e-6)
    gen = subprocess.run([sys.executable, "-m", "gpn_scale", "generate", str(out / "train"), "--prompt", "The class",
                          "--max-new-tokens", "20", "--temperature", "0"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert gen.returncode == 0 and gen.stdout.startswith("The class") and len(gen.stdout) > len("The class\n") + 20

    # Running it again resumes every stage instead of redoing or failing.
    again = subprocess.run([sys.executable, "-m", "gpn_scale", "demo", "--out", str(out), "--steps", str(STEPS)],
                           capture_output=True, text=True, timeout=600, env=dict(os.environ, WANDB_MODE="disabled"))
    assert again.returncode == 0, again.stderr[-5000:]
    assert "already prepared" in again.stdout and "resumed from" in again.stdout
