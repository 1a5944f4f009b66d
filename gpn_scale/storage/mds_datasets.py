"""Opening MosaicML Streaming datasets: fast to import, and safe when several jobs start at once.

**Importing.** Streaming's dataset module alone, without the package's heavy `__init__`
(`data_prep.lazy_streaming`): about 2 s (mostly torch) instead of 7 s in every rank.

**Opening.** Each `StreamingDataset` registers its shared memory under the first free prefix on
the node: it scans /dev/shm for the first prefix nobody holds, then creates that prefix's
blocks. Two processes that scan at the same moment pick the same prefix, and the second to
create it fails with `FileExistsError` (two sweep points, or a training and an evaluation,
started together). Here the scan and the creation are one step for a job's rank 0, which holds a
node-wide file lock while it constructs the dataset, so the next job scans only after the prefix
is taken. Every rank scans (the node's other ranks then attach to the prefix they found, which
must be the one their leader registered), so a job's other ranks wait at a barrier until rank 0
holds the lock: scanning earlier, they could find a prefix free that another job's leader, holding
the lock, registers before this job's rank 0 scans, and attach to the wrong job's blocks. They
never wait for the lock itself (they meet rank 0 at Streaming's barriers inside the
construction, so waiting for a lock rank 0 holds would never end); the leaders of a multi-node
job's other nodes register on their own nodes without the lock.

**Checking.** Streaming trusts the index: each shard's file name is joined to the dataset's
directory and read, fetched or decompressed there. `open_dataset` checks the index first
(`data_prep.mds_index`); a remote dataset's index is fetched into the cache by the node's leader
under a temporary name, checked, then renamed into place, where Streaming finds it and fetches no
index of its own. The node's other ranks check a cached index too (names and sizes; hashes are the
leader's), and wait in Streaming for one that is still being fetched: it only appears checked.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from data_prep import mds_index
from data_prep.lazy_streaming import streaming_module
from data_prep.errors import UserError

LOCK_NAME = "gpn_scale_streaming_prefix.lock"  # in the temp dir, beside Streaming's own file locks
QUIET_WAIT_S = 10.0  # the lock waited for this long before the wait is said


def lock_path() -> Path:
    return Path(tempfile.gettempdir()) / LOCK_NAME


@contextmanager
def registering():
    """Held by a job's rank 0 while it constructs a dataset. Not by its other ranks: they wait at
    Streaming's barriers for rank 0, which may be waiting here (a deadlock if another node's
    leader of the same job, on the same host as an elastic test runs them, waited here too)."""
    group = _job_group()
    if int(os.environ.get("RANK", 0)) != 0:
        if group:
            group.barrier()  # until rank 0 holds the lock: this job's scans then see every prefix taken before
        yield
        return
    # Read-only is enough for flock, and lets every user of the node open the one file.
    fd = os.open(lock_path(), os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        _lock(fd)
        if group:
            group.barrier()
        yield
    finally:
        os.close(fd)  # releases the lock (so does the process's end)


def _lock(fd: int) -> None:
    """The node's lock. Another job opening a dataset holds it for a second or two: waited for
    quietly, and said on stderr only when the wait goes on (a command's output is not cluttered
    whenever two jobs start together)."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    print(f"waiting for {lock_path()}: another process on this node is opening a Streaming dataset",
          file=sys.stderr, flush=True)
    fcntl.flock(fd, fcntl.LOCK_EX)


