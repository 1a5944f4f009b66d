"""`gpn-scale demo`: the main job end to end on the embedded corpus, on any machine.

1. write the corpus (CPython's bundled documentation topics) as FineWeb-Edu-schema parquet,
2. train a byte-level BPE tokenizer on it and prepare MDS shards (train, and the last file as val),
3. train a small GPN+M with DeepSpeed (configs/train/demo.yaml),
4. evaluate it on the held-out split against the corpus's unigram entropy (`gpn_scale.eval`),
5. analyse its states and memory on held-out windows (`gpn-scale analyze`'s report, linked) and
   write report.md / report.json and print where they are.

Every stage is resumable: running the demo again continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from gpn_scale.config import CONFIG_ROOT
from data_prep.helptext import HelpFormatter
from gpn_scale.storage.jsonl import read_jsonl
from data_prep.outputs import DEMO, check_resumable
from data_prep.errors import read_json

DEMO_CONFIG = CONFIG_ROOT / "train" / "demo.yaml"
ANALYSIS_WINDOWS = 32  # 4,096 states: the analysis and its ablations in seconds


def _stage(title: str) -> None:
    print(f"\n== {title}", flush=True)


def unigram_entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/demo", help="where everything goes (default: runs/demo)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the demo config's)")
    ap.add_argument("--vocab-size", type=int, default=2048, help="the BPE tokenizer's vocabulary size")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    ap.add_argument("--workers", type=int, default=2, help="data prep processes")
    args = ap.parse_args(argv)
    out = Path(args.out)
    check_resumable(out, "--out", "demo", (DEMO,))  # a rerun resumes every stage; nothing else is written into
    began = time.time()

    from data_prep.cli import main as prep
    from data_prep.embedded import write_embedded_corpus

    _stage("1/5 corpus: CPython's documentation topics as FineWeb-Edu-schema parquet")
    files = [str(p) for p in write_embedded_corpus(out / "corpus")]
    print(f"{len(files)} parquet files in {out / 'corpus'}")

    _stage(f"2/5 tokenizer (byte-level BPE, vocab {args.vocab_size}) and MDS shards (windows of {args.seq_len})")
    tokenizer = out / "tokenizer.json"
    if not tokenizer.is_file():
        prep(["train-tokenizer", *files, "--vocab-size", str(args.vocab_size), "--out", str(tokenizer)])
    data = out / "data"
    if not (data / "stats.json").is_file():
        prep([*files, "--out", str(data), "--tokenizer", str(tokenizer), "--seq-len", str(args.seq_len),
              "--val-files", files[-1], "--workers", str(args.workers)])
    else:
        print(f"already prepared: {data}")

    _stage("3/5 training a small GPN+M with DeepSpeed")
    from gpn_scale.storage.checkpoints import tags
    from gpn_scale.train.engine import main as train

    run_dir = out / "train"
    overrides = [f"run.dir={run_dir}", f"data.train={data / 'train'}", f"data.val={data / 'val'}",
                 f"model.vocab_size={args.vocab_size}"]
    if args.steps:
        overrides.append(f"train.total_steps={args.steps}")
    resume = "auto" if tags(run_dir / "checkpoints") else "none"
    status = train([str(DEMO_CONFIG), *overrides, "--resume", resume])
    if status != 0:
        return status

    _stage("4/5 evaluation on the held-out split")
    from gpn_scale.eval.prep_output import open_prep_output, read_windows
    from gpn_scale.eval.heldout import evaluate_windows
    from gpn_scale.storage.checkpoints import load_model

    model = load_model(run_dir)
    prepared = open_prep_output(data)  # its val split, stats.json, tokenizer copy and unigram counts
    windows = read_windows(prepared)
    held = evaluate_windows(model, windows)
    val_loss, val_tokens = held.loss, held.tokens
    entropy = unigram_entropy(np.load(data / "unigram.npy"))
    train_rows = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    print(f"held-out loss {val_loss:.4f} nats (PPL {math.exp(val_loss):.2f}) over {val_tokens:,} tokens; "
          f"unigram entropy of the training split {entropy:.4f} nats")

    _stage(f"5/5 analysis of the states and memory ({ANALYSIS_WINDOWS} held-out windows) and the report")
    from gpn_scale.eval.analyze import analyze
    from gpn_scale.eval.codec import Codec
    from gpn_scale.eval.report import write_report

    results, arrays = analyze(model, windows[:ANALYSIS_WINDOWS], Codec(prepared.tokenizer_path), prepared.unigram())
    analysis = write_report(results, arrays, out / "analysis", f"the demo model on `{data / 'val'}`")
    print(f"analysis: {analysis.resolve()}")
    report = {
        "model": model.config.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": read_json(data / "stats.json"),
        "train": {"steps": train_rows[-1]["step"], "tokens": train_rows[-1]["tokens"],
                  "first_loss": train_rows[0]["loss"], "final_loss": train_rows[-1]["loss"],
                  "median_tokens_per_s": float(np.median([m["tokens_per_s"] for m in train_rows]))},
        "heldout": {"loss": val_loss, "ppl": math.exp(val_loss), "tokens": val_tokens},
        "unigram_entropy": entropy,
        "analysis": {"report": str(analysis), **{k: results[k] for k in ("geometry", "memory", "ablations")}},
        "seconds": time.time() - began,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    t, h, abl = report["train"], report["heldout"], results["ablations"]
    (out / "report.md").write_text(f"""# gpn-scale demo report

A {model.config.family} model ({report['parameters']:,} parameters, d_state {model.config.d_state}) trained
with DeepSpeed for {t['steps']} steps ({t['tokens']:,} tokens) on CPython's documentation topics.

| | nats/token | PPL |
|---|---|---|
| unigram entropy of the training split (a model without context) | {entropy:.4f} | {math.exp(entropy):.1f} |
| training loss, first step | {t['first_loss']:.4f} | {math.exp(t['first_loss']):.1f} |
| training loss, last step | {t['final_loss']:.4f} | {math.exp(t['final_loss']):.1f} |
| **held-out loss** (all positions of {h['tokens']:,} tokens) | **{h['loss']:.4f}** | **{h['ppl']:.1f}** |

The model's states and memory, analysed as in the paper (geometry, the mean direction, horizons,
memory half-lives) with ablations on {ANALYSIS_WINDOWS} held-out windows: [analysis/report.md](analysis/report.md).
PPL on those windows: {abl['intact']['ppl']:.1f} intact, {abl['sbar_projected_out']['ppl']:.1f} with s-bar
projected out of the state, {abl['memory_reads_off']['ppl']:.1f} with the memory reads off.

Median training throughput: {t['median_tokens_per_s']:,.0f} tokens/s. Total time: {report['seconds']:.0f} s.

Files: data and its `stats.json` in `{data}`, the run (checkpoints, `metrics.jsonl`, `config.yaml`) in
`{run_dir}`.
""")
    print(f"report: {(out / 'report.md').resolve()} (and report.json)")
    return 0
