"""`gpn-scale sweep collect DIR`: results.csv, scaling-law fits and plots of a sweep's runs; the fits
and plots of any points (`gpn-scale sweep fit CSV` writes them with the same code)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from data_prep.errors import UserError, read_json
from gpn_scale.storage.jsonl import read_jsonl
from gpn_scale.sweep.laws import Fitted, fit_all
from gpn_scale.sweep.run import final_val_loss, status
from gpn_scale.sweep.spec import train_flops

COLUMNS = ["name", "family", "seed", "target_params", "params", "tokens_per_param", "tokens", "flops", "lr",
           "steps", "status", "final_train_loss", "val_loss"]


def results(out: Path) -> list[dict]:
    rows = []
    for point_file in sorted(out.glob("*/point.json")):
        point, run_dir = read_json(point_file), point_file.parent
        train_rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
        tokens = train_rows[-1]["tokens"] if train_rows else 0
        rows.append({**{k: point[k] for k in COLUMNS if k in point}, "tokens": tokens,
                     "flops": train_flops(point["model"], point["seq_len"], tokens), "status": status(run_dir),
                     "final_train_loss": train_rows[-1]["loss"] if train_rows else None,
                     "val_loss": final_val_loss(run_dir)})
    if not rows:
        raise UserError(f"{out}: no sweep points here (expected */point.json written by `gpn-scale sweep`)")
    return rows


def points(rows: list[dict]) -> list[dict]:
    """The finished points with a validation loss, as the rows `sweep fit` reads from a CSV (the
    validation loss is the loss)."""
    return [{"family": r["family"], "params": r["params"], "tokens": r["tokens"], "loss": r["val_loss"],
             "flops": r["flops"]}
            for r in rows if r["status"] == "finished" and r["val_loss"] is not None and r["tokens"] > 0]


def fits(rows: list[dict], bootstrap: int = 200, seed: int = 0, single_bootstrap: int = 1000) -> tuple[dict, dict]:
    """Per family (every family of the sweep, finished or not), from its finished points: L(N) and
    L(C) (1000 resamples, as before), and L(N,D), the compute-optimal allocation, isoFLOP profiles
    and the families compared where the points allow them (gpn_scale/sweep/laws.py)."""
    done = points(rows)
    entries, fitted = fit_all(done, bootstrap, seed, single_bootstrap) if done else ({}, {})
    out = {}
    for family in sorted({r["family"] for r in rows}):
        out[family] = entries.get(family) or {
            "points": 0, **{key: "not fitted: no finished points" for key in
                            ("L(N)", "L(C)", "L(N,D)", "compute_optimal", "isoFLOP")}}
    return out, fitted


def write_fits(rows: list[dict], out: Path, bootstrap: int = 200, seed: int = 0,
               single_bootstrap: int | None = None) -> tuple[dict, list[Path]]:
    """fits.json and the plots in `out` from rows with params, tokens, loss (optional family,
    flops), as `sweep fit` reads them; returns the JSON content and the plots written."""
    entries, fitted = fit_all(rows, bootstrap, seed, single_bootstrap)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fits.json").write_text(json.dumps(entries, indent=1) + "\n")
    return entries, plot_fits(fitted, out)


def plot_fits(fitted: dict[str, Fitted], out: Path) -> list[Path]:
    """Every plot the fits allow: L(N) and L(C); L(N,D) against tokens per size; the
    compute-optimal N_opt(C) and the frontier's loss; the isoFLOP parabolas."""
    written = [out / "loss_vs_params.png", out / "loss_vs_compute.png"]
    _plot(fitted, "L(N)", "parameters N", written[0])
    _plot(fitted, "L(C)", "training compute C (FLOPs)", written[1])
    if any(f.law for f in fitted.values()):
        written += [out / "loss_vs_tokens.png", out / "compute_optimal.png"]
        _plot_tokens(fitted, written[-2])
        _plot_optimal(fitted, written[-1])
    if any(f.isoflop for f in fitted.values()):
        written.append(out / "isoflop.png")
        _plot_isoflop(fitted, written[-1])
    return written


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, path: Path) -> None:
    for a in np.atleast_1d(ax):
        a.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def _plot(fitted: dict[str, Fitted], key: str, xlabel: str, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for i, family in enumerate(sorted(fitted)):
        color, points = f"C{i}", fitted[family].points
        x = points.N if key == "L(N)" else points.C
        ax.scatter(x, points.L, color=color, zorder=3)
        fit = fitted[family].entry[key]
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
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below the axes: never over a point
    _save(fig, ax, path)


def _panels(count: int, width: float = 6.0):
    plt = _pyplot()
    fig, axes = plt.subplots(1, count, figsize=(width * count, 5.0), squeeze=False)
    return fig, axes[0]


def _plot_tokens(fitted: dict[str, Fitted], path: Path) -> None:
    """Per family with L(N,D): loss against tokens, coloured by size, with the law's curve per size."""
    from matplotlib import cm, colors

    laws = [f for _, f in sorted(fitted.items()) if f.law]
    fig, axes = _panels(len(laws))
    for ax, f in zip(axes, laws):
        p, e = f.points, f.entry["L(N,D)"]
        norm = colors.LogNorm(p.N.min(), p.N.max() * 1.0001)
        grid = np.geomspace(p.D.min() / 1.5, p.D.max() * 1.5, 200)
        for n in np.unique(p.N):
            color = cm.viridis(norm(n))
            ax.plot(grid, f.law(n, grid), color=color, lw=1)
            mine = p.N == n
            ax.scatter(p.D[mine], p.L[mine], color=color, zorder=3, s=18)
        fig.colorbar(cm.ScalarMappable(norm=norm, cmap="viridis"), ax=ax, label="parameters N")
        ax.set_xscale("log")
        ax.set_xlabel("tokens D")
        ax.set_ylabel("loss")
        ax.set_title(f"{f.points.family}: {e['E']:.3g} + {e['A']:.3g}/N^{e['alpha']:.3f} + {e['B']:.3g}/D^{e['beta']:.3f}",
                     fontsize=9)
    _save(fig, axes, path)


def _plot_optimal(fitted: dict[str, Fitted], path: Path) -> None:
    """N_opt(C) from L(N,D) (95% band) with the isoFLOP minima, and the loss along each family's
    compute-optimal frontier (95% band) over every point's compute."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.0))
    C_all = np.concatenate([f.points.C for f in fitted.values()])
    grid = np.geomspace(C_all.min() / 2, C_all.max() * 2, 100)
    for i, (family, f) in enumerate(sorted(fitted.items())):
        color = f"C{i}"
        right.scatter(f.points.C, f.points.L, color=color, alpha=0.35, s=12)
        if f.law:
            at = f.law.optimal(grid)
            a = f.entry["compute_optimal"]["a"]
            left.plot(grid, at["N_opt"], color=color, label=f"{family}: L(N,D), a = {a:.3f}")
            right.plot(grid, at["loss"], color=color, label=f"{family}: L(N,D) at N_opt(C)")
            if len(f.law.draws):
                draws = [f.law.optimal(grid, t) for t in f.law.draws]
                for ax, key in ((left, "N_opt"), (right, "loss")):
                    values = np.array([d[key] for d in draws])
                    ax.fill_between(grid, *np.percentile(values, [2.5, 97.5], axis=0), color=color, alpha=0.15, lw=0)
        if f.isoflop:
            used = [g for g in f.isoflop.budgets if "N_opt" in g]
            left.scatter([g["C"] for g in used], [g["N_opt"] for g in used], color=color, marker="*", s=80, zorder=3,
                         label=f"{family}: isoFLOP minima, a = {f.isoflop.a:.3f}")
            left.plot(grid, f.isoflop.N0 * grid ** f.isoflop.a, color=color, ls="--", lw=1)
    left.set_ylabel("compute-optimal parameters N_opt")
    right.set_ylabel("loss (points faint; lines: the compute-optimal frontier)")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    left.set_yscale("log")
    _save(fig, (left, right), path)


def _plot_isoflop(fitted: dict[str, Fitted], path: Path) -> None:
    """Per family with isoFLOP profiles: loss against N per budget, its parabola and minimum."""
    from matplotlib import cm, colors

    isos = [f for _, f in sorted(fitted.items()) if f.isoflop]
    fig, axes = _panels(len(isos))
    for ax, f in zip(axes, isos):
        p, budgets = f.points, f.isoflop.budgets
        norm = colors.LogNorm(min(g["C"] for g in budgets), max(g["C"] for g in budgets) * 1.0001)
        cmap = colors.ListedColormap(cm.plasma(np.linspace(0, 0.85, 256)))  # no pale yellow on white
        for g in budgets:
            color, idx = cmap(norm(g["C"])), g["indices"]
            ax.scatter(p.N[idx], p.L[idx], color=color, s=18, zorder=3)
            if "N_opt" in g:
                logn = np.linspace(np.log(p.N[idx]).min(), np.log(p.N[idx]).max(), 100)
                ax.plot(np.exp(logn), np.polyval(g["coef"], logn - g["centre"]), color=color, lw=1)
                ax.scatter([g["N_opt"]], [g["loss"]], color=color, marker="*", s=90, edgecolor="k", zorder=4)
        fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="compute budget C (FLOPs)")
        ax.set_xscale("log")
        ax.set_xlabel("parameters N")
        ax.set_ylabel("loss")
        ax.set_title(f"{p.family}: isoFLOP profiles, N_opt ~ C^{f.isoflop.a:.3f}", fontsize=9)
    _save(fig, axes, path)


def collect(out: Path, bootstrap: int = 200, seed: int = 0, single_bootstrap: int = 1000) -> dict:
    if not out.is_dir():
        raise UserError(f"{out}: no such directory")
    rows = results(out)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    fitted, objects = fits(rows, bootstrap, seed, single_bootstrap)
    (out / "fits.json").write_text(json.dumps(fitted, indent=1) + "\n")
    plots = plot_fits(objects, out)
    return {"rows": rows, "fits": fitted, "plots": plots}