def _job_group():
    """torch.distributed, where this process is one of several ranks of an initialised job (as
    Streaming finds them: it synchronises the construction the same way); else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def dataset_class():
    """streaming.StreamingDataset, without importing the rest of the package if it is not yet."""
    return streaming_module("base.dataset").StreamingDataset


def stream_class():
    """streaming.Stream (one source of a mixture), loaded as `dataset_class` loads the dataset."""
    return streaming_module("base.stream").Stream


def open_dataset(cls=None, **kwargs):
    """`cls(**kwargs)` (default `StreamingDataset`), its index checked (each stream's, for a
    mixture's `streams`), constructed under the node's lock."""
    cls = dataset_class() if cls is None else cls
    for stream in kwargs.get("streams") or ():
        check_index(stream.local, stream.remote)
    if not kwargs.get("streams"):
        check_index(kwargs["local"], kwargs.get("remote"))
    with registering(), _scan_leaves_nothing_open():
        return cls(**kwargs)


@contextmanager
def _scan_leaves_nothing_open():
    """Streaming's scan for a free prefix attaches to each prefix registered on the node (to read
    its directories) and keeps every attachment, with its file descriptor, until the process
    exits: a process opening datasets while others are registered (an evaluation beside a
    training, a test suite) gains descriptors for each. The scan's attachments are closed when
    it returns; nothing else reads them, and the blocks stay with whoever registered them."""
    prefix = importlib.import_module("streaming.base.shared.prefix")
    scan, attach = prefix._check_and_find, prefix.SharedMemory

    def scan_closing(*args, **kwargs):
        opened = []

        def attach_recorded(*a, **k):
            opened.append(attach(*a, **k))
            return opened[-1]

        prefix.SharedMemory = attach_recorded
        try:
            return scan(*args, **kwargs)
        finally:
            prefix.SharedMemory = attach
            for block in opened:
                block.cleanup()  # an attachment's cleanup closes it; it never unlinks another's block

    prefix._check_and_find = scan_closing
    try:
        yield
    finally:
        prefix._check_and_find = scan


@contextmanager
def reading(**kwargs):
    """A dataset opened (as `open_dataset`) for one read in this process, its shared memory given
    back when the block ends. Streaming keeps every block it creates or attaches to until the
    process exits, and each new dataset attaches to all the node's registered prefixes in turn,
    so a process that opens many datasets one after another (an evaluation per checkpoint, a test
    suite) would hold a growing number of file descriptors for each."""
    dataset = open_dataset(**kwargs)
    try:
        yield dataset
    finally:
        release(dataset)


def release(dataset) -> None:
    """Close and unlink the shared memory a dataset registered (what Streaming does at exit)."""
    from streaming.base.shared import SharedMemory

    def blocks(obj, depth=0):
        for value in vars(obj).values():
            if isinstance(value, SharedMemory):
                yield value
            elif depth < 2 and hasattr(value, "__dict__") and type(value).__module__.startswith("streaming"):
                yield from blocks(value, depth + 1)

    for block in blocks(dataset):
        block.cleanup()


def check_index(local: str, remote: str | None) -> None:
    """The dataset's index checked before Streaming reads it (see the module's docstring)."""
    leader = int(os.environ.get("LOCAL_RANK", 0)) == 0
    if remote and leader:
        fetch_remote_index(remote, Path(local))
    if not remote or (Path(local) / mds_index.INDEX).exists():
        mds_index.check(local, remote=bool(remote), hashes=leader)


def fetch_remote_index(remote: str, local: Path, timeout: float = 60.0) -> None:
    """`remote`'s index in the cache directory `local`, checked before it takes its real name (a
    bad one is removed: it was this call's own temporary file). An index already there is kept."""
    final = local / mds_index.INDEX
    if final.exists():
        return
    # A name of this process's own: two jobs sharing a cache (or two nodes' leaders on one host) may
    # fetch at once, and each renames only what it checked itself.
    tmp = local / f"{mds_index.INDEX}.gpn-scale.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    streaming_module("base")  # Streaming's packages, without their heavy __init__
    from streaming.base.storage.download import CloudDownloader

    source = f"{remote.rstrip('/')}/{mds_index.INDEX}"
    tmp.unlink(missing_ok=True)
    try:
        CloudDownloader.direct_download(source, str(tmp), timeout)
    except Exception as e:  # each store's client raises its own kinds
        first = str(e).splitlines()[0] if str(e) else ""
        raise UserError(f"{source}: cannot fetch it ({type(e).__name__}{': ' + first if first else ''})") from None
    try:
        mds_index.check(local, remote=True, index_path=tmp, shown=source)
    except UserError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
