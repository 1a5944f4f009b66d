"""Prep's test inputs: FineWeb-Edu-shaped parquet and jsonl.zst corpora, a tokenizer trained on one, the
prep CLI in-process, and an independent expectation of what it writes (tests/data_prep/, and the SLURM
prep array in tests/launchers/)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.embedded import SCHEMA
from gpn_scale.cli import main as gpn_main

SEQ_LEN = 64
WORDS = "the of grounded prediction network state memory token window river stone light".split()


def fineweb_table(texts: list, text_type=pa.string()) -> pa.Table:
    """`texts` under the FineWeb-Edu schema (other columns filled plausibly)."""
    n = len(texts)
    columns = {
        "text": pa.array(texts, text_type), "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n, "url": [f"https://example.org/{i}" for i in range(n)],
        "date": ["2024-02-20T00:00:00Z"] * n, "file_path": ["s3://commoncrawl/x.warc.gz"] * n,
        "language": ["en"] * n, "language_score": [0.9] * n, "token_count": [100] * n,
        "score": [2.5 + (i % 3) * 0.5 for i in range(n)], "int_score": [2 + i % 3 for i in range(n)],
    }
    schema = SCHEMA if text_type == pa.string() else SCHEMA.set(0, pa.field("text", text_type))
    return pa.table(columns, schema=schema)


def english(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def write_corpus(root: Path, files: int = 3, docs_per_file: int = 40, row_group: int = 9, seed: int = 0) -> Path:
    """FineWeb-Edu parquet files with Unicode, empty and very long documents, plus one jsonl.zst."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    specials = ["Ünïcödé naïve café — 東京 🚀 שלום", "", english(rng, 12_000), "e\u0301 combining", " "]
    for k in range(files):
        texts = [english(rng, rng.randint(1, 300)) for _ in range(docs_per_file)]
        for j, special in enumerate(specials):
            texts.insert((7 * j + k) % len(texts), special)
        pq.write_table(fineweb_table(texts), root / f"part-{k:03d}.parquet", row_group_size=row_group)
    lines = [json.dumps({"text": english(rng, rng.randint(5, 80)), "int_score": 3}) for _ in range(25)]
    (root / "extra.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("\n".join(lines).encode() + b"\n"))
    return root


def prep(*args, capsys=None) -> tuple[int, str]:
    code = gpn_main(["prep", *map(str, args)])
    err = capsys.readouterr().err if capsys else ""
    return code, err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    assert gpn_main(["prep", "train-tokenizer", str(corpus), "--vocab-size", "400", "--out", str(path)]) == 0
    return path


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_split(path: Path, **kw) -> np.ndarray:
    """A split's windows in order, read through the project's opener: it registers Streaming's shared
    memory under the node's lock (a dataset opened without it can take the prefix another test's
    process is registering at the same moment) and gives it back afterwards."""
    from gpn_scale.storage.mds_datasets import reading

    with reading(local=str(path), batch_size=1, shuffle=False, **kw) as ds:
        return np.stack([ds[i]["tokens"] for i in range(len(ds))]) if len(ds) else np.empty((0, SEQ_LEN))


def expected_stream(corpus: Path, tokenizer: Path, val_fraction: float) -> dict[str, tuple[list[int], int]]:
    """Independently of prep's code paths: each unit (a parquet row group, or the jsonl file,
    in sorted file order) packs its kept documents' tokens + EOS per split and drops its tail.
    Returns, per split, the kept token stream and the dropped-tail total."""
    from tokenizers import Tokenizer

    from data_prep.unit import is_val

    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    units = []
    for path in sorted(corpus.iterdir(), key=lambda p: p.as_uri()):
        if path.suffix == ".parquet":
            f = pq.ParquetFile(path)
            units += [f.read_row_group(i, columns=["text"]).column("text").to_pylist() for i in range(f.num_row_groups)]
        else:
            raw = zstandard.ZstdDecompressor().decompress(path.read_bytes()).decode()
            units.append([json.loads(line)["text"] for line in raw.splitlines()])
    result = {s: ([], 0) for s in ("train", "val")}
    for texts in units:
        per_split = {"train": [], "val": []}
        for text in texts:
            if text:  # empty documents are skipped (and counted)
                split = "val" if is_val(text.encode(), val_fraction) else "train"
                per_split[split] += tok.encode(text, add_special_tokens=False).ids + [eos]
        for split, tokens in per_split.items():
            cut = len(tokens) // SEQ_LEN * SEQ_LEN
            stream, dropped = result[split]
            result[split] = (stream + tokens[:cut], dropped + len(tokens) - cut)
    return result
