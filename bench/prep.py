"""Prep throughput: one worker against the bare tokenizer, and the speedup from 1 to 2 workers;
with --memory, a worker's peak memory against the size of one document.

    python bench/prep.py [--tokens 2e6] [--vocab-size 8192] [--repeat 3]
    python bench/prep.py --memory [--doc-mb 1 25 100]

Generates a FineWeb-Edu-schema corpus of about `--tokens` tokens (sentences of the embedded
pydoc corpus, sampled with a fixed seed), trains a byte-level BPE, then times on the same text:
the bare tokenizer (single-threaded `encode_batch_fast`, the call prep makes), and the full
`gpn-scale prep` (read parquet, check, tokenize, pack, write zstd MDS, merge) with 1 and 2 workers.
Each is run `--repeat` times, interleaved, and its fastest run kept: on a shared machine the
minimum is the measurement least disturbed by other load.

--memory prepares, in a forked process as prep's pool does, the work unit of a jsonl holding one
document of each `--doc-mb` size (the corpus's documents, back to back), with the byte-level BPE
and a sentencepiece BPE: read, check, tokenize, pack and write MDS, as a worker does. It reports
how far the worker's peak resident set (VmHWM, reset before the unit) rose over its resident set
before it, against the same on a 1 kB document, and that rise as a multiple of the document's size,
which must stay a small constant as documents grow (a tokenizer holds ~100 bytes per character of
the text it encodes at once, so encoding a document whole grows with it).
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
from data_prep import cli, embedded, run# noqa: E402,F401  (run imports streaming and torch: not timed)
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


def long_document(chars: int, seed: int = 0) -> str:
    """About `chars` characters of the corpus's sentences, with its paragraphs' newlines and spaces."""
    rng = random.Random(seed)
    texts = [text for _, text in embedded.documents()]
    parts, n = [], 0
    while n < chars:
        part = rng.choice(texts)
        parts.append(part)
        n += len(part) + 2
    return "\n\n".join(parts)[:chars]


def _status_kib(field: str) -> int:
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field)).split()[1])


def _measure_unit(out: Path, src: Path, tokenizer: Path, conn) -> None:
    """In a forked process, as a prep worker is: load the tokenizer, prepare the one unit of `src`;
    send back how far the peak resident set rose above the resident set before the unit."""
    from data_prep.sources import Filters, plan_units
    from data_prep.tokenizer import Tokenizer
    from data_prep.unit import Settings, prepare_unit

    settings = Settings(out=str(out), tokenizer_path=str(tokenizer), eos_token=None, bos_token=None,
                        filters=Filters(), seq_len=128, add_bos=False, val_fraction=0.0, val_files=frozenset(),
                        splits=("train",), compression="zstd", size_limit=1 << 26, skip_bad=False)
    tok = Tokenizer(settings.tokenizer_path)
    [unit], _ = plan_units([str(src)], settings.filters, skip_bad=False)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current RSS
    before = _status_kib("VmRSS:")
    stats = prepare_unit(0, unit, settings, tok, {})
    conn.send(((_status_kib("VmHWM:") - before) * 1024, stats["splits"]["train"]["tokens"]))


def worker_peak_growth(root: Path, tokenizer: Path, doc_chars: int) -> tuple[int, int]:
    """(bytes the peak resident set of a prep worker rises while it prepares a unit holding one
    document of `doc_chars` characters, tokens)."""
    import multiprocessing

    src = root / "doc.jsonl"
    src.write_text(json.dumps({"text": long_document(doc_chars)}) + "\n")
    ctx = multiprocessing.get_context("fork")  # a worker is forked, as prep's pool forks them
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_measure_unit, args=(root / f"out-{doc_chars}", src, tokenizer, send))
    worker.start()
    growth, tokens = receive.recv()
    worker.join()
    src.unlink()
    return growth, tokens


def memory(sizes_mb: list[float], vocab_size: int) -> None:
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = embedded.write_embedded_corpus(root / "pydoc")
        tokenizers = {"byte-level BPE": root / "tokenizer.json", "sentencepiece BPE": root / "sp.model"}
        cli.main(["train-tokenizer", *map(str, corpus), "--vocab-size", str(vocab_size),
                  "--out", str(tokenizers["byte-level BPE"])])
        (root / "sp.txt").write_text("\n".join(text for _, text in embedded.documents()))
        spm.SentencePieceTrainer.train(input=str(root / "sp.txt"), model_prefix=str(root / "sp"), model_type="bpe",
                                       vocab_size=min(vocab_size, 4000), minloglevel=2)
        print(f"\none prep worker (forked, as prep's pool does) preparing a unit of one document; rise of its peak "
              f"resident set (VmHWM) over its resident set before the unit; baseline: a 1 kB document")
        print(f"{'tokenizer':20} {'document MB':>12} {'tokens':>12} {'peak rise MiB':>14} {'over baseline':>14} "
              f"{'/ document size':>16}")
        for kind, tokenizer in tokenizers.items():
            base, tokens = worker_peak_growth(root, tokenizer, 1000)
            print(f"{kind:20} {0.001:>12.3f} {tokens:>12,} {base / 2**20:>14,.1f} {0:>14,.1f} {'':>16}", flush=True)
            for mb in sizes_mb:
                chars = int(mb * 1e6)
                growth, tokens = worker_peak_growth(root, tokenizer, chars)
                over = max(growth - base, 0)
                print(f"{kind:20} {mb:>12.3f} {tokens:>12,} {growth / 2**20:>14,.1f} {over / 2**20:>14,.1f} "
                      f"{over / chars:>15.1f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=2e6)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--memory", action="store_true", help="a worker's peak memory by document size instead")
    p.add_argument("--doc-mb", type=float, nargs="+", default=[1, 25, 100], help="document sizes for --memory")
    a = p.parse_args()
    if a.memory:
        memory(a.doc_mb, a.vocab_size)
        return
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
