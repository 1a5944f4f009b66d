import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers: `support` (tests/support/)
# The Triton kernel modules, defined before any test module is collected: under the interpreter on a
# machine without CUDA (tests/support/triton_kernels.py). A module that imports torch._inductor at collection
# (tests/models/test_baselines_compile.py) makes kernels defined after it compiled ones, which the
# interpreter then refuses to call ("Cannot call @triton.jit'd outside of the scope of a kernel").
import support.triton_kernels as triton_kernels  # noqa: E402,F401
os.environ.setdefault("WANDB_MODE", "disabled")
import support.streaming_guard as streaming_guard  # noqa: E402

streaming_guard.install()  # a test that opens a dataset outside the node's lock fails, not its neighbour
if os.environ.get("PYTEST_XDIST_WORKER"):
    # scripts/test.sh runs one worker per core: each worker's torch, and the processes its tests
    # start, take one thread, so that the workers do not fight over the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Files whose tests share a session fixture run on one worker, so it is built once (gpu_check_dry).
_SHARED_WORKER = {"test_gpu_check.py": "gpu_check", "test_bench_gpu.py": "gpu_check"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup` (scripts/test.sh) a file's tests stay on one worker, so a
    module-scoped fixture (a trained run, a cluster) is built once, not once per worker; the files
    with the most slow (multi-process) tests go out first, so that no long file starts last.
    First among the hooks: xdist's own, on each worker, reads the group markers into the test ids
    the scheduler groups by, and a marker added after it does nothing."""
    if not config.pluginmanager.hasplugin("xdist"):  # a machine with pytest alone (scripts/gpu_check.sh)
        return
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's tests keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_SHARED_WORKER.get(item.path.name, item.path.stem)))


@pytest.fixture(autouse=True)
def _deterministic_torch():
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tensors this small gain nothing from threads; on a busy 2-core machine they cost 50x.
    A module that computes only such tensors uses it: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def gpu_check_dry(tmp_path_factory):
    """One dry run of scripts/gpu_check.sh, shared: its bench stage runs bench/gpu.py's CPU command,
    which tests/bench/test_bench_gpu.py checks too. (proc, report, OUT)."""
    from support.gpu_check_run import HANG_ARGS, run

    out = tmp_path_factory.mktemp("gpu_check")
    proc, report = run("--dry", *HANG_ARGS, out=out)
    return proc, report, out
