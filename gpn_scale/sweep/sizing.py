"""The sizing rule: a model config of each family at a target parameter count.

Each family has one free width `d` (GPN's d_state, the baselines' d_model); everything else
follows from it by the ratios of the paper's 130M configs (configs/models/*_130m*.yaml):

| family       | from d                                                                          |
|--------------|---------------------------------------------------------------------------------|
| `gpn_m_1l`   | d_state d, d_emb 0.31 d, d_ffn 8/3 d, d_key d/20 (8..128), d_val 2 d_key, heads 0.77 d / d_key |
| `gpn_m_2l`   | as gpn_m_1l with 2 layers and d_ffn 2 d                                         |
| `gpn_1l`     | d_state d, d_emb 0.24 d, d_ffn 2.6 d                                            |
| `transformer`| d_model d, layers d/64 (>= 2), heads of 64 (32 below d 512, 16 below d 128), d_ffn 8/3 d |
| `gdn`        | d_model d, layers d/77 (>= 2), heads d/128 (>= 1), d_key 1.25 d / heads, d_val 2 d_key, d_ffn 8/3 d |

The rule takes the largest `d` (a multiple of 16) whose model stays at or under the target, then
widens the FFN to close the remaining gap (the FFN's count is linear in its width, so the total
lands within one FFN rounding step of the target: well within 3% from ~20K parameters up).
Counts are exact (the model is built on the meta device) and include the (tied) embedding.
"""

from __future__ import annotations

from typing import Callable

from data_prep.errors import UserError


def _round(x: float, multiple: int, minimum: int | None = None) -> int:
    return max(minimum or multiple, multiple * round(x / multiple))


def _ffn_step(d: int) -> int:
    return 8 if d < 512 else 64


def _gpn_m(layers: int, ffn_ratio: float) -> Callable[[int], dict]:
    def shape(d: int) -> dict:
        d_key = min(128, _round(d / 20, 8))
        return {"family": "gpn_m", "n_layers": layers, "d_state": d, "d_emb": _round(0.31 * d, 8, 16),
                "d_ffn": _round(ffn_ratio * d, _ffn_step(d)), "d_key": d_key, "d_val": 2 * d_key,
                "n_heads": max(1, round(0.77 * d / d_key))}
    return shape


def _gpn(d: int) -> dict:
    return {"family": "gpn", "n_layers": 1, "d_state": d, "d_emb": _round(0.24 * d, 8, 16),
            "d_ffn": _round(2.6 * d, _ffn_step(d))}


def _transformer(d: int) -> dict:
    head = 64 if d >= 512 else 32 if d >= 128 else 16
    d = _round(d, head)
    return {"family": "transformer", "d_model": d, "n_layers": max(2, round(d / 64)), "n_heads": d // head,
            "d_ffn": _round(8 / 3 * d, _ffn_step(d))}


def _gdn(d: int) -> dict:
    heads = max(1, round(d / 128))
    d_key = _round(1.25 * d / heads, 8)
    return {"family": "gdn", "d_model": d, "n_layers": max(2, round(d / 77)), "n_heads": heads, "d_key": d_key,
            "d_val": 2 * d_key, "d_ffn": _round(8 / 3 * d, _ffn_step(d))}


RULES = {  # family -> the model config at width d
    "gpn_m_1l": _gpn_m(1, 8 / 3),
    "gpn_m_2l": _gpn_m(2, 2.0),
    "gpn_1l": _gpn,
    "transformer": _transformer,
    "gdn": _gdn,
}
WIDTH_STEP = 16
MAX_WIDTH = 1 << 15


def count(model: dict) -> int:
    from gpn_scale.config import model_config
    from gpn_scale.models import param_count

    return param_count(model_config(dict(model), where="sizing rule"))


def size(family: str, target: float, vocab_size: int, **fixed) -> tuple[dict, int]:
    """(model config dict, its exact parameter count) of `family` closest to `target` parameters.

    `fixed` holds keys every size shares (e.g. `bptt`, `recompute_every`); they must not be ones
    the rule sets."""
    if family not in RULES:
        raise UserError(f"family: expected one of {', '.join(RULES)}, got {family!r}")
    shape = RULES[family]

    def config(d: int) -> dict:
        return {**shape(d), "vocab_size": vocab_size, **fixed}

    lo, hi = WIDTH_STEP, MAX_WIDTH  # count(config(lo)) must fit, count(config(hi)) must not
    if count(config(lo)) > target:
        raise UserError(f"{family}: {target:,.0f} parameters is below the smallest model of the rule "
                        f"({count(config(lo)):,} with vocab {vocab_size})")
    while hi - lo > WIDTH_STEP:
        mid = (lo + hi) // 2 // WIDTH_STEP * WIDTH_STEP
        lo, hi = (mid, hi) if count(config(mid)) <= target else (lo, mid)
    best = config(lo)
    n = count(best)
    step = _ffn_step(lo)
    wider = {**best, "d_ffn": best["d_ffn"] + step}
    per_step = count(wider) - n
    best["d_ffn"] += step * max(0, round((target - n) / per_step))
    return best, count(best)
