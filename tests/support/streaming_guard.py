"""Every Streaming dataset a test's own process constructs registers its shared-memory prefix under
the node's lock (gpn_scale.storage.mds_datasets), as the project's openers do.

The suite's two workers open datasets at the same time. One registration outside the lock scans
for a free prefix unordered with the other worker's, both pick the same one, and the second to
create it fails a test that did nothing wrong with FileExistsError ('/000774_locals'). Installed
for the suite's processes by conftest.py, the registration raises instead, naming the test that
skipped the lock."""

import fcntl
import os

from data_prep.lazy_streaming import streaming_module
from gpn_scale.storage.mds_datasets import lock_path


class UnlockedRegistration(AssertionError):
    pass


def lock_is_held() -> bool:
    """Whether some open file holds the node's lock: flock refuses a second open file description,
    in this process as in any other."""
    fd = os.open(lock_path(), os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def install() -> None:
    dataset_module = streaming_module("base.dataset")
    register = dataset_module.get_shm_prefix
    if getattr(register, "guarded", False):
        return

    def register_locked(*args, **kwargs):
        if not lock_is_held():
            raise UnlockedRegistration("a Streaming dataset registered its shared-memory prefix without the node's "
                                       "lock: open it with gpn_scale.storage.mds_datasets.open_dataset (or inside "
                                       "registering())")
        return register(*args, **kwargs)

    register_locked.guarded = True
    dataset_module.get_shm_prefix = register_locked
