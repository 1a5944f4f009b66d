"""`gpn-scale model-info CONFIG`: the parameter breakdown of a model config."""

from __future__ import annotations

import argparse

import torch

from gpn_scale.config import model_config, parse_overrides
from gpn_scale.models import build_model

# Which part of the model each top-level parameter name belongs to; everything else is the loop.
_GROUPS = {"embedding": "embedding (tied)", "fuse": "input projection", "decode": "decoder"}


def parameter_groups(model: torch.nn.Module) -> dict[str, int]:
    counts = {"embedding (tied)": 0, "input projection": 0, "loop": 0, "decoder": 0}
    for name, p in model.named_parameters():
        group = next((g for prefix, g in _GROUPS.items() if name.startswith(prefix)), "loop")
        counts[group] += p.numel()
    return counts


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpn-scale model-info", description=__doc__)
    ap.add_argument("config", help="model YAML (or a name in configs/models/)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. d_state=1024")
    args = ap.parse_args(argv)
    cfg = model_config(args.config, parse_overrides(args.overrides))
    with torch.device("meta"):  # shapes only: a 1B config costs nothing
        model = build_model(cfg)
    counts = parameter_groups(model)
    total = sum(counts.values())
    print(f"{args.config}: family {cfg.family}, {cfg.n_layers} layer(s)")
    for group, n in counts.items():
        print(f"  {group:<18} {n:>15,}  {100 * n / total:5.1f}%")
    print(f"  {'total':<18} {total:>15,}  ({total / 1e6:.1f}M)")
    return 0
