"""bench/generate.py on the tiny models: every row, the baselines, and what it derives from them."""

import json
import os
import subprocess
import sys

import pytest

from support import ROOT


@pytest.mark.slow
def test_generate_bench_runs_and_derives_its_ratios(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "generate.py"), "--gpn", "gpn_m_tiny", "--transformer",
                           "transformer_tiny", "--lengths", "16,64", "--tokens", "4", "--rounds", "2", "--baselines",
                           "--baseline-length", "32",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["length"] for r in rows] == [16, 64]
    for r in rows:
        for model in ("gpn_m", "transformer"):
            assert r[model]["ms_per_token"] > 0 and r[model]["peak_bytes"] >= r[model]["state_bytes"] > 0, proc.stdout
    # GPN+M's state is the same at any prompt length; the KV cache holds every position, the empty
    # context's and the prompt's (2 layers x keys and values x 64 wide x 4 bytes of transformer_tiny each)
    assert rows[0]["gpn_m"]["state_bytes"] == rows[1]["gpn_m"]["state_bytes"]
    assert [r["transformer"]["state_bytes"] for r in rows] == [17 * 2 * 2 * 64 * 4, 65 * 2 * 2 * 64 * 4]
    assert [(b["name"], b["length"]) for b in result["baselines"]] == [("two_forwards", 32), ("hf_generate", 32)]
    assert all(b["ms_per_token"] > 0 and b["decode_ms_per_token"] > 0 for b in result["baselines"])
    lines = proc.stdout.splitlines()
    assert any(line.startswith("GPN+M across prompt lengths: time per token max/min") for line in lines)
    assert result["overtake"] in proc.stdout
    assert "two forwards per token (before the decode step)" in proc.stdout and "the HF export's generate" in proc.stdout
