"""Long context, read the recurrent way: held-out streams scored window after window with the state
carried across windows (loss by position out to N), and passkey retrieval by distance.

Every family continues from the state its last call returned: GPN / GPN+M their state and memory,
GDN its last token and layer states, the Transformer its key-value cache (so it attends over the
whole context, its rotary positions running on past the window it was trained on). For the
recurrent families the result does not depend on the chunk length the text is fed in; for the
Transformer neither, up to float rounding.
"""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_prep.errors import UserError
from gpn_scale.eval.heldout import model_device


# ---- loss by position over held-out streams --------------------------------------------------


def check_context(split_dir: Path, layout, context: int) -> None:
    """--context against the streams' layout (streams.json): a whole number of windows, no longer
    than a stream. Cheap: the eval CLI runs it before anything is loaded or scored."""
    if context % layout.seq_len:
        raise UserError(f"--context: {context} is not a multiple of the streams' window of {layout.seq_len} tokens "
                        f"({split_dir / 'streams.json'})")
    if context // layout.seq_len > layout.windows_per_stream:
        raise UserError(f"--context: {context} tokens, but the streams of {split_dir} hold "
                        f"{layout.windows_per_stream * layout.seq_len} each ({layout.windows_per_stream} windows); "
                        f"prepare fewer, longer streams (--val-streams) or ask for less")


def stream_tokens(split_dir: Path, layout, context: int, limit: int | None) -> torch.Tensor:
    """The first `context` tokens of each of the first `limit` streams (all when None): (n, context) int64."""
    from gpn_scale.storage.mds_datasets import reading

    check_context(split_dir, layout, context)
    windows = context // layout.seq_len
    n = layout.streams if limit is None else min(limit, layout.streams)
    with reading(local=str(split_dir), shuffle=False, batch_size=1) as dataset:
        rows = [[np.asarray(dataset[k * layout.streams + i]["tokens"], np.int64) for k in range(windows)]
                for i in range(n)]
    return torch.from_numpy(np.stack([np.concatenate(r) for r in rows]))


def eos_id(streams) -> int:
    """The EOS id of the prep that wrote the held-out streams (its stats.json)."""
    if streams.stats is None or streams.stats.get("eos_id") is None:
        where = "no stats.json beside it" if streams.stats is None else "a stats.json without eos_id beside it"
        raise UserError(f"--reset-on-eos: needs the EOS id from the prep's stats.json, and {streams.split_dir} has "
                        f"{where} (pass the prep output's directory as --data)")
    return int(streams.stats["eos_id"])


def check_resettable(model) -> None:
    from gpn_scale.models import MODEL_FAMILIES

    family = model.config.family
    if not MODEL_FAMILIES[family].carries_state:
        raise UserError(f"--reset-on-eos: the {family} family has no recurrent state to reset (its attention spans its "
                        "cache)")


@torch.no_grad()
def carried_losses(model, tokens: torch.Tensor, chunk: int, batch: int, eos: int | None = None) -> np.ndarray:
    """Mean loss at each position 1..N over the rows of `tokens` (n, N), fed `chunk` tokens at a
    time, each call starting from the state the last one returned (with `eos`: the empty state
    after each EOS, models/resets.py)."""
    model.eval()
    sums = torch.zeros(tokens.shape[1], dtype=torch.float64)
    for start in range(0, len(tokens), batch):
        rows = tokens[start : start + batch].to(model_device(model))
        state = None
        for t0 in range(0, rows.shape[1], chunk):
            piece = rows[:, t0 : t0 + chunk]
            out = model(piece, state=state, **({} if eos is None else {"resets": piece == eos}))
            sums[t0 : t0 + chunk] += out.token_losses.double().sum(0).cpu()
            state = out.state
    return (sums / len(tokens)).numpy()


@dataclass(frozen=True)
class PositionBins:
    """Mean loss over positions [start, stop), log-spaced: 1, 2-3, 4-7, ..., N/2-N (powers of two)."""

    starts: list[int]
    stops: list[int]
    loss: list[float]

    @classmethod
    def of(cls, per_position: np.ndarray) -> "PositionBins":
        n = len(per_position)
        edges = [1]  # the powers of two below n, then the last bin ends at n
        while edges[-1] * 2 < n:
            edges.append(edges[-1] * 2)
        edges.append(n + 1)
        starts, stops = edges[:-1], edges[1:]
        return cls(starts, stops, [float(per_position[a - 1 : b - 1].mean()) for a, b in zip(starts, stops)])

    def to_json(self) -> list[dict]:
        return [{"positions": [a, b - 1], "loss": x} for a, b, x in zip(self.starts, self.stops, self.loss)]


# ---- passkey retrieval ------------------------------------------------------------------------

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = " What is the pass key? The pass key is"
KEYS = range(10_000, 100_000)  # every five-digit key, drawn uniformly
# What a guess of the key, uniform over KEYS, scores: accuracy 1 / 90,000, log p(key) -11.41 nats
CHANCE = {"keys": len(KEYS), "accuracy": 1 / len(KEYS), "key_logprob": -math.log(len(KEYS))}


def distances(longest: int, shortest: int = 256) -> list[int]:
    """256, 512, ... up to `longest` (and `longest` itself)."""
    out, d = [], shortest
    while d < longest:
        out.append(d)
        d *= 2
    return [*out, longest]


