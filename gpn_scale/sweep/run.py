"""Running a sweep's points: one after another here (`local`), or one SLURM job each (`slurm`)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from gpn_scale.config import BUNDLE_ROOT
from gpn_scale.errors import UserError
from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.train.launch import torchrun_command
from gpn_scale.sweep.spec import Point, SweepSpec


def status(run_dir: Path) -> str:
    """The engine's record of the run: finished, preempted, running (or crashed), or not started."""
    try:
        return json.loads((run_dir / "status.json").read_text())["status"]
    except (OSError, ValueError, KeyError):
        return "not started"


def final_val_loss(run_dir: Path) -> float | None:
    loss = None
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        if "val_loss" in row:
            loss = row["val_loss"]
    return loss


def train_command(run_dir: Path, nproc: int) -> list[str]:
    if nproc > 1:
        return torchrun_command(str(run_dir / "train.yaml"), [], nproc)
    return [sys.executable, "-m", "gpn_scale", "train", str(run_dir / "train.yaml"), "--resume", "auto"]


def run_local(points: list[Point], out: Path, nproc: int, dry_run: bool) -> int:
    """Each unfinished point in turn (a rerun skips finished ones and resumes the rest). Failures are
    reported and the sweep goes on; the exit status is 1 if any point failed."""
    failed = []
    began = time.time()
    for i, point in enumerate(points, 1):
        run_dir = out / point.name
        head = f"[{i}/{len(points)}] {point.name} ({point.params:,} parameters, {point.steps} steps)"
        if status(run_dir) == "finished":
            print(f"{head}: already finished", flush=True)
            continue
        cmd = train_command(run_dir, nproc)
        if dry_run:
            print(f"{head}\n  + {shlex.join(cmd)}")
            continue
        print(f"{head}: training (log: {run_dir / 'train.log'})", flush=True)
        started = time.time()
        with open(run_dir / "train.log", "a") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            tail = (run_dir / "train.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
            print(f"  failed with exit status {code}: {tail[0]}", flush=True)
            failed.append(point.name)
            continue
        loss = final_val_loss(run_dir)
        print(f"  done in {time.time() - started:.0f} s; final val loss "
              f"{'n/a' if loss is None else f'{loss:.4f}'}", flush=True)
    if not dry_run:
        print(f"sweep: {len(points) - len(failed)}/{len(points)} points finished in {time.time() - began:.0f} s; "
              f"next: gpn-scale sweep collect {out}")
    if failed:
        print(f"failed: {', '.join(failed)} (rerun the same command to retry them)", file=sys.stderr)
    return 1 if failed else 0


def slurm_script(spec: SweepSpec) -> Path:
    """`slurm.script`: a path as given, else (relative) the bundled launchers' file of that name."""
    script = Path(spec.slurm.script)
    if not script.is_absolute() and not script.is_file():
        script = (BUNDLE_ROOT / script).resolve()  # in a checkout: the repository's launchers/, not the link
    if not script.is_file():
        raise UserError(f"slurm.script: {spec.slurm.script}: no such file here nor in {BUNDLE_ROOT}")
    return script


def submit_slurm(spec: SweepSpec, points: list[Point], out: Path, dry_run: bool) -> int:
    """One `sbatch` of the training template per unfinished point; job ids go to each point's slurm_job."""
    script = slurm_script(spec)
    previous = None
    for point in points:
        run_dir = out / point.name
        if status(run_dir) == "finished":
            print(f"{point.name}: already finished")
            continue
        cmd = ["sbatch", "--parsable", f"--job-name={point.name}", f"--output={run_dir}/slurm-%j.out",
               *map(str, spec.slurm.sbatch_args)]
        if spec.slurm.chain and previous:
            cmd.append(f"--dependency=afterany:{previous}")
        cmd += [str(script), str(run_dir / "train.yaml"), f"run.dir={run_dir}"]
        if dry_run:
            print(f"+ {shlex.join(cmd)}")
            previous = previous or "JOBID"
            continue
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise UserError("--backend slurm: sbatch not found on PATH (run this on a SLURM login node)") from None
        if proc.returncode != 0:
            raise UserError(f"sbatch for {point.name} failed: {proc.stderr.strip().splitlines()[-1:]}")
        previous = proc.stdout.strip().split(";")[0]
        (run_dir / "slurm_job").write_text(previous + "\n")
        print(f"{point.name}: job {previous}")
    return 0
