"""Scaling laws in parameters and tokens, read from any CSV with `params`, `tokens`, `loss`
(`gpn-scale sweep fit`) or from a sweep's runs (`gpn-scale sweep collect`), per family:

- L(N,D) = E + A / N^alpha + B / D^beta (Chinchilla's approach 3): a Huber loss (delta 1e-3) on
  log-loss residuals, log L(N, D) = logsumexp(e, a - alpha log N, b - beta log D) against log of the
  observed loss, minimised by scipy's L-BFGS-B from the best starts of a grid, the best optimum kept.
  The grid runs over (alpha, beta); at each pair the law is linear in (E, A, B), which least squares
  on relative residuals gives in closed form, so every start is already the best it can be for its
  exponents. 95% intervals: percentiles over refits to points resampled with replacement.
- the compute-optimal allocation the law implies: with C = k N D (k = 6, or fitted to the CSV's
  `flops` column), N_opt(C) = G (C/k)^a and D_opt(C) = (C/k) / N_opt with
  G = (alpha A / (beta B))^(1/(alpha+beta)), a = beta/(alpha+beta), b = alpha/(alpha+beta), and the
  tokens per parameter and the loss there at the points' compute budgets.
- isoFLOP profiles (approach 2) where the points allow it: points whose compute agrees within 10%
  form a budget; a parabola of loss in log N per budget with 3 or more sizes gives N_opt(C); lines
  through log N_opt and log D_opt against log C give a and b (bootstrap over points in each budget).
- L(N) and L(C) over parameters and over compute (gpn_scale/sweep/fit.py).
- families compared: the difference of their losses along their compute-optimal frontiers at equal
  compute, with a bootstrap interval (the families' resamples are independent; draw i of one is
  paired with draw i of the other).

A law with five parameters needs more than five points, and at least three sizes and three token
budgets: with two sizes, E and A / N^alpha are not determined separately (any alpha fits both).
"""

from __future__ import annotations

import csv
import io
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep.errors import UserError, read_text
from gpn_scale.sweep.fit import fit_power_law

HUBER_DELTA = 1e-3
NAMES = ("E", "A", "B", "alpha", "beta")  # the law's parameters; fitted as (log E, log A, log B, alpha, beta)
EXPONENTS = np.geomspace(0.02, 2.0, 24)  # the grid of starts, for alpha and for beta alike
BOUNDS = [(math.log(1e-4), math.log(1e3)), (None, None), (None, None), (0.005, 3.0), (0.005, 3.0)]
STARTS = 8  # L-BFGS-B runs from the best grid points (a resample: 2, plus the fit to all points)
BUDGET_TOLERANCE = 0.10  # an isoFLOP budget: points whose compute is within 10% of its smallest
FLOPS_PER_TOKEN_PER_PARAM = 6.0  # C = 6 N D where the CSV has no `flops` column
REQUIRED = ("params", "tokens")
OPTIONAL = ("family", "flops")


@dataclass
class Points:
    """One family's points: parameters N, tokens D, loss L and training compute C."""

    family: str
    N: np.ndarray
    D: np.ndarray
    L: np.ndarray
    C: np.ndarray
    flops_given: bool

    @property
    def k(self) -> float:
        """FLOPs per token per parameter: C ~ k N D, least squares in log space (6 without a flops column)."""
        return float(np.exp(np.mean(np.log(self.C / (self.N * self.D)))))

    def __len__(self) -> int:
        return len(self.N)


# ---------------------------------------------------------------------------------------------- reading