@dataclass(frozen=True)
class Passkey:
    requested: int  # the distance asked for (256, 512, ..., N)
    distance: int  # tokens from the end of the key's sentence to the end of the prompt (filler, then the question):
    # the requested one, less what of the filler's last word did not fit
    key: str
    prompt: list[int]  # ends with the question
    answer: list[int]  # the key's tokens as they follow the question


def filler_tokens(encode, n: int) -> list[int]:
    """The filler's words, repeated, for at most `n` tokens: whole words only, each encoded alone
    (with its space), so the text never stops mid-word."""
    words = [encode(w) for w in re.findall(r" \S+", FILLER)]
    out: list[int] = []
    for i in itertools.count():
        word = words[i % len(words)]
        if len(out) + len(word) > n:
            return out
        out += word


def make_passkeys(encode, longest: int, trials: int, seed: int = 0, bos: int | None = None) -> list[Passkey]:
    """`trials` prompts per distance, each with its own five-digit key, the same for every model
    (seeded). The pieces are encoded apart and joined as token lists, so the distances are counted
    in tokens; the filler before the question ends at a word, so a distance may fall short of the
    requested one by part of a word (each Passkey says both). `bos`: the token that began every
    training document (the prep's --bos), put before the prompt. A distance shorter than the
    question is refused."""
    rng = random.Random(seed)
    intro, filler, question = encode(INTRO), encode(FILLER), encode(QUESTION)
    shortest = min(distances(longest))
    if shortest < len(question):
        raise UserError(f"--passkey: {longest} tokens is shorter than the question that ends every prompt "
                        f"({len(question)} tokens:{QUESTION!r}); expected at least {len(question)}")
    out = []
    for d in distances(longest):
        tail = filler_tokens(encode, d - len(question)) + question
        for _ in range(trials):
            key = str(rng.randrange(KEYS.start, KEYS.stop))
            needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
            prompt = ([] if bos is None else [bos]) + intro + filler * 2 + needle + tail
            out.append(Passkey(d, len(tail), key, prompt, encode(" " + key)))
    return out


@torch.no_grad()
def score_passkey(model, item: Passkey, chunk: int) -> tuple[bool, float]:
    """(greedy decoding gives the key, log-probability of the key's tokens). The prompt is read
    `chunk` tokens at a time with the state carried; the last call reads the answer, teacher-forced
    (a model's output at position t is its prediction of token t)."""
    model.eval()
    device = model_device(model)
    prompt, answer = torch.tensor(item.prompt, device=device)[None], torch.tensor(item.answer, device=device)[None]
    state = None
    for t0 in range(0, prompt.shape[1], chunk):
        state = model(prompt[:, t0 : t0 + chunk], state=state).state
    logits = model(answer, state=state, return_logits=True).logits[0].float()
    correct = bool((logits.argmax(-1) == answer[0]).all())
    logprob = float(torch.log_softmax(logits, -1).gather(1, answer[0][:, None]).sum())
    return correct, logprob


def passkey_table(model, items: list[Passkey], chunk: int) -> list[dict]:
    """Accuracy and mean key log-probability at each requested distance (and the real one)."""
    rows: dict[int, list[tuple[bool, float]]] = {}
    longest: dict[int, int] = {}
    real: dict[int, int] = {}
    for item in items:
        rows.setdefault(item.requested, []).append(score_passkey(model, item, chunk))
        longest[item.requested] = max(longest.get(item.requested, 0), len(item.prompt))
        real[item.requested] = item.distance
    return [{"requested": d, "distance": real[d], "trials": len(r), "correct": sum(c for c, _ in r),
             "accuracy": sum(c for c, _ in r) / len(r), "mean_key_logprob": sum(lp for _, lp in r) / len(r),
             "prompt_tokens": longest[d]} for d, r in rows.items()]


# ---- figures ------------------------------------------------------------------------------------


def plot_context(per_position: np.ndarray, bins: PositionBins, path: Path, title: str) -> None:
    from gpn_scale.eval.report import _plain_log_ticks, _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = np.arange(1, len(per_position) + 1)
    ax.plot(x, per_position, lw=0.5, alpha=0.35, label="per position")
    centres = [math.sqrt(a * (b - 1)) for a, b in zip(bins.starts, bins.stops)]
    ax.plot(centres, bins.loss, "o-", label="log-spaced bins")
    ax.set(xscale="log", xlabel="position in the stream (tokens, log)", ylabel="loss (nats)", title=title)
    _plain_log_ticks(ax.xaxis)
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_passkey(table: list[dict], path: Path, title: str) -> None:
    from gpn_scale.eval.report import _plain_log_ticks, _pyplot, _save

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    d = [r["distance"] for r in table]
    left.plot(d, [r["accuracy"] for r in table], "o-")
    left.set(xscale="log", ylim=(-0.05, 1.05), xlabel="distance (tokens, log)", ylabel="accuracy", title=title)
    right.plot(d, [r["mean_key_logprob"] for r in table], "o-")
    right.axhline(CHANCE["key_logprob"], color="gray", ls=":", label=f"chance ({CHANCE['key_logprob']:.2f})")
    right.legend()
    right.set(xscale="log", xlabel="distance (tokens, log)", ylabel="mean log p(key)", title="Key log-probability")
    for ax in (left, right):
        _plain_log_ticks(ax.xaxis)
        ax.grid(alpha=0.3)
    _save(fig, path)
