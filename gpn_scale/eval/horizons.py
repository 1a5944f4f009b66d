"""State-similarity horizon: c_k = E_t[cos(s^p_t, s^p_{t+k})] against the lag k, raw and after
subtracting each sequence's own mean state (the raw curve plateaus at the shared s-bar component;
the centred one shows how long a sequence's specific content persists)."""

from __future__ import annotations

import numpy as np

from gpn_scale.eval.geometry import cosine


def lags(T: int, points: int = 24) -> np.ndarray:
    """Roughly log-spaced lags 1 .. T-1."""
    return np.unique(np.round(np.geomspace(1, max(T - 1, 1), points)).astype(int))


def similarity_horizon(states: np.ndarray, ks: np.ndarray | None = None) -> dict:
    """states (N, T, d). c_k averages over every sequence and every t with t+k inside the window."""
    ks = lags(states.shape[1]) if ks is None else np.asarray(ks)
    centred = states - states.mean(axis=1, keepdims=True)
    raw = [float(cosine(states[:, :-k], states[:, k:]).mean()) for k in ks]
    cen = [float(cosine(centred[:, :-k], centred[:, k:]).mean()) for k in ks]
    return {"lags": ks.tolist(), "raw": raw, "centred": cen}