def read_csv(path: str | Path, loss: str = "loss") -> list[dict]:
    """The rows of a CSV as {[family,] params, tokens, loss[, flops]}: a missing column, an empty file
    and a value that is not a finite positive number (with its line) are one-line UserErrors."""
    path = Path(path)
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    reader = csv.DictReader(io.StringIO(text))
    header = [name.strip() for name in reader.fieldnames or [] if name is not None]
    expected = f"columns {', '.join((*REQUIRED, loss))} (optional: {', '.join(OPTIONAL)})"
    if not header:
        raise UserError(f"{path}: empty (expected a header with {expected})")
    reader.fieldnames = header
    missing = [c for c in (*REQUIRED, loss) if c not in header]
    if missing:
        raise UserError(f"{path}: no column {', '.join(map(repr, missing))} (expected {expected}; found "
                        f"{', '.join(header)})")
    numeric = [*REQUIRED, loss] + (["flops"] if "flops" in header else [])
    rows = []
    for row in reader:
        if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
            continue  # a blank line
        out = {}
        if "family" in header:
            out["family"] = (row.get("family") or "").strip()
            if not out["family"]:
                raise UserError(f"{path}: line {reader.line_num}: family: expected a name, got nothing")
        for column in numeric:
            raw = (row.get(column) or "").strip()
            try:
                value = float(raw)
            except ValueError:
                value = None
            if value is None or not math.isfinite(value) or value <= 0:
                got = repr(raw) if raw else "nothing"
                raise UserError(f"{path}: line {reader.line_num}: {column}: expected a finite positive number, "
                                f"got {got}")
            out["loss" if column == loss else column] = value
        rows.append(out)
    if not rows:
        raise UserError(f"{path}: no rows after the header (expected one row per point with {expected})")
    return rows


def families(rows: list[dict]) -> dict[str, Points]:
    """Rows (params, tokens, loss, optional family and flops) grouped by family ("all" without one)."""
    out = {}
    for family in sorted({r.get("family", "all") for r in rows}):
        mine = [r for r in rows if r.get("family", "all") == family]
        N, D, L = (np.array([float(r[k]) for r in mine]) for k in ("params", "tokens", "loss"))
        flops_given = all(r.get("flops") is not None for r in mine)
        C = np.array([float(r["flops"]) for r in mine]) if flops_given else FLOPS_PER_TOKEN_PER_PARAM * N * D
        out[family] = Points(family, N, D, L, C, flops_given)
    return out


def why_not_joint(points: Points) -> str | None:
    """Why L(N,D) cannot be fitted to these points, or None."""
    n, sizes, budgets = len(points), np.unique(points.N), np.unique(points.D)
    distinct = len({*zip(points.N, points.D)})
    if distinct <= len(NAMES):
        at = f" at {distinct} distinct (params, tokens)" if distinct < n else ""
        return (f"{n} point{'s' * (n != 1)}{at}: L(N,D) = E + A/N^alpha + B/D^beta has {len(NAMES)} parameters, so "
                f"it needs at least {len(NAMES) + 1} distinct points")
    for values, column, what in ((sizes, "params", "sizes"), (budgets, "tokens", "token budgets")):
        if len(values) < 3:
            shown = ", ".join(f"{v:.4g}" for v in values)
            one = f"one {what[:-1]} only" if len(values) == 1 else f"{len(values)} {what} only"
            return (f"{one} ({column} {shown}): L(N,D) needs at least 3 distinct {column} (with fewer, E and the "
                    f"{'A/N^alpha' if column == 'params' else 'B/D^beta'} term are not determined separately)")
    ratios = grouped(points.D / points.N)
    if len(ratios) < 2:
        ratio = float(np.exp(np.log(points.D / points.N).mean()))
        return (f"tokens are proportional to params (one tokens-per-parameter ratio, {ratio:.3g}, within "
                f"{BUDGET_TOLERANCE:.0%}): the N and D terms of L(N,D) cannot be told apart; train some sizes on "
                "several token budgets")
    return None


# ------------------------------------------------------------------------------------- the joint law


