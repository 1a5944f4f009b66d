"""LAMBADA by the paper's protocol (docs/model.md, "Results"), for any model family.

Each line of the file (EleutherAI's format) is a JSON object with "text". The target is the last
whitespace-separated word: the context is the text before the whitespace that precedes it, the
continuation is that whitespace and the word, each encoded on its own (as lm-evaluation-harness
does), so the word's first subword is the one a reader would predict after the context.

accuracy = share of examples whose first target subword is the top-1 prediction given the context;
PPL = exp of the mean over examples of the mean CE over that example's target subwords.
Per example, the target's summed log-likelihood is kept too (what lm-evaluation-harness reports).
Only the model interface `model(tokens, return_logits=True)` -> (loss, token_losses, state, logits)
is used, with logits[:, t] and token_losses[:, t] predicting token t from tokens before it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpn_scale.errors import UserError
from gpn_scale.eval.heldout import model_device


@dataclass
class Example:
    context: list[int]  # token ids of the context (with the BOS, when the model was trained with one)
    target: list[int]  # token ids of the last word (with its leading whitespace)


def read_lambada(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read LAMBADA file ({e})") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f"{path}: line {number}: expected an object with a string \"text\"")
        texts.append(record["text"])
    if not texts:
        raise UserError(f"{path}: no examples")
    return texts


def split_last_word(text: str) -> tuple[str, str] | None:
    """(context, " word"): the context up to the whitespace before the last word; None without context."""
    text = text.rstrip()
    cut = max((i for i, ch in enumerate(text) if ch.isspace()), default=-1)
    if cut <= 0 or not text[:cut].strip():
        return None
    return text[:cut], text[cut:]


def make_examples(texts: list[str], encode, bos_id: int | None = None, where: str = "LAMBADA") -> list[Example]:
    examples = []
    for i, text in enumerate(texts, 1):
        parts = split_last_word(text)
        if parts is None:
            raise UserError(f"{where}: example {i}: needs a context and a last word separated by whitespace")
        context, target = (encode(part) for part in parts)
        if not target:
            raise UserError(f"{where}: example {i}: the last word encodes to no tokens")
        examples.append(Example(([] if bos_id is None else [bos_id]) + context, target))
    return examples


@torch.no_grad()
def score_lambada(model, examples: list[Example], batch: int = 8) -> dict:
    """accuracy, perplexity and the per-example results. Examples are batched by length and padded on
    the right: a causal model's outputs at a position never depend on the padding after it."""
    model.eval()
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].context) + len(examples[i].target))
    correct, word_ce, word_logprob = [False] * len(examples), [0.0] * len(examples), [0.0] * len(examples)
    for start in range(0, len(order), batch):
        group = [examples[i] for i in order[start : start + batch]]
        length = max(len(e.context) + len(e.target) for e in group)
        tokens = torch.zeros(len(group), length, dtype=torch.long)
        for row, e in enumerate(group):
            ids = e.context + e.target
            tokens[row, : len(ids)] = torch.tensor(ids)
        out = model(tokens.to(model_device(model)), return_logits=True)
        for row, (i, e) in enumerate(zip(order[start : start + batch], group)):
            first, end = len(e.context), len(e.context) + len(e.target)
            correct[i] = int(out.logits[row, first].argmax()) == e.target[0]
            losses = out.token_losses[row, first:end].double()
            word_ce[i], word_logprob[i] = float(losses.mean()), -float(losses.sum())
    mean_ce = sum(word_ce) / len(word_ce)
    return {"lambada_acc": sum(correct) / len(correct), "lambada_ppl": math.exp(mean_ce),
            "lambada_examples": len(examples), "per_example": {"correct": correct, "word_ce": word_ce, "word_logprob": word_logprob}}
