"""LAMBADA by the paper's protocol (docs/model.md, "Results"), for any model family.

Each line of the file (EleutherAI's format) is a JSON object with "text". The target is the last
whitespace-separated word: the context is the text before the whitespace that precedes it, the
continuation is that whitespace and the word, each encoded on its own (as lm-evaluation-harness
does), so the word's first subword is the one a reader would predict after the context.

accuracy = share of examples whose first target subword is the top-1 prediction given the context;
PPL = exp of the mean over examples of the mean CE over that example's target subwords.
Per example, the target's summed log-likelihood is kept too (what lm-evaluation-harness reports).

Each context is run once through the forward (a batch in segments between its lengths, the state
carried: `harness.final_states`); the target is then read off the model's decoder
(gpn_scale/models/decode.py): its first step's distribution is the prediction after the context,
and each target token fed gives the next one. No logits are kept for the context's positions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from data_prep.errors import UserError
from gpn_scale.eval.harness import final_states, stack_rows
from gpn_scale.eval.heldout import model_device
from gpn_scale.models.decode import decoder


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
    """accuracy, perplexity and the per-example results. A batch's contexts run together in segments
    between their lengths; its targets are decoded together from the states of the rows whose
    contexts have one length (so the states stack for every family: a Transformer's KV caches too)."""
    model.eval()
    device = model_device(model)
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].context), len(examples[i].target)))
    correct, word_ce, word_logprob = [False] * len(examples), [0.0] * len(examples), [0.0] * len(examples)
    dec = decoder(model, batch)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        ran = [i for i in rows if examples[i].context]
        states = dict(zip(ran, final_states(model, [examples[i].context for i in ran])))
        for length in sorted({len(examples[i].context) for i in rows}):
            group = [i for i in rows if len(examples[i].context) == length]
            logits, state = dec.resume(stack_rows([states[i] for i in group]) if length else None, len(group))
            targets = torch.zeros(len(group), max(len(examples[i].target) for i in group), dtype=torch.long)
            for r, i in enumerate(group):
                targets[r, : len(examples[i].target)] = torch.tensor(examples[i].target)
            hits = logits.argmax(-1).cpu() == targets[:, 0]
            logprobs = []  # per target position: (rows,) log-probability of the target token
            for t in range(targets.shape[1]):
                logprobs.append(torch.log_softmax(logits.double().cpu(), -1).gather(1, targets[:, t : t + 1])[:, 0])
                if t + 1 < targets.shape[1]:
                    logits, state = dec.step(state, targets[:, t].to(device))
            logprobs = torch.stack(logprobs, 1)
            for r, i in enumerate(group):
                n = len(examples[i].target)
                correct[i] = bool(hits[r])
                word_logprob[i] = float(logprobs[r, :n].sum())
                word_ce[i] = -word_logprob[i] / n
    mean_ce = sum(word_ce) / len(word_ce)
    return {"lambada_acc": sum(correct) / len(correct), "lambada_ppl": math.exp(mean_ce),
            "lambada_examples": len(examples), "per_example": {"correct": correct, "word_ce": word_ce, "word_logprob": word_logprob}}
