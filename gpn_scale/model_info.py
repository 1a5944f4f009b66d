"""`gpn-scale model-info CONFIG`: the parameter breakdown of a model config."""

from __future__ import annotations

import argparse

import torch

from gpn_scale.config import model_config, parse_overrides
from data_prep.helptext import HelpFormatter
from gpn_scale.models import build_model

# Which part of a GPN each top-level parameter name belongs to; everything else is the loop.
_GROUPS = {"embedding": "embedding (tied)", "fuse": "input projection", "decode": "decoder"}
# The layered baselines: what `layers.{i}.mixer` is; the blocks' norms count with the final norm and `start`.
_MIXERS = {"transformer": "attention", "gdn": "gated delta rule"}


def _group(name: str, family: str) -> str:
    if name.startswith("embedding"):
        return "embedding (tied)"
    if family in _MIXERS:
        part = name.split(".")[2] if name.startswith("layers.") else None
        return {"mixer": _MIXERS[family], "mlp": "MLP (SwiGLU)"}.get(part, "norms, start")
    return next((g for prefix, g in _GROUPS.items() if name.startswith(prefix)), "loop")


def parameter_groups(model: torch.nn.Module) -> dict[str, int]:
    family = model.config.family
    if family in _MIXERS:
        order = ["embedding (tied)", _MIXERS[family], "MLP (SwiGLU)", "norms, start"]
    else:
        order = ["embedding (tied)", "input projection", "loop", "decoder"]
    counts = dict.fromkeys(order, 0)
    for name, p in model.named_parameters():
        counts[_group(name, family)] += p.numel()
    return counts


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="gpn-scale model-info", description=__doc__)
    ap.add_argument("config", help="model YAML (or a name in configs/models/)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, e.g. d_state=1024")
    args = ap.parse_args(argv)
    cfg = model_config(args.config, parse_overrides(args.overrides), override_prefix="")
    with torch.device("meta"):  # shapes only: a 1B config costs nothing
        model = build_model(cfg)
    counts = parameter_groups(model)
    total = sum(counts.values())
    print(f"{args.config}: family {cfg.family}, {cfg.n_layers} layer(s)")
    for group, n in counts.items():
        print(f"  {group:<18} {n:>15,}  {100 * n / total:5.1f}%")
    print(f"  {'total':<18} {total:>15,}  ({total / 1e6:.1f}M)")
    return 0
