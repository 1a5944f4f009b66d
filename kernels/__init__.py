"""Kernels of the fused recurrent core, a leaf package: it imports torch (and Triton, when a Triton
kernel is asked for), never the model code that calls it.

Each family is a folder with its reference twin and its implementations side by side:
`kernels.memory` (the memory step) and `kernels.step` (the elementwise groups and GEMMs of a
step), each with `reference.py` (plain PyTorch), `triton.py` (GPUs) and `cpu.py` (C++, built on
first use, kernels/cpu_build.py); `kernels.graph` captures the core's loops as CUDA graphs, `kernels.side_streams` gives them a side stream.

`backend(kernel, device_type, graphs)` bundles what the fused core runs on one device into a
`Backend`: the memory ops, the step ops, the graph factory and the streams. Triton is imported only when a
Triton implementation is asked for, and the C++ one is built only when asked for, so the model
package imports fast and runs anywhere.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

from kernels.graph import GraphFactory, factory_for
from kernels.memory import MemoryOps
from kernels.memory_chunk import ChunkOps
from kernels.step import StepOps
from kernels.side_streams import Lanes, lanes_for

Kernel = Literal["auto", "triton", "cpp", "torch"]  # a config key: its values are listed and checked from this
KERNELS = get_args(Kernel)


@dataclass(frozen=True)
class Backend:
    """What the fused core runs on one device: `name` is "triton", "cpp" or "torch"; `chunk`: the
    memory's chunk form (the torch twin's where there is no kernel of its own: cpp); `graphs`
    captures its loops (None: they run eagerly); `lanes` the side stream the reverse sweep's
    weight gradients run on (kernels.side_streams)."""

    name: str
    memory: MemoryOps
    chunk: ChunkOps
    step: StepOps
    graphs: GraphFactory | None
    lanes: Lanes


def resolve(kernel: str, device_type: str) -> str:
    """"auto" is triton on CUDA, cpp on CPU (torch, with a warning, where the C++ kernels cannot
    be built) and torch elsewhere; triton off CUDA needs Triton's interpreter."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        if device_type == "cuda":
            return "triton"
        if device_type != "cpu":
            return "torch"
        from kernels import cpu_build

        built, why = cpu_build.available()
        if not built:
            warnings.warn(f"kernel auto: the C++ CPU kernels could not be built ({why}); using the slower torch twins",
                          stacklevel=2)
        return "cpp" if built else "torch"
    if kernel == "cpp" and device_type != "cpu":
        raise ValueError(f"kernel: 'cpp' runs on CPU tensors, not {device_type}; use 'auto'")
    if kernel == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernel: 'triton' on {device_type} runs only in Triton's interpreter (TRITON_INTERPRET=1); "
                         "use 'torch' or 'auto'")
    return kernel


def backend(kernel: str, device_type: str, graphs: bool) -> Backend:
    """The implementations `kernel` (a `KERNELS` value) chooses on a device, and with `graphs`
    the device's graph factory (`kernels.graph.factory_for`)."""
    name = resolve(kernel, device_type)
    if name == "triton":
        from kernels.memory import triton as memory
        from kernels.memory_chunk import triton as chunk
        from kernels.step import triton as step
    elif name == "cpp":
        from kernels.memory import cpu as memory
        from kernels.memory_chunk import reference as chunk  # no C++ chunk form: CPUs run the step form faster
        from kernels.step import cpu as step
    else:
        from kernels.memory import reference as memory
        from kernels.memory_chunk import reference as chunk
        from kernels.step import reference as step
    return Backend(name, memory.OPS, chunk.OPS, step.OPS, factory_for(device_type) if graphs else None,
                   lanes_for(device_type))
