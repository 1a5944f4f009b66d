"""scripts/gpu_check.sh: its dry mode on the CPU (every stage, the summary, the JSON), and that its
checks fail when they should: the gradient comparison on the known graph-memory defect, a stage
past its timeout, a GPU run without a GPU, a bad flag."""

import json
import os
import re
import subprocess
import sys

import pytest

from support import ROOT
from support.gpu_check_run import run

STAGES = ["env", "graphs", "kernels", "bench", "engine"]


@pytest.fixture
def dry(gpu_check_dry):
    return gpu_check_dry


def tiny_param_names():
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model

    return [n for n, _ in build_model(model_config("gpn_m_tiny")).named_parameters()]


@pytest.mark.slow
def test_dry_run_passes_every_stage_and_prints_a_summary(dry):
    proc, report, out = dry
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    for name in STAGES:  # one line as the stage ends, one in the closing summary
        assert sum(bool(re.match(rf"{name}\s+PASS\s+\d+\.\d s  \S", line)) for line in lines) == 2, name
    assert "PASS: 5 passed, 0 failed, 0 skipped" in proc.stdout
    assert f"json: {out / 'gpu_check.json'}" in proc.stdout and (out / "gpu_check.log").is_file()
    assert report["status"] == "PASS" and report["mode"] == "dry" and list(report["stages"]) == STAGES
    for name, part in report["stages"].items():
        assert part["status"] == "PASS" and 0 < part["seconds"] <= part["timeout_s"], name
    assert report["wall_s"] < report["budget_s"]


@pytest.mark.slow
def test_dry_env_stage_records_versions_and_clean_imports(dry):
    import torch
    import triton

    env = dry[1]["stages"]["env"]
    assert env["torch"] == torch.__version__ and env["triton"] == triton.__version__
    assert env["cuda_available"] is False and env["gpu"] is None
    for how in ("plain", "blocked"):  # imported as they are, and with deepspeed/streaming/wandb unimportable
        assert env["imports"][how]["ok"] and env["imports"][how]["forbidden_loaded"] == [], how
    assert {"gpn_scale.models.core", "kernels.memory.triton", "kernels.step.triton", "kernels.graph"} <= set(env["modules"])


@pytest.mark.slow
def test_dry_graph_stage_compared_every_gradient_with_graphs_replayed(dry):
    g = dry[1]["stages"]["graphs"]
    names = tiny_param_names()
    assert g["params"] == len(names) and sorted(g["max_rel_error"]) == sorted(names)
    assert all(e == 0 for e in g["max_rel_error"].values()) and g["bitwise"] is True
    assert g["final_params_max_rel_error"] == 0 and g["missing_gradients"] == []
    assert len(g["per_step"]) == g["steps"] >= 2
    assert all(s["params_compared"] == len(names) and s["losses_equal"] for s in g["per_step"])
    assert g["losses"]["graphs"] == g["losses"]["eager"]
    assert all(len(step) == g["micro_batches"] == 2 for step in g["losses"]["graphs"])
    stats = g["graph_stats"]
    calls = g["steps"] * g["micro_batches"]
    assert stats["forward"] == {"eager": 1, "captured": 1, "replayed": calls - 1, "failed": 0}
    # the backward graph runs for forwards that were replayed: all but the first
    assert stats["backward"] == {"eager": 1, "captured": 1, "replayed": calls - 2, "failed": 0}
    assert g["eager_model_has_graphs"] is False
    c = g["chunk_form"]  # the memory's chunk form, held to eager the same way
    assert c["memory_form"] == "chunk" and g["memory_form"] == "step"
    assert all(e == 0 for e in c["max_rel_error"].values()) and c["losses"]["graphs"] == c["losses"]["eager"]
    assert all(s["params_compared"] == len(names) for s in c["per_step"]) and c["graph_stats"] == stats


@pytest.mark.slow
def test_dry_kernel_bench_and_engine_stages_report_what_they_ran(dry):
    _, report, out = dry
    k = report["stages"]["kernels"]
    assert k["passed"] == k["total"] > 0 and k["failed"] == k["errors"] == 0
    assert {"tests/kernels/test_kernels.py", "tests/kernels/test_kernels_memory_chunk.py"} <= set(k["files"]) and (out / "kernel_tests.xml").is_file()
    assert ("tests/kernels/test_kernels_accuracy.py" in k["files"]) == (ROOT / "tests" / "kernels" / "test_kernels_accuracy.py").is_file()

    b = report["stages"]["bench"]
    assert set(b["rows"]) == {"gpn_m_triton", "gpn_m_chunk", "gpn_m_eager", "gpn_m_torch", "naive", "transformer"}
    assert b["rows"]["gpn_m_triton"]["cuda_graphs"]["forward"]["replayed"] > 0
    assert b["rows"]["transformer"]["compile"]["used"] == "eager"  # the dry bench does not compile
    assert b["ratio_table"][0].startswith("ratio") and len(b["ratio_table"]) == len(b["ratios"]) + 1
    assert [line.split("  ")[0].strip() for line in b["ratio_table"][1:]] == [r["name"] for r in b["ratios"]]
    assert json.loads((out / "bench.json").read_text())["ratios"] == b["ratios"]

    e = report["stages"]["engine"]
    assert e["returncodes"] == {"uninterrupted": 0, "stopped": 0, "resumed": 0}
    assert len(e["losses_uninterrupted"]) == e["steps"] and e["stopped_at"] == e["steps"] // 2
    assert e["losses_resumed"] == e["losses_uninterrupted"] and e["max_abs_loss_diff"] == 0
    for name, stats in e["graph_stats"].items():  # every run's fused core ran through the CPU graph stand-in
        assert stats["forward"]["replayed"] > 0 and stats["backward"]["replayed"] > 0, name


