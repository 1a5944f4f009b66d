"""`export --to reference`: the paper's checkpoint format (docs/model.md, "Reference checkpoints"),
complete enough for the paper's trainer to resume from it.

`checkpoint.pkl` is a pickle of

    {"step": int, "data_position": int, "params": {reference name: float32 array}, "opt_state": optax state}

with `opt_state` in the structure that the paper's optimiser chain, `optax.chain(
optax.clip_by_global_norm(.), optax.adamw(schedule, ..., mask=matrices))`, gives at `init`:

    (EmptyState(),                                         # clip_by_global_norm
     (ScaleByAdamState(count, mu={name: array}, nu={...}), # adamw: scale_by_adam
      MaskedState(inner_state=EmptyState()),               #        add_decayed_weights, masked
      ScaleByScheduleState(count)))                        #        scale_by_learning_rate(schedule)

mu and nu are gpn-scale's AdamW moments (exp_avg, exp_avg_sq: the same recurrences), both counts
the number of updates made (zeros and 0 for a checkpoint without optimiser state, such as a native
one). `data_position` is in the paper's unit: its trainer passes it to its loader as
`dataset.batches(batch_size, start=data_position)` and adds one per batch, so it is the index of the
next batch, the run's consumed windows (step x global batch) divided by the batch size the paper's
trainer will run with (`--batch-size`, default the run's global batch). Where the two differ, or
the windows are not a whole number of such batches, a note says so; the position is rounded down,
so the paper's trainer re-reads at most one partial batch and skips none. Arrays are NumPy: the
paper's loader puts them back on its devices.

Writing it needs neither jax nor optax: optax's state classes are stood in for by NamedTuples of
the same fields, which the pickle records under optax's module and class names (as pickling the
real ones does), so that loading it with optax installed gives optax's classes, and gpn-scale's
own loader (`gpn_scale.export.convert`) reads it without optax. `config.json` holds the model fields
under "model", with the memory fields only for GPN+M, as the reference writes them.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gpn_scale.export.convert import reference_name, to_reference
from data_prep.errors import UserError

CHECKPOINT, CONFIG = "checkpoint.pkl", "config.json"
_MODEL_FIELDS = ("vocab_size", "d_state", "d_emb", "d_ffn", "n_layers", "use_decoder_bias")
_MEMORY_FIELDS = ("n_heads", "d_key", "d_val")


class EmptyState(NamedTuple):
    pass


class ScaleByAdamState(NamedTuple):
    count: Any  # int32, the number of updates made
    mu: Any  # first moments, like the parameters
    nu: Any  # second moments


class MaskedState(NamedTuple):
    inner_state: Any


class ScaleByScheduleState(NamedTuple):
    count: Any


# Where optax (0.2.x) defines each class: the module and name a pickle of the real state records.
OPTAX_NAMES = {
    EmptyState: ("optax._src.base", "EmptyState"),
    ScaleByAdamState: ("optax._src.transform", "ScaleByAdamState"),
    MaskedState: ("optax.transforms._masking", "MaskedState"),
    ScaleByScheduleState: ("optax._src.transform", "ScaleByScheduleState"),
}


class _Pickler(pickle._Pickler):
    """The standard pickler (the pure-Python one, whose global lookup can be extended), recording the
    stand-ins above as optax's classes, without importing optax."""

    def save_global(self, obj, name=None):
        where = OPTAX_NAMES.get(obj)
        if where is None:
            return super().save_global(obj, name)
        self.save(where[0])
        self.save(where[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def check_exportable(source) -> None:
    if source.family not in ("gpn", "gpn_m"):
        raise UserError(f"{source.path}: --to reference: the paper's format holds GPN and GPN+M only, this is a "
                        f"{source.family} model; export it with --to native")


def reference_config(cfg) -> dict:
    fields = _MODEL_FIELDS + (_MEMORY_FIELDS if cfg.memory else ())
    return {"model": {k: getattr(cfg, k) for k in fields}}


def optimizer_state(params: dict[str, np.ndarray], adam, cfg) -> tuple:
    """The paper's chain state from gpn-scale's AdamW state (`checkpoints.AdamState`; None: zeros, count 0)."""

    def moments(native: dict) -> dict:  # every parameter's, zeros where the checkpoint holds none
        out = {name: np.zeros_like(value) for name, value in params.items()}
        out.update({reference_name(n, cfg): t.detach().float().cpu().numpy() for n, t in native.items()})
        return out

    mu, nu = (moments(adam.exp_avg), moments(adam.exp_avg_sq)) if adam is not None else (moments({}), moments({}))
    step = adam.step if adam is not None else 0
    count = lambda: np.asarray(step, dtype=np.int32)  # noqa: E731
    return (EmptyState(), (ScaleByAdamState(count(), mu, nu), MaskedState(EmptyState()), ScaleByScheduleState(count())))


def data_position(state, batch_size: int | None, note=print) -> int:
    """The paper's batch index that follows the windows the run consumed (see the module's docstring);
    `state`: the checkpoint's TrainerState (None: a checkpoint that never trained here, position 0)."""
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size: expected a number of windows >= 1, got {batch_size}")
    if state is None:
        return 0
    consumed = state.step * state.global_batch
    size = batch_size or state.global_batch
    position, left = divmod(consumed, size)
    if size != state.global_batch:
        note(f"note: the run's batches held {state.global_batch} windows; data_position {position} counts "
             f"batches of {size}: run the paper's trainer with batch_size {size}")
    if left:
        note(f"note: the run consumed {consumed} windows, not a whole number of batches of {size}: the paper's "
             f"trainer starts {left} windows before where the run stopped (re-reading them, skipping none)")
    return position


def write(source, out: Path, batch_size: int | None = None) -> None:
    import sys

    from gpn_scale.storage.checkpoints import read_adam_state

    params = to_reference(source.model)
    adam = read_adam_state(source.checkpoint, source.model) if source.checkpoint is not None else None
    position = data_position(source.trainer_state, batch_size, lambda line: print(line, file=sys.stderr))
    payload = {"step": source.step or 0, "data_position": position, "params": params,
               "opt_state": optimizer_state(params, adam, source.model.config)}
    with open(out / CHECKPOINT, "wb") as f:
        _Pickler(f, protocol=4).dump(payload)
    (out / CONFIG).write_text(json.dumps(reference_config(source.model.config), indent=1) + "\n")
