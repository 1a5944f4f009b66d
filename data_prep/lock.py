"""One writer per output directory: `run.dir/trainer.lock`, held by rank 0 while it trains, and
`OUT/prep.node-N.lock`, held by the prep of node N.

Two trainers on one directory would interleave metrics, write one run's config beside the
other's checkpoints and race on the same checkpoint names; two preps of one node would clear
each other's units half-way. The lock file says who holds it (host, pid, SLURM job and restart
count, start time) and is refreshed every HEARTBEAT_S by a background thread. A lock is stale,
and taken over with a warning, when its holder is gone: a dead process on this host; the same
SLURM job requeued (a higher restart count); or, on another host, a heartbeat older than STALE_S
(a node that died without releasing it). A lock that cannot be written (a full disk) is removed
again, with the directory if it was made for it: nothing half-written stays behind.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from data_prep.errors import UserError

LOCK = "trainer.lock"
HEARTBEAT_S = 15.0
STALE_S = 120.0


def pid_alive(pid: int) -> bool:
    """Whether a process of this host with this pid exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _me() -> dict:
    env = os.environ
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": env.get("SLURM_JOB_ID"),
            "slurm_restart": env.get("SLURM_RESTART_COUNT", "0"), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _stale(holder: dict, age_s: float) -> str | None:
    """Why the holder is gone, or None while it may still be training."""
    me = _me()
    if holder.get("slurm_job") and holder["slurm_job"] == me["slurm_job"] and holder.get("slurm_restart") != me["slurm_restart"]:
        return f"SLURM job {holder['slurm_job']} was requeued"
    if holder.get("host") == me["host"]:
        return None if pid_alive(int(holder.get("pid", -1))) else f"process {holder.get('pid')} is gone"
    if age_s > STALE_S:
        return f"no heartbeat from {holder.get('host')} for {age_s:.0f} s"
    return None


class RunLock:
    """Held from construction to `release()`; `flag` names the directory in messages (run.dir, --out)."""

    def __init__(self, directory: Path, name: str = LOCK, flag: str = "run.dir",
                 warn=lambda message: print(message, file=sys.stderr, flush=True)):
        self.path = directory / name
        self.flag = flag
        self._stop = threading.Event()
        self._thread = None
        made = _missing(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            while not self._create():
                self._take_over_if_stale(warn)
        except OSError as e:
            for path in made:  # deepest first; each was empty when made
                try:
                    path.rmdir()
                except OSError:
                    break
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
                raise UserError(f"{flag} {directory}: {what} (cannot write the lock {self.path.name}); "
                                "free some space and run the same command again") from None
            raise
        self._thread = threading.Thread(target=self._beat, name="lock-heartbeat", daemon=True)
        self._thread.start()

    def _create(self) -> bool:
        """Create the lock with our record; False when one exists. A lock that cannot be written
        whole is removed: an empty lock would block the next run until judged stale."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(_me()) + "\n")
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        return True

    def _take_over_if_stale(self, warn) -> None:
        try:
            text = self.path.read_bytes()  # bytes: a torn or foreign file is stale, not a decode error
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
                f"{self.flag} {self.path.parent} is in use by pid {holder.get('pid')} on {holder.get('host')} "
                f"since {holder.get('started')} ({self.path}); wait for it, or choose another {self.flag}")
        # Move the stale lock aside under a name of our own, then check it is the one judged: two
        # starters that both found it stale must not remove the lock the faster one just made.
        aside = self.path.with_name(f"{LOCK}.stale.{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_bytes() != text:  # another starter's fresh lock: put it back, and lose the race
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


def _missing(directory: Path) -> list[Path]:
    """The directory and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing
