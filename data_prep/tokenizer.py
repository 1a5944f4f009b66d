"""Tokenizers behind one interface: a sentencepiece `.model` or a Hugging Face `tokenizer.json`,
plus training a byte-level BPE for offline use.

Encoding is single-threaded on purpose: parallelism comes from worker processes, one core each,
so one worker's throughput is comparable to the bare tokenizer's and workers scale linearly.

Memory is bounded whatever one document's size: a tokenizer keeps ~100 bytes per character of the
text it encodes at once (offsets, alignments, token strings), so a 26 MB document would take GBs.
A document longer than `PIECE_CHARS` is encoded in pieces cut only where the tokenizer splits
anyway, and each call takes at most about `CALL_CHARS` of text; the ids are the same as encoding
the whole document at once. The cut is before a single space between two letters or digits
(`x| y`): byte-level BPE's pre-tokenizer (GPT-2's regex and its relatives) never puts a letter or
digit in one piece with the space after it, and encodes the text after a piece boundary on its
own, and sentencepiece splits its words at each space (`▁`) and encodes them apart, the space
before a word becoming that word's `▁` whether or not a piece begins there. Whether a tokenizer
behaves so is checked when it is loaded, on probe texts (every added token among them): one that
does not (a normalizer that strips each text's ends, sentencepiece keeping extra whitespace, an
added token with a space inside) encodes each document whole, as before. So does a unigram model
(sentencepiece's default, or a tokenizer.json's `Unigram`): its Viterbi search breaks exact ties
(a run of one repeated character, say) by the rounding of the score summed from the text's start,
so a piece encoded on its own may split such a run otherwise; BPE merges by rank, word by word.
A document with no such space for a long stretch (text without spaces) is encoded in longer pieces.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import UserError

# Read by `tokenizers` when its thread pool first starts, so it must be set before any encode.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PIECE_CHARS = 1 << 15  # a longer document is encoded in pieces of about this many characters
CALL_CHARS = 1 << 18  # characters of text per call into the tokenizer, at most (one long piece aside)
CUT = re.compile(r"(?<=[^\W_]) (?=[^\W_])")  # before a single space between two letters or digits
PROBES = ("a b", "Hello world, it is 12 34 o'clock. Über naïve café x y",
          "one two\nthree four\tfive  six", "ab cd ef gh ij kl mn op qr st uv wx yz 0 1 2")

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
        self.splits = self._merges_by_rank and self._cuts_hold()

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
        self._specials, self._merges_by_rank = _sentencepiece_model(raw)
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
        self._specials = [added.content for added in tok.get_added_tokens_decoder().values()]
        self._merges_by_rank = json.loads(raw).get("model", {}).get("type") in ("BPE", "WordPiece", "WordLevel")
        return "huggingface", eos_id, bos_id, tok.get_vocab_size(with_added_tokens=True)

    def _cuts_hold(self) -> bool:
        """Whether encoding pieces cut by `CUT` gives the ids of the whole text, on every probe text
        and every cut in it (the added tokens' texts among them)."""
        probes = [*PROBES, *(f"a {special} b {special}c d" for special in self._specials)]
        for text in probes:
            cuts = [0, *(m.start() for m in CUT.finditer(text)), len(text)]
            pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
            whole, *parts = self._encode([text, *pieces])
            if [i for part in parts for i in part] != whole:
                return False
        return True

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (`info.dtype`), without any special tokens. A long text is encoded
        in pieces, each call taking at most about CALL_CHARS characters (see the module's
        docstring): memory does not grow with one text's size beyond its ids and its text."""
        parts: list[list[np.ndarray]] = [[] for _ in texts]
        call: list[str] = []
        owners: list[int] = []
        size = 0
        for i, text in enumerate(texts):
            for piece in self._pieces(text):
                if call and size + len(piece) > CALL_CHARS:
                    self._encode_call(call, owners, parts)
                    call, owners, size = [], [], 0
                call.append(piece)
                owners.append(i)
                size += len(piece)
        if call:
            self._encode_call(call, owners, parts)
        return [doc[0] if len(doc) == 1 else np.concatenate(doc) for doc in parts]

    def _encode_call(self, pieces: list[str], owners: list[int], parts: list[list[np.ndarray]]) -> None:
        for owner, ids in zip(owners, self._encode(pieces)):
            parts[owner].append(np.array(ids, dtype=self.info.dtype))

    def _pieces(self, text: str) -> Iterator[str]:
        """`text` cut into pieces of about PIECE_CHARS (longer where no cut is near) where the
        tokenizer splits anyway; the whole text when it is short or the cuts do not hold."""
        if len(text) <= PIECE_CHARS or not self.splits:
            yield text
            return
        start = 0
        while len(text) - start > PIECE_CHARS:
            cut = CUT.search(text, start + PIECE_CHARS)
            if cut is None:
                break
            yield text[start:cut.start()]
            start = cut.start()
        yield text[start:]


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


def _sentencepiece_model(raw: bytes) -> tuple[list[str], bool]:
    """A sentencepiece model's user-defined pieces (matched in the raw text before encoding, like a
    tokenizer.json's added tokens; `▁` standing for a space), and whether it is a BPE (or word,
    char) model rather than a unigram one."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(raw)
    user_defined = pb.ModelProto.SentencePiece.USER_DEFINED
    specials = [piece.piece.replace("\u2581", " ") for piece in model.pieces if piece.type == user_defined]
    return specials, model.trainer_spec.model_type != pb.TrainerSpec.UNIGRAM
