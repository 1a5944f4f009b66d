"""MosaicML Streaming's modules without its packages' heavy `__init__`.

`import streaming` runs the package's `__init__` files, which import Streaming's text, vision and
multimodal datasets and its DataLoader, and with them transformers, scikit-learn and torchvision:
about 7 s of CPU in every process that writes or reads data (each prep worker, every rank of every
training). `streaming_module("base.format.mds.writer")` loads that module alone: the two package
modules, `streaming` and `streaming.base`, are created without running their `__init__`, which
runs, in full, the first time anything asks either package for a name it does not hold yet
(`from streaming import MDSWriter` elsewhere in the process works as ever, and finds the same
classes).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


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


def streaming_module(name: str) -> ModuleType:
    """`streaming.<name>` (e.g. `base.format.mds.writer`), without the packages' `__init__` if
    nothing in the process has imported the package yet."""
    if "streaming" not in sys.modules:
        _deferred_package("streaming")
        _deferred_package("streaming.base")
        # first, as the package's own __init__ has it: streaming.base.util and streaming.base.format
        # import each other, and only this order completes
        importlib.import_module("streaming.base.format")
    return importlib.import_module(f"streaming.{name}")
