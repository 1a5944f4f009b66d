"""Tiny models, a real byte-level BPE and real prep outputs for the eval / analysis / generation tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from gpn_scale.models import GPNConfig, build_model

SENTENCES = [
    "the cat sat on the mat and the dog sat on the log",
    "a naive café serves crème brûlée to the ünïcode crowd",
    "river stones roll slowly under the cold water of the valley",
    "seven small ships sailed past the lighthouse at dawn",
]


def tiny_model(vocab: int, family: str = "gpn_m", seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = dict(family=family, vocab_size=vocab, d_state=32, d_emb=16, d_ffn=48, n_heads=4, d_key=8, d_val=8)
    return build_model(GPNConfig(**{**cfg, **over}))


def train(model, windows: torch.Tensor, steps: int, lr: float = 1e-2, batch: int = 8):
    """A few Adam steps on the windows, so the model under test is a trained one."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(0, len(windows), (batch,), generator=g)
        loss = model(windows[rows]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def corpus_texts(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(SENTENCES, 2)) for _ in range(n)]


def make_tokenizer(out: Path, vocab: int = 300) -> Path:
    from data_prep.tokenizer import train_bpe

    train_bpe(corpus_texts(), vocab, str(out))
    return out


def make_prep(root: Path, tokenizer: Path, seq_len: int = 32, bos: bool = False) -> Path:
    """A real `gpn-scale prep` output (train and val splits, stats.json, unigram.npy, tokenizer copy);
    `bos`: each document begins with BOS."""
    import json

    from gpn_scale.cli import main

    root.mkdir(parents=True, exist_ok=True)
    for name, seed in (("train", 0), ("val", 1)):
        lines = [json.dumps({"text": t}) for t in corpus_texts(60, seed)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "prep"
    assert main(["prep", str(root / "train.jsonl"), str(root / "val.jsonl"), "--val-files", str(root / "val.jsonl"),
                 "--out", str(out), "--tokenizer", str(tokenizer), "--seq-len", str(seq_len), "--workers", "1",
                 *(["--bos"] if bos else [])]) == 0
    return out
