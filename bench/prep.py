"""Prep throughput: one worker against the bare tokenizer, and the speedup from 1 to 2 workers.

    python bench/prep.py [--tokens 2e6] [--vocab-size 8192] [--repeat 3]

Generates a FineWeb-Edu-schema corpus of about `--tokens` tokens (sentences of the embedded
pydoc corpus, sampled with a fixed seed), trains a byte-level BPE, then times on the same text:
the bare tokenizer (single-threaded `encode_batch_fast`, the call prep makes), and the full
`gpn-scale prep` (read parquet, check, tokenize, pack, write zstd MDS, merge) with 1 and 2 workers.
Each is run `--repeat` times, interleaved, and its fastest run kept: on a shared machine the
minimum is the measurement least disturbed by other load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the baseline is one thread, like one prep worker

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from data_prep import cli, embedded, run  # noqa: E402,F401  (run imports streaming and torch: not timed)
from data_prep.sources import BATCH  # noqa: E402

FILES, ROW_GROUPS = 8, 4
CHARS_PER_TOKEN = 4.2  # of this BPE on this text, to size the corpus


def write_corpus(root: Path, tokens: float) -> list[str]:
    rng = random.Random(0)
    sentences = [s for _, text in embedded.documents() for s in re.split(r"(?<=[.!?])\s+", text) if len(s) > 20]
    texts, chars = [], 0
    while chars < tokens * CHARS_PER_TOKEN:
        text = " ".join(rng.choice(sentences) for _ in range(int(rng.lognormvariate(3, 1)) + 1))
        texts.append(text)
        chars += len(text)
    per_file = -(-len(texts) // FILES)
    for k in range(FILES):
        part = texts[k * per_file:(k + 1) * per_file]
        table = embedded.pa.table({"text": part, **{n: [None] * len(part) for n in embedded.SCHEMA.names[1:]}},
                                  schema=embedded.SCHEMA)
        pq.write_table(table, root / f"bench-{k:02d}.parquet", row_group_size=-(-len(part) // ROW_GROUPS))
    return texts


def bare_tokenizer(tokenizer: Path, texts: list[str]) -> tuple[int, float]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    started = time.perf_counter()
    tokens = sum(len(e.ids) for lo in range(0, len(texts), BATCH)
                 for e in tok.encode_batch_fast(texts[lo:lo + BATCH], add_special_tokens=False))
    return tokens, time.perf_counter() - started


def prep(corpus: Path, tokenizer: Path, out: Path, workers: int) -> tuple[int, float]:
    started = time.perf_counter()
    code = cli.main([str(corpus), "--out", str(out), "--tokenizer", str(tokenizer), "--seq-len", "2048",
                     "--workers", str(workers)])
    elapsed = time.perf_counter() - started
    assert code == 0
    stats = json.loads((out / "stats.json").read_text())
    return sum(s["tokens"] for s in stats["splits"].values()), elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=2e6)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "corpus").mkdir()
        texts = write_corpus(root / "corpus", a.tokens)
        tokenizer = root / "tokenizer.json"
        cli.main(["train-tokenizer", *map(str, embedded.write_embedded_corpus(root / "pydoc")),
                  "--vocab-size", str(a.vocab_size), "--out", str(tokenizer)])
        timings: dict[str, list[tuple[int, float]]] = {"bare": [], 1: [], 2: []}
        for i in range(a.repeat):
            timings["bare"].append(bare_tokenizer(tokenizer, texts))
            for w in (1, 2):
                timings[w].append(prep(root / "corpus", tokenizer, root / f"out{w}-{i}", w))
        bare_tokens, bare_s = min(timings["bare"], key=lambda t: t[1])
        runs = {w: min(timings[w], key=lambda t: t[1]) for w in (1, 2)}

    bare = bare_tokens / bare_s
    print(f"\ncorpus: {len(texts):,} documents, {bare_tokens:,} tokens; {os.cpu_count()} cores; "
          f"best of {a.repeat}; prep times include reading, packing, zstd MDS writing and the merge")
    print(f"{'':34} {'tokens':>12} {'seconds':>8} {'tokens/s':>12} {'per worker':>12} {'vs bare':>8} {'speedup':>8}")
    print(f"{'bare tokenizer, 1 thread':34} {bare_tokens:>12,} {bare_s:>8.2f} {bare:>12,.0f} {bare:>12,.0f} "
          f"{1:>8.2f} {'':>8}")
    for w, (tokens, s) in runs.items():
        rate = tokens / s
        print(f"{f'prep, {w} worker' + ('s' if w > 1 else ''):34} {tokens:>12,} {s:>8.2f} {rate:>12,.0f} "
              f"{rate / w:>12,.0f} {rate / w / bare:>8.2f} {runs[1][1] / s:>8.2f}")


if __name__ == "__main__":
    main()
