"""Running a sweep's points: here, up to `--slots` at once, each on its own share of the machine
(`local`); inside a SLURM allocation, each as an `srun --exact` job step on its share of the
allocation (`srun`); or one SLURM job each (`slurm`).

A point whose process dies (killed, out of memory, its node lost, preempted) is started again
with `--resume auto`, so it continues from its newest complete checkpoint, up to `--retries`
times, while the other points go on; a point refused for its input (exit status 2) is not
retried, as the same input would be refused again. Every start and end is appended to
OUT/sweep.jsonl (time, point, attempt, slot, exit status). Rerunning the command skips finished
points and resumes the rest.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpn_scale.config import BUNDLE_ROOT
from data_prep.errors import UserError
from gpn_scale.storage import checkpoints
from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.train.launch import torchrun_command
from gpn_scale.sweep.spec import Point, SweepSpec

REFUSED = 2  # the trainer's exit status for bad input: retrying the same input cannot help
POLL_SECONDS = 0.5


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


def branch_checkpoint(out: Path, point: Point) -> Path | None:
    """The trunk's checkpoint a WSD decay branch starts from (None for a point of its own)."""
    if point.branch_of is None:
        return None
    return out / point.branch_of / "checkpoints" / checkpoints.tag_for(point.branch_step)


def ready(out: Path, point: Point) -> bool:
    """A point can start: it is its own run, or its trunk has saved the checkpoint it branches from."""
    start = branch_checkpoint(out, point)
    return start is None or (start / checkpoints.MANIFEST).is_file()


def train_command(out: Path, point: Point, nproc: int) -> list[str]:
    """The point's training, resumed from its newest checkpoint when it has one (a branch: from its
    trunk's checkpoint until it has one of its own)."""
    run_dir, start = out / point.name, branch_checkpoint(out, point)
    how = ("--resume", "auto") if start is None else ("--branch-from", str(start))
    if nproc > 1:
        return torchrun_command(str(run_dir / "train.yaml"), [], nproc, start=how)
    return [sys.executable, "-m", "gpn_scale", "train", str(run_dir / "train.yaml"), *how]


@dataclass
class Slot:
    """One share of the machine a point runs on: its CPU cores (pinned) or its GPUs, or, under
    `srun`, the CPUs and GPUs of a job step that SLURM places."""
    index: int
    cpus: list[int] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.gpus:
            return f"slot {self.index} (GPU {','.join(self.gpus)})"
        if self.cpus:
            return f"slot {self.index} (CPU {','.join(map(str, self.cpus))})"
        return f"slot {self.index}"


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def local_slots(slots: int, gpus_per_point: int | None) -> list[Slot]:
    """`slots` disjoint shares of this machine: `gpus_per_point` GPUs each where there are GPUs,
    else an equal share of the cores this process may use."""
    gpus = _visible_gpus()
    if gpus:
        per = gpus_per_point or len(gpus) // slots
        if per < 1 or per * slots > len(gpus):
            raise UserError(f"--slots {slots} x --gpus-per-point {gpus_per_point or per}: needs "
                            f"{slots * max(per, 1)} GPUs, {len(gpus)} visible here")
        return [Slot(i, gpus=gpus[i * per:(i + 1) * per]) for i in range(slots)]
    if gpus_per_point:
        raise UserError(f"--gpus-per-point {gpus_per_point}: no GPU is visible here (points run on the CPU cores)")
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // slots
    if per < 1:
        raise UserError(f"--slots {slots}: each point needs at least one core of its own; this process may use "
                        f"{len(cores)}")
    return [Slot(i, cpus=cores[i * per:(i + 1) * per]) for i in range(slots)]


def srun_slots(slots: int, cpus_per_point: int | None, dry_run: bool) -> tuple[list[Slot], int | None]:
    """`slots` job steps of the allocation this process runs in, and the CPUs of each (default:
    the allocation's CPUs shared equally; SLURM places the steps, `--exact` keeps them apart)."""
    if "SLURM_JOB_ID" not in os.environ:
        if not dry_run:
            raise UserError("--backend srun: not inside a SLURM allocation (SLURM_JOB_ID is not set): run the sweep "
                            "from a job script or salloc, or use --backend slurm to submit one job per point")
        return [Slot(i) for i in range(slots)], cpus_per_point
    if cpus_per_point is None:
        per_node = os.environ.get("SLURM_CPUS_ON_NODE", "")
        nodes = os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1"))
        if per_node.isdigit() and nodes.isdigit():
            total = int(per_node) * int(nodes)
            if total < slots:
                raise UserError(f"--slots {slots}: the allocation has {total} CPUs, fewer than one per point")
            cpus_per_point = total // slots
    return [Slot(i) for i in range(slots)], cpus_per_point