# Puts back the defect the graph stage exists to catch: the backward graph's outputs handed to
# autograd as views of the graph's own memory (detached, so autograd takes them as they are), so
# the first micro-batch's gradient, kept as .grad, is overwritten by the second micro-batch's replay.
DEFECT = """
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_stages", sys.argv[1])
gc = sys.modules["gpu_stages"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)
import gpn_scale.models.core as core
core._copied = lambda x: [core._copied(y) for y in x] if isinstance(x, (list, tuple)) else None if x is None else x.detach()
gc.stage_graphs(gc.Part(Path(sys.argv[2]), "graphs"), gc.DRY)
"""


@pytest.mark.slow
def test_graph_stage_fails_on_graph_owned_gradients(tmp_path):
    (tmp_path / "stages").mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", GPN_SCALE_CPU_GRAPHS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", DEFECT, str(ROOT / "scripts" / "gpu_stages.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = json.loads((tmp_path / "stages" / "graphs.json").read_text())
    assert g["status"] == "FAIL" and "gradients differ" in g["detail"], g["detail"]
    assert g["bitwise"] is False and max(g["max_rel_error"].values()) > 1e-3
    assert g["per_step"][0]["max_rel_error"] == 0  # step 1's backward ran eagerly; step 2's replayed


# A stage process that hangs: Python imports sitecustomize at startup, and this one sleeps in the
# graphs stage's process only (its command line says so), whatever the machine's speed.
HANG = """
from pathlib import Path
import time
if b"--stage\\0graphs\\0" in Path("/proc/self/cmdline").read_bytes():
    time.sleep(3600)
"""


def test_stage_past_its_timeout_fails_and_keeps_its_json(tmp_path):
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "sitecustomize.py").write_text(HANG)
    path = os.pathsep.join([str(hang), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc, report = run("--dry", "--stages", "graphs", "--timeout", "graphs=4", out=tmp_path / "out",
                       env={"PYTHONPATH": path})
    assert proc.returncode == 1
    g = report["stages"]["graphs"]
    assert g["status"] == "FAIL" and g["detail"].startswith("timed out after 4 s") and g["timeout_s"] == 4
    assert re.search(r"^graphs\s+FAIL\s+\d+\.\d s  timed out after 4 s", proc.stdout, re.M)
    assert "FAIL: 0 passed, 1 failed, 0 skipped" in proc.stdout and report["status"] == "FAIL"


def test_gpu_mode_without_a_gpu_fails_and_skips_the_rest(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc, report = run("--stages", "env,graphs", out=tmp_path)
    assert proc.returncode == 1
    assert report["stages"]["env"]["status"] == "FAIL" and "no CUDA device" in report["stages"]["env"]["detail"]
    assert report["stages"]["graphs"]["status"] == "SKIP" and "--dry" in report["stages"]["graphs"]["detail"]


@pytest.mark.parametrize("args, message", [(["--bogus"], "unrecognized arguments: --bogus"),
                                           (["--stages", "env,gpu"], "--stages: unknown gpu"),
                                           (["--timeout", "bench=soon"], "--timeout: expected STAGE=SECONDS")])
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
    proc, report = run(*args, out=tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert report is None


def test_engine_stage_names_what_went_wrong_when_a_run_logged_nothing():
    """The engine stage's verdict on its three runs, in-process: a resumed run that crashed before
    its first step is reported as such (it once raised formatting a missing loss difference)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_stages", ROOT / "scripts" / "gpu_stages.py")
    gpu_check = sys.modules["gpu_stages"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    replayed = {"forward": {"replayed": 3}, "backward": {"replayed": 3}}
    losses = {1: 6.1, 2: 6.0, 3: 5.9, 4: 5.8}
    first = {s: losses[s] for s in (1, 2)}
    ok = dict(codes={"uninterrupted": 0, "stopped": 0, "resumed": 0},
              logs={"uninterrupted": "", "stopped": "", "resumed": "resumed from step_00000002"},
              graphs={n: replayed for n in ("uninterrupted", "stopped", "resumed")}, first=first, a=losses, total=4, stop=2)
    assert gpu_check.engine_problems(**ok, b=dict(losses)) == []
    assert gpu_check.engine_problems(**ok, b={**losses, 3: 5.95}) == [
        "losses differ from the uninterrupted run (max |diff| 0.05)"]
    crashed = dict(ok, codes={**ok["codes"], "resumed": 1}, logs={**ok["logs"], "resumed": "FileExistsError: /001405_locals"},
                   graphs={**ok["graphs"], "resumed": None})
    assert gpu_check.engine_problems(**crashed, b=dict(first)) == [
        "resumed run exited with 1: FileExistsError: /001405_locals",
        "the stopped and resumed runs logged steps [1, 2], expected 1..4"]
