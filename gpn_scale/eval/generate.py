"""Sampling with O(1) memory per token, and batch scoring of texts.

The model interface scores the token it is fed: logits[:, t] are the distribution of token t given
the tokens before it. So the distribution of the next token is read by feeding a placeholder on the
current state and discarding the state that call returns; the sampled token is then fed on the same
state to advance it. Only (s, prev_s, M) is carried, so memory does not grow with the length.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gpn_scale.eval.heldout import model_device

PLACEHOLDER = 0  # any id: the logits at a position do not depend on the token fed there


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Probabilities to sample from: softmax(logits / T) over the top_k most likely tokens (0: all), cut
    to the smallest set of most likely tokens whose mass reaches top_p, renormalised. temperature 0 is
    greedy (all mass on the argmax)."""
    logits = logits.double()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -torch.inf)
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs[before >= top_p] = 0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs /= probs.sum()
    return probs


@torch.no_grad()
def next_token_logits(model, state) -> torch.Tensor:
    placeholder = torch.full((1, 1), PLACEHOLDER, dtype=torch.long, device=model_device(model))
    return model(placeholder, state=state, return_logits=True).logits[0, -1].cpu()


@torch.no_grad()
def generate_tokens(model, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                    seed: int = 0, top_k: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """Yields (token, the probabilities it was sampled from) one at a time."""
    model.eval()
    device = model_device(model)
    generator = torch.Generator().manual_seed(seed)  # sampling runs on the CPU: the same text on any device
    state = model(torch.tensor([prompt], device=device)).state if prompt else None
    for _ in range(max_new_tokens):
        probs = sampling_probs(next_token_logits(model, state), temperature, top_p, top_k)
        token = int(torch.multinomial(probs, 1, generator=generator))
        yield token, probs
        state = model(torch.tensor([[token]], device=device), state=state).state


@torch.no_grad()
def score_texts(model, encode, texts: list[str], batch: int = 8, bos_id: int | None = None) -> list[dict]:
    """Per text: its tokens, the total and mean CE (nats) of every token given the ones before it (the
    first from the empty state, or from BOS when given). Batched by length, padded on the right."""
    model.eval()
    ids = [([] if bos_id is None else [bos_id]) + encode(t) for t in texts]
    first = 0 if bos_id is None else 1  # BOS itself is not scored
    results: list[dict] = [{}] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        length = max(1, max(len(ids[i]) for i in rows))
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        for r, i in enumerate(rows):
            tokens[r, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
        losses = model(tokens.to(model_device(model))).token_losses.double().cpu()
        for r, i in enumerate(rows):
            total = float(losses[r, first : len(ids[i])].sum())
            n = len(ids[i]) - first
            results[i] = {"tokens": n, "loss_sum": total, "loss_mean": total / n if n else float("nan")}
    return results
