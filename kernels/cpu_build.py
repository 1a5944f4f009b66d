"""Builds and loads the C++ CPU kernels (kernels/cpu/*.cpp) on first use.

They are compiled with torch's C++ extension builder (a C++ compiler and ninja, both present
wherever DeepSpeed builds its CPU ops) and cached in torch's extensions directory
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions): about half a minute once, then a load.
The build is named after a hash of its sources, flags and torch version (`build_name`), so
checkouts and virtual environments sharing one cache (a cluster's home directory) each find
their own build instead of rebuilding each other's. `available()` says whether they built, and
why not.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

_SOURCES = [Path(__file__).parent / "cpu" / f for f in ("module.cpp", "memory_step.cpp", "elementwise.cpp", "gemm.cpp")]
_HEADERS = [Path(__file__).parent / "cpu" / f for f in ("kernels.h", "layout.h")]
# -fno-trapping-math: no floating-point exceptions are relied upon, and without it a comparison
# inside a loop (the clamps of layout.h's exp_vec) keeps the loop from being vectorised.
_FLAGS = ["-O3", "-fopenmp-simd", "-fno-trapping-math"]
# The vector units torch detected on this CPU, and the flags that let the compiler use them. The
# build is named after them, so a cache shared by different machines (a cluster's home
# directory) never loads a build made for wider vectors than this CPU has.
_ARCH_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw"]}
_ext = None
_error: str | None = None


def build_name(arch: str) -> str:
    """The build's name in the cache: the CPU's vector units and a hash of everything that goes
    into the build (sources and headers, flags, torch's version)."""
    import torch

    digest = hashlib.sha256()
    for path in (*_SOURCES, *_HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*_FLAGS, *_ARCH_FLAGS.get(arch, [])]).encode() + b"\0" + torch.__version__.encode())
    return f"gpn_cpu_kernels_{arch.lower()}_{digest.hexdigest()[:16]}"


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
            name = build_name(arch)
            build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
            built = build_dir / f"{name}.so"
            if built.is_file():
                # The name holds the sources' hash, so a build there is of these very sources: load it.
                # (torch's loader would rewrite the build file with this checkout's paths, and ninja
                # would then rebuild what another checkout built.)
                _ext = _import(name, build_dir)
            if _ext is None:  # a build takes a while: say why
                print(f"[kernels] building the C++ CPU kernels in {build_dir} (about half a minute): "
                      f"{_why_build(build_dir.parent, arch, name)}", file=sys.stderr)
                _ext = cpp_extension.load(name, [str(s) for s in _SOURCES],
                                          extra_cflags=[*_FLAGS, *_ARCH_FLAGS.get(arch, [])], verbose=False)
        except Exception as exc:  # no compiler, no ninja, no headers: the torch twins still work
            lines = str(exc).strip().splitlines()
            _error = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    if _ext is None:
        raise RuntimeError(f"kernel 'cpp': the C++ CPU kernels could not be built ({_error})")
    return _ext


def _import(name: str, build_dir: Path):
    """The built module, or None where it does not load (a build being written: build it then)."""
    from torch.utils import cpp_extension

    try:  # torch's own loader of a built extension, as `cpp_extension.load` ends with
        return cpp_extension._import_module_from_library(name, str(build_dir), True)
    except (ImportError, OSError):
        return None


def _why_build(cache: Path, arch: str, name: str) -> str:
    others = sorted(p.name for p in cache.glob(f"gpn_cpu_kernels_{arch.lower()}_*") if p.is_dir() and p.name != name)
    if others:
        return (f"the cache has builds of other sources, flags or torch versions ({', '.join(others)}), "
                "none of these")
    return "none in the cache yet"


def available() -> tuple[bool, str | None]:
    """(built, why not): builds the extension on the first call."""
    try:
        load()
        return True, None
    except RuntimeError:
        return False, _error
