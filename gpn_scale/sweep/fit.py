"""Scaling-law fits L(x) = E + A x^-alpha, with bootstrap intervals. NumPy only.

For a fixed alpha the model is linear in (E, A), so the fit scans alpha on a fine grid, solves
(E, A) by least squares at each, keeps the best, and polishes alpha with a golden-section search
around it. Intervals come from refitting on points resampled with replacement (a resample with
fewer than three distinct x cannot determine three parameters and is redrawn); with a handful
of points they are wide, and say so. With no more points than parameters every such resample is
the points again, so there is no interval: it is reported as undefined, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALPHAS = np.linspace(0.005, 2.0, 400)
PARAMETERS = 3  # E, A, alpha


@dataclass
class Fit:
    E: float
    A: float
    alpha: float
    rmse: float
    n: int
    interval: dict[str, tuple[float, float]] | None  # 95% bootstrap percentile intervals of E, A, alpha
    warning: str | None = None  # set when the points do not pin down a power law
    interval_warning: str | None = None  # why `interval` is None

    def __call__(self, x):
        return self.E + self.A * np.asarray(x, dtype=float) ** -self.alpha

    def to_dict(self) -> dict:
        return {"E": self.E, "A": self.A, "alpha": self.alpha, "rmse": self.rmse, "points": self.n,
                "interval_95": None if self.interval is None else {k: list(v) for k, v in self.interval.items()},
                "warning": self.warning, "interval_warning": self.interval_warning}


def _solve(logx: np.ndarray, y: np.ndarray, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares (E, A) and the sum of squared residuals at each alpha, with A >= 0 (a loss
    that does not fall with x is fitted flat) and E >= 0."""
    z = np.exp(-np.outer(alphas, logx))  # [alphas, points]
    zc, yc = z - z.mean(1, keepdims=True), y - y.mean()
    A = np.maximum((zc * yc).sum(1) / np.maximum((zc * zc).sum(1), 1e-300), 0.0)
    E = y.mean() - A * z.mean(1)
    negative = E < 0  # a loss has no negative floor: fit A x^-alpha through zero instead
    A = np.where(negative, np.maximum((z * y).sum(1) / (z * z).sum(1), 0.0), A)
    E = np.where(negative, 0.0, E)
    sse = ((E[:, None] + A[:, None] * z - y) ** 2).sum(1)
    return E, A, sse


def _fit_point(logx: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    i = int(np.argmin(_solve(logx, y, ALPHAS)[2]))
    lo, hi = ALPHAS[max(0, i - 1)], ALPHAS[min(len(ALPHAS) - 1, i + 1)]
    ratio = (np.sqrt(5) - 1) / 2
    for _ in range(30):  # golden section inside the bracketing grid cells
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        sse = _solve(logx, y, np.array([a, b]))[2]
        lo, hi = (lo, b) if sse[0] < sse[1] else (a, hi)
    alpha = (lo + hi) / 2
    E, A, sse = _solve(logx, y, np.array([alpha]))
    return float(E[0]), float(A[0]), float(alpha), float(sse[0])


def fit_power_law(x, y, bootstrap: int = 1000, seed: int = 0) -> Fit:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(np.unique(x)) < 3:
        raise ValueError(f"a fit of E + A x^-alpha needs at least 3 distinct x, got {len(np.unique(x))}")
    logx = np.log(x)
    E, A, alpha, sse = _fit_point(logx, y)
    interval, interval_warning = None, None
    if len(x) > PARAMETERS:
        interval = _bootstrap(logx, x, y, bootstrap, seed)
    else:
        interval_warning = (f"{len(x)} points for {PARAMETERS} parameters: the fit passes through them, so no "
                            f"95% interval (it needs more points than parameters)")
    warning = None
    if E == 0.0 and A > 0:
        warning = ("the floor E sits at its bound 0: the points show no flattening yet, so E and alpha are not "
                   "determined separately (train longer or over a wider range of x)")
    if not ALPHAS[0] * 1.01 < alpha < ALPHAS[-1] * 0.99:
        warning = (f"alpha at the edge of the search range [{ALPHAS[0]}, {ALPHAS[-1]}]: these points do not follow "
                   "E + A x^-alpha (too early in training, or too narrow a range of x)")
    return Fit(E, A, alpha, float(np.sqrt(sse / len(x))), len(x), interval, warning, interval_warning)


def _bootstrap(logx: np.ndarray, x: np.ndarray, y: np.ndarray, bootstrap: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    draws = []
    while len(draws) < bootstrap:
        idx = rng.integers(0, len(x), len(x))
        if len(np.unique(x[idx])) >= 3:
            draws.append(_fit_point(logx[idx], y[idx])[:3])
    draws = np.array(draws)
    return {name: (float(np.percentile(draws[:, j], 2.5)), float(np.percentile(draws[:, j], 97.5)))
            for j, name in enumerate(("E", "A", "alpha"))}
