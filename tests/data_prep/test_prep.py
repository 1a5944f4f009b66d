"""Data prep on real parquet/jsonl, real tokenizers and real MosaicML Streaming, in-process.

The multi-process checks (workers x nodes identity, SIGKILL resume) are in test_prep_e2e.py.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.embedded import SCHEMA, write_embedded_corpus
from data_prep.pack import Packer
from gpn_scale.cli import main as gpn_main
from support.prep_runs import (SEQ_LEN, corpus, english, expected_stream, fineweb_table, prep, read_split,  # noqa: F401
                                tokenizer, tree_bytes, write_corpus)

# ---------------------------------------------------------------- packing


def test_packer_cuts_windows_in_order_and_reports_the_tail():
    packer = Packer(4, np.dtype(np.uint16))
    first = packer.add([[1, 2, 3], [4, 5]])
    second = packer.add([[6], [7, 8, 9, 10, 11]])
    assert first.tolist() == [[1, 2, 3, 4]]
    assert second.tolist() == [[5, 6, 7, 8]]
    assert packer.finish() == 3  # 9, 10, 11
    assert packer.add([[1]]).shape == (0, 4) and packer.finish() == 1


# ---------------------------------------------------------------- the token stream, end to end


def test_windows_reproduce_every_kept_document_in_order(corpus, tokenizer, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = prep(corpus, "--out", out, "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                     "--val-fraction", 0.2, "--on-error", "skip", capsys=capsys)
    assert code == 0, err
    stats = json.loads((out / "stats.json").read_text())
    expected = expected_stream(corpus, tokenizer, 0.2)
    for split in ("train", "val"):
        windows = read_split(out / split)
        assert windows.dtype == np.uint16 and windows.shape[1] == SEQ_LEN
        stream, dropped = expected[split]
        assert windows.ravel().tolist() == stream
        assert stats["splits"][split]["dropped_tail_tokens"] == dropped
        assert stats["splits"][split]["tokens"] == len(stream) + dropped
    assert stats["skipped"]["documents"] == {"empty text": 3}  # one per parquet file
    vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    assert stats["seq_len"] == SEQ_LEN and stats["vocab_size"] == len(vocab) and stats["eos_id"] == 0
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    unigram = np.load(out / "unigram.npy")
    assert unigram.dtype == np.int64 and unigram.shape == (len(vocab),)
    assert np.array_equal(unigram, np.bincount(read_split(out / "train").ravel(), minlength=len(vocab)))


def test_streaming_reads_a_filesystem_remote_into_a_separate_cache(corpus, tokenizer, tmp_path):
    out = tmp_path / "out"
    assert prep(corpus, "--out", out, "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                "--on-error", "skip")[0] == 0
    local = read_split(out / "train")
    cache = tmp_path / "cache"
    # Streaming 0.13 has no `file://` scheme: a remote on a (shared) filesystem is a plain path,
    # downloaded shard by shard into the local cache just like s3:// would be.
    remote = read_split(cache, remote=str(out / "train"))
    assert np.array_equal(local, remote) and len(local) > 0
    assert (cache / "index.json").exists() and any(cache.glob("000000/shard.*.mds"))  # unit paths resolve


def test_merge_again_replaces_the_root_index_with_the_units_in_order(corpus, tokenizer, tmp_path):
    out = tmp_path / "out"
    assert prep(corpus, "--out", out, "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                "--on-error", "skip")[0] == 0
    first = (out / "train" / "index.json").read_bytes()
    root_handlers = list(logging.getLogger().handlers)
    assert prep("merge", out)[0] == 0  # over an existing root index: replaced, not refused
    assert (out / "train" / "index.json").read_bytes() == first
    assert logging.getLogger().handlers == root_handlers and not (out / ".tmp").exists()
    expected = []  # each unit's shards in unit order, their paths made relative to the split root
    for unit in sorted(p for p in (out / "train").iterdir() if p.is_dir()):
        for shard in json.loads((unit / "index.json").read_text())["shards"]:
            for key in ("raw_data", "zip_data"):
                if shard.get(key):
                    shard[key]["basename"] = f"{unit.name}/{shard[key]['basename']}"
            expected.append(shard)
    assert len(expected) > 1 and json.loads(first) == {"shards": expected, "version": 2}


def test_a_rerun_clears_what_a_crash_left_and_matches_a_clean_run(corpus, tokenizer, tmp_path):
    args = ["--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1, "--on-error", "skip"]
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    assert prep(corpus, "--out", clean, *args)[0] == 0
    shutil.copytree(clean, crashed)
    # A crash mid-commit of unit 1: its shards moved into place, its marker not yet written;
    # another unit caught mid-write in .tmp; the merge never ran.
    (crashed / "units" / "000001.json").unlink()
    (crashed / "train" / "000002" / "shard.00000.mds.zstd").write_bytes(b"half")
    (crashed / "units" / "000002.json").unlink()
    (crashed / ".tmp" / "000003" / "train").mkdir(parents=True)
    for name in ("stats.json", "unigram.npy", "train/index.json"):
        (crashed / name).unlink()
    assert prep(corpus, "--out", crashed, *args)[0] == 0
    assert tree_bytes(crashed) == tree_bytes(clean)


def test_embedded_corpus_goes_through_the_real_path(tmp_path):
    files = write_embedded_corpus(tmp_path / "corpus")
    assert len(files) >= 3 and files == sorted(files)
    table = pq.read_table(files[0])
    assert table.schema.names == SCHEMA.names and table.num_rows > 10
    assert "def" in " ".join(table.column("text").to_pylist())  # real Python documentation prose
    tok = tmp_path / "tok.json"
    assert gpn_main(["prep", "train-tokenizer", *map(str, files), "--vocab-size", "512", "--out", str(tok)]) == 0
    out = tmp_path / "out"
    assert prep(*files[:-1], "--val-files", files[-1], "--out", out, "--tokenizer", tok, "--seq-len", 128,
                "--workers", 1)[0] == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["splits"]["train"]["windows"] > 100 and stats["splits"]["val"]["windows"] > 20
    assert stats["skipped"]["documents"] == {}
    assert len(read_split(out / "val")) == stats["splits"]["val"]["windows"]


def test_sentencepiece_model_filters_and_limits(corpus, tmp_path):
    import sentencepiece as spm

    text = tmp_path / "text.txt"
    rng = random.Random(1)
    text.write_text("\n".join(english(rng, 30) for _ in range(300)) + "\nÜnïcödé 東京 🚀\n")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    model = tmp_path / "sp.model"
    out = tmp_path / "out"
    parquet = sorted(corpus.glob("*.parquet"))
    assert prep(*parquet, "--out", out, "--tokenizer", model, "--seq-len", 32, "--workers", 1, "--bos",
                "--min-int-score", 3, "--max-docs", 60, "--on-error", "skip")[0] == 0
    stats = json.loads((out / "stats.json").read_text())
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert (stats["vocab_size"], stats["eos_id"], stats["bos_id"], stats["add_bos"]) == (400, sp.eos_id(), sp.bos_id(), True)
    # --max-docs: the first 60 rows in input order, across the file boundary (45 rows per file)
    rows = pa.concat_tables(pq.read_table(p) for p in parquet).slice(0, 60).to_pylist()
    keep = [r["text"] for r in rows if r["int_score"] >= 3 and r["text"]]
    tokens = sum(len(sp.encode(t)) + 2 for t in keep)
    assert stats["splits"]["train"]["documents"] == len(keep)
    assert stats["splits"]["train"]["tokens"] == tokens
    assert sum(stats["filtered"].values()) + sum(stats["skipped"]["documents"].values()) + len(keep) == 60
    first = read_split(out / "train")[0]
    assert first[0] == sp.bos_id()


def test_max_tokens_stops_at_a_unit_boundary(corpus, tokenizer, tmp_path):
    out = tmp_path / "out"
    assert prep(corpus, "--out", out, "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                "--on-error", "skip", "--max-tokens", 5000)[0] == 0
    stats = json.loads((out / "stats.json").read_text())
    units = [json.loads(p.read_text()) for p in sorted((out / "units").glob("*.json"))]
    windows = [u["splits"]["train"]["windows"] for u in units]
    assert len(units) == stats["units"] < len(json.loads((out / "prep.json").read_text())["units"])
    assert sum(windows) * SEQ_LEN >= 5000 > sum(windows[:-1]) * SEQ_LEN


# ---------------------------------------------------------------- bad input


def _bad_inputs(root: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the one-line error must say)"""
    root.mkdir()
    ok = ["A fine document.", "Another one."]
    cases = {}

    def parquet(name, table):
        pq.write_table(table, root / name)
        return root / name

    truncated = root / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cases["corrupt parquet"] = (truncated, "not a readable parquet file")
    cases["missing text column"] = (parquet("notext.parquet", pa.table({"content": ok})), "no column 'text'")
    cases["non-string column"] = (parquet("ints.parquet", pa.table({"text": [1, 2]})), "has type int64, expected string")
    cases["null text"] = (parquet("null.parquet", fineweb_table(ok + [None])), "row 2: text is null")
    # Not an error (an empty document is skipped and counted whatever --on-error says), but a skip.
    cases["empty text"] = (parquet("empty.parquet", fineweb_table([ok[0], "", ok[1]])), "")
    cases["invalid UTF-8 (parquet)"] = (parquet("binary.parquet", fineweb_table([b"ok", b"\xff\xfebad"], pa.binary())),
                                        "row 1: invalid UTF-8")
    jsonl = root / "bad-utf8.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    cases["invalid UTF-8 (jsonl)"] = (jsonl, "line 2: invalid UTF-8")  # lines count from 1, as in an editor
    numbers = root / "numbers.jsonl"
    numbers.write_text('{"text": "fine"}\n{"text": 42}\n{"title": "x"}\nnot json\n{"text": "\\ud800"}\n')
    cases["non-string text (jsonl)"] = (numbers, "line 2: text is int, expected a string")
    cut = root / "cut.jsonl.zst"
    whole = zstandard.ZstdCompressor().compress("".join(f'{{"text": "doc {i}"}}\n' for i in range(5000)).encode())
    cut.write_bytes(whole[: len(whole) // 2])
    cases["truncated zstd"] = (cut, "zstd stream ends inside a frame")
    return cases


@pytest.fixture(scope="module")
def bad_inputs(corpus, tmp_path_factory):
    return _bad_inputs(tmp_path_factory.mktemp("bad") / "in", corpus / "part-000.parquet")


@pytest.mark.parametrize("case", ["corrupt parquet", "missing text column", "non-string column", "null text",
                                  "invalid UTF-8 (parquet)", "invalid UTF-8 (jsonl)", "non-string text (jsonl)",
                                  "truncated zstd"])
def test_bad_input_is_one_line_naming_file_and_problem(case, bad_inputs, tokenizer, tmp_path, capsys):
    path, message = bad_inputs[case]
    code, err = prep(path, "--out", tmp_path / "out", "--tokenizer", tokenizer, "--seq-len", SEQ_LEN,
                     "--workers", 1, capsys=capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert str(path.name) in lines[0] and message in lines[0], lines[0]


def test_skip_counts_and_lists_every_bad_file_and_document(bad_inputs, corpus, tokenizer, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = prep(*[p for p, _ in bad_inputs.values()], corpus / "part-000.parquet", "--out", out,
                     "--tokenizer", tokenizer, "--seq-len", 16, "--workers", 1, "--on-error", "skip", capsys=capsys)
    assert code == 0, err
    stats = json.loads((out / "stats.json").read_text())
    assert stats["skipped"]["documents"] == {
        "empty text": 2,  # empty.parquet and the one in part-000
        "invalid UTF-8": 2,
        "invalid UTF-8 (lone surrogate)": 1,
        "no field 'text'": 1,
        "not valid JSON (Expecting value)": 1,
        "text is int, expected a string": 1,
        "text is null": 1,
    }
    files = {Path(f["file"]).name: f["reason"] for f in stats["skipped"]["files"]}
    assert set(files) == {"truncated.parquet", "notext.parquet", "ints.parquet", "cut.jsonl.zst"}
    assert "not a readable parquet file" in files["truncated.parquet"]
    assert {(Path(d["file"]).name, d.get("row", d.get("line")), d["reason"]) for d in stats["skipped"]["listed"]} >= {
        ("binary.parquet", 1, "invalid UTF-8"), ("numbers.jsonl", 2, "text is int, expected a string"),
        ("numbers.jsonl", 4, "not valid JSON (Expecting value)")}
    good_docs = 2 + 2 + 1 + 1 + 1 + (45 - 1)  # null, empty, binary, bad-utf8, numbers, part-000 (45 rows, 1 empty)
    assert stats["splits"]["train"]["documents"] == good_docs


def test_a_different_tokenizer_on_an_existing_output_is_refused(corpus, tokenizer, tmp_path, capsys):
    out = tmp_path / "out"
    part = corpus / "part-000.parquet"
    assert prep(part, "--out", out, "--tokenizer", tokenizer, "--seq-len", SEQ_LEN, "--workers", 1,
                "--on-error", "skip")[0] == 0
    other = tmp_path / "other.json"
    assert gpn_main(["prep", "train-tokenizer", str(part), "--vocab-size", "300", "--out", str(other)]) == 0
    capsys.readouterr()
    code, err = prep(part, "--out", out, "--tokenizer", other, "--seq-len", SEQ_LEN, "--workers", 1,
                     "--on-error", "skip", capsys=capsys)
    assert code == 2 and err.count("\n") == 1
    assert "prep.json" in err and "another tokenizer" in err and "vocab 300" in err
