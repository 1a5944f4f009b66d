"""Running scripts/gpu_check.sh from the tests, with stage limits for hangs only."""

import json
import os
import subprocess
import sys

from support import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# The tests' stage limits are for hangs only, about 10x each stage's time on an idle 2-core machine
# (the engine's first run there also builds DeepSpeed's CPU op): a loaded machine must not fail a
# stage that works. The script's own defaults budget a real GPU session; they are not what is tested.
HANG_LIMITS = dict(env=120, graphs=600, kernels=300, bench=600, engine=1800)
HANG_ARGS = ["--budget", str(sum(HANG_LIMITS.values())), *(f"--timeout={k}={v}" for k, v in HANG_LIMITS.items())]


def run(*args, out, timeout=sum(HANG_LIMITS.values()) + 300, env=None):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), **(env or {}))
    for var in ("TRITON_INTERPRET", "GPN_SCALE_CPU_GRAPHS"):  # the script sets them for its dry mode itself
        env.pop(var, None)
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else None
    return proc, report


def stage_output(out, stage: str) -> list[str]:
    """The lines a stage printed, from the run's gpu_check.log."""
    lines = (out / "gpu_check.log").read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"===== stage {stage} ("))
    last = next(i for i, line in enumerate(lines) if line.startswith(f"===== stage {stage}: "))
    return lines[first + 1 : last]
