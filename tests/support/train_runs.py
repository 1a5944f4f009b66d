"""The training runs tests start: `gpn-scale train` on the tiny GPN+M config in processes of their own
(one rank, or several under torch.distributed.run), and what they read back from a run directory."""

import json
import subprocess
from pathlib import Path

from support import ROOT, gpn_scale_command, process_env

CONFIG = ROOT / "configs" / "train" / "gpn_m_tiny.yaml"
TOTAL = 12


def train_cmd(data, run_dir, nproc, *overrides, resume=None):
    cmd = gpn_scale_command(nproc) + ["train", str(CONFIG), f"run.dir={run_dir}", f"data.train={data / 'train'}",
                                      f"data.val={data / 'val'}", "data.log_sample_ids=true",
                                      f"train.total_steps={TOTAL}", "train.save_every=3", *overrides]
    return cmd + (["--resume", resume] if resume else [])


def train(data, run_dir, nproc, *overrides, resume=None, expect=0, extra_env=None):
    proc = subprocess.run(train_cmd(data, run_dir, nproc, *overrides, resume=resume), env=process_env(**(extra_env or {})),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, proc.stderr[-8000:]
    return proc


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def samples(run_dir) -> list[list[int]]:
    return [json.loads(l)["samples"] for l in (Path(run_dir) / "samples.jsonl").read_text().splitlines()]


def error_line(proc) -> str:
    """The one line the CLI prints for bad input: no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]
