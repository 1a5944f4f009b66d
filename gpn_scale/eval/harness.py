"""The three request kinds of lm-evaluation-harness, scored on token ids with the recurrent state
carried: a context is run once and its final state is where its continuation (or generation) starts,
never a second pass over the context. Needs only torch; the harness's model class that calls these
is `gpn_scale.eval.lm_eval_model`.

Batching a recurrent model's contexts of different lengths: padding would run the state on past a
short row's end, so a batch is run in segments between its distinct lengths (sorted), and a row
leaves the batch, with its state, where it ends. Every token is run once and no padding is run
through a state that is kept. Continuations and whole texts are only scored, so they are padded on
the right: a position's output never depends on the tokens after it.

The state must be a fixed-size structure of batch-first tensors (GPN, GPN+M, GDN): states of rows
with different contexts are stacked into one batch. A Transformer++'s KV cache grows with its
context and is not stacked; it is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from data_prep.errors import UserError
from gpn_scale.eval.generate import draw, sampling_probs
from gpn_scale.eval.heldout import model_device
from gpn_scale.models.decode import decoder

STATEFUL_FAMILIES = ("gpn", "gpn_m", "gdn")


def check_stateful(model) -> None:
    family = model.config.family
    if family not in STATEFUL_FAMILIES:
        raise UserError(f"family {family}: the harness adapter carries fixed-size recurrent states "
                        f"({', '.join(STATEFUL_FAMILIES)}); a {family}'s cache grows with its context")


def take_rows(state, rows: Sequence[int]):
    """The state of the given batch rows (a NamedTuple / tuple of batch-first tensors, None kept)."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state[list(rows)]
    parts = [take_rows(part, rows) for part in state]
    return type(state)(*parts) if hasattr(state, "_fields") else type(state)(parts)


def stack_rows(states: Sequence):
    """One batch from single-row states of the same structure."""
    first = states[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(list(states), 0)
    parts = [stack_rows([s[i] for s in states]) for i in range(len(first))]
    return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)


def _padded(rows: Sequence[Sequence[int]], device) -> torch.Tensor:
    tokens = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens.to(device)


@torch.no_grad()
def final_states(model, rows: Sequence[Sequence[int]]) -> list:
    """The state after each (non-empty) row of token ids, each as a batch of one; the rows are run
    as one batch, in segments between their distinct lengths."""
    device = model_device(model)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out: list = [None] * len(rows)
    active, state, done_len = order, None, 0
    for length in sorted({len(rows[i]) for i in order}):
        tokens = _padded([rows[i][done_len:length] for i in active], device)
        state = model(tokens, state=state).state
        keep = []
        for k, i in enumerate(active):
            if len(rows[i]) == length:
                out[i] = take_rows(state, [k])
            else:
                keep.append(k)
        active, done_len = [active[k] for k in keep], length
        state = take_rows(state, keep) if keep else None
    return out


@dataclass
class Scored:
    logprob: float  # summed log-likelihood of the continuation's tokens (nats)
    greedy: bool  # every continuation token is the argmax given what precedes it


@torch.no_grad()
def score_continuations(model, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                        batch: int = 16) -> list[Scored]:
    """Each continuation's log-likelihood given its context. A context shared by several requests
    (the choices of a multiple-choice question) is run once; an empty context is the empty state."""
    model.eval()
    device = model_device(model)
    order = sorted(range(len(contexts)), key=lambda i: (len(contexts[i]), tuple(contexts[i])))
    results: list[Scored | None] = [None] * len(contexts)
    for start in range(0, len(order), batch):
        group = order[start : start + batch]
        unique = sorted({tuple(contexts[i]) for i in group if contexts[i]}, key=len)
        states = dict(zip(unique, final_states(model, unique))) if unique else {}
        # Rows with and without a context state cannot share a forward (the empty state is the model's own)
        for rows in ([i for i in group if contexts[i]], [i for i in group if not contexts[i]]):
            if not rows:
                continue
            state = stack_rows([states[tuple(contexts[i])] for i in rows]) if contexts[rows[0]] else None
            out = model(_padded([continuations[i] for i in rows], device), state=state, return_logits=True)
            for r, i in enumerate(rows):
                n, target = len(continuations[i]), torch.tensor(continuations[i], device=device)
                results[i] = Scored(-float(out.token_losses[r, :n].double().sum()),
                                    bool((out.logits[r, :n].argmax(-1) == target).all()))
    return results


@torch.no_grad()
def score_rolling(model, texts: Sequence[Sequence[int]], first: int = 0, batch: int = 16,
                  chunk: int = 2048) -> list[float]:
    """Each text's summed log-likelihood of its tokens from position `first` on (1 skips a BOS), the
    first from the empty state. Long texts are run `chunk` tokens at a time, the state carried: a
    recurrent model has no context limit, so nothing is truncated or re-run."""
    model.eval()
    device = model_device(model)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    results = [0.0] * len(texts)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        tokens = _padded([texts[i] for i in rows], device)
        losses, state = [], None
        for t0 in range(0, tokens.shape[1], chunk):
            out = model(tokens[:, t0 : t0 + chunk], state=state)
            losses.append(out.token_losses.double())
            state = out.state
        losses = torch.cat(losses, 1)
        for r, i in enumerate(rows):
            results[i] = -float(losses[r, first : len(texts[i])].sum())
    return results


@dataclass
class Generation:
    context: list[int]
    until: list[str]  # stop strings: the text is cut before the first one
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@torch.no_grad()
def generate_batch(model, requests: Sequence[Generation], decode: Callable[[list[int]], str], eos_id: int | None,
                   seed: int = 0) -> list[str]:
    """Each request's continuation text, the rows decoded together one token at a time from their
    context's state (one decode step per token, gpn_scale/models/decode.py); a row leaves the batch
    at a stop string, EOS or its token limit."""
    model.eval()
    device = model_device(model)
    generator = torch.Generator().manual_seed(seed)
    texts = [""] * len(requests)
    with_context = [i for i, r in enumerate(requests) if r.context]
    states = dict(zip(with_context, final_states(model, [requests[i].context for i in with_context])))
    dec = decoder(model, batch=len(requests))
    for rows in (with_context, [i for i, r in enumerate(requests) if not r.context]):
        active = [i for i in rows if requests[i].max_new_tokens > 0]
        if not active:
            continue
        state = stack_rows([states[i] for i in active]) if requests[active[0]].context else None
        logits, state = dec.resume(state, len(active))
        generated: dict[int, list[int]] = {i: [] for i in active}
        while active:
            logits = logits.cpu()
            chosen, keep = [], []
            for k, i in enumerate(active):
                request = requests[i]
                probs = sampling_probs(logits[k], request.temperature, request.top_p)
                token = draw(probs, generator)
                if token == eos_id:
                    continue
                generated[i].append(token)
                text = decode(generated[i])
                cut = min((text.find(s) for s in request.until if s and s in text), default=-1)
                texts[i] = text if cut < 0 else text[:cut]
                if cut < 0 and len(generated[i]) < request.max_new_tokens:
                    keep.append(k)
                    chosen.append(token)
            if keep:
                logits, state = dec.step(take_rows(state, keep), torch.tensor(chosen, device=device))
            active = [active[k] for k in keep]
    return texts
