"""Builds and loads the C++ CPU kernels (kernels/cpu/*.cpp) on first use.

They are compiled with torch's C++ extension builder (a C++ compiler and ninja, both present
wherever DeepSpeed builds its CPU ops) and cached in torch's extensions directory
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions): about half a minute once, then a load.
`available()` says whether they built, and why not.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

_SOURCES = [Path(__file__).parent / "cpu" / f for f in ("module.cpp", "memory_step.cpp", "elementwise.cpp", "gemm.cpp")]
# -fno-trapping-math: no floating-point exceptions are relied upon, and without it a comparison
# inside a loop (the clamps of layout.h's exp_vec) keeps the loop from being vectorised.
_FLAGS = ["-O3", "-fopenmp-simd", "-fno-trapping-math"]
# The vector units torch detected on this CPU, and the flags that let the compiler use them. The
# build is named after them, so a cache shared by different machines (a cluster's home
# directory) never loads a build made for wider vectors than this CPU has.
_ARCH_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw"]}
_ext = None
_error: str | None = None


def load():
    """The extension module; builds it the first time. Raises RuntimeError if it cannot be built."""
    global _ext, _error
    if _ext is None and _error is None:
        try:
            # Importing the builder logs a CUDA_HOME warning on CPU-only machines: not ours to show.
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            import torch
            from torch.utils import cpp_extension

            arch = torch.backends.cpu.get_cpu_capability()
            name = f"gpn_cpu_kernels_{arch.lower()}"
            build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
            if not (build_dir / f"{name}.so").is_file():  # a first build takes a while: say why
                print(f"[kernels] building the C++ CPU kernels in {build_dir} (once, about half a minute)", file=sys.stderr)
            _ext = cpp_extension.load(name, [str(s) for s in _SOURCES], extra_cflags=[*_FLAGS, *_ARCH_FLAGS.get(arch, [])], verbose=False)
        except Exception as exc:  # no compiler, no ninja, no headers: the torch twins still work
            lines = str(exc).strip().splitlines()
            _error = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    if _ext is None:
        raise RuntimeError(f"kernel 'cpp': the C++ CPU kernels could not be built ({_error})")
    return _ext


def available() -> tuple[bool, str | None]:
    """(built, why not): builds the extension on the first call."""
    try:
        load()
        return True, None
    except RuntimeError:
        return False, _error