def _huber(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.abs(r)
    return np.where(a <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (a - 0.5 * HUBER_DELTA)), np.clip(r, -HUBER_DELTA,
                                                                                                   HUBER_DELTA)


def _terms(theta: np.ndarray, logN: np.ndarray, logD: np.ndarray) -> np.ndarray:
    """(..., 3, points): e, a - alpha log N, b - beta log D for parameter rows theta (..., 5)."""
    e, a, b, alpha, beta = (theta[..., i, None] for i in range(5))
    return np.stack(np.broadcast_arrays(e, a - alpha * logN, b - beta * logD), axis=-2)


def _objective(theta: np.ndarray, logN, logD, logL) -> tuple[float, np.ndarray]:
    """Mean Huber loss of log-loss residuals (in units of delta^2, so that L-BFGS-B's tolerances
    are meaningful), and its gradient in (e, a, b, alpha, beta)."""
    t = _terms(theta, logN, logD)
    m = t.max(0)
    w = np.exp(t - m)
    s = w.sum(0)
    w /= s
    h, dh = _huber(m + np.log(s) - logL)
    scale = 1.0 / (len(logL) * HUBER_DELTA ** 2)
    grad = np.array([(dh * w[0]).sum(), (dh * w[1]).sum(), (dh * w[2]).sum(),
                     -(dh * w[1] * logN).sum(), -(dh * w[2] * logD).sum()])
    return float(h.sum() * scale), grad * scale


def _objectives(thetas: np.ndarray, logN, logD, logL) -> np.ndarray:
    """The objective at many parameter rows at once (the grid of starts)."""
    t = _terms(thetas, logN, logD)
    pred = np.logaddexp(np.logaddexp(t[:, 0], t[:, 1]), t[:, 2])
    return _huber(pred - logL)[0].mean(-1) / HUBER_DELTA ** 2


def _grid_starts(logN, logD, L) -> tuple[np.ndarray, np.ndarray]:
    """Every (alpha, beta) of the grid with its least-squares (E, A, B) (relative residuals, each
    kept >= a tiny positive value), as parameter rows, and their objectives."""
    alpha, beta = (g.ravel() for g in np.meshgrid(EXPONENTS, EXPONENTS, indexing="ij"))
    x, y = np.exp(-alpha[:, None] * logN), np.exp(-beta[:, None] * logD)
    X = np.stack(np.broadcast_arrays(np.ones_like(x), x, y), axis=-1) / L[:, None]  # (pairs, points, 3)
    norm = np.sqrt((X * X).sum(1, keepdims=True))
    Xn = X / norm
    gram = np.einsum("pni,pnj->pij", Xn, Xn) + 1e-10 * np.eye(3)
    coef = np.linalg.solve(gram, Xn.sum(1)[..., None])[..., 0] / norm[:, 0]
    floor = 1e-6 * L.min()
    logs = np.log(np.maximum(coef, np.array([math.exp(BOUNDS[0][0]), floor, floor])))
    logs[:, 0] = np.minimum(logs[:, 0], BOUNDS[0][1])
    thetas = np.column_stack([logs, alpha, beta])
    return thetas, _objectives(thetas, logN, logD, np.log(L))


def _minimise(logN, logD, L, starts: int, extra: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    from scipy.optimize import minimize

    logL = np.log(L)
    thetas, values = _grid_starts(logN, logD, L)
    candidates = list(thetas[np.argsort(values)[:starts]])
    if extra is not None:
        candidates.append(extra)
    best, best_value = None, np.inf
    for theta0 in candidates:
        result = minimize(_objective, theta0, args=(logN, logD, logL), jac=True, method="L-BFGS-B", bounds=BOUNDS,
                          options={"maxiter": 1000, "ftol": 1e-13, "gtol": 1e-9})
        if result.fun < best_value:
            best, best_value = result.x, float(result.fun)
    return best, best_value


@dataclass
class Law:
    """L(N,D) fitted to one family's points: the parameters, the bootstrap refits and the
    compute-optimal allocation they imply."""

    points: Points
    theta: np.ndarray  # log E, log A, log B, alpha, beta
    objective: float
    draws: np.ndarray  # (resamples, 5), same layout; empty when no resample could be fitted
    warning: str | None = None
    interval_warning: str | None = None

    def __call__(self, N, D, theta: np.ndarray | None = None) -> np.ndarray:
        theta = self.theta if theta is None else theta
        e, a, b, alpha, beta = theta
        return np.exp(e) + np.exp(a - alpha * np.log(N)) + np.exp(b - beta * np.log(D))

    @staticmethod
    def natural(theta: np.ndarray) -> np.ndarray:
        """(E, A, B, alpha, beta) from rows of (log E, log A, log B, alpha, beta)."""
        theta = np.asarray(theta, dtype=float)
        return np.concatenate([np.exp(theta[..., :3]), theta[..., 3:]], axis=-1)

    def optimal(self, C, theta: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """N_opt, D_opt, tokens per parameter and loss at compute C (any shape) along the law's
        compute-optimal frontier, in log space so that a large A or B does not overflow."""
        e, a, b, alpha, beta = self.theta if theta is None else theta
        logC = np.log(np.asarray(C, dtype=float) / self.points.k)
        logG = (math.log(alpha) + a - math.log(beta) - b) / (alpha + beta)
        logN = logG + beta / (alpha + beta) * logC
        logD = logC - logN
        loss = np.exp(e) + np.exp(a - alpha * logN) + np.exp(b - beta * logD)
        return {"N_opt": np.exp(logN), "D_opt": np.exp(logD), "tokens_per_param": np.exp(logD - logN), "loss": loss}

    def allocation(self, theta: np.ndarray | None = None) -> dict[str, float]:
        e, a, b, alpha, beta = self.theta if theta is None else theta
        return {"G": math.exp((math.log(alpha) + a - math.log(beta) - b) / (alpha + beta)),
                "a": float(beta / (alpha + beta)), "b": float(alpha / (alpha + beta))}

    def frontier_draws(self, C) -> np.ndarray:
        """The frontier's loss at compute C under every bootstrap refit: (resamples, len(C))."""
        return np.array([self.optimal(C, t)["loss"] for t in self.draws]).reshape(len(self.draws), len(C))

    def to_dict(self, budgets: np.ndarray) -> tuple[dict, dict]:
        """The law's JSON entry and the compute-optimal allocation's, at the given compute budgets."""
        p = self.points
        values = dict(zip(NAMES, map(float, self.natural(self.theta))))
        residuals = np.log(self(p.N, p.D)) - np.log(p.L)
        have = len(self.draws) > 0
        law = {"law": "L(N,D) = E + A/N^alpha + B/D^beta", **values, "points": len(p),
               "huber_delta": HUBER_DELTA, "objective": self.objective,
               "rmse_log": float(np.sqrt(np.mean(residuals ** 2))), "max_abs_log_residual": float(np.abs(residuals).max()),
               "bootstrap": len(self.draws),
               "interval_95": _percentiles(self.natural(self.draws), NAMES) if have else None,
               "warning": self.warning, "interval_warning": self.interval_warning}
        allocation = self.allocation()
        draws = np.array([list(self.allocation(t).values()) for t in self.draws]) if have else None
        at = self.optimal(budgets)
        at_draws = [self.optimal(budgets, t) for t in self.draws]
        rows = []
        for j, C in enumerate(budgets):
            inside = p.N.min() <= at["N_opt"][j] <= p.N.max() and p.D.min() <= at["D_opt"][j] <= p.D.max()
            row = {"C": float(C), **{key: float(at[key][j]) for key in at}, "extrapolated": not inside}
            for key in ("tokens_per_param", "loss"):
                row[f"{key}_95"] = _percentile([d[key][j] for d in at_draws]) if have else None
            rows.append(row)
        optimal = {"C": f"C = k N D, k = {p.k:.4g} FLOPs per token per parameter"
                        + (f" (fitted to the flops column; per point {np.min(p.C / (p.N * p.D)):.4g} to "
                           f"{np.max(p.C / (p.N * p.D)):.4g})" if p.flops_given else " (6 N D: no flops column)"),
                   "k": p.k, **allocation,
                   "interval_95": _percentiles(draws, tuple(allocation)) if have else None,
                   "budgets": rows}
        return law, optimal


def _percentile(values) -> list[float]:
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def _percentiles(draws: np.ndarray, names) -> dict[str, list[float]]:
    return {name: _percentile(draws[:, j]) for j, name in enumerate(names)}


def _resample_ok(N: np.ndarray, D: np.ndarray) -> bool:
    """A resample that can determine the law: 3+ sizes, 3+ token budgets, 5+ distinct points and
    2+ tokens-per-parameter ratios."""
    return (len(np.unique(N)) >= 3 and len(np.unique(D)) >= 3 and len({*zip(N, D)}) >= len(NAMES)
            and len(grouped(D / N)) >= 2)


def fit_joint(points: Points, bootstrap: int = 200, seed: int = 0, starts: int = STARTS) -> Law:
    """L(N,D) by Huber on log-loss from the grid's best starts; intervals from `bootstrap` refits to
    points resampled with replacement (each from the full fit's optimum and its own 2 best starts)."""
    reason = why_not_joint(points)
    if reason:
        raise ValueError(reason)
    logN, logD = np.log(points.N), np.log(points.D)
    theta, value = _minimise(logN, logD, points.L, starts)
    rng = np.random.default_rng([seed, zlib.crc32(points.family.encode())])
    draws, tries = [], 0
    while len(draws) < bootstrap and tries < 20 * bootstrap:
        tries += 1
        idx = rng.integers(0, len(points), len(points))
        if _resample_ok(points.N[idx], points.D[idx]):
            draws.append(_minimise(logN[idx], logD[idx], points.L[idx], 2, extra=theta)[0])
    draws = np.array(draws).reshape(-1, 5)
    law = Law(points, theta, value, draws)
    if bootstrap == 0:
        law.interval_warning = "no resamples asked for: no interval"
    elif len(draws) < bootstrap:
        law.draws = np.empty((0, 5))
        law.interval_warning = (f"only {len(draws)} of {tries} resamples had 3+ sizes, 3+ token budgets, 2+ "
                                f"tokens-per-parameter ratios and 5+ distinct points: no interval")
    warnings = []
    if theta[0] <= BOUNDS[0][0] + 1e-6:
        warnings.append(f"the floor E sits at its lower bound {math.exp(BOUNDS[0][0]):g}: the losses show no "
                        "floor yet, so E is not determined")
    if theta[0] >= BOUNDS[0][1] - 1e-6:
        warnings.append(f"the floor E sits at its upper bound {math.exp(BOUNDS[0][1]):g}: these points do not "
                        "follow the law")
    for j, name in ((3, "alpha"), (4, "beta")):
        lo, hi = BOUNDS[j]
        if not lo * 1.01 < theta[j] < hi * 0.99:
            warnings.append(f"{name} at the edge of its range [{lo}, {hi}]: these points do not follow the law")
    law.warning = "; ".join(warnings) or None
    return law


# ------------------------------------------------------------------------------------------ isoFLOPs


def grouped(values: np.ndarray, tolerance: float = BUDGET_TOLERANCE) -> list[np.ndarray]:
    """Indices of positive values grouped from the smallest up: each group holds the values within
    `tolerance` (relative) of its smallest (compute into budgets, tokens per parameter into ratios)."""
    order = np.argsort(values)
    groups, start = [], 0
    logv = np.log(values[order])
    for i in range(1, len(order) + 1):
        if i == len(order) or logv[i] - logv[start] > math.log1p(tolerance):
            groups.append(order[start:i])
            start = i
    return groups


def _parabola(logN: np.ndarray, L: np.ndarray) -> tuple[float, float, np.ndarray] | str:
    """(log N at the minimum, the minimum loss, the coefficients in log N - mean) of a parabola of
    loss in log N, or why it has no minimum among the sizes."""
    centre = logN.mean()
    coef = np.polyfit(logN - centre, L, 2)
    if coef[0] <= 0:
        return "the parabola opens downwards (no minimum)"
    vertex = -coef[1] / (2 * coef[0])
    if not logN.min() - centre <= vertex <= logN.max() - centre:
        return "the parabola's minimum lies outside the sizes (the budget does not bracket its optimum)"
    return float(vertex + centre), float(np.polyval(coef, vertex)), coef


@dataclass
class IsoFLOP:
    """Approach 2 for one family: per budget the parabola's minimum, and N_opt ~ C^a, D_opt ~ C^b."""

    points: Points
    budgets: list[dict]  # C, sizes, indices, and N_opt, loss, coef or reason
    a: float
    b: float
    N0: float  # N_opt(C) = N0 C^a
    D0: float
    draws: np.ndarray = field(default_factory=lambda: np.empty((0, 2)))  # (a, b) per resample
    interval_warning: str | None = None

    def to_dict(self) -> dict:
        rows = []
        for g in self.budgets:
            row = {"C": g["C"], "sizes": g["sizes"], "points": len(g["indices"])}
            if "N_opt" in g:
                row.update(N_opt=g["N_opt"], D_opt=g["D_opt"], loss=g["loss"])
            else:
                row["not used"] = g["reason"]
            rows.append(row)
        have = len(self.draws) > 0
        return {"N_opt": "N0 C^a", "D_opt": "D0 C^b", "a": self.a, "b": self.b, "N0": self.N0, "D0": self.D0,
                "tolerance": BUDGET_TOLERANCE, "bootstrap": len(self.draws),
                "interval_95": _percentiles(self.draws, ("a", "b")) if have else None,
                "interval_warning": self.interval_warning, "budgets": rows}


def _isoflop_line(points: Points, budgets: list[dict], pick) -> tuple[float, float, float, float] | None:
    """(a, b, N0, D0) through the budgets' minima; pick(g) gives a budget's indices (a resample)."""
    logC, logNopt = [], []
    for g in budgets:
        idx = pick(g)
        if len(np.unique(points.N[idx])) < 3:
            continue
        fit = _parabola(np.log(points.N[idx]), points.L[idx])
        if isinstance(fit, tuple):
            logC.append(math.log(g["C"]))
            logNopt.append(fit[0])
    if len(logC) < 2:
        return None
    logC, logNopt = np.array(logC), np.array(logNopt)
    logDopt = logC - math.log(points.k) - logNopt
    a, n0 = np.polyfit(logC, logNopt, 1)
    b, d0 = np.polyfit(logC, logDopt, 1)
    return float(a), float(b), float(np.exp(n0)), float(np.exp(d0))


def fit_isoflop(points: Points, bootstrap: int = 200, seed: int = 0) -> IsoFLOP | str:
    """Approach 2, or why the points do not allow it (a string)."""
    budgets = []
    for idx in grouped(points.C):
        C = float(np.exp(np.log(points.C[idx]).mean()))
        g = {"C": C, "sizes": int(len(np.unique(points.N[idx]))), "indices": idx}
        if g["sizes"] < 3:
            continue
        fit = _parabola(np.log(points.N[idx]), points.L[idx])
        if isinstance(fit, str):
            g["reason"] = fit
        else:
            g.update(N_opt=math.exp(fit[0]), D_opt=C / (points.k * math.exp(fit[0])), loss=fit[1], coef=fit[2],
                     centre=float(np.log(points.N[idx]).mean()))
        budgets.append(g)
    if not budgets:
        return (f"no compute budget has 3 or more sizes (points grouped by compute within "
                f"{BUDGET_TOLERANCE:.0%}): isoFLOP profiles need several sizes trained at the same compute")
    used = [g for g in budgets if "N_opt" in g]
    if len(used) < 2:
        reasons = "; ".join(f"C {g['C']:.3g}: {g['reason']}" for g in budgets if "reason" in g)
        return (f"{len(used)} compute budget{'s' * (len(used) != 1)} with a minimum among 3 or more sizes "
                f"(2 needed for N_opt ~ C^a)" + (f"; {reasons}" if reasons else ""))
    a, b, N0, D0 = _isoflop_line(points, used, lambda g: g["indices"])
    iso = IsoFLOP(points, budgets, a, b, N0, D0)
    rng = np.random.default_rng([seed, zlib.crc32(points.family.encode()), 2])
    draws, tries = [], 0
    while len(draws) < bootstrap and tries < 20 * bootstrap:
        tries += 1
        line = _isoflop_line(points, used, lambda g: rng.choice(g["indices"], len(g["indices"])))
        if line is not None:
            draws.append(line[:2])
    if len(draws) == bootstrap:
        iso.draws = np.array(draws)
    else:
        iso.interval_warning = f"only {len(draws)} of {tries} resamples kept 2 budgets with a minimum: no interval"
    exact = sum(len(g["indices"]) == 3 for g in used)
    if exact and iso.interval_warning is None:
        iso.interval_warning = (f"{exact} of the {len(used)} budgets used have 3 points: their parabolas pass through "
                                "them and barely vary under resampling, so the interval understates the uncertainty")
    if len(used) == 2 and iso.interval_warning is None:
        iso.interval_warning = "2 budgets: the line passes through both minima; more budgets give a firmer a and b"
    return iso


# --------------------------------------------------------------------------------------- everything


def budgets_of(groups: dict[str, Points], most: int = 8) -> tuple[np.ndarray, str]:
    """The compute budgets the allocation and the comparison are reported at: the points' budgets
    (all families, grouped within 10%) when there are at most `most`, else 6 spread evenly in log
    space over their range."""
    C = np.concatenate([p.C for p in groups.values()])
    found = [float(np.exp(np.log(C[idx]).mean())) for idx in grouped(C)]
    if len(found) <= most:
        return np.array(found), f"the points' compute budgets (grouped within {BUDGET_TOLERANCE:.0%})"
    return np.geomspace(C.min(), C.max(), 6), "6 budgets spread evenly in log space over the points' compute"


@dataclass
class Fitted:
    """Everything fitted to one family's points: the JSON entry plus the objects the plots draw."""

    points: Points
    entry: dict
    law: Law | None = None
    isoflop: IsoFLOP | None = None


def fit_all(rows: list[dict], bootstrap: int = 200, seed: int = 0, single_bootstrap: int | None = None,
            starts: int = STARTS) -> tuple[dict, dict[str, Fitted]]:
    """fits.json's content (per family) and the fitted objects, from rows with params, tokens, loss
    (optional family, flops). A family the joint law cannot be fitted to has the reason as a string
    in its entry. `single_bootstrap`: resamples of L(N) and L(C) (default: `bootstrap`)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a wild start or resample: inf, never a warning
        entries, fitted = _fit_all(rows, bootstrap, seed, single_bootstrap, starts)
    return finite(entries), fitted


def finite(value):
    """JSON-safe: every non-finite float (a law extrapolated until it overflows) as None."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fit_all(rows, bootstrap, seed, single_bootstrap, starts) -> tuple[dict, dict[str, Fitted]]:
    groups = families(rows)
    budgets, budgets_from = budgets_of(groups)
    out: dict[str, Fitted] = {}
    for family, points in groups.items():
        entry: dict = {"points": len(points)}
        for key, x, name in (("L(N)", points.N, "params"), ("L(C)", points.C, "flops" if points.flops_given else "6 N D")):
            if len(np.unique(x)) < 3:
                entry[key] = f"not fitted: {len(np.unique(x))} distinct {name} among the points (3 needed)"
            else:
                entry[key] = fit_power_law(x, points.L, bootstrap=single_bootstrap or bootstrap, seed=seed).to_dict()
        if isinstance(entry["L(N)"], dict) and len({*zip(points.N, points.D)}) > len(np.unique(points.N)):
            entry["L(N)"]["note"] = ("pools each size's token budgets; with several budgets per size, read L(N,D) "
                                     "instead")
        fitted = Fitted(points, entry)
        reason = why_not_joint(points)
        if reason:
            entry["L(N,D)"] = entry["compute_optimal"] = f"not fitted: {reason}"
        else:
            fitted.law = fit_joint(points, bootstrap, seed, starts)
            entry["L(N,D)"], entry["compute_optimal"] = fitted.law.to_dict(budgets)
            entry["compute_optimal"]["budgets_from"] = budgets_from
        iso = fit_isoflop(points, bootstrap, seed)
        if isinstance(iso, str):
            entry["isoFLOP"] = f"not fitted: {iso}"
        else:
            fitted.isoflop = iso
            entry["isoFLOP"] = iso.to_dict()
        out[family] = fitted
    for family, fitted in out.items():
        fitted.entry["compared"] = compare(fitted, out, budgets) if len(out) > 1 else "one family only"
    return {family: f.entry for family, f in out.items()}, out


def compare(mine: Fitted, fitted: dict[str, Fitted], budgets: np.ndarray) -> dict:
    """This family's loss minus each other family's, along their compute-optimal frontiers at the
    budgets, with 95% intervals from their independent resamples paired draw by draw."""
    out = {}
    for other, theirs in fitted.items():
        if theirs is mine:
            continue
        if mine.law is None or theirs.law is None:
            out[other] = "not compared: L(N,D) is not fitted for " + (mine.points.family if mine.law is None else other)
            continue
        ours, their = mine.law.optimal(budgets)["loss"], theirs.law.optimal(budgets)["loss"]
        draws = min(len(mine.law.draws), len(theirs.law.draws))
        diff = (mine.law.frontier_draws(budgets)[:draws] - theirs.law.frontier_draws(budgets)[:draws]) if draws else None
        out[other] = [{"C": float(C), "loss": float(ours[j]), "loss_other": float(their[j]),
                       "difference": float(ours[j] - their[j]),
                       "difference_95": _percentile(diff[:, j]) if draws else None}
                      for j, C in enumerate(budgets)]
    return out
