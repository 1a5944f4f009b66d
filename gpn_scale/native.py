"""Native checkpoints: `model.safetensors` (weights, native names) + `model.yaml` (the model config)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gpn_scale.config import model_config
from gpn_scale.errors import UserError
from gpn_scale.models import build_model

WEIGHTS, CONFIG = "model.safetensors", "model.yaml"


def save_native(model: torch.nn.Module, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, out / WEIGHTS)
    (out / CONFIG).write_text(yaml.safe_dump(model.config.to_dict(), sort_keys=False))
    return out


def load_native(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    path = Path(path)
    for name in (WEIGHTS, CONFIG):
        if not (path / name).is_file():
            raise UserError(f"{path}: not a native checkpoint (missing {name})")
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
