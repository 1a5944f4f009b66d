"""Opening MosaicML Streaming datasets: fast to import, and safe when several jobs start at once.

**Importing.** `import streaming` runs the package's `__init__` files, which import Streaming's
text, vision and multimodal datasets and its DataLoader, and with them transformers,
scikit-learn and torchvision: about 7 s of CPU in every process that reads data, every rank of
every training. `dataset_class` loads `streaming.base.dataset` alone (2 s, mostly torch): the two
package modules are created without running their `__init__`, which runs, in full, the first
time anything asks either package for a name it does not hold yet (`from streaming import
MDSWriter` elsewhere in the process works as ever, and finds the same `StreamingDataset`).

**Opening.** Each `StreamingDataset` registers its shared memory under the first free prefix on
the node: it scans /dev/shm for the first prefix nobody holds, then creates that prefix's
blocks. Two processes that scan at the same moment pick the same prefix, and the second to
create it fails with `FileExistsError` (two sweep points, or a training and an evaluation,
started together). Here the scan and the creation are one step for a job's rank 0, which holds a
node-wide file lock while it constructs the dataset, so the next job scans only after the prefix
is taken. A single-node job's other ranks attach to what rank 0 registered; the leaders of a
multi-node job's other nodes register on their own nodes without the lock (they meet rank 0 at
Streaming's barriers inside the construction, so waiting for a lock rank 0 holds would never end).
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = "gpn_scale_streaming_prefix.lock"  # in the temp dir, beside Streaming's own file locks


def lock_path() -> Path:
    return Path(tempfile.gettempdir()) / LOCK_NAME


@contextmanager
def registering():
    """Held by a job's rank 0 while it constructs a dataset. Not by its other ranks: they wait at
    Streaming's barriers for rank 0, which may be waiting here (a deadlock if another node's
    leader of the same job, on the same host as an elastic test runs them, waited here too)."""
    if int(os.environ.get("RANK", 0)) != 0:
        yield
        return
    # Read-only is enough for flock, and lets every user of the node open the one file.
    fd = os.open(lock_path(), os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another job on this node is opening a dataset: a second or two, normally
            print(f"waiting for {lock_path()}: another process on this node is opening a Streaming dataset",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock (so does the process's end)


def _deferred_package(name: str) -> None:
    """The package `name` in sys.modules with its `__init__` not run yet: a submodule asked for is
    imported; any other name runs the `__init__` (once) and is looked up again."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)

    def __getattr__(attr):
        if importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")
        del module.__getattr__
        spec.loader.exec_module(module)
        return getattr(module, attr)

    module.__getattr__ = __getattr__
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def dataset_class():
    """streaming.StreamingDataset, without importing the rest of the package if it is not yet."""
    if "streaming" not in sys.modules:
        _deferred_package("streaming")
        _deferred_package("streaming.base")
    return importlib.import_module("streaming.base.dataset").StreamingDataset


def open_dataset(cls=None, **kwargs):
    """`cls(**kwargs)` (default `StreamingDataset`), constructed under the node's lock."""
    cls = dataset_class() if cls is None else cls
    with registering():
        return cls(**kwargs)
