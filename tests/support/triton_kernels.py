"""The Triton kernel modules for tests, and where they run: on the GPU where there is one, else
in Triton's interpreter.

The interpreter reads TRITON_INTERPRET when a kernel is defined and when it runs, so it is set
around the imports here and, by the `interpreter` fixture, around each test that uses the
kernels: never for other modules' tests, whose subprocesses would inherit it.
"""

import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
import kernels.step.triton as elementwise  # noqa: E402
import kernels.step.cpu as elementwise_cpu  # noqa: E402
import kernels.memory.triton as memory_step  # noqa: E402
import kernels.memory_chunk.triton as memory_chunk  # noqa: E402
import kernels.numerics as numerics  # noqa: E402

if INTERPRET:
    del os.environ["TRITON_INTERPRET"]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Autouse in every test module that imports it."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