class Launcher:
    """How a point's training command starts on a slot: `local` pins it to the slot's cores or
    GPUs; `srun` wraps it in a job step of the allocation it runs in."""

    def __init__(self, backend: str, nproc: int, cpus_per_point: int | None = None, gpus_per_point: int | None = None):
        self.backend, self.nproc = backend, nproc
        self.cpus_per_point, self.gpus_per_point = cpus_per_point, gpus_per_point

    def command(self, out: Path, point: Point) -> list[str]:
        cmd = train_command(out, point, self.nproc)
        if self.backend != "srun":
            return cmd
        step = ["srun", "--exact", "--nodes=1", "--ntasks=1", f"--job-name={point.name}", "--kill-on-bad-exit=1"]
        if self.cpus_per_point:
            step.append(f"--cpus-per-task={self.cpus_per_point}")
        if self.gpus_per_point:
            step.append(f"--gpus-per-task={self.gpus_per_point}")
        return step + cmd

    def start(self, cmd: list[str], slot: Slot, log) -> subprocess.Popen:
        env = dict(os.environ)
        if slot.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
        share = len(slot.cpus) or (self.cpus_per_point if self.backend == "srun" else 0)
        if share:  # each training process's threads on its share of the cores (fewer if the caller asked)
            threads = max(1, share // self.nproc)
            asked = os.environ.get("OMP_NUM_THREADS", "")
            env["OMP_NUM_THREADS"] = str(min(threads, int(asked)) if asked.isdigit() and int(asked) > 0 else threads)
        cpus = slot.cpus

        def pin():  # in the child, before exec: the point and everything it starts stay on the slot's cores
            if cpus:
                os.sched_setaffinity(0, cpus)

        try:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=pin,
                                    start_new_session=True)
        except FileNotFoundError:
            raise UserError(f"--backend {self.backend}: {cmd[0]} not found on PATH") from None


@dataclass
class Running:
    point: Point
    slot: Slot
    attempt: int
    proc: subprocess.Popen
    started: float
    log: object


