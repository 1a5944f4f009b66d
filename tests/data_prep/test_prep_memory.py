"""A prep worker's memory does not grow with one document's size beyond a small multiple of it, and
a long document, encoded in pieces cut where the tokenizer splits anyway, gets exactly the ids of
the whole document encoded at once: with a byte-level BPE tokenizer.json and a sentencepiece BPE
model, the real libraries, on real text (data_prep/tokenizer.py). Tokenizers whose pieces could
differ (a unigram model among them) encode documents whole, with the same ids."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest

from data_prep import embedded, tokenizer as tokenizer_module
from data_prep.tokenizer import Tokenizer, train_bpe
from support import ROOT


def prep_bench():
    """bench/prep.py, whose worker memory measurement the test uses. Imported when the test runs,
    not at collection: it imports streaming (and with it triton), which must not be imported
    before the kernel tests set up Triton's interpreter."""
    spec = importlib.util.spec_from_file_location("prep_bench", ROOT / "bench" / "prep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def text_of(chars: int, seed: int = 0) -> str:
    """Real English with the corpus's newlines, indentation and code, plus runs of spaces, tabs,
    Unicode, digits and the tokenizers' special tokens written as text."""
    rng = random.Random(seed)
    extras = ["  double  spaces ", "\ttab\tbed", " Ünïcödé naïve café — 東京 🚀 ", " 12 345 6789 ", "<|endoftext|>",
              " x <|endoftext|> y ", "\n\n\n", " e\u0301 ", "</s> <s>", " a b c d "]
    docs = [text for _, text in embedded.documents()]
    parts, n = [], 0
    while n < chars:
        part = rng.choice(docs) if rng.random() < 0.8 else rng.choice(extras)
        parts.append(part)
        n += len(part)
    return "".join(parts)[:chars]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("tokenizers")
    texts = [text for _, text in embedded.documents()]
    train_bpe(texts, 2048, str(root / "bpe.json"))
    (root / "corpus.txt").write_text("\n".join(texts))
    paths = {"byte-level BPE": root / "bpe.json"}
    for kind in ("bpe", "unigram"):
        spm.SentencePieceTrainer.train(input=str(root / "corpus.txt"), model_prefix=str(root / kind), model_type=kind,
                                       vocab_size=1000, byte_fallback=True, minloglevel=2)
        paths[f"sentencepiece {kind}"] = root / f"{kind}.model"
    return paths


def whole(path: Path, text: str) -> list[int]:
    """The ids of `text` encoded at once by the tokenizer library itself."""
    if path.suffix == ".model":
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(path)).encode(text)
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("kind", ["byte-level BPE", "sentencepiece bpe"])
def test_a_long_document_in_pieces_has_the_ids_of_the_whole(tokenizers, kind, monkeypatch):
    """Pieces of ~300 characters, so that the 200k-character document is cut some 600 times: each
    cut must leave the ids as they are."""
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 300)
    monkeypatch.setattr(tokenizer_module, "CALL_CHARS", 5000)
    tok = Tokenizer(str(tokenizers[kind]))
    assert tok.splits
    text = text_of(200_000)
    pieces = list(tok._pieces(text))
    assert len(pieces) > 500 and "".join(pieces) == text
    short = ["", "a b", text_of(1000, seed=1)]
    encoded = tok.encode([short[0], text, *short[1:]])
    assert all(ids.dtype == tok.info.dtype for ids in encoded)
    assert encoded[1].tolist() == whole(tokenizers[kind], text)
    assert [ids.tolist() for ids in encoded[:1] + encoded[2:]] == [whole(tokenizers[kind], t) for t in short]


def test_a_tokenizer_whose_pieces_would_differ_encodes_documents_whole(tokenizers, tmp_path, monkeypatch):
    """The probe texts show where cutting would change the ids (an added token with a space inside;
    sentencepiece keeping extra whitespace), and a unigram model breaks exact ties by the running
    score's rounding (the text below has runs of '*' that it splits otherwise in pieces): each
    encodes a document at once."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 300)
    hf = HFTokenizer.from_file(str(tokenizers["byte-level BPE"]))
    hf.add_tokens([AddedToken("New York", normalized=False)])
    hf.save(str(tmp_path / "added.json"))
    (tmp_path / "corpus.txt").write_text("\n".join(text for _, text in embedded.documents()))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "spaces"),
                                   vocab_size=1000, remove_extra_whitespaces=False, minloglevel=2)
    for path in (tmp_path / "added.json", tmp_path / "spaces.model", tokenizers["sentencepiece unigram"]):
        tok = Tokenizer(str(path))
        assert not tok.splits, path
        text = text_of(20_000) + " New York is large "
        assert list(tok._pieces(text)) == [text]
        assert tok.encode([text])[0].tolist() == whole(path, text)
    unigram = Tokenizer(str(tokenizers["sentencepiece unigram"]))
    unigram.splits = True  # were it cut anyway: another split of some run of one character
    text = text_of(200_000)
    assert unigram.encode([text])[0].tolist() != whole(tokenizers["sentencepiece unigram"], text)


def test_a_prep_worker_peak_grows_a_small_multiple_of_one_documents_size(tokenizers, tmp_path):
    """A worker preparing the unit of one 4 MB document (read, check, tokenize, pack, MDS), measured
    as bench/prep.py --memory does, against a 1 kB document: its peak resident set rises by a few
    times the document's size (encoded whole, ~110 times with byte-level BPE)."""
    bench = prep_bench()
    base, _ = bench.worker_peak_growth(tmp_path, tokenizers["byte-level BPE"], 1000)
    chars = 4_000_000
    growth, tokens = bench.worker_peak_growth(tmp_path, tokenizers["byte-level BPE"], chars)
    doc = bench.long_document(chars)
    assert tokens == len(whole(tokenizers["byte-level BPE"], doc)) + 1  # the document's ids and EOS, as whole
    rise = (growth - base) / chars
    assert rise < 16, f"peak rose {rise:.1f}x the document's size"
    out = tmp_path / f"out-{chars}"
    stats = json.loads((out / "units" / "000000.json").read_text())
    assert stats["splits"]["train"]["tokens"] == tokens
    assert np.load(out / "units" / "000000.npy").sum() == tokens // 128 * 128  # every full window counted
