"""Loading checkpoint files without running code from them.

A `.pt` file is a pickle inside a zip archive, and an unrestricted unpickler calls whatever
functions the pickle names: a planted `mp_rank_00_model_states.pt` could run `os.system`. Three
things stand between a checkpoint file and that:

- torch's restricted unpickler guards every load (`restricted`): inside it, every `torch.load`
  unpickles with `weights_only=True`, which builds tensors and containers and resolves only the
  globals on torch's own list and on `ALLOWED`. That includes the loads DeepSpeed makes itself
  (`engine.load_checkpoint` at ZeRO 0-3, `ds_to_universal`, `zero_to_fp32`), which ask torch for
  its unrestricted unpickler: the scope sets `TORCH_FORCE_WEIGHTS_ONLY_LOAD`, which torch reads at
  every call and which overrides the caller's choice. Worker processes started inside the scope inherit
  the variable; forked ones also inherit the allow-list, while a spawned one has none and refuses
  any file that names a DeepSpeed record, so the guard fails closed.
- Before a checkpoint is used, each of its pickle files must be one plain zip archive as torch
  writes it (`gpn_scale.storage.plain_zip`), so that no zip reader sees other bytes than torch's, and must
  load through that same restricted unpickler (`check_file`); a file that does not is refused
  with one line naming it and why, before any other load starts.
- The manifest (`gpn_scale.storage.manifest`) is for integrity, not against tampering: whoever can plant
  a file can rewrite the manifest too.

The files that are not pickles (`TEXT_FILES`) are read as JSON or text only.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from gpn_scale.storage import manifest, plain_zip
from data_prep.errors import UserError

# Beyond torch's own weights-only list (tensors, storages, torch.Size, OrderedDict, ...): every
# global the pickles of this system's checkpoints name (torch 2.14, DeepSpeed 0.19.8, ZeRO 0-3, the
# universal form), found with torch's own `get_unsafe_globals_in_checkpoint`, with why each is there.
ALLOWED: dict[str, str] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": "the static loss scaler of a ZeRO optimiser state (fp32: 1.0)",
    "deepspeed.runtime.zero.config.ZeroStageEnum": "the ZeRO stage that wrote an optimiser state",
    "deepspeed.utils.tensor_fragment.fragment_address": "ZeRO-1/2: where each parameter sits in its flat partition",
}
# rng_rank{r}.pt written before RNG format 2 (see train.checkpoint_writer.save_rng) held NumPy's state
# tuple with a uint32 array; only those files may name these (NumPy 2's spelling and NumPy 1's).
OLD_RNG: dict[str, str] = {
    "numpy._core.multiarray._reconstruct": "rebuilds NumPy's MT19937 key array (NumPy >= 2)",
    "numpy.core.multiarray._reconstruct": "the same, as written by NumPy 1.x",
    "numpy.ndarray": "the type of that array",
    "numpy.dtype": "its dtype (uint32)",
}
# Not globals of a file but types whose state the unpickler sets (BUILD): the dtype instance.
_BUILD_TYPES = {"numpy.dtype": ("numpy.dtypes.UInt32DType",)}

TEXT_FILES = ("manifest.json", "trainer_state.json")  # read as JSON only
_FORCE, _FORCE_NO = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def allowed_for(path: Path) -> dict[str, str]:
    """The globals a file of this name may name."""
    return {**ALLOWED, **OLD_RNG} if path.name.startswith("rng_rank") else ALLOWED


def _resolve(name: str):
    module, _, attr = name.rpartition(".")
    with warnings.catch_warnings():  # numpy.core under NumPy 2 warns that it moved
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(module), attr)


def _safe_globals(names: Iterable[str]) -> list:
    found = []
    for name in sorted(set(names)):
        for each in (name, *_BUILD_TYPES.get(name, ())):
            try:
                found.append((_resolve(each), each))
            except (ImportError, AttributeError):  # not in this environment (NumPy 1's spelling under 2): not allowed
                pass
    return found


def _refusal(path: Path | str, what: str) -> str:
    return f"{path}: refusing to load: {what}; nothing was loaded (see 'Loading checkpoints safely' in docs/train.md)"


def _unpickler_says(e: Exception) -> str:
    """What torch's restricted unpickler refused, in one line: its error is a paragraph about
    weights_only, the reason, and a pointer to torch's documentation."""
    paragraphs = [p.strip() for p in str(e).split("\n\n") if p.strip()]
    said = next((p for p in paragraphs[1:] if not p.startswith("Check the documentation")),
                paragraphs[0] if paragraphs else repr(e))
    return " ".join(said.split("WeightsUnpickler error: ")[-1].split())


