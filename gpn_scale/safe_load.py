"""Loading checkpoint files without running code from them.

A `.pt` file is a pickle (inside a zip archive), and unpickling calls whatever functions and
classes the pickle names: a planted `mp_rank_00_model_states.pt` or `rng_rank0.pt` could run
`os.system`. So, before anything loads a checkpoint (resume, `eval`, `generate`, `analyze`, the
universal conversion), every file under its directory is scanned for the globals its pickles ask
for, without executing anything (`pickletools.genops`, following the unpickler's stack and memo so
that STACK_GLOBAL's module and name are known), and a file asking for anything outside `ALLOWED`
is refused with one line naming it and the global. This guards DeepSpeed's own loads too
(`load_checkpoint`, `ds_to_universal`, `zero_to_fp32` unpickle without torch's restrictions, and
each call site says that its files were scanned first): a pickle that names only these globals
can build tensors, containers and these few DeepSpeed records, and call nothing else. Our own loads also go through torch's restricted unpickler
(`load`: `weights_only=True`, allowing exactly the globals of the file, all of them in `ALLOWED`).

What `torch.load` would unpickle, and so what is scanned, per file:
  - a zip archive (it starts with a zip local header, torch's own test): every `*.pkl` member, each
    one pickle; a TorchScript archive (`constants.pkl`), which torch hands to `torch.jit.load`,
    and an archive Python cannot read are refused;
  - a tar archive (torch's oldest format, unpickled member by member) is refused;
  - anything else: up to five pickles one after the other (torch's legacy format: magic number,
    protocol, system info, the object, storage keys). A stream that stops being a pickle ends the
    scan there: the unpickler fails at the same byte, having resolved only the globals before it.
    JSON files (`trainer_state.json`, `manifest.json`) fail at their first byte.

This module imports only the standard library, torch and the CLI's error type; the allowed
DeepSpeed and NumPy globals are imported only to load a file that names them.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import os
import pickle
import pickletools
import tarfile
import warnings
import zipfile
from pathlib import Path

import torch

from gpn_scale.errors import UserError

# Every global a checkpoint of this system holds (torch 2.14, DeepSpeed 0.19.8, ZeRO stages 0-3,
# their universal form, and our RNG files), found by listing the GLOBAL / STACK_GLOBAL opcodes of
# every pickle of real checkpoints; with why each is there. Nothing else is ever resolved.
ALLOWED: dict[str, str] = {
    # torch.save's own records
    "torch._utils._rebuild_tensor_v2": "rebuilds every tensor from its storage, offset, size and stride",
    "torch.FloatStorage": "the storage type of float32 tensors (weights, optimiser moments, steps)",
    "torch.ByteStorage": "the storage type of uint8 tensors: torch's RNG state in rng_rank{r}.pt",
    "torch.Size": "tensor shapes: DeepSpeed's `param_shapes` in the model-states files",
    "collections.OrderedDict": "state dicts, and the (empty) backward hooks of every rebuilt tensor",
    "torch._tensor._rebuild_from_type_v2": "rebuilds a tensor that carries Python attributes (ZeRO-3's and "
                                           "the universal form's optimiser-state tensors)",
    "torch.Tensor": "the type `_rebuild_from_type_v2` gives those tensors",
    # DeepSpeed's records in its optimiser-state files (and the universal form's optimizer_state.pt)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "the static loss scaler of a ZeRO optimiser state (fp32: 1.0)",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "the ZeRO stage that wrote an optimiser state",
    "deepspeed.utils.tensor_fragment.fragment_address": "ZeRO-1/2: where each parameter sits in its flat partition",
    # rng_rank{r}.pt written before the RNG format 2 (see checkpoint.save_rng): NumPy's state tuple
    # holds a uint32 array; the two spellings of its rebuild function are NumPy 2's and NumPy 1's.
    "numpy._core.multiarray._reconstruct": "rebuilds NumPy's MT19937 key array (NumPy >= 2)",
    "numpy.core.multiarray._reconstruct": "the same, as written by NumPy 1.x",
    "numpy.ndarray": "the type of that array",
    "numpy.dtype": "its dtype (uint32)",
    "_codecs.encode": "bytes under pickle protocol 2: the array's raw data",
}
# Not globals of the file but types torch's restricted unpickler must also accept to set an
# object's state (BUILD): the dtype instance of NumPy's key array in old RNG files.
_BUILD_TYPES = {"numpy.dtype": ("numpy.dtypes.UInt32DType",)}

_ZIP_MAGIC = b"PK\x03\x04"  # how torch.load tells its zip format from the legacy one
_LEGACY_PICKLES = 5
_STRINGS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_MARK, _UNKNOWN = object(), object()
COMPUTED = "a global whose name is computed at load time"


class _Malformed(Exception):
    """The stream stops being a pickle: the unpickler fails at the same opcode."""


def pickle_globals(data: bytes, start: int = 0) -> tuple[list[str], int | None]:
    """The globals one pickle in `data` (from byte `start`) asks for, in order, and the byte after
    its STOP (None when the stream stops being a pickle before it: the globals are those the
    unpickler would resolve before failing). Nothing is executed or imported.

    The unpickler's stack and memo are followed with pickletools' stack effects, keeping the
    value of string pushes, so STACK_GLOBAL's module and name are known however they were pushed
    (directly, or memoised by PUT / MEMOIZE and fetched by GET); one that cannot be followed is
    reported as COMPUTED."""
    found: list[str] = []
    stack: list = []
    memo: dict = {}
    stream = io.BytesIO(data)
    stream.seek(start)
    try:
        for op, arg, pos in pickletools.genops(stream):
            name = op.name
            if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if not stack or stack[-1] is _MARK:
                    raise _Malformed
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
                continue
            if name == "STOP":
                return found, pos + 1
            if name == "POP" and stack and stack[-1] is _MARK:
                stack.pop()
                continue
            popped = _pop(stack, op.stack_before)
            if name in ("GLOBAL", "INST"):  # two lines after the opcode (pickletools joins them with a space)
                end = data.index(b"\n", data.index(b"\n", pos + 1) + 1)
                module, qualname = data[pos + 1:end].decode("utf-8", "replace").split("\n")
                found.append(_global(module, qualname))
            elif name == "STACK_GLOBAL":
                module, qualname = popped
                found.append(_global(module, qualname) if isinstance(module, str) and isinstance(qualname, str)
                             else COMPUTED)
            elif name in ("EXT1", "EXT2", "EXT4"):
                key = copyreg._inverted_registry.get(arg)
                found.append(_global(*key) if key else f"extension code {arg}")
            if name in _STRINGS:
                stack.append(arg if isinstance(arg, str) else _UNKNOWN)
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise _Malformed
                stack.append(memo[arg])
            elif name == "DUP":
                stack += popped * 2
            elif name == "MARK":
                stack.append(_MARK)
            else:
                stack += [_UNKNOWN] * len(op.stack_after)
    except (ValueError, _Malformed):  # an unknown opcode, a truncated argument, a stack underflow
        return found, None
    return found, None  # no STOP: the unpickler runs out of data


def _global(module: str, qualname: str) -> str:
    """`module.qualname`; a dotted qualname (an attribute path, resolved by protocol 4) is never
    allowed, so that each allowed name reaches exactly one object."""
    return f"{module}.{qualname}" if "." not in qualname else f"{module}:{qualname}"


def _pop(stack: list, before: list) -> list:
    if pickletools.markobject in before:  # everything down to the topmost mark, then what lies below it
        below = before.index(pickletools.markobject)
        marks = [i for i, v in enumerate(stack) if v is _MARK]
        if not marks or marks[-1] < below:
            raise _Malformed
        del stack[marks[-1]:]
        popped = stack[len(stack) - below:] if below else []
        del stack[len(stack) - below:]
        return popped
    n = len(before)
    if len(stack) < n or any(v is _MARK for v in stack[len(stack) - n:]):
        raise _Malformed
    popped = stack[len(stack) - n:] if n else []
    del stack[len(stack) - n:]
    return popped


def _refusal(path: Path, what: str) -> str:
    return f"{path}: refusing to load: {what}; nothing was loaded (see 'Loading checkpoints safely' in docs/train.md)"


def _scan_pickle(path: Path, data: bytes, pickles: int, found: set[str]) -> str | None:
    start: int | None = 0
    for _ in range(pickles):
        if start is None or start >= len(data):
            break
        names, start = pickle_globals(data, start)
        for name in names:
            if name not in ALLOWED:
                return _refusal(path, f"its pickle asks for {name}, which no checkpoint of this system holds")
        found.update(names)
    return None


def scan_file(path: str | Path, found: set[str] | None = None) -> str | None:
    """None when everything `torch.load` would unpickle from `path` names only allowed globals
    (added to `found`), else the one-line reason to refuse the file."""
    path = Path(path)
    found = set() if found is None else found
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if head == _ZIP_MAGIC:
        try:
            with zipfile.ZipFile(path) as archive:
                members = archive.infolist()
                if any(m.filename.rsplit("/", 1)[-1] == "constants.pkl" for m in members):
                    return _refusal(path, "it is a TorchScript archive, which torch.load runs through torch.jit.load")
                for member in members:
                    if member.filename.endswith(".pkl"):
                        problem = _scan_pickle(path, archive.read(member), 1, found)
                        if problem:
                            return problem
        except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, OSError, EOFError) as e:
            return _refusal(path, f"it starts as a zip archive but cannot be read as one ({e})")
        return None
    if tarfile.is_tarfile(path):
        return _refusal(path, "it is a tar archive (torch's oldest format, which torch.load unpickles member by member)")
    return _scan_pickle(path, path.read_bytes(), _LEGACY_PICKLES, found)


def scan_checkpoint(directory: str | Path) -> str | None:
    """None when every file under `directory` (recursively: `universal/` too) passes `scan_file`,
    else the one-line reason to refuse the first that does not."""
    for path in _files(Path(directory)):
        problem = scan_file(path)
        if problem:
            return problem
    return None


def _files(directory: Path) -> list[Path]:
    """Every file under `directory`, through symbolic links to directories too (a loader follows
    them), each directory once."""
    files, seen = [], set()
    for root, dirs, names in os.walk(directory, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        files += [Path(root) / n for n in names if (Path(root) / n).is_file()]
    return sorted(files)


def check_checkpoint(directory: str | Path) -> None:
    """Raise UserError (one line, naming the file and the global) unless `scan_checkpoint` passes."""
    problem = scan_checkpoint(directory)
    if problem:
        raise UserError(problem)


def _resolve(name: str):
    module, _, attr = name.rpartition(".")
    with warnings.catch_warnings():  # numpy.core under NumPy 2 warns that it moved
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(module), attr)


def load(path: str | Path, map_location="cpu"):
    """`torch.load` of one checkpoint file with `weights_only=True`, after `scan_file`, allowing
    exactly the (allowed) globals the file names."""
    path = Path(path)
    found: set[str] = set()
    problem = scan_file(path, found)
    if problem:
        raise UserError(problem)
    names = sorted(found) + [t for name in sorted(found) for t in _BUILD_TYPES.get(name, ())]
    allowed = []
    for name in names:
        try:
            allowed.append((_resolve(name), name))
        except (ImportError, AttributeError):
            pass  # not in this environment: torch's unpickler refuses the file below
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        detail = next((l.strip() for l in str(e).splitlines() if "WeightsUnpickler error" in l), str(e).splitlines()[0])
        raise UserError(_refusal(path, f"torch's restricted unpickler failed: {detail}")) from None
