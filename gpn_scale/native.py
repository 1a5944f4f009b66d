"""Native checkpoints: `model.safetensors` (weights, native names) + `model.yaml` (the model config)
+ `manifest.json` (their sizes and xxh3-128 hashes, written last, checked at every load).

Safetensors holds no code, so the manifest guards integrity (a truncated, corrupted or swapped
file), as for training checkpoints. A native checkpoint written before manifests existed still
loads, with a one-line warning that its files are not verified; `add_manifest(DIR)` gives it one.
Reading them is `gpn_scale.checkpoints.load_native`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from gpn_scale.manifest import write_manifest

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
