"""Memory horizon: per-head retention of the data-dependent decays, half-lives, fast and slow pools.

A write keeps exp(gamma_t) of each head's memory, so what was written at step t is still there,
scaled by R_h(k) = prod_{j=t+1}^{t+k} exp(gamma_{h,j}), k writes later. The retention curve is the
mean of that product over every start t in the held-out windows; the half-life is the lag where the
curve falls to 1/e (log-linear interpolation between lags). A head that keeps more than 1/e across a
whole window is extrapolated with its mean decay, -1 / mean(gamma) (the same number for a constant
decay), and flagged.
"""

from __future__ import annotations

import numpy as np

INV_E = np.exp(-1.0)


def retention_lags(T: int, dense: int = 64, points: int = 48) -> np.ndarray:
    """Every lag 0..dense, then log-spaced lags up to T-1: fast heads need the first, slow ones the rest."""
    return np.unique(np.r_[np.arange(min(dense, T - 1) + 1), np.round(np.geomspace(1, max(T - 1, 1), points))]).astype(int)


def retention(decays: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """decays (N, T, H) gamma -> R (len(ks), H): R[i, h] = mean over t of exp(sum_{j=t+1}^{t+k} gamma_j), k = ks[i]."""
    N, T, H = decays.shape
    cum = np.concatenate([np.zeros((N, 1, H)), np.cumsum(decays.astype(np.float64), axis=1)], axis=1)
    # writes j = t+1 .. t+k for starts t = 0 .. T-1-k: cum[t+k+1] - cum[t+1]
    return np.stack([np.exp(cum[:, k + 1 :] - cum[:, 1 : T - k + 1]).mean(axis=(0, 1)) for k in ks])


def half_lives(ks: np.ndarray, R: np.ndarray, decays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per head: the lag where R crosses 1/e, and whether it had to be extrapolated. ks starts at 0."""
    H = R.shape[1]
    out, extrapolated = np.empty(H), np.zeros(H, dtype=bool)
    mean_gamma = decays.reshape(-1, H).mean(0)
    for h in range(H):
        below = np.flatnonzero(R[:, h] <= INV_E)
        if len(below) == 0:
            out[h], extrapolated[h] = -1.0 / mean_gamma[h], True
            continue
        i = below[0]  # R at lag 0 is 1 > 1/e, so i >= 1
        lo, hi = np.log(R[i - 1, h]), np.log(R[i, h])
        out[h] = ks[i - 1] + (ks[i] - ks[i - 1]) * (lo + 1.0) / (lo - hi)
    return out, extrapolated


def two_pools(half_life: np.ndarray) -> tuple[np.ndarray, float]:
    """Split heads into fast / slow by the optimal 1-D 2-means on log half-life: every cut of the sorted
    values is tried and the one with the least within-pool squared deviation wins (exact in 1-D).
    Returns a boolean mask of the slow heads and the threshold (the geometric mean of the two heads
    around the cut)."""
    x = np.log(half_life)
    order = np.argsort(x)
    xs = x[order]
    best, cut = np.inf, 1
    for i in range(1, len(xs)):
        cost = ((xs[:i] - xs[:i].mean()) ** 2).sum() + ((xs[i:] - xs[i:].mean()) ** 2).sum()
        if cost < best - 1e-12:
            best, cut = cost, i
    slow = np.zeros(len(x), dtype=bool)
    slow[order[cut:]] = True
    return slow, float(np.exp((xs[cut - 1] + xs[cut]) / 2))


def memory_horizon(decays: np.ndarray) -> dict:
    ks = retention_lags(decays.shape[1])
    R = retention(decays, ks)
    hl, extrapolated = half_lives(ks, R, decays)
    slow, threshold = two_pools(hl) if len(hl) > 1 else (np.zeros(len(hl), dtype=bool), float("nan"))
    return {"half_lives": hl.tolist(), "extrapolated": extrapolated.tolist(), "slow_heads": np.flatnonzero(slow).tolist(),
            "fast_heads": np.flatnonzero(~slow).tolist(), "pool_threshold": threshold, "lags": ks, "retention": R}
