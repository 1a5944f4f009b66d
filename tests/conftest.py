import json
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


# The seconds each file took in a whole run (scripts/test_durations.py writes the table); a file
# it does not list yet is estimated from its tests.
DURATIONS = Path(__file__).parent / "durations.json"
SLOW_S, FAST_S = 15.0, 1.0


def group_of(path: Path) -> str:
    """The xdist group of a test file: its stem, or the group of the files sharing its fixture."""
    return _SHARED_WORKER.get(path.name, path.stem)


def expected_seconds(items) -> dict[str, float]:
    """{xdist group: seconds}: the table's figure for each file, else its tests' estimate."""
    table = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    root = Path(__file__).parent.parent
    by_file: dict[Path, float] = {}
    for item in items:
        estimate = SLOW_S if item.get_closest_marker("slow") else FAST_S
        by_file[item.path] = by_file.get(item.path, 0.0) + estimate
    seconds: dict[str, float] = {}
    for path, estimate in by_file.items():
        seconds[group_of(path)] = seconds.get(group_of(path), 0.0) + table.get(path.relative_to(root).as_posix(), estimate)
    return seconds


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup --no-loadscope-reorder` (scripts/test.sh) a file's tests
    stay on one worker, so a module-scoped fixture (a trained run, a cluster) is built once, not
    once per worker, and the files go out longest first (tests/durations.json), so
    that no long file starts last while the other worker has nothing left to do.
    First among the hooks: xdist's own, on each worker, reads the group markers into the test ids
    the scheduler groups by, and a marker added after it does nothing."""
    if not config.pluginmanager.hasplugin("xdist"):  # a machine with pytest alone (scripts/gpu_check.sh)
        return
    seconds = expected_seconds(items)
    items.sort(key=lambda item: -seconds[group_of(item.path)])  # stable: a file's tests keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item.path)))


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
