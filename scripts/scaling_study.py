"""The CPU scaling study: a sweep with WSD decay branches on a corpus no point reads twice, then
its fits (docs/sweep.md, "A CPU study").

Stages, each kept and skipped when a rerun finds it done:
1. the corpus: the running Python's standard library source (`data_prep.embedded`), 16
   parquet files, the last one held out;
2. a byte-level BPE tokenizer of the spec's vocabulary, and MDS windows of its `seq_len`;
3. the check that the largest point's tokens fit in the training split once (no repetition);
4. `gpn-scale sweep SPEC --slots N` (resumes), then `gpn-scale sweep collect`.

    PYTHONPATH=. python scripts/scaling_study.py OUT --slots 2           # configs/sweeps/cpu_scaling.yaml
    PYTHONPATH=. python scripts/scaling_study.py OUT --spec SPEC --max-files 48   # a smaller corpus
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_prep.embedded import stdlib_documents, stdlib_fingerprint, write_documents  # noqa: E402

N_FILES = 16  # the last file is the held-out split


def log(msg: str) -> None:
    print(f"[scaling-study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_cli(*args: str, quiet: bool = False) -> None:
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "WANDB_MODE": "disabled",
           "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "gpn_scale", *args], env=env, text=True,
                            stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT)
    if result.returncode:
        if quiet:
            print(result.stdout[-4000:], file=sys.stderr)
        sys.exit(f"scaling_study: `gpn-scale {' '.join(args[:2])} ...` failed with exit status {result.returncode}")


def corpus(out: Path, max_files: int | None) -> list[Path]:
    """The standard library's source as parquet, written once; a rerun under another Python (a
    different library) is refused, as its points would not be comparable."""
    docs = stdlib_documents()
    docs = docs[:max_files] if max_files else docs
    fingerprint = stdlib_fingerprint(docs)
    record = out / "corpus" / "corpus.json"
    if record.exists():
        if json.loads(record.read_text())["fingerprint"] != fingerprint:
            sys.exit(f"scaling_study: {record}: written from another standard library (or --max-files); "
                     f"use a new OUT")
    else:
        log(f"corpus: {len(docs)} files of the standard library")
        write_documents(out / "corpus", docs, "python-stdlib", N_FILES, f"python-{sys.version.split()[0]}")
        record.write_text(json.dumps({"fingerprint": fingerprint, "documents": len(docs)}) + "\n")
    return sorted((out / "corpus").glob("python-stdlib-*.parquet"))


def prepare(out: Path, files: list[Path], vocab: int, seq_len: int) -> Path:
    tokenizer, data = out / "tokenizer.json", out / "data"
    if not tokenizer.exists():
        log(f"tokenizer: byte-level BPE, {vocab} tokens")
        run_cli("prep", "train-tokenizer", *map(str, files[:-1]), "--vocab-size", str(vocab), "--out",
                str(tokenizer), quiet=True)
    if not (data / "stats.json").exists():
        log(f"prep: windows of {seq_len}")
        run_cli("prep", *map(str, files), "--out", str(data), "--tokenizer", str(tokenizer), "--seq-len",
                str(seq_len), "--val-files", str(files[-1]), "--workers", "1", quiet=True)
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--spec", default=str(ROOT / "configs" / "sweeps" / "cpu_scaling.yaml"))
    ap.add_argument("--slots", type=int, default=2, help="points at once (a core each on the CPU)")
    ap.add_argument("--max-files", type=int, help="the first N library files only (a smoke run)")
    args = ap.parse_args()

    from gpn_scale.sweep.spec import load_spec, plan

    spec, _ = load_spec(args.spec)
    if spec.vocab_size is None:
        sys.exit(f"scaling_study: {args.spec}: vocab_size: the study trains its own tokenizer and needs the number")
    files = corpus(args.out, args.max_files)
    data = prepare(args.out, files, spec.vocab_size, spec.seq_len)
    train_tokens = json.loads((data / "stats.json").read_text())["splits"]["train"]["tokens"]
    most = max(p.tokens for p in plan(spec))
    if most > train_tokens:
        sys.exit(f"scaling_study: the largest point reads {most:,} tokens and the training split holds "
                 f"{train_tokens:,}: it would read text twice (fewer tokens_per_param or smaller params)")
    log(f"data: {train_tokens:,} training tokens; the largest point reads {most:,} ({most / train_tokens:.0%})")
    sweep = args.out / "sweep"
    run_cli("sweep", args.spec, f"data.train={data / 'train'}", f"data.val={data / 'val'}", "--out", str(sweep),
            "--slots", str(args.slots))
    run_cli("sweep", "collect", str(sweep))
    log(f"done: {sweep / 'results.csv'}, {sweep / 'fits.json'} and the plots beside them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
