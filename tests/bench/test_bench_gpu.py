"""bench/gpu.py on CPU: tiny configs, the Triton kernels in the interpreter, every row and figure."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT
from support.gpu_check_run import stage_output


@pytest.mark.slow
def test_gpu_bench_runs_on_cpu(gpu_check_dry):
    """`bench/gpu.py --device cpu --seq-len 4 --naive-seq-len 2 --steps 1`, every model: as the dry
    gpu_check's bench stage runs it (one run, shared with tests/scripts/test_gpu_check.py)."""
    _, report, check_out = gpu_check_dry
    stage = report["stages"]["bench"]
    assert stage["status"] == "PASS", stage
    assert stage["command"].endswith("--device cpu --seq-len 4 --naive-seq-len 2 --steps 1 --out " + stage["bench_json"])
    models = ["gpn_m_triton", "gpn_m_chunk", "gpn_m_eager", "gpn_m_torch", "naive", "transformer"]
    out = stage["bench_json"]
    stdout = "\n".join(stage_output(check_out, "bench"))
    result = json.loads(Path(out).read_text())
    rows = result["rows"]
    assert list(rows) == models
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["batch"] == 2
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq_len"] / r["step_s"])
    # Same seed, same model, same tokens: the first step's loss cannot depend on the memory kernel.
    assert rows["gpn_m_triton"]["loss"] == pytest.approx(rows["gpn_m_torch"]["loss"], rel=1e-5)
    assert rows["gpn_m_chunk"]["loss"] == pytest.approx(rows["gpn_m_triton"]["loss"], rel=1e-5)  # nor on the memory's form
    assert "chunk form" in rows["gpn_m_chunk"]["label"] and "step form" in rows["gpn_m_triton"]["label"]
    assert rows["naive"]["seq_len"] == 2 and rows["naive"]["extrapolated_to_seq_len"] == 4
    assert "extrapolated to T 4" in stdout
    for name in ("memory_step (fwd)", "decay_and_write", "memory_step_backward", "chunk step 2 of 4 (fwd)",
                 "chunk step 2 of 4 backward", "chunk dM products", "chunk algebra", "chunk finish"):
        assert result["memory_kernels"][name]["bytes_per_s"] > 0
    assert result["copy_bytes_per_s"] > 0 and all(g["tflops"] > 0 for g in result["gemms"].values())
    # what the schedule's overlap rule assumes, measured: a copy on a share of the SMs, M's traffic beside a GEMM
    overlap = result["overlap"]
    shares = overlap["by_sm_share"]
    assert [c["programs"] for c in shares.values()] == sorted({1, overlap["sms"] // 2, overlap["sms"], 4 * overlap["sms"]})
    assert all(c["bytes_per_s"] > 0 and c["of_copy"] > 0 for c in shares.values())
    beside = overlap["beside_gemm"]
    assert beside["concurrent"] is False and beside["serial_s"] == pytest.approx(beside["gemm_s"] + beside["copy_s"])
    assert beside["gain"] == pytest.approx(beside["serial_s"] / beside["together_s"])
    assert "serial / together" in stdout
    names = [r["name"] for r in result["ratios"]]
    assert "gpn_m_triton / naive tokens/s" in names and "memory_step (fwd) / copy bandwidth" in names
    assert "gpn_m_triton / gpn_m_eager tokens/s" in names and "gpn_m_chunk / gpn_m_triton tokens/s" in names
    assert "chunk step 2 of 4 backward / copy bandwidth" in names
    # CPU default: no torch.compile (tens of seconds on the tiny model), and the table says so.
    assert rows["transformer"]["compile"]["used"] == "eager" and rows["transformer"]["compile"]["compiled_s"] is None
    assert rows["transformer"]["step_s"] == rows["transformer"]["compile"]["eager_s"]
    assert "gpn_m_triton / transformer (eager) tokens/s" in names
    # The ratio table is printed last (before the line naming the JSON file).
    tail = stdout.strip().splitlines()[-(len(names) + 2):]
    assert tail[0].startswith("ratio") and tail[-1] == f"wrote {out}"
    assert [line.split("  ")[0].strip() for line in tail[1:-1]] == names


def test_models_kernels_and_bench_import_only_torch_triton_numpy_yaml():
    """The GPU machine has torch, triton and numpy (and yaml) only: nothing heavier may be imported."""
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); import gpn_scale.models, gpn_scale.config, kernels.memory.triton; "
            "import json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench" / "gpu.py")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    top = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert not top & {"deepspeed", "streaming", "wandb", "pyarrow", "tokenizers", "safetensors"}, top
    assert {"torch", "triton", "yaml", "gpn_scale", "kernels"} <= top


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transformer_baseline_is_the_faster_of_eager_and_compiled():
    bench = load_bench()
    assert bench.fastest(0.2, 0.1, "timed").used == "compiled"
    assert bench.fastest(0.1, 0.2, "timed").used == "eager"
    assert bench.fastest(0.1, 0.1, "timed").used == "eager"  # a tie needs no compiler
    failed = bench.fastest(0.3, None, "torch.compile failed (X); eager used")
    assert failed.used == "eager" and failed.note.startswith("torch.compile failed")
    # Compile is on by default on CUDA only; either way a flag overrides it.
    assert bench.parse_args(["--device", "cuda"]).compile and not bench.parse_args(["--device", "cpu"]).compile
    assert bench.parse_args(["--device", "cpu", "--compile"]).compile
    assert not bench.parse_args(["--device", "cuda", "--no-compile"]).compile
    # The ratio's name says which baseline it was measured against.
    rows = {"gpn_m_triton": dict(tokens_per_s=30.0), "transformer": dict(tokens_per_s=60.0, compile=dict(used="compiled"))}
    assert bench.ratios(rows, None, None) == [("gpn_m_triton / transformer (compiled) tokens/s", 0.5, 0.5)]


@pytest.mark.slow
def test_transformer_row_falls_back_to_eager_when_compile_fails(monkeypatch):
    """A real torch.compile failure (inductor finds no C++ compiler): the row is eager and says why."""
    import torch
    import torch._inductor.config

    bench = load_bench()
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", (None, "/nonexistent/c++"))
    args = bench.parse_args(["--device", "cpu", "--models", "transformer", "--seq-len", "8", "--steps", "1", "--compile"])
    try:
        row = bench.run_row(args, "transformer", torch.device("cpu"))
    finally:
        torch._dynamo.reset()  # no compiled or failed frames left for later tests
    timing = row["compile"]
    assert timing["used"] == "eager" and timing["compiled_s"] is None
    assert timing["note"].startswith("torch.compile failed (") and "C++ compiler" in timing["note"]
    assert row["step_s"] == timing["eager_s"] and row["label"].endswith(", eager)")
    assert bench.ratios({"gpn_m_triton": dict(tokens_per_s=1.0), "transformer": row}, None, None)[0][0] == \
        "gpn_m_triton / transformer (eager) tokens/s"
