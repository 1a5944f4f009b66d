"""Geometry of the predicted states and of their mean direction s-bar (docs/model.md, "Analyses").

Every function takes plain arrays: X is (n, d), one state per row. Spectra are of the centred
states (the covariance): the mean direction is large (the paper: |s-bar| ~107 against norms ~132),
so an uncentred spectrum would only measure s-bar.
"""

from __future__ import annotations

import numpy as np

DEAD_REL = 1e-3  # a dimension is dead when its std is below this fraction of the median std


def norm_stats(X: np.ndarray) -> dict:
    norms = np.linalg.norm(X, axis=1)
    return {"norm_mean": float(norms.mean()), "norm_std": float(norms.std())}


def dim_std(X: np.ndarray) -> np.ndarray:
    return X.std(axis=0)


def dead_dims(std: np.ndarray) -> int:
    return int((std < DEAD_REL * np.median(std)).sum())


def correlation(X: np.ndarray) -> np.ndarray:
    """Pearson correlation between dimensions (dead dimensions give 0 rather than NaN)."""
    Xc = X - X.mean(0)
    std = Xc.std(0)
    Z = Xc / np.where(std > 0, std, 1.0)
    return Z.T @ Z / len(X)


def off_diagonal_abs(C: np.ndarray) -> dict:
    off = np.abs(C[~np.eye(len(C), dtype=bool)])
    return {"offdiag_abs_corr_mean": float(off.mean()), "offdiag_abs_corr_max": float(off.max())}


def covariance_spectrum(X: np.ndarray) -> np.ndarray:
    """Eigenvalues of the covariance, largest first (squared singular values of the centred states / n)."""
    s = np.linalg.svd(X - X.mean(0), compute_uv=False)
    return s**2 / len(X)


def components_for(spectrum: np.ndarray, fraction: float) -> int:
    """Fewest principal components explaining at least `fraction` of the variance."""
    cumulative = np.cumsum(spectrum) / spectrum.sum()
    return int(np.searchsorted(cumulative, fraction - 1e-12) + 1)


def stable_rank(spectrum: np.ndarray) -> float:
    return float(spectrum.sum() / spectrum.max())


def participation_ratio(spectrum: np.ndarray) -> float:
    return float(spectrum.sum() ** 2 / (spectrum**2).sum())


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine along the last axis (broadcasting)."""
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)


def mean_direction(states: np.ndarray, groups: int = 8) -> dict:
    """s-bar of (N, T, d) states: its norm against the typical state norm, the pairwise cosine of the
    means of `groups` disjoint groups of sequences (do batches agree on it?), and how fast a
    sequence's running mean over its first k tokens turns towards it (mean cosine at each k)."""
    N, T, d = states.shape
    X = states.reshape(-1, d)
    sbar = X.mean(0)
    typical = np.linalg.norm(X, axis=1).mean()
    parts = [p.reshape(-1, d).mean(0) for p in np.array_split(states, min(groups, N)) if len(p)]
    pairs = [cosine(a, b) for i, a in enumerate(parts) for b in parts[i + 1 :]]
    running = np.cumsum(states, axis=1) / np.arange(1, T + 1)[None, :, None]
    convergence = cosine(running, sbar).mean(0)
    out = {"sbar_norm": float(np.linalg.norm(sbar)), "sbar_fraction_of_norm": float(np.linalg.norm(sbar) / typical),
           "batch_mean_cosine": float(np.mean(pairs)) if pairs else None, "groups": len(parts)}
    for k in (10, 100):
        out[f"running_mean_cosine_at_{k}"] = float(convergence[k - 1]) if T >= k else None
    return {**out, "sbar": sbar, "running_mean_cosine": convergence}


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties sharing their average rank."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1]
    ends = np.r_[starts[1:], len(x)]
    average = (starts + ends + 1) / 2.0
    r = np.empty(len(x))
    r[order] = np.repeat(average, ends - starts)
    return r


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = ranks(np.asarray(a, float)), ranks(np.asarray(b, float))
    return float(np.corrcoef(ra, rb)[0, 1])


def geometry(X: np.ndarray, heatmap_dims: int = 64) -> dict:
    """All scalar geometry of (n, d) states, plus the arrays the figures draw."""
    std = dim_std(X)
    C = correlation(X)
    spectrum = covariance_spectrum(X)
    return {**norm_stats(X), "dim_std_min": float(std.min()), "dim_std_max": float(std.max()),
            "dead_dims": dead_dims(std), **off_diagonal_abs(C), "states": len(X), "d": X.shape[1],
            "pca_components_90": components_for(spectrum, 0.90), "pca_components_99": components_for(spectrum, 0.99),
            "stable_rank": stable_rank(spectrum), "participation_ratio": participation_ratio(spectrum),
            "dim_std": std, "spectrum": spectrum, "corr_sample": C[:heatmap_dims, :heatmap_dims]}
