"""`gpn-scale analyze`: the paper's analyses (docs/model.md, "Analyses") and the ablations it lacked,
on held-out windows, as one result dict (scalars for report.json) plus the arrays the figures draw."""

from __future__ import annotations

import numpy as np
import torch

from gpn_scale.eval import geometry, horizons, memory
from gpn_scale.eval.ablations import run_ablations
from gpn_scale.eval.heldout import evaluate_windows
from gpn_scale.eval.states import has_memory, has_state, record

TOP_K = 10


def _token_text(codec, token: int) -> str:
    return codec.decode([token]) if codec is not None else str(token)


@torch.no_grad()
def decode_direction(model, sbar: np.ndarray, codec=None, unigram: np.ndarray | None = None) -> dict:
    """s-bar read through the model's own head: its top tokens, and the Spearman correlation of its
    logits with the unigram counts. The control does the same with the mean token embedding in place
    of the decoded s-bar: tied embeddings of frequent tokens share a direction, so part of any
    correlation with frequency comes from the embedding alone."""
    emb = model.embedding.detach().double().cpu()
    sbar = torch.as_tensor(sbar, dtype=model.embedding.dtype, device=model.embedding.device)
    h = model.decode_hidden(sbar[None]).double().cpu()[0]
    logits = (emb @ h).numpy()
    control = (emb @ emb.mean(0)).numpy()
    top = np.argsort(-logits)[:TOP_K]
    out = {"top_tokens": [{"id": int(t), "text": _token_text(codec, int(t)), "logit": float(logits[t])} for t in top]}
    if unigram is not None and len(unigram) == len(logits):
        out["spearman_unigram"] = geometry.spearman(logits, unigram)
        out["spearman_unigram_mean_embedding_control"] = geometry.spearman(control, unigram)
    return out


def analyze(model, windows: torch.Tensor, codec=None, unigram: np.ndarray | None = None, batch: int = 16):
    """Returns (results, arrays): results holds only JSON-able values; arrays feed the figures."""
    model.eval()
    held = evaluate_windows(model, windows, batch)
    results = {"heldout": {"loss": held.loss, "ppl": held.ppl, "tokens": held.tokens, "windows": len(windows),
                           "window": windows.shape[1]}}
    arrays = {"per_position": held.per_position}
    if not has_state(model):
        why = f"does not apply: the {model.config.family} family has no single recurrent state vector"
        results.update(geometry=why, mean_direction=why, horizons=why, memory=why, ablations=why)
        return results, arrays

    trace = record(model, windows, batch)
    states = trace.predictions.double().numpy()
    geo = geometry.geometry(states.reshape(-1, states.shape[-1]))
    arrays.update({k: geo.pop(k) for k in ("dim_std", "spectrum", "corr_sample")})
    results["geometry"] = geo

    direction = geometry.mean_direction(states)
    sbar = direction.pop("sbar")
    arrays["running_mean_cosine"] = direction.pop("running_mean_cosine")
    results["mean_direction"] = {**direction, **decode_direction(model, sbar, codec, unigram)}

    results["horizons"] = horizons.similarity_horizon(states)

    slow, fast = [], []
    if has_memory(model):
        mem = memory.memory_horizon(trace.decays.double().numpy())
        arrays["retention_lags"], arrays["retention"] = mem.pop("lags"), mem.pop("retention")
        results["memory"] = mem
        slow, fast = mem["slow_heads"], mem["fast_heads"]
    else:
        results["memory"] = "does not apply: the gpn family has no matrix memory"
    results["ablations"] = run_ablations(model, windows, torch.as_tensor(sbar, dtype=torch.float32), slow, fast, batch)
    return results, arrays
