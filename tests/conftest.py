import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests' own helpers (reference_gpn, ...)
os.environ.setdefault("WANDB_MODE", "disabled")


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
    which tests/test_bench_gpu.py checks too. (proc, report, OUT)."""
    from gpu_check_run import HANG_ARGS, run

    out = tmp_path_factory.mktemp("gpu_check")
    proc, report = run("--dry", *HANG_ARGS, out=out)
    return proc, report, out
