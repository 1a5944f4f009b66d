"""report.json, report.md and the PNG figures of an analysis (matplotlib, Agg backend: no display)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

FAST, SLOW = "tab:red", "tab:blue"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_ticks(axis) -> None:
    """Log-axis tick labels as plain numbers (1.5, 40) rather than 1.5 x 10^0: every tick when the data
    span less than a decade, else 1, 2 and 5 of each decade (all of them would crowd)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    lo, hi = axis.get_data_interval()
    if hi >= 10 * lo:
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(fmt)
    axis.set_minor_formatter(fmt if hi < 10 * lo else NullFormatter())


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path.name


def figures(results: dict, arrays: dict, out: Path) -> list[str]:
    plt = _pyplot()
    names = []

    fig, ax = plt.subplots(figsize=(6, 4))
    per_position = arrays["per_position"]
    ax.plot(np.arange(1, len(per_position) + 1), per_position)
    ax.set(xscale="log", xlabel="position in the window (log)", ylabel="mean CE (nats)",
           title=f"Held-out loss by position (PPL {results['heldout']['ppl']:.2f})")
    ax.grid(alpha=0.3)
    names.append(_save(fig, out / "loss_by_position.png"))
    if not isinstance(results["geometry"], dict):
        return names

    geo = results["geometry"]
    fig, ax = plt.subplots(figsize=(6, 4))
    std = np.sort(arrays["dim_std"])[::-1]
    ax.plot(np.arange(1, len(std) + 1), std)
    ax.set(yscale="log", xlabel="dimension (sorted by std)", ylabel="std of s^p (log)",
           title=f"Per-dimension std of s^p ({geo['dead_dims']} dead of {geo['d']})")
    _plain_log_ticks(ax.yaxis)
    ax.grid(alpha=0.3)
    names.append(_save(fig, out / "geometry_dim_std.png"))

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    corr = arrays["corr_sample"]
    im = ax.imshow(corr, cmap="RdBu_r", vmin=-1, vmax=1)
    fig.colorbar(im, ax=ax, label="correlation")
    ax.set(xlabel="dimension", ylabel="dimension",
           title=f"Correlation, first {len(corr)} dims (mean |off-diag| {geo['offdiag_abs_corr_mean']:.3f})")
    names.append(_save(fig, out / "geometry_correlation.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    spectrum = arrays["spectrum"]
    ax.plot(np.arange(1, len(spectrum) + 1), np.cumsum(spectrum) / spectrum.sum(), label="cumulative variance")
    for frac, k, color in ((0.90, geo["pca_components_90"], "tab:orange"), (0.99, geo["pca_components_99"], "tab:green")):
        ax.axhline(frac, color=color, ls="--", lw=1)
        ax.axvline(k, color=color, ls=":", lw=1, label=f"{frac:.0%}: {k} components")
    ax.set(xscale="log", xlabel="principal components (log)", ylabel="fraction of variance",
           title=f"PCA of s^p (stable rank {geo['stable_rank']:.1f}, PR {geo['participation_ratio']:.1f})")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    names.append(_save(fig, out / "geometry_pca.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    conv = arrays["running_mean_cosine"]
    ax.plot(np.arange(1, len(conv) + 1), conv, label="running mean of a sequence vs s-bar")
    for k in (10, 100):
        if k <= len(conv):
            ax.plot([k], [conv[k - 1]], "o", label=f"token {k}: {conv[k - 1]:.3f}")
    ax.set(xscale="log", xlabel="tokens averaged (log)", ylabel="cosine with s-bar", title="Running-mean convergence")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    names.append(_save(fig, out / "sbar_running_mean.png"))

    hor = results["horizons"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(hor["lags"], hor["raw"], "o-", label="raw")
    ax.plot(hor["lags"], hor["centred"], "s-", label="per-sequence centred")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="lag k (tokens, log)", ylabel="c_k = E_t cos(s^p_t, s^p_t+k)", title="State horizon")
    ax.legend()
    ax.grid(alpha=0.3)
    names.append(_save(fig, out / "horizons.png"))

    if isinstance(results["memory"], dict):
        mem = results["memory"]
        hl, slow = np.array(mem["half_lives"]), set(mem["slow_heads"])
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        lags, R = arrays["retention_lags"], arrays["retention"]
        labelled = set()
        for h in range(R.shape[1]):
            pool = "slow" if h in slow else "fast"
            left.plot(lags[1:], R[1:, h], color=SLOW if h in slow else FAST, alpha=0.8,
                      label=None if pool in labelled else f"{pool} pool")
            labelled.add(pool)
        left.axhline(math.exp(-1), color="gray", ls="--", label="1/e")
        left.set(xscale="log", xlabel="lag k (writes, log)", ylabel="retention R_h(k)", title="Memory retention per head")
        left.legend()
        left.grid(alpha=0.3)
        order = np.argsort(hl)
        right.bar(np.arange(len(hl)), hl[order], color=[SLOW if h in slow else FAST for h in order])
        right.axhline(mem["pool_threshold"], color="gray", ls="--", label=f"pool split {mem['pool_threshold']:.1f}")
        right.set_xticks(np.arange(len(hl)), [str(h) for h in order])
        right.set(yscale="log", xlabel="head (sorted)", ylabel="half-life (tokens, log)",
                  title=f"Half-lives: {len(mem['fast_heads'])} fast, {len(slow)} slow")
        _plain_log_ticks(right.yaxis)
        right.legend()
        names.append(_save(fig, out / "memory_half_lives.png"))

    abl = results["ablations"]
    fig, ax = plt.subplots(figsize=(6, 4))
    arms = [a for a in abl if a != "intact"]
    ax.barh(arms, [abl[a]["delta_loss"] for a in arms], color="tab:purple")
    ax.set(xlabel="held-out loss change vs intact (nats)", title=f"Ablations (intact PPL {abl['intact']['ppl']:.2f})")
    ax.grid(alpha=0.3, axis="x")
    names.append(_save(fig, out / "ablations.png"))
    return names


def _f(x, digits=3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def markdown(results: dict, figure_names: list[str], title: str) -> str:
    h = results["heldout"]
    lines = [f"# Analysis of {title}", "",
             f"Held-out: {h['windows']} windows of {h['window']} tokens ({h['tokens']:,} tokens), "
             f"loss {h['loss']:.4f} nats, **PPL {h['ppl']:.2f}**.", "", "![](loss_by_position.png)", ""]
    if not isinstance(results["geometry"], dict):
        return "\n".join(lines + [f"Geometry, horizons, memory and ablations: {results['geometry']}.", ""])
    g, m = results["geometry"], results["mean_direction"]
    lines += ["## Geometry of s^p", "", "| measure | value |", "|---|---|",
              f"| states | {g['states']:,} of dimension {g['d']} |",
              f"| norm mean / std | {g['norm_mean']:.2f} / {g['norm_std']:.2f} |",
              f"| per-dimension std min .. max | {g['dim_std_min']:.3f} .. {g['dim_std_max']:.3f} |",
              f"| dead dimensions | {g['dead_dims']} |",
              f"| mean / max abs off-diagonal correlation | {g['offdiag_abs_corr_mean']:.3f} / {g['offdiag_abs_corr_max']:.3f} |",
              f"| PCA components for 90% / 99% variance | {g['pca_components_90']} / {g['pca_components_99']} |",
              f"| stable rank | {g['stable_rank']:.2f} |", f"| participation ratio | {g['participation_ratio']:.2f} |", "",
              "![](geometry_dim_std.png) ![](geometry_correlation.png) ![](geometry_pca.png)", "",
              "## Mean direction s-bar", "", "| measure | value |", "|---|---|",
              f"| norm of s-bar | {m['sbar_norm']:.2f} ({m['sbar_fraction_of_norm']:.1%} of the mean state norm) |",
              f"| pairwise cosine of {m['groups']} group means | {_f(m['batch_mean_cosine'])} |",
              f"| running mean cosine at token 10 / 100 | {_f(m['running_mean_cosine_at_10'])} / "
              f"{_f(m['running_mean_cosine_at_100'])} |"]
    if "spearman_unigram" in m:
        lines += [f"| Spearman of its logits vs unigram counts | {m['spearman_unigram']:.3f} |",
                  f"| same for the mean embedding (control) | {m['spearman_unigram_mean_embedding_control']:.3f} |"]
    tops = ", ".join(f"`{t['text']!r}`" for t in m["top_tokens"])
    lines += ["", f"Top {len(m['top_tokens'])} tokens of s-bar through the head: {tops}", "", "![](sbar_running_mean.png)",
              "", "## Horizons", "", "c_k = E_t[cos(s^p_t, s^p_t+k)], raw and after subtracting each sequence's mean.", "",
              "| lag | " + " | ".join(map(str, results["horizons"]["lags"])) + " |",
              "|---|" + "---|" * len(results["horizons"]["lags"]),
              "| raw | " + " | ".join(f"{x:.3f}" for x in results["horizons"]["raw"]) + " |",
              "| centred | " + " | ".join(f"{x:.3f}" for x in results["horizons"]["centred"]) + " |", "",
              "![](horizons.png)", ""]
    mem = results["memory"]
    if isinstance(mem, dict):
        lines += ["## Memory", "", "Half-life: the lag where a head's mean retention of the data-dependent decays falls "
                  "to 1/e (* extrapolated from the mean decay: above 1/e over the whole window). Pools: the best 1-D "
                  "two-way split of log half-lives.", "", "| head | half-life (tokens) | pool |", "|---|---|---|"]
        for head, (hl, ext) in enumerate(zip(mem["half_lives"], mem["extrapolated"])):
            pool = "slow" if head in mem["slow_heads"] else "fast"
            lines.append(f"| {head} | {hl:.2f}{' *' if ext else ''} | {pool} |")
        lines += ["", "![](memory_half_lives.png)", ""]
    else:
        lines += ["## Memory", "", f"{mem}.", ""]
    lines += ["## Ablations", "", "Held-out loss with an intervention at every step (naive core), against the intact model.", "",
              "| arm | loss | PPL | delta loss | delta PPL |", "|---|---|---|---|---|"]
    for arm, r in results["ablations"].items():
        lines.append(f"| {arm} | {r['loss']:.4f} | {r['ppl']:.2f} | {r['delta_loss']:+.4f} | {r['delta_ppl']:+.2f} |")
    lines += ["", "![](ablations.png)", "", "Figures: " + ", ".join(figure_names), ""]
    return "\n".join(lines)


def write_report(results: dict, arrays: dict, out: str | Path, title: str) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = figures(results, arrays, out)
    results = {**results, "figures": names}
    (out / "report.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(markdown(results, names, title))
    return out / "report.md"
