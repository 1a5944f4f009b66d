"""Writes checkpoints in the reference trainer's format: `<run>/<name>_<step>/checkpoint.pkl` + JSON.

The optimiser state is made of namedtuples that claim to live in optax's modules, as the real
one does, so loaders are tested against a pickle that names optax classes without optax present.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import sys
import types
from collections import namedtuple
from pathlib import Path

import numpy as np

ScaleByAdamState = namedtuple("ScaleByAdamState", ["count", "mu", "nu"])
EmptyState = namedtuple("EmptyState", [])


@contextlib.contextmanager
def _pretend_module(name: str, **members):
    """Make `name` importable for the duration, so pickle records classes under it."""
    parts = name.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        mod_name = ".".join(parts[:i])
        if mod_name not in sys.modules:
            sys.modules[mod_name] = types.ModuleType(mod_name)
            added.append(mod_name)
    module = sys.modules[name]
    for attr, cls in members.items():
        cls.__module__ = name
        setattr(module, attr, cls)
    try:
        yield
    finally:
        for mod_name in added:
            del sys.modules[mod_name]


def write(run_dir: Path, params: dict, model_cfg: dict, step: int = 100) -> tuple[Path, Path]:
    """Returns (checkpoint directory, config path)."""
    ckpt_dir = Path(run_dir) / f"gpn_{step}"
    ckpt_dir.mkdir(parents=True)
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    with _pretend_module("optax._src.transform", ScaleByAdamState=ScaleByAdamState), \
         _pretend_module("optax._src.base", EmptyState=EmptyState):
        opt_state = (ScaleByAdamState(np.int32(step), zeros, zeros), EmptyState())
        payload = {"step": step, "data_position": 12345, "params": params, "opt_state": opt_state}
        (ckpt_dir / "checkpoint.pkl").write_bytes(pickle.dumps(payload, protocol=4))
    config_path = Path(run_dir) / "config.json"
    config_path.write_text(json.dumps({"model": model_cfg, "train": {"lr": 6e-4}}))
    return ckpt_dir, config_path
