"""One command that proves the GPU path: environment, CUDA graphs against eager, the kernel tests
with the real compiler, the GPU benchmark and a real DeepSpeed engine run.

    PYTHONPATH=. bash scripts/gpu_check.sh                 # one CUDA GPU: budgeted to end within 8 minutes
    bash scripts/gpu_check.sh --dry                        # CPU: tiny configs, Triton's interpreter, CPU graph stand-in
    bash scripts/gpu_check.sh --out DIR --stages env,graphs

Stages (docs/gpu.md says what each checks):
  env      versions (python, torch, triton, CUDA, GPU, driver); the model and kernel modules
           import without deepspeed, streaming or wandb
  graphs   the fused core with CUDA graphs (and the reverse sweep's side stream) against eager on one
           stream, in both memory forms: losses and every
           parameter's gradient, after accumulating 2 micro-batches, at every optimizer step
  kernels  pytest -m "not cpu_only" tests/kernels/test_kernels.py, tests/kernels/test_kernels_memory_chunk.py (and
           tests/kernels/test_kernels_accuracy.py when present) on the device
  bench    bench/gpu.py with a fixed batch per row; its ratio table
  engine   DeepSpeed ZeRO-2 training of the tiny GPN+M, stopped halfway and resumed, against an
           uninterrupted run (needs deepspeed and mosaicml-streaming, installed or as wheels from
           scripts/gpu_wheels.sh; SKIP otherwise)

Everything goes to OUT (--out, else $OUT, else a new temporary directory): gpu_check.log (all
output), gpu_check.json (rewritten as each stage ends, so a run cut short keeps what it
measured), and each stage's own files. Each stage runs in its own process group with its own
timeout, clipped to what is left of --budget. Exit status: 0 when no stage failed, 1 when one
did, 2 on bad arguments.

This script is the command line, the orchestrator and the summary; the stages and the modes they
run in are scripts/gpu_stages.py. Imports only the standard library here; the stages import
torch, triton, numpy and yaml, and the engine stage deepspeed and streaming in its training
processes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as `python scripts/gpu_check.py` too, not only with PYTHONPATH=.
from scripts.gpu_stages import DRY, GPU, read_json, run_one, write_json  # noqa: E402
STAGES = ("env", "graphs", "kernels", "bench", "engine")
DEFAULT_WHEELS = ROOT / "scripts" / ".gpu_wheels"
MIN_STAGE_S = 15  # a stage is skipped when less than this is left of the budget


# ---- arguments -------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        print(f"gpu_check: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv):
    p = _Parser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    p.add_argument("--dry", action="store_true", help="run on the CPU: tiny configs, Triton's interpreter, the CPU graph stand-in")
    p.add_argument("--out", help="output directory (default: $OUT, else a new temporary directory)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--budget", type=float, help=f"seconds for all stages (default: {GPU.budget_s} on a GPU, {DRY.budget_s} dry)")
    p.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                   help="a stage's own time limit (repeatable; default: " + ", ".join(f"{k} {v}" for k, v in GPU.timeouts.items())
                   + " s; dry " + ", ".join(f"{k} {v}" for k, v in DRY.timeouts.items()) + " s)")
    p.add_argument("--wheels", default=str(DEFAULT_WHEELS), help="wheels for the engine stage (scripts/gpu_wheels.sh)")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # internal: run one stage in this process
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        p.error(f"--stages: unknown {','.join(unknown) or '(empty)'}; expected a subset of {','.join(STAGES)}")
    args.stages = [s for s in STAGES if s in stages]
    if args.budget is not None and args.budget <= 0:
        p.error("--budget: expected a positive number of seconds")
    args.mode = DRY if args.dry else GPU
    args.budget = args.budget or args.mode.budget_s
    args.timeouts = dict(args.mode.timeouts)
    for item in args.timeout:
        stage, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1
        if stage not in STAGES or value <= 0:
            p.error(f"--timeout: expected STAGE=SECONDS with STAGE one of {','.join(STAGES)}, got {item!r}")
        args.timeouts[stage] = value
    return args


# ---- the orchestrator: one process per stage ------------------------------------------------


def stage_env(dry: bool) -> dict:
    """The environment every stage runs in."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    if dry:
        env.update(TRITON_INTERPRET="1", GPN_SCALE_CPU_GRAPHS="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    else:  # the interpreter or the CPU stand-in would replace what this run is meant to prove
        env.pop("TRITON_INTERPRET", None)
        env.pop("GPN_SCALE_CPU_GRAPHS", None)
    return env


_INTERRUPT = {"proc": None, "signal": None}  # the running stage, and a SIGTERM/SIGINT received meanwhile


def _on_signal(signum, frame) -> None:
    """Stop the running stage (its part of the JSON is kept) and then the run."""
    _INTERRUPT["signal"] = signal.Signals(signum).name
    proc = _INTERRUPT["proc"]
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def run_stage(args, name: str, out: Path, log, timeout: float) -> dict:
    """Run one stage in its own process group; its part of the JSON, also when it was cut short."""
    part_path = out / "stages" / f"{name}.json"
    part_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--out", str(out), "--wheels", args.wheels]
    cmd += ["--dry"] if args.dry else []
    log.write(f"\n===== stage {name} (timeout {timeout:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    t0 = time.monotonic()
    proc = _INTERRUPT["proc"] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=stage_env(args.dry),
                                                 cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
        cut = f"interrupted by {_INTERRUPT['signal']}" if _INTERRUPT["signal"] else None
    except subprocess.TimeoutExpired:
        cut = f"timed out after {timeout:.0f} s"
        _kill_group(proc)
        rc = proc.returncode
    _INTERRUPT["proc"] = None
    seconds = time.monotonic() - t0
    part = read_json(part_path) or {}
    if cut:
        part.update(status="FAIL", detail=f"{cut}; {part['detail']}" if part.get("detail") else cut)
    elif "status" not in part or part.get("status") == "RUNNING":
        part.update(status="FAIL", detail=f"stage process ended with status {rc} without a result; see the log")
    part.update(seconds=round(seconds, 1), timeout_s=round(timeout))
    log.write(f"===== stage {name}: {part['status']} in {seconds:.1f} s: {part.get('detail', '')}\n")
    log.flush()
    return part


def _kill_group(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def orchestrate(args) -> int:
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check."))
    (out / "stages").mkdir(parents=True, exist_ok=True)
    json_path, log_path = out / "gpu_check.json", out / "gpu_check.log"
    t_start = time.monotonic()
    what = "dry run on the CPU: tiny configs, Triton's interpreter, CPU graph stand-in" if args.dry else "GPU"
    report = dict(mode=args.mode.name, command=" ".join(["scripts/gpu_check.sh"] + sys.argv[1:]), out=str(out),
                  started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), host=platform.node(),
                  python=sys.executable, budget_s=args.budget, stages={}, status="RUNNING")
    write_json(json_path, report)
    print(f"gpu_check ({what}); results in {out}", flush=True)
    failed_env = None
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    with open(log_path, "a") as log:
        log.write(f"gpu_check {report['started']}: {report['command']}\n")
        for name in STAGES:
            if name not in args.stages:
                continue
            left = args.budget - (time.monotonic() - t_start)
            timeout = min(args.timeouts[name], left)
            if _INTERRUPT["signal"]:
                part = dict(status="SKIP", detail=f"the run was interrupted by {_INTERRUPT['signal']}", seconds=0.0)
            elif failed_env and name != "env":
                part = dict(status="SKIP", detail=failed_env, seconds=0.0)
            elif left < MIN_STAGE_S:
                part = dict(status="SKIP", detail=f"out of the time budget ({left:.0f} s of {args.budget:.0f} s left)", seconds=0.0)
            else:
                part = run_stage(args, name, out, log, timeout)
            if name == "env" and part.get("status") == "FAIL" and not args.dry and not part.get("cuda_available"):
                failed_env = "no CUDA device (see the env stage); on a machine without a GPU use --dry"
            report["stages"][name] = part
            write_json(json_path, report)
            print(_summary_line(name, part), flush=True)
    statuses = [p["status"] for p in report["stages"].values()]
    report.update(status="FAIL" if "FAIL" in statuses or _INTERRUPT["signal"] else "PASS", wall_s=round(time.monotonic() - t_start, 1),
                  finished=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  counts={s: statuses.count(s) for s in ("PASS", "FAIL", "SKIP")})
    write_json(json_path, report)
    print_summary(report, log_path, json_path)
    return 1 if report["status"] == "FAIL" else 0


def _summary_line(name: str, part: dict) -> str:
    return f"{name:8s} {part['status']:4s} {part.get('seconds', 0):7.1f} s  {part.get('detail', '')}"


def print_summary(report: dict, log_path: Path, json_path: Path) -> None:
    print(f"\n{'stage':8s} {'':4s} {'time':>9s}  detail")
    for name, part in report["stages"].items():
        print(_summary_line(name, part))
    c = report["counts"]
    print(f"\n{report['status']}: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped in {report['wall_s']:.0f} s "
          f"({report['mode']} mode)")
    print(f"log:  {log_path}\njson: {json_path}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.stage:
        return run_one(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())

