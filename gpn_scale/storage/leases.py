"""Readers' leases on training checkpoints: rotation (`train.keep_last`) never deletes a checkpoint
that `eval`, `generate`, `analyze` or `export` is reading beside a live run, and never waits for one.

The files, in `checkpoints/.leases/` beside the step directories:

    step_00000500.reader.<host>.<pid>.<n>   a reader holds step_00000500 (JSON: host, pid, started);
                                            its modification time is the reader's heartbeat
    step_00000500.removing                  rotation is deleting step_00000500

Each side writes its own file first, then looks for the other's:
- a reader writes its lease, then looks for `removing` (and for the directory): if either says the
  checkpoint is going, it drops its lease and takes another checkpoint;
- rotation writes `removing`, then looks for live leases: with one, it drops `removing` and keeps
  the checkpoint for a later save to remove; without, it deletes the directory, then `removing`.
Whichever writes second sees the other's file, so no checkpoint is deleted under a reader that
found it usable, and rotation never blocks: a leased checkpoint just stays until a later save.

A lease is live while its holder is: a process of this host that still exists, or, on another
host, one whose heartbeat (refreshed every HEARTBEAT_S by a background thread) is younger than
STALE_S. A killed reader's lease therefore keeps nothing for long: rotation removes stale leases
as it finds them. Where the reader cannot write (a read-only mount), it reads without a lease.

A command holds the checkpoints it resolved until it ends (`release_all`, called by the CLI and
at exit), so everything it reads of one checkpoint (weights, trainer state) comes from the same one.
Standard library only.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from data_prep.lock import pid_alive

LEASES = ".leases"
HEARTBEAT_S = 15.0
STALE_S = 120.0
_counter = itertools.count()


def is_live(lease: Path, now: float | None = None) -> bool:
    """Whether the reader that wrote `lease` may still be reading (see the module's docstring)."""
    try:
        holder = json.loads(lease.read_text())
        age = (time.time() if now is None else now) - lease.stat().st_mtime
    except FileNotFoundError:
        return False
    except ValueError:  # written half-way by a reader that died at once, or being written now
        holder, age = {}, 0.0
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return pid_alive(holder["pid"])
    return age <= STALE_S


class Lease:
    """A reader's hold on one checkpoint (None as its file: held without one, where none can be written)."""

    def __init__(self, file: Path | None):
        self.file = file

    def release(self) -> None:
        if self.file is not None:
            _heartbeat.forget(self.file)
            try:
                self.file.unlink()
            except FileNotFoundError:
                pass
            self.file = None


def take(root: Path, tag: str) -> Lease | None:
    """A lease on `root/tag`, or None when rotation is removing it or it is gone."""
    leases = root / LEASES
    file = leases / f"{tag}.reader.{socket.gethostname()}.{os.getpid()}.{next(_counter)}"
    try:
        leases.mkdir(exist_ok=True)
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    except OSError:
        if not (root / tag).is_dir():
            return None
        return Lease(None)  # cannot write here (read-only): read unprotected
    if (leases / f"{tag}.removing").exists() or not (root / tag).is_dir():
        Lease(file).release()
        return None
    _heartbeat.add(file)
    return Lease(file)


def live_readers(root: Path, tag: str) -> list[Path]:
    """The live leases on `root/tag`; stale ones are removed on the way."""
    found = []
    for lease in sorted((root / LEASES).glob(f"{tag}.reader.*")):
        if is_live(lease):
            found.append(lease)
        else:
            lease.unlink(missing_ok=True)
    return found


def remove_unless_read(root: Path, tag: str) -> bool:
    """Rotation: delete `root/tag` unless a reader holds it; whether it was deleted. Where the
    marker cannot be written (a full disk, which is when rotation matters most) the leases are
    still respected; only a reader arriving in that very moment is not warned off."""
    leases = root / LEASES
    marker = leases / f"{tag}.removing"
    try:
        leases.mkdir(exist_ok=True)
        marker.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n")
    except OSError:
        pass
    try:
        if live_readers(root, tag):
            return False
        shutil.rmtree(root / tag, ignore_errors=True)
        return True
    finally:
        marker.unlink(missing_ok=True)


class _Heartbeat:
    """One daemon thread refreshing the modification time of every lease this process holds."""

    def __init__(self):
        self._files: set[Path] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, file: Path) -> None:
        with self._lock:
            self._files.add(file)
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name="checkpoint-lease-heartbeat", daemon=True)
                self._thread.start()

    def forget(self, file: Path) -> None:
        with self._lock:
            self._files.discard(file)

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            self.refresh()

    def refresh(self) -> None:
        with self._lock:
            files = list(self._files)
        for file in files:
            try:
                os.utime(file)
            except OSError:  # released meanwhile, or a lost mount: the lease just ages
                pass


_heartbeat = _Heartbeat()

# What this command resolved each checkpoint or run directory it named to, and the lease it holds:
# {path as named, resolved: (checkpoint directory, lease, verified)}.
_held: dict[Path, tuple[Path, Lease, bool]] = {}


def remember(named: Path, tag_dir: Path, lease: Lease, verified: bool) -> None:
    _held[named.resolve()] = _held[tag_dir.resolve()] = (tag_dir, lease, verified)


def held(named: Path) -> tuple[Path, Lease, bool] | None:
    return _held.get(Path(named).resolve())


def release_all() -> None:
    """Release every lease this process holds (the end of a command)."""
    for _, lease, _ in list(_held.values()):
        lease.release()
    _held.clear()


atexit.register(release_all)
