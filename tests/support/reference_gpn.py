"""An independent float64 NumPy transcription of docs/model.md, on reference-layout parameters.

It shares no code with `gpn_scale`: it reads the flat reference dict (`embedding`, `L0_ffn_w1_k`,
...) and runs the loop token by token exactly as docs/model.md writes it. Tests use it as the
stand-in for the paper's own code.
"""

from __future__ import annotations

import numpy as np


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _l2n(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-12)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _silu(x):
    return x * _sigmoid(x)


def _softplus(x):
    return np.logaddexp(0.0, x)


def _gate(x, p, prefix):
    return _sigmoid(_rms(x, p[prefix + "norm_w"]) @ p[prefix + "gate_k"] + p[prefix + "gate_b"])


def _ffn(x, p, prefix):
    h = _rms(x, p[prefix + "ffn_norm_w"]) @ p[prefix + "ffn_w1_k"]
    f = h.shape[-1] // 2
    return (_silu(h[..., :f]) * h[..., f:]) @ p[prefix + "ffn_w2_k"]


def layer_prefixes(model_cfg: dict, memory: bool) -> list[str]:
    n = model_cfg.get("n_layers", 1)
    if not memory and n == 1:
        return [""]
    return [f"L{i}_" for i in range(n)]


def forward(params: dict, model_cfg: dict, tokens: np.ndarray, state=None):
    """Returns (mean loss, logits (B, T, V), (s, prev_s, M)) in float64."""
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    memory = "write_W_k_k" in p
    B, T = tokens.shape
    d = p["fg_gate_b"].shape[0]
    H = model_cfg.get("n_heads", 0)
    if state is None:
        g = np.zeros((B, d))
        g_prev = np.zeros((B, d))
        M = np.zeros((B, H, model_cfg["d_key"], model_cfg["d_val"])) if memory else None
    else:
        g, g_prev, M = (None if a is None else np.asarray(a, dtype=np.float64) for a in state)
    emb = p["embedding"]
    logits = np.zeros((B, T, emb.shape[0]))
    losses = np.zeros((B, T))
    for t in range(T):
        x = tokens[:, t]
        if memory:
            a_prev = _rms(g_prev, p["write_norm_w"])
            a = _rms(g, p["write_norm_w"])
            k = _l2n(np.maximum(a_prev @ p["write_W_k_k"] + p["write_W_k_b"], 0).reshape(B, H, -1))
            v = (a @ p["write_W_v_k"]).reshape(B, H, -1)
            beta = _sigmoid(a @ p["write_W_beta_k"])
            gamma = -np.exp(p["write_A_log"]) * _softplus(a @ p["write_W_a_k"] + p["write_dt_bias"])
            pred_v = np.einsum("bhij,bhi->bhj", M, k)
            M = np.exp(gamma)[:, :, None, None] * M + beta[:, :, None, None] * np.einsum(
                "bhi,bhj->bhij", k, v - pred_v
            )
        c = g
        for pre in layer_prefixes(model_cfg, memory):
            update = _ffn(c, p, pre)
            if memory:
                r = _rms(c, p[pre + "read_norm_w"])
                q = _l2n(np.maximum(r @ p[pre + "read_W_q_k"] + p[pre + "read_W_q_b"], 0).reshape(B, H, -1))
                o = np.einsum("bhij,bhi->bhj", M, q).reshape(B, -1)
                gate = _silu(r @ p[pre + "read_W_gate_k"])
                update = update + (gate * _rms(o, p[pre + "read_out_norm_w"])) @ p[pre + "read_W_o_k"]
            c = _gate(c, p, pre + "pg_") * c + update
        h = _rms(c, p["decode_norm_w"]) @ p["decode_proj_k"]
        if "decode_bias" in p:
            h = h + p["decode_bias"]
        z = h @ emb.T
        logits[:, t] = z
        zmax = z.max(-1, keepdims=True)
        lse = np.log(np.exp(z - zmax).sum(-1)) + zmax[:, 0]
        losses[:, t] = lse - z[np.arange(B), x]
        u = _rms(emb[x], p["fuse_norm_w"]) @ p["fuse_proj_k"]
        g_prev, g = g, _gate(c, p, "fg_") * c + u
    return losses.mean(), logits, (g, g_prev, M)


def random_params(model_cfg: dict, memory: bool, rng: np.random.Generator, scale: float = 0.3) -> dict:
    """Random, non-zero reference-layout parameters (float32), as a trained checkpoint would hold."""
    V, E, d, F = (model_cfg[k] for k in ("vocab_size", "d_emb", "d_state", "d_ffn"))
    shapes = {
        "embedding": (V, E),
        "decode_norm_w": (d,),
        "decode_proj_k": (d, E),
        "fuse_norm_w": (E,),
        "fuse_proj_k": (E, d),
        "fg_norm_w": (d,),
        "fg_gate_k": (d, d),
        "fg_gate_b": (d,),
    }
    if model_cfg.get("use_decoder_bias", False):
        shapes["decode_bias"] = (E,)
    if memory:
        H, dk, dv = model_cfg["n_heads"], model_cfg["d_key"], model_cfg["d_val"]
        shapes.update(
            write_norm_w=(d,), write_W_k_k=(d, H * dk), write_W_k_b=(H * dk,), write_W_v_k=(d, H * dv),
            write_W_beta_k=(d, H), write_W_a_k=(d, H), write_A_log=(H,), write_dt_bias=(H,),
        )
    for pre in layer_prefixes(model_cfg, memory):
        shapes.update({pre + "ffn_norm_w": (d,), pre + "ffn_w1_k": (d, 2 * F), pre + "ffn_w2_k": (F, d)})
        shapes.update({pre + "pg_norm_w": (d,), pre + "pg_gate_k": (d, d), pre + "pg_gate_b": (d,)})
        if memory:
            H, dk, dv = model_cfg["n_heads"], model_cfg["d_key"], model_cfg["d_val"]
            shapes.update({
                pre + "read_norm_w": (d,), pre + "read_W_q_k": (d, H * dk), pre + "read_W_q_b": (H * dk,),
                pre + "read_W_gate_k": (d, H * dv), pre + "read_out_norm_w": (H * dv,),
                pre + "read_W_o_k": (H * dv, d),
            })
    params = {}
    for name, shape in shapes.items():
        if name.endswith("norm_w"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name == "embedding":
            params[name] = 0.5 * rng.standard_normal(shape)
        elif name == "write_A_log":
            params[name] = np.log(rng.uniform(0.05, 2.0, shape))
        else:
            fan_in = shape[0] if len(shape) == 2 else 1
            params[name] = rng.standard_normal(shape) * (scale / np.sqrt(fan_in) if len(shape) == 2 else 0.3)
    return {k: v.astype(np.float32) for k, v in params.items()}
