"""scripts/scaling_study.py end to end at smoke size: the corpus, tokenizer and prep, the refusal of
a point that would read the training split twice, a WSD sweep and its collection."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import ROOT


def run(out: Path, spec: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "scaling_study.py"), str(out), "--spec", str(spec),
                           "--max-files", "24", "--slots", "1"], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_a_smoke_study_refuses_to_repeat_text_then_runs_and_collects(tmp_path):
    spec = {"train": "gpn_m_tiny", "overrides": {"eval.batches": 1, "train.micro_batch": 4},
            "families": ["gpn_m_1l"], "params": ["40e3"], "tokens_per_param": [400], "vocab_size": 384,
            "seq_len": 32, "global_batch": 4, "schedule": "wsd", "decay_fraction": 0.25}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "study"
    refused = run(out, path)  # 16M tokens from 24 files: refused before any training
    assert refused.returncode != 0 and "would read text twice" in refused.stderr, refused.stdout + refused.stderr
    assert not (out / "sweep").exists()

    path.write_text(yaml.safe_dump({**spec, "tokens_per_param": [0.05, 0.1]}))
    done = run(out, path)  # the corpus, tokenizer and prep are kept from the refused run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "corpus:" not in done.stdout and "tokenizer:" not in done.stdout
    rows = list(csv.DictReader(open(out / "sweep" / "results.csv")))
    assert len(rows) == 2 and {r["status"] for r in rows} == {"finished"}
    branch = json.loads((out / "sweep" / "gpn_m_1l-40K-x0.05-s0" / "branch.json").read_text())
    assert Path(branch["checkpoint"]).parent.parent.name == "gpn_m_1l-40K-x0.1-s0"
    assert "gpn_m_1l" in json.loads((out / "sweep" / "fits.json").read_text())