class Stopped(Exception):
    """Ctrl-C or SIGTERM (a job's end, a scheduler's preemption) reached the sweep."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    # installed rather than inherited: a parent that ignores SIGINT (a job launcher, a test
    # runner's worker) would otherwise leave Ctrl-C without effect
    raise Stopped(signum)


def _event(out: Path, **record) -> None:
    """One line of OUT/sweep.jsonl, appended in one write."""
    line = json.dumps({"time": round(time.time(), 3), **record}) + "\n"
    with open(out / "sweep.jsonl", "a") as f:
        f.write(line)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return {75: "stopped to be resumed (exit status 75)", 130: "interrupted"}.get(code, f"exit status {code}")


def _tail(run_dir: Path) -> str:
    lines = (run_dir / "train.log").read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "(no output)"


def run_points(points: list[Point], out: Path, launcher: Launcher, slots: list[Slot], retries: int,
               dry_run: bool) -> int:
    """Every unfinished point, up to len(slots) at once, each started again from its newest
    checkpoint when its process dies (up to `retries` times). The exit status is 1 if any point
    failed for good."""
    todo = []
    for i, point in enumerate(points, 1):
        head = f"[{i}/{len(points)}] {point.name} ({point.params:,} parameters, {point.steps} steps" + \
            (f"; the decay from step {point.branch_step} of {point.branch_of})" if point.branch_of else ")")
        if status(out / point.name) == "finished":
            print(f"{head}: already finished", flush=True)
        elif dry_run:
            print(f"{head}\n  + {shlex.join(launcher.command(out, point))}")
        else:
            todo.append(point)
    if dry_run or not todo:
        return 0
    began, durations = time.time(), []
    failed: list[str] = []
    attempts = {p.name: 0 for p in todo}
    queue, running, free = list(todo), [], list(slots)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while queue or running:
            while free and any(ready(out, p) for p in queue):
                point = next(p for p in queue if ready(out, p))  # a branch waits for its trunk's checkpoint
                queue.remove(point)
                slot = free.pop(0)
                attempts[point.name] += 1
                run_dir = out / point.name
                cmd = launcher.command(out, point)
                log = open(run_dir / "train.log", "a")
                proc = launcher.start(cmd, slot, log)
                running.append(Running(point, slot, attempts[point.name], proc, time.time(), log))
                again = f" (attempt {attempts[point.name]} of {retries + 1}, from its newest checkpoint)" \
                    if attempts[point.name] > 1 else ""
                print(f"{point.name}: training on {slot.describe()}{again} (log: {run_dir / 'train.log'})", flush=True)
                _event(out, point=point.name, event="start", attempt=attempts[point.name], slot=slot.index,
                       command=shlex.join(cmd))
            if queue and not running and not any(ready(out, p) for p in queue):
                for p in queue:  # their trunk ended without the checkpoint they start from
                    print(f"{p.name}: failed ({p.branch_of} ended without its step-{p.branch_step} checkpoint)",
                          flush=True)
                    failed.append(p.name)
                queue.clear()
                break
            time.sleep(POLL_SECONDS)
            for r in [r for r in running if r.proc.poll() is not None]:
                running.remove(r)
                free.append(r.slot)
                free.sort(key=lambda s: s.index)
                r.log.close()
                code, run_dir = r.proc.returncode, out / r.point.name
                _event(out, point=r.point.name, event="end", attempt=r.attempt, slot=r.slot.index, exit=code,
                       status=status(run_dir))
                if code == 0 and status(run_dir) == "finished":
                    durations.append(time.time() - r.started)
                    loss = final_val_loss(run_dir)
                    left = len(queue) + len(running)
                    eta = sum(durations) / len(durations) * -(-left // len(slots))
                    print(f"{r.point.name}: done in {time.time() - r.started:.0f} s; final val loss "
                          f"{'n/a' if loss is None else f'{loss:.4f}'} ({len(todo) - left - len(failed)}/{len(todo)} "
                          f"done, {left} to go, ETA {eta:.0f} s)", flush=True)
                elif code == REFUSED or code == 0 or attempts[r.point.name] > retries:
                    why = "refused its input" if code == REFUSED else _exit_reason(code) if code else \
                        f"ended {status(run_dir)}"
                    print(f"{r.point.name}: failed ({why}): {_tail(run_dir)}", flush=True)
                    failed.append(r.point.name)
                else:
                    print(f"{r.point.name}: {_exit_reason(code)}; starting it again from its newest checkpoint",
                          flush=True)
                    queue.insert(0, r.point)
    except Stopped as stop:
        for sig in previous:  # a second Ctrl-C would leave the points' processes behind, unwaited for
            signal.signal(sig, signal.SIG_IGN)
        print(f"sweep: {signal.Signals(stop.signum).name}: {len(running)} running points checkpoint and stop",
              file=sys.stderr, flush=True)
        for r in running:  # each trainer checkpoints at its next step boundary and exits 75
            try:
                os.killpg(r.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for r in running:
            r.proc.wait()
        print(f"sweep: stopped by {signal.Signals(stop.signum).name}; rerun the same command to resume "
              f"{len(running) + len(queue)} points", file=sys.stderr)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"sweep: {len(todo) - len(failed)}/{len(todo)} points finished in {time.time() - began:.0f} s; "
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
    previous, jobs = None, {}
    for point in points:
        run_dir = out / point.name
        if status(run_dir) == "finished":
            print(f"{point.name}: already finished")
            continue
        cmd = ["sbatch", "--parsable", f"--job-name={point.name}", f"--output={run_dir}/slurm-%j.out",
               *map(str, spec.slurm.sbatch_args)]
        after = [previous] if spec.slurm.chain and previous else []
        if point.branch_of in jobs:  # a decay branch starts once its trunk has finished (and saved its checkpoint)
            after.append(jobs[point.branch_of])
        if after:
            cmd.append(f"--dependency=afterany:{':'.join(dict.fromkeys(after))}")
        start = branch_checkpoint(out, point)
        cmd += [str(script), str(run_dir / "train.yaml"), f"run.dir={run_dir}",
                *(["--branch-from", str(start)] if start else [])]
        if dry_run:
            print(f"+ {shlex.join(cmd)}")
            previous = jobs[point.name] = f"<job of {point.name}>"
            continue
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise UserError("--backend slurm: sbatch not found on PATH (run this on a SLURM login node)") from None
        if proc.returncode != 0:
            raise UserError(f"sbatch for {point.name} failed: {proc.stderr.strip().splitlines()[-1:]}")
        previous = jobs[point.name] = proc.stdout.strip().split(";")[0]
        (run_dir / "slurm_job").write_text(previous + "\n")
        print(f"{point.name}: job {previous}")
    return 0
