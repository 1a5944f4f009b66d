"""Native checkpoints: `model.safetensors` (weights, native names) + `model.yaml` (the model config)
+ `manifest.json` (their sizes and sha256, written last, checked at every load).

Safetensors holds no code, so the manifest guards integrity (a truncated, corrupted or swapped
file), as for training checkpoints. A native checkpoint written before manifests existed still
loads, with a one-line warning that its files are not verified; `add_manifest(DIR)` gives it one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gpn_scale.config import model_config
from gpn_scale.errors import UserError
from gpn_scale.manifest import MANIFEST, verify_manifest, write_manifest
from gpn_scale.models import build_model

WEIGHTS, CONFIG = "model.safetensors", "model.yaml"


def save_native(model: torch.nn.Module, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, out / WEIGHTS)
    (out / CONFIG).write_text(yaml.safe_dump(model.config.to_dict(), sort_keys=False))
    add_manifest(out)
    return out


def add_manifest(path: str | Path) -> Path:
    """Write (or rewrite) the manifest of a native checkpoint from its files as they are now."""
    return write_manifest(path, [WEIGHTS, CONFIG])


def check_manifest(path: Path) -> None:
    """UserError unless the files match the manifest; a checkpoint without one: a warning."""
    if not (path / MANIFEST).is_file():
        print(f"warning: {path} has no {MANIFEST} (written before native checkpoints had one): its files are "
              "not verified; gpn_scale.native.add_manifest(DIR) writes one", file=sys.stderr)
        return
    problem = verify_manifest(path, required=(WEIGHTS, CONFIG))
    if problem:
        raise UserError(f"{path}: {problem}")


def load_native(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    path = Path(path)
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise UserError(f"{path}: not a native checkpoint (missing {name})")
    check_manifest(path)
    cfg = model_config(path / CONFIG)
    with torch.device("meta"):
        model = build_model(cfg)
    try:
        state = load_file(path / WEIGHTS, device=str(device))
    except SafetensorError as e:
        raise UserError(f"{path / WEIGHTS}: unreadable weights ({e})") from None
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        first = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
        raise UserError(f"{path / WEIGHTS}: weights do not match {CONFIG}: {first}") from None
    return model


def load_model(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Any model the system writes: a native checkpoint (model.safetensors + model.yaml), a training
    checkpoint directory, or a run directory (its newest complete checkpoint)."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return load_native(path, device)
    from gpn_scale.train.checkpoint import load_trained_model

    return load_trained_model(path, device)
