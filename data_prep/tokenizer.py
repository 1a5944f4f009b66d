"""Tokenizers behind one interface: a sentencepiece `.model` or a Hugging Face `tokenizer.json`,
plus training a byte-level BPE for offline use.

Encoding is single-threaded on purpose: parallelism comes from worker processes, one core each,
so one worker's throughput is comparable to the bare tokenizer's and workers scale linearly.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpn_scale.errors import UserError

# Read by `tokenizers` when its thread pool first starts, so it must be set before any encode.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "<|startoftext|>")
TRAINED_SPECIALS = ["<|endoftext|>", "<|startoftext|>"]  # ids 0 and 1 of trained tokenizers


@dataclass(frozen=True)
class TokenizerInfo:
    """What the output records about its tokenizer; equal infos mean interchangeable outputs."""

    kind: str  # "sentencepiece" or "huggingface"
    sha256: str
    vocab_size: int
    eos_id: int
    bos_id: int | None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    @property
    def filename(self) -> str:
        """Name of the tokenizer's copy in the output directory."""
        return "tokenizer.model" if self.kind == "sentencepiece" else "tokenizer.json"


class Tokenizer:
    def __init__(self, path: str, eos_token: str | None = None, bos_token: str | None = None):
        self.path = path
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read tokenizer ({e.strerror})") from None
        if path.endswith(".model"):
            kind, eos_id, bos_id, vocab = self._load_sentencepiece(raw)
        elif path.endswith(".json"):
            kind, eos_id, bos_id, vocab = self._load_huggingface(raw, eos_token, bos_token)
        else:
            raise UserError(f"{path}: unknown tokenizer format; expected a sentencepiece .model or a tokenizer.json")
        self.info = TokenizerInfo(kind, hashlib.sha256(raw).hexdigest(), vocab, eos_id, bos_id)

    def _load_sentencepiece(self, raw: bytes):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(raw)
        except Exception:
            raise UserError(f"{self.path}: not a sentencepiece model") from None
        if sp.eos_id() < 0:
            raise UserError(f"{self.path}: sentencepiece model has no EOS piece")
        self._encode = lambda texts: sp.encode(texts, out_type=int, num_threads=1)
        return "sentencepiece", sp.eos_id(), (sp.bos_id() if sp.bos_id() >= 0 else None), sp.vocab_size()

    def _load_huggingface(self, raw: bytes, eos_token: str | None, bos_token: str | None):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:
            raise UserError(f"{self.path}: not a Hugging Face tokenizer.json ({str(e)[:120]})") from None
        eos_id = _special_id(tok, eos_token, EOS_CANDIDATES)
        if eos_id is None:
            want = repr(eos_token) if eos_token else f"one of {', '.join(EOS_CANDIDATES)}"
            raise UserError(f"{self.path}: no end-of-text token {want}; pass --eos-token")
        bos_id = _special_id(tok, bos_token, BOS_CANDIDATES)
        if bos_token and bos_id is None:
            raise UserError(f"{self.path}: no token {bos_token!r} (from --bos-token)")
        self._encode = lambda texts: [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
        return "huggingface", eos_id, bos_id, tok.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without any special tokens."""
        return self._encode(texts)


def _special_id(tok, name: str | None, candidates: tuple[str, ...]) -> int | None:
    for token in [name] if name else candidates:
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


def train_bpe(texts: Iterable[str], vocab_size: int, out: str) -> int:
    """Train a byte-level BPE (GPT-2 style) with `<|endoftext|>` as EOS and write tokenizer.json.
    Returns the vocabulary size reached: less than asked when the text has too few distinct merges."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(TRAINED_SPECIALS):
        raise UserError(f"--vocab-size: {vocab_size} is too small; a byte-level BPE needs at least "
                        f"{256 + len(TRAINED_SPECIALS)} (256 bytes + special tokens)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TRAINED_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(out)
    return tok.get_vocab_size(with_added_tokens=True)
