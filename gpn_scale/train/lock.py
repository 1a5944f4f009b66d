"""One trainer per run directory: `run.dir/trainer.lock`, held by rank 0 while it trains.

Two trainers on one directory would interleave metrics, write one run's config beside the
other's checkpoints and race on the same checkpoint names. The lock file says who holds it
(host, pid, SLURM job and restart count, start time) and is refreshed every HEARTBEAT_S by a
background thread. A lock is stale, and taken over with a warning, when its holder is gone:
a dead process on this host; the same SLURM job requeued (a higher restart count); or, on
another host, a heartbeat older than STALE_S (a node that died without releasing it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from gpn_scale.errors import UserError

LOCK = "trainer.lock"
HEARTBEAT_S = 15.0
STALE_S = 120.0


def _me() -> dict:
    env = os.environ
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": env.get("SLURM_JOB_ID"),
            "slurm_restart": env.get("SLURM_RESTART_COUNT", "0"), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _stale(holder: dict, age_s: float) -> str | None:
    """Why the holder is gone, or None while it may still be training."""
    me = _me()
    if holder.get("slurm_job") and holder["slurm_job"] == me["slurm_job"] and holder.get("slurm_restart") != me["slurm_restart"]:
        return f"SLURM job {holder['slurm_job']} was requeued"
    if holder.get("host") == me["host"]:
        return None if _alive(int(holder.get("pid", -1))) else f"process {holder.get('pid')} is gone"
    if age_s > STALE_S:
        return f"no heartbeat from {holder.get('host')} for {age_s:.0f} s"
    return None


class RunLock:
    def __init__(self, run_dir: Path, warn=lambda message: print(message, file=sys.stderr, flush=True)):
        self.path = run_dir / LOCK
        self._stop = threading.Event()
        self._thread = None
        run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_stale(warn)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(_me()) + "\n")
            break
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _take_over_if_stale(self, warn) -> None:
        try:
            text = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:  # released meanwhile: try again
            return
        try:
            holder = json.loads(text)
        except ValueError:  # written half-way by a holder that died at once
            holder, age = {}, STALE_S + 1
        why = _stale(holder, age)
        if why is None:
            raise UserError(
                f"run.dir {self.path.parent} is in use by pid {holder.get('pid')} on {holder.get('host')} "
                f"since {holder.get('started')} ({self.path}); wait for it, or choose another run.dir")
        # Move the stale lock aside under a name of our own, then check it is the one judged: two
        # starters that both found it stale must not remove the lock the faster one just made.
        aside = self.path.with_name(f"{LOCK}.stale.{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() != text:  # another starter's fresh lock: put it back, and lose the race
            os.replace(aside, self.path)
            return
        aside.unlink()
        warn(f"warning: took over the stale lock {self.path} ({why})")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # a full disk or a lost mount must not kill training; the lock just ages
                pass

    def release(self) -> None:
        self._stop.set()
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
