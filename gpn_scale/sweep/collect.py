"""`gpn-scale sweep collect DIR`: results.csv, scaling-law fits and plots of a sweep's runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from gpn_scale.errors import UserError, read_json
from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.sweep.fit import fit_power_law
from gpn_scale.sweep.run import final_val_loss, status

COLUMNS = ["name", "family", "seed", "target_params", "params", "tokens_per_param", "tokens", "flops", "lr",
           "steps", "status", "final_train_loss", "val_loss"]


def _train_flops(point: dict, tokens: int) -> float:
    from gpn_scale.config import model_config
    from gpn_scale.models import build_model
    from gpn_scale.train.metrics import flops_per_token
    import torch

    with torch.device("meta"):
        model = build_model(model_config(point["model"], where="point.json: model"))
    return flops_per_token(model, point["seq_len"]) * tokens


def results(out: Path) -> list[dict]:
    rows = []
    for point_file in sorted(out.glob("*/point.json")):
        point, run_dir = read_json(point_file), point_file.parent
        train_rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
        tokens = train_rows[-1]["tokens"] if train_rows else 0
        rows.append({**{k: point[k] for k in COLUMNS if k in point}, "tokens": tokens,
                     "flops": _train_flops(point, tokens), "status": status(run_dir),
                     "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
                     "val_loss": final_val_loss(run_dir)})
    if not rows:
        raise UserError(f"{out}: no sweep points here (expected */point.json written by `gpn-scale sweep`)")
    return rows


def fits(rows: list[dict]) -> dict:
    """Per family: L(N) over parameters and L(C) over training FLOPs, from finished points."""
    out = {}
    for family in sorted({r["family"] for r in rows}):
        done = [r for r in rows if r["family"] == family and r["status"] == "finished" and r["val_loss"] is not None]
        entry = {"points": len(done)}
        for key, x_name in (("L(N)", "params"), ("L(C)", "flops")):
            x = [r[x_name] for r in done]
            if len(set(x)) < 3:
                entry[key] = f"not fitted: {len(set(x))} distinct {x_name} among finished points (3 needed)"
            else:
                entry[key] = fit_power_law(x, [r["val_loss"] for r in done]).to_dict()
        out[family] = entry
    return out


def _plot(rows: list[dict], fitted: dict, x_name: str, key: str, xlabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for i, family in enumerate(sorted(fitted)):
        color = f"C{i}"
        done = [r for r in rows if r["family"] == family and r["val_loss"] is not None and r["status"] == "finished"]
        if not done:
            continue
        x = np.array([r[x_name] for r in done], dtype=float)
        ax.scatter(x, [r["val_loss"] for r in done], color=color, zorder=3)
        fit = fitted[family][key]
        label = family
        if isinstance(fit, dict):
            interval = fit["interval_95"]
            ci = "n/a" if interval is None else "[{:.2f}, {:.2f}]".format(*interval["alpha"])
            label += f": {fit['E']:.2f} + {fit['A']:.3g} x^-{fit['alpha']:.3f} (alpha 95% {ci})"
            if fit["warning"]:
                label += " - not a power-law regime, see fits.json"
            grid = np.geomspace(x.min() / 1.5, x.max() * 1.5, 200)
            ax.plot(grid, fit["E"] + fit["A"] * grid ** -fit["alpha"], color=color, label=label)
        else:
            ax.plot([], [], color=color, marker="o", ls="none", label=f"{family} (not fitted)")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(f"{key} = E + A x^-alpha, per family")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below the axes: never over a point
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(out: Path) -> dict:
    if not out.is_dir():
        raise UserError(f"{out}: no such directory")
    rows = results(out)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    fitted = fits(rows)
    (out / "fits.json").write_text(json.dumps(fitted, indent=1) + "\n")
    _plot(rows, fitted, "params", "L(N)", "parameters N", out / "loss_vs_params.png")
    _plot(rows, fitted, "flops", "L(C)", "training compute C (FLOPs)", out / "loss_vs_compute.png")
    return {"rows": rows, "fits": fitted}
