"""`gpn-scale prep --streams`: each split's documents dealt whole to S streams, each cut into
consecutive windows, written window-major (checked against an independent re-derivation from the
corpus); refusals. Byte-identity across workers and nodes: tests/data_prep/test_prep_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zstandard

from support.prep_runs import SEQ_LEN, corpus, prep, tokenizer  # noqa: F401 (fixtures)


def expected_documents(corpus_dir: Path, tokenizer_file: Path, val_fraction: float) -> dict[str, list[list[int]]]:
    """Per split, every kept document's tokens (ids + EOS), in the output's order: files sorted,
    row groups, rows."""
    from tokenizers import Tokenizer

    from data_prep.unit import is_val

    tok = Tokenizer.from_file(str(tokenizer_file))
    eos = tok.token_to_id("<|endoftext|>")
    docs = {"train": [], "val": []}
    for path in sorted(corpus_dir.iterdir(), key=lambda p: p.as_uri()):
        if path.suffix == ".parquet":
            texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
        else:
            texts = [json.loads(line)["text"] for line in
                     zstandard.ZstdDecompressor().decompress(path.read_bytes()).decode().splitlines()]
        for text in texts:
            if text:
                split = "val" if is_val(text.encode(), val_fraction) else "train"
                docs[split].append(tok.encode(text, add_special_tokens=False).ids + [eos])
    return docs


def dealt(documents: list[list[int]], streams: int) -> list[list[list[int]]]:
    """Each document to the stream with the fewest tokens so far, the lowest index among equals."""
    out, totals = [[] for _ in range(streams)], [0] * streams
    for doc in documents:
        i = min(range(streams), key=lambda j: (totals[j], j))
        out[i].append(doc)
        totals[i] += len(doc)
    return out


def samples(path: Path) -> list[dict]:
    from gpn_scale.storage.mds_datasets import reading

    with reading(local=str(path), batch_size=1, shuffle=False) as ds:
        return [ds[i] for i in range(len(ds))]


def test_streams_hold_whole_documents_in_order_window_major(corpus, tokenizer, tmp_path, capsys):  # noqa: F811
    out, S, V = tmp_path / "out", 3, 2
    code, err = prep(corpus, "--out", out, "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                     "--val-fraction", 0.2, "--on-error", "skip", "--streams", S, "--val-streams", V, capsys=capsys)
    assert code == 0, err
    stats = json.loads((out / "stats.json").read_text())
    for split, count in (("train", S), ("val", V)):
        docs = expected_documents(corpus, tokenizer, 0.2)[split]
        streams = [sum(d, []) for d in dealt(docs, count)]
        K = min(len(s) for s in streams) // SEQ_LEN
        assert K >= 2, "the corpus is too small for the test to show the order"
        got = samples(out / "streams" / split)
        assert len(got) == K * count
        for j, sample in enumerate(got):  # sample k*S + i is window k of stream i
            k, i = divmod(j, count)
            assert (sample["window"], sample["stream"]) == (k, i)
            assert sample["tokens"].dtype == np.uint16
            assert sample["tokens"].tolist() == streams[i][k * SEQ_LEN : (k + 1) * SEQ_LEN], (split, k, i)
        record = json.loads((out / "streams" / split / "streams.json").read_text())
        assert record == stats["streams"][split]
        total = sum(map(len, streams))
        assert record["streams"] == count and record["windows_per_stream"] == K and record["seq_len"] == SEQ_LEN
        assert record["documents"] == len(docs) and record["tokens"] == K * count * SEQ_LEN
        assert record["dropped_tail_tokens"] == total - K * count * SEQ_LEN
        assert record["shortest_stream_tokens"] == min(map(len, streams))
        assert f"{count:,} streams of {K:,} windows" in err
    # the packed windows are written as ever beside the streams
    assert stats["splits"]["train"]["windows"] > 0 and (out / "train" / "index.json").is_file()


@pytest.mark.parametrize("args, message", [
    (["--streams", "0"], "--streams: got 0, expected at least 1"),
    (["--val-streams", "2"], "--val-streams: given without --streams"),
    (["--streams", "100000"], "documents for 100,000 streams; each stream needs a document and a window of "
                              "--seq-len 64 tokens: at least 100,000 documents and 6,400,000 tokens"),
])
def test_bad_stream_settings_are_one_line(corpus, tokenizer, tmp_path, capsys, args, message):  # noqa: F811
    code, err = prep(corpus, "--out", tmp_path / "out", "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                     "--on-error", "skip", *args, capsys=capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert message in lines[-1] and lines[-1].startswith("error:"), err
    assert not (tmp_path / "out" / "streams").exists()