@contextlib.contextmanager
def restricted(where: Path | str, names: Iterable[str] = tuple(ALLOWED)) -> Iterator[None]:
    """Every `torch.load` in this scope, whoever calls it and whatever it asks for, unpickles with
    torch's restricted unpickler allowing torch's own records and `names`. A refusal is a UserError
    naming `where`. Not reentrant: leaving an inner scope would drop the outer one's allow-list."""
    saved = {key: os.environ.get(key) for key in (_FORCE, _FORCE_NO)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_FORCE_NO, None)  # with both set torch refuses every load
    try:
        with torch.serialization.safe_globals(_safe_globals(names)):
            yield
    except pickle.UnpicklingError as e:
        raise UserError(_refusal(where, f"torch's restricted unpickler refused a file: {_unpickler_says(e)}")) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def check_file(path: str | Path) -> str | None:
    """None when `path` is one plain zip archive that torch's restricted unpickler loads allowing
    only what `allowed_for` it; else the one-line reason to refuse it. Tensor data is mapped, not read."""
    return _check(Path(path))[0]


def _check(path: Path) -> tuple[str | None, list[str]]:
    """(check_file's answer, the allowed globals beyond torch's own list that the file names)."""
    problem = plain_zip.problem(path)
    if problem:
        return _refusal(path, f"not one plain zip archive as torch writes it: {problem}"), []
    try:  # torch's own listing, from the bytes torch reads, of the globals beyond its own list
        names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (ValueError, RuntimeError, pickle.UnpicklingError, EOFError) as e:  # TorchScript, a broken pickle, ...
        return _refusal(path, f"torch cannot list what its pickle names ({_first_line(e)})"), []
    foreign = [name for name in names if name not in allowed_for(path)]
    if foreign:
        return _refusal(path, f"its pickle names {foreign[0]}, which no checkpoint of this system holds"), []
    try:
        with restricted(path, names):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except UserError as e:
        return str(e), []
    except (RuntimeError, ValueError, EOFError) as e:
        return _refusal(path, f"torch cannot load it ({_first_line(e)})"), []
    return None, names


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def load(path: str | Path, map_location="cpu"):
    """One checkpoint file, after `check_file`, through torch's restricted unpickler (allowing the
    globals the file names, so that loading a file without DeepSpeed's records imports no DeepSpeed)."""
    path = Path(path)
    problem, names = _check(path)
    if problem:
        raise UserError(problem)
    with restricted(path, names):
        return torch.load(path, map_location=map_location, weights_only=True)


def checkpoint_problem(directory: str | Path, besides: tuple[str, ...] = ()) -> str | None:
    """None when every pickle file under `directory` (recursively, but not under the top-level names
    `besides`) passes `check_file`, else the one-line reason to refuse the first that does not."""
    directory = Path(directory)
    outside = manifest.link_outside(directory, besides)
    if outside:
        return f"{directory}: {outside}"
    for rel in manifest.files_under(directory, besides):
        if Path(rel).name not in TEXT_FILES:
            problem = check_file(directory / rel)
            if problem:
                return problem
    return None


def check_checkpoint(directory: str | Path, besides: tuple[str, ...] = ()) -> None:
    """Raise UserError (one line, naming the file) unless `checkpoint_problem` passes."""
    problem = checkpoint_problem(directory, besides)
    if problem:
        raise UserError(problem)
