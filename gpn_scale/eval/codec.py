"""Text <-> token ids through the tokenizer a prep output records (its copy beside stats.json)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from data_prep.tokenizer import EOS_CANDIDATES
from data_prep.errors import UserError


class Codec:
    """A Hugging Face `tokenizer.json` or a sentencepiece `.model`: encode without special tokens,
    decode ids back to text. `eos_id`: the end-of-text token (by the names prep looks for), if any."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: cannot read tokenizer ({e.strerror})") from None
        self.path, self.sha256 = path, hashlib.sha256(raw).hexdigest()
        if path.suffix == ".model":
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor()
            try:
                sp.LoadFromSerializedProto(raw)
            except Exception:
                raise UserError(f"{path}: not a sentencepiece model") from None
            self._encode, self._decode = lambda text: sp.encode(text, out_type=int), sp.decode
            self.vocab_size = sp.vocab_size()
            self.eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        elif path.suffix == ".json":
            from tokenizers import Tokenizer

            try:
                tok = Tokenizer.from_str(raw.decode("utf-8"))
            except Exception as e:
                raise UserError(f"{path}: not a Hugging Face tokenizer.json ({str(e)[:120]})") from None
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
            self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
            self.eos_id = next((i for i in map(tok.token_to_id, EOS_CANDIDATES) if i is not None), None)
        else:
            raise UserError(f"{path}: unknown tokenizer format; expected a sentencepiece .model or a tokenizer.json")

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))


class IncrementalDecoder:
    """Decodes a growing token sequence piece by piece, emitting exactly what decoding the whole
    sequence gives: each new token is decoded together with a few tokens before it and only the new
    suffix is emitted (tokenizers drop leading spaces or split a character's bytes across tokens, so
    tokens do not decode one by one)."""

    CONTEXT = 4

    def __init__(self, codec: Codec):
        self.codec, self.context, self.pending = codec, [], []

    def push(self, token: int) -> str:
        self.pending.append(token)
        text = self.codec.decode(self.context + self.pending)
        # Text ending in U+FFFD may be a character whose remaining bytes are still to come, or bytes
        # that a later one turns into a different count of replacement characters: hold it until a
        # character ends cleanly (or flush). Only then is everything before it final, and only then
        # may the context move. A model that writes valid text holds back at most one character.
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Whatever is still held back, decoded as it is."""
        return self._emit(self.codec.decode(self.context + self.pending)) if self.pending else ""

    def _emit(self, text: str) -> str:
        before = self.codec.decode(self.context)
        self.context = (self.context + self.pending)[-self.CONTEXT:]
        self.pending = []
        return text.removeprefix(before)
