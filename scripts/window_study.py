"""Choosing the window: what short windows with the state carried cost in quality.

Trains the same GPN+M at equal tokens and equal tokens per step, on full windows of W from the
empty state and on carried windows of W/2, W/4, ... (the batch of streams scaled up to match),
several seeds each, then scores every run on held-out text:

- the held-out loss from the empty state (every held-out window of W alone) and with the state
  carried across the held-out streams (the mean over positions 1..8W);
- the loss by position out to 8W, state carried (log-spaced bins);
- recall by distance: a key's value stated d tokens before a query for it, d from W/4 to 8W,
  scored as the share of queries whose value is the model's top prediction.

The corpus is the running Python's standard library source (`data_prep.embedded`), with
key-value facts written into every file: a line `# key = V` and then lines `# recall key = V`
at log-uniform gaps of 8 to 2W tokens (`--fact-gap-max`), V one of 16 words, a new key after one
to four recalls. Every stage keeps its output and a rerun goes on where the last one stopped.

    PYTHONPATH=. python scripts/window_study.py OUT --controls 256,64,32  # docs/train.md's (~65 min; 40 without)
    PYTHONPATH=. python scripts/window_study.py OUT --window 32 --fractions 1,4 --seeds 0 --steps 3 \
        --tokens-per-step 64 --model gpn_m_tiny --vocab 512 --max-files 48 --heldout-streams 2  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_prep.embedded import stdlib_documents, stdlib_fingerprint, write_documents  # noqa: E402

VALUES = ("alfa", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett", "kilo",
          "lima", "mike", "november", "oscar", "papa")
SET_LINE = "# key = {}"
QUERY_PREFIX = "# recall key ="
# Facts' gaps are placed by characters, before there is a tokenizer: the study's 4,096-token BPE reads
# 3.47 characters a token on Python 3.11's library with its facts.
CHARS_PER_TOKEN = 3.5
LEAD = 32  # held-out tokens before a recall prompt's key, so the key is not the first thing read
N_FILES = 16  # the last file is the held-out split (36 of the 577 files)
RECALL_TRIALS = 64


@dataclass(frozen=True)
class Arm:
    """One configuration of the study: windows of `window`, the state carried across them or each
    window from the empty state (shuffled windows)."""

    window: int
    carried: bool

    @property
    def label(self) -> str:
        return f"{self.window} ({'carried' if self.carried else 'shuffled, empty state'})"


@dataclass(frozen=True)
class Study:
    out: Path
    window: int  # W, the full window
    fractions: tuple[int, ...]  # carried windows of W / f (1: full windows from the empty state)
    seeds: tuple[int, ...]
    steps: int
    tokens_per_step: int
    model: str
    vocab: int
    lr: float
    warmup: int
    threads: int
    max_files: int | None  # this many of the library's files, evenly spaced over it (smoke runs)
    heldout_streams: int
    fact_gap_max: int | None  # the facts' longest gap in tokens (default 2W)
    controls: tuple[int, ...]  # carried windows also trained as shuffled windows from the empty state, same B

    def fact_gaps(self) -> tuple[int, int]:
        return (8, self.fact_gap_max or 2 * self.window)

    def windows(self) -> list[int]:
        return [self.window // f for f in self.fractions]

    def arms(self) -> list[Arm]:
        """The full window from the empty state, each shorter window carried, then the controls."""
        return [Arm(w, w < self.window) for w in self.windows()] + [Arm(w, False) for w in self.controls]

    def streams(self, w: int) -> int:
        return self.tokens_per_step // w

    def name(self, arm: Arm, seed: int) -> str:
        shuffled_short = not arm.carried and arm.window < self.window
        return f"w{arm.window}{'_shuffled' if shuffled_short else ''}_s{seed}"


def log(msg: str) -> None:
    print(f"[window-study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the corpus -------------------------------------------------------------------------------


def with_facts(text: str, rng: random.Random, gaps: tuple[int, int]) -> str:
    """`text` with a fact's lines inserted at line starts: a key set, then recalls of it at gaps
    drawn log-uniformly from gaps[0] to gaps[1] tokens (placed by characters), then a new key."""
    lines = text.split("\n")
    out, since, gap, value, recalls = [], 0, 0.0, None, 0
    for line in lines:
        if value is None or since >= gap:
            if value is None or recalls == 0:
                value, recalls = rng.choice(VALUES), rng.randint(1, 4)
                out.append(SET_LINE.format(value))
            else:
                out.append(f"{QUERY_PREFIX} {value}")
                recalls -= 1
                if recalls == 0:
                    value = None
            since = 0
            gap = math.exp(rng.uniform(math.log(gaps[0]), math.log(gaps[1]))) * CHARS_PER_TOKEN
        out.append(line)
        since += len(line) + 1
    return "\n".join(out)


def write_corpus(study: Study) -> list[Path]:
    corpus = study.out / "corpus"
    done = corpus / "corpus.json"
    if done.exists():
        return sorted(corpus.glob("*.parquet"))
    docs = stdlib_documents()
    if study.max_files and study.max_files < len(docs):
        docs = docs[:: math.ceil(len(docs) / study.max_files)]
    rng = random.Random(0)
    docs_with_facts = [(url, path, with_facts(text, rng, study.fact_gaps())) for url, path, text in docs]
    paths = write_documents(corpus, docs_with_facts, "python-stdlib", N_FILES, dump="python-stdlib")
    chars = sum(len(t) for *_, t in docs_with_facts)
    done.write_text(json.dumps({"fingerprint": stdlib_fingerprint(docs), "documents": len(docs), "chars": chars,
                                "fact_gaps_tokens": study.fact_gaps()}, indent=1))
    log(f"corpus: {len(docs)} files of the standard library, {chars / 1e6:.1f}M characters with facts")
    return paths


# ---- stages through the CLI ---------------------------------------------------------------------


def run_cli(*args: str, threads: int, quiet: bool = False) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "WANDB_MODE": "disabled",
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "gpn_scale", *args]
    result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT,
                            text=True)
    if result.returncode:
        if quiet:
            print(result.stdout[-4000:], file=sys.stderr)
        sys.exit(f"window_study: `gpn-scale {' '.join(args[:2])} ...` failed with exit code {result.returncode}")


def prepare(study: Study, files: list[Path]) -> None:
    tokenizer = study.out / "tokenizer.json"
    if not tokenizer.exists():
        log(f"tokenizer: byte-level BPE, {study.vocab} tokens")
        run_cli("prep", "train-tokenizer", *map(str, files[:-1]), "--vocab-size", str(study.vocab), "--out",
                  str(tokenizer), threads=study.threads, quiet=True)
    for w in study.windows():
        out = study.out / "data" / f"w{w}"
        if (out / "stats.json").exists():
            continue
        log(f"prep: windows of {w}, {study.streams(w)} streams")
        run_cli("prep", *map(str, files), "--out", str(out), "--tokenizer", str(tokenizer), "--seq-len", str(w),
                  "--val-files", str(files[-1]), "--workers", "1", "--streams", str(study.streams(w)),
                  "--val-streams", str(study.heldout_streams), threads=study.threads, quiet=True)


def train(study: Study, arm: Arm, seed: int) -> Path:
    run = study.out / "runs" / study.name(arm, seed)
    status = run / "status.json"
    if status.exists() and json.loads(status.read_text())["status"] == "finished":
        return run
    w, carried = arm.window, arm.carried
    data = study.out / "data" / f"w{w}"
    overrides = [
        f"model={study.model}", f"model.vocab_size={study.vocab}", f"run.dir={run}",
        f"data.train={data / 'streams' / 'train' if carried else data / 'train'}", f"data.val={data / 'val'}",
        f"train.micro_batch={study.streams(w)}", "train.grad_accum=1", f"train.total_steps={study.steps}",
        f"train.save_every={max(1, study.steps // 2)}", f"train.warmup_steps={study.warmup}", f"train.lr={study.lr}",
        "eval.every=0", "eval.batches=1", f"seed={seed}", *(["train.carry_state=true"] if carried else []),
    ]
    resume = "auto" if (run / "checkpoints").exists() else "none"
    run_cli("train", "demo", *overrides, "--resume", resume, threads=study.threads, quiet=True)
    return run


# ---- scoring --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecallItem:
    distance: int  # tokens from the set line's value to the query's value
    prompt: list[int]  # ends with the query's prefix
    answer: list[int]  # the value's tokens as they follow the prefix


def value_tokens(encode, prefix: str, value: str) -> tuple[list[int], list[int]]:
    """(prefix tokens, value tokens): the line's tokens split where the prefix's end, the value's
    tokens as they follow the prefix in running text."""
    whole, head = encode(f"\n{prefix} {value}\n"), encode(f"\n{prefix}")
    if whole[: len(head)] != head:
        raise SystemExit(f"window_study: the tokenizer merges {prefix!r} with its value; choose other fact words")
    tail = encode("\n")
    answer = whole[len(head) :]
    if answer[-len(tail) :] == tail:
        answer = answer[: -len(tail)]
    return head, answer


def recall_items(encode, filler: np.ndarray, distances: list[int], trials: int, seed: int = 0) -> list[RecallItem]:
    """`trials` prompts per distance: held-out text, a key set, held-out text for the distance,
    the query's prefix; the same for every model (seeded)."""
    rng = random.Random(seed)
    items = []
    for d in distances:
        for _ in range(trials):
            value = rng.choice(VALUES)
            set_head, set_value = value_tokens(encode, SET_LINE.format("").rstrip(), value)
            query_head, answer = value_tokens(encode, QUERY_PREFIX, value)
            between = d - len(set_value) - len(query_head)  # filler between the set line's value and the query
            if between < 1:
                raise SystemExit(f"window_study: distance {d} is shorter than the value and the query "
                                 f"({len(set_value) + len(query_head)} tokens): use a longer --window")
            start = rng.randrange(0, len(filler) - LEAD - between)
            gap = filler[start + LEAD : start + LEAD + between]
            prompt = [*filler[start : start + LEAD], *set_head, *set_value, *gap, *query_head]
            items.append(RecallItem(d, [int(t) for t in prompt], answer))
    return items


def score_recall(model, items: list[RecallItem], chunk: int, batch: int = 16) -> list[dict]:
    import torch

    from gpn_scale.eval.heldout import model_device

    model.eval()
    by_distance: dict[int, list[tuple[bool, float]]] = {}
    with torch.no_grad():
        groups: dict[tuple[int, int, int], list[RecallItem]] = {}
        for item in items:
            groups.setdefault((item.distance, len(item.prompt), len(item.answer)), []).append(item)
        for (d, _, _), group in groups.items():
            for b in range(0, len(group), batch):
                rows = group[b : b + batch]
                prompt = torch.tensor([r.prompt for r in rows], device=model_device(model))
                answer = torch.tensor([r.answer for r in rows], device=model_device(model))
                state = None
                for t0 in range(0, prompt.shape[1], chunk):
                    state = model(prompt[:, t0 : t0 + chunk], state=state).state
                logits = model(answer, state=state, return_logits=True).logits.float()
                correct = (logits.argmax(-1) == answer).all(-1)
                logp = torch.log_softmax(logits, -1).gather(2, answer[..., None])[..., 0].sum(-1)
                by_distance.setdefault(d, []).extend(zip(correct.tolist(), logp.tolist()))
    return [{"distance": d, "trials": len(r), "accuracy": sum(c for c, _ in r) / len(r),
             "mean_value_logprob": sum(lp for _, lp in r) / len(r)} for d, r in sorted(by_distance.items())]


def recall_distances(window: int) -> list[int]:
    out, d = [], window // 4
    while d <= 8 * window:
        out.append(d)
        d *= 2
    return out


def without_facts(text: str) -> str:
    """`text` with the fact lines `with_facts` inserted taken out again (the library's file as it was)."""
    return "\n".join(line for line in text.split("\n")
                     if not (line.startswith(SET_LINE.format("")) or line.startswith(QUERY_PREFIX)))


def held_out_filler(corpus: Path, encode) -> list[int]:
    """The held-out file's tokens without the corpus's facts, end to end: a recall prompt's only key
    is the one it places."""
    import pyarrow.parquet as pq

    held_out = sorted(corpus.glob("*.parquet"))[-1]
    return [t for text in pq.read_table(held_out, columns=["text"]).column("text").to_pylist()
            for t in encode(without_facts(text) + "\n")]


def score(study: Study, arm: Arm, seed: int, run: Path) -> dict:
    path = study.out / "scores" / f"{study.name(arm, seed)}.json"
    if path.exists():
        return json.loads(path.read_text())
    import torch

    from gpn_scale.eval.prep_output import open_prep_output, open_streams, read_windows
    from gpn_scale.eval.heldout import evaluate_windows
    from gpn_scale.eval.long_context import PositionBins, carried_losses, stream_tokens
    from data_prep.document_streams import StreamLayout
    from data_prep.tokenizer import Tokenizer
    from gpn_scale.storage.checkpoints import load_model

    torch.set_num_threads(study.threads)
    model = load_model(run)
    full = study.out / "data" / f"w{study.window}"
    windows = read_windows(open_prep_output(full))  # every held-out window of W, from the empty state
    empty = evaluate_windows(model, windows, batch=16)
    streams = open_streams(full)
    layout = StreamLayout.read(streams.split_dir)
    context = 8 * study.window
    tokens = stream_tokens(streams.split_dir, layout, context, None)
    curve = carried_losses(model, tokens, study.window, batch=16)
    tokenizer = Tokenizer(str(study.out / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return tokenizer.encode([text])[0].tolist()

    filler = held_out_filler(study.out / "corpus", encode)
    items = recall_items(encode, filler, recall_distances(study.window), RECALL_TRIALS)
    result = {
        "run": study.name(arm, seed), "arm": arm.label, "window": arm.window, "carried": arm.carried, "seed": seed,
        "streams": study.streams(arm.window),
        "heldout_empty": empty.loss, "heldout_windows": len(windows),
        "heldout_carried": float(curve.mean()), "context": context, "context_streams": len(tokens),
        "bins": PositionBins.of(curve).to_json(),
        "recall": score_recall(model, items, study.window),
        "train_step_s": sum(json.loads(line).get("step_time_s", 0.0)
                            for line in (run / "metrics.jsonl").read_text().splitlines()),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


# ---- the report --------------------------------------------------------------------------------


def by_arm(results: list[dict]) -> dict[str, list[dict]]:
    """Each arm's runs (its seeds), in the study's order."""
    out: dict[str, list[dict]] = {}
    for r in results:
        out.setdefault(r["arm"], []).append(r)
    return out


def summarize(study: Study, results: list[dict]) -> str:
    arms = by_arm(results)

    def spread(values: list[float]) -> str:
        mean = sum(values) / len(values)
        half = (max(values) - min(values)) / 2
        return f"{mean:.3f} ± {half:.3f}" if len(values) > 1 else f"{mean:.3f}"

    full = arms[Arm(study.window, False).label]
    base_empty = sum(r["heldout_empty"] for r in full) / len(full)
    base_carried = sum(r["heldout_carried"] for r in full) / len(full)
    lines = [f"Windows of W = {study.window} and shorter, {study.tokens_per_step} tokens per step, {study.steps} steps "
             f"({study.steps * study.tokens_per_step / 1e6:.2f}M tokens per run), seeds {list(study.seeds)}, "
             f"model {study.model} (vocabulary {study.vocab}). Mean ± half the range over the seeds; loss in nats.",
             "",
             "| window | streams (B) | held-out, from the empty state | vs full | held-out, state carried | vs full |",
             "|---|---|---|---|---|---|"]
    for label, rs in arms.items():
        e = [r["heldout_empty"] for r in rs]
        c = [r["heldout_carried"] for r in rs]
        lines.append(f"| {label} | {rs[0]['streams']} | {spread(e)} | {sum(e) / len(e) - base_empty:+.3f} | "
                     f"{spread(c)} | {sum(c) / len(c) - base_carried:+.3f} |")
    bins = full[0]["bins"]
    lines += ["", "Loss by position, state carried across held-out streams (mean over seeds):", "",
              "| window | " + " | ".join(f"{b['positions'][0]}-{b['positions'][1]}" for b in bins) + " |",
              "|---|" + "---|" * len(bins)]
    for label, rs in arms.items():
        cells = [sum(r["bins"][i]["loss"] for r in rs) / len(rs) for i in range(len(bins))]
        lines.append(f"| {label} | " + " | ".join(f"{x:.3f}" for x in cells) + " |")
    dists = [x["distance"] for x in full[0]["recall"]]
    lines += ["", f"Recall accuracy by distance (chance {1 / len(VALUES):.3f}: one of {len(VALUES)} values; "
              f"{RECALL_TRIALS} queries per distance and seed):", "",
              "| window | " + " | ".join(str(d) for d in dists) + " |", "|---|" + "---|" * len(dists)]
    for label, rs in arms.items():
        cells = [sum(r["recall"][i]["accuracy"] for r in rs) / len(rs) for i in range(len(dists))]
        lines.append(f"| {label} | " + " | ".join(f"{x:.2f}" for x in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(study: Study, results: list[dict], path: Path) -> None:
    """Loss by position, the same less the full window's, and recall by distance, each arm's mean."""
    from gpn_scale.eval.report import _pyplot, _save

    plt = _pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.2))
    arms = by_arm(results)
    full = arms[Arm(study.window, False).label]

    def mean_bins(rs: list[dict]) -> np.ndarray:
        return np.mean([[b["loss"] for b in r["bins"]] for r in rs], axis=0)

    for label, rs in arms.items():
        style = "o-" if rs[0]["carried"] or rs[0]["window"] == study.window else "s--"
        centres = [math.sqrt(b["positions"][0] * b["positions"][1]) for b in rs[0]["bins"]]
        left.plot(centres, mean_bins(rs), style, label=label)
        middle.plot(centres, mean_bins(rs) - mean_bins(full), style, label=label)
        dists = [row["distance"] for row in rs[0]["recall"]]
        right.plot(dists, np.mean([[row["accuracy"] for row in r["recall"]] for r in rs], axis=0), style, label=label)
    for ax in (left, middle):
        ax.axvline(study.window, color="gray", ls=":", lw=1)
    right.axhline(1 / len(VALUES), color="gray", ls=":", lw=1, label="chance")
    left.set(xscale="log", xlabel="position in the held-out stream (tokens, log)", ylabel="loss (nats)",
             title="Loss by position, state carried")
    middle.set(xscale="log", xlabel="position in the held-out stream (tokens, log)", ylabel="loss - full window's",
               title=f"Less the full window's ({study.window}, shuffled)")
    right.set(xscale="log", xlabel="distance from the key's value (tokens, log)", ylabel="accuracy",
              title="Recall by distance")
    context = results[0]["context"]
    position_ticks = [4**k for k in range(int(math.log(context, 4)) + 1)]
    for ax, ticks in ((left, position_ticks), (middle, position_ticks), (right, recall_distances(study.window))):
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])  # powers of 4 and the distances: labels that do not crowd
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


# The settings every output of a study depends on: a rerun may add seeds, windows and controls (new
# arms), or change the threads, but not these.
SHAPING = ("window", "steps", "tokens_per_step", "model", "vocab", "lr", "warmup", "max_files", "heldout_streams",
           "fact_gap_max")


def refuse(message: str) -> None:
    print(f"window_study: {message}", file=sys.stderr)
    sys.exit(2)


def int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        refuse(f"{flag}: expected comma-separated whole numbers, got {text!r}")
    if any(v < (0 if flag == "--seeds" else 1) for v in values):
        refuse(f"{flag}: expected {'non-negative' if flag == '--seeds' else 'positive'} numbers, got {text!r}")
    return values


def check(study: Study) -> None:
    """One line for settings the study cannot run, before anything is written."""
    for flag, value, least in (("--window", study.window, 1), ("--steps", study.steps, 1),
                               ("--tokens-per-step", study.tokens_per_step, 1), ("--heldout-streams",
                               study.heldout_streams, 1), ("--fact-gap-max", study.fact_gap_max or 8, 8)):
        if value < least:
            refuse(f"{flag}: expected at least {least}, got {value}")
    if not study.seeds:
        refuse("--seeds: expected at least one seed")
    for f in study.fractions:
        if study.window % f or study.tokens_per_step % (study.window // f):
            refuse(f"--fractions: W / {f} must be a whole window that divides --tokens-per-step")
    if 1 not in study.fractions:
        refuse("--fractions: 1 (the full window) is the baseline and must be in the list")
    if set(study.controls) - set(study.windows()[1:]):
        refuse(f"--controls: each must be one of the carried windows {study.windows()[1:]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the study's directory (a rerun resumes it)")
    p.add_argument("--window", type=int, default=512, help="W, the full window")
    p.add_argument("--fractions", default="1,2,4,8,16", help="windows of W / f; 1 is the full window")
    p.add_argument("--seeds", default="0,1", help="seeds of every window's runs")
    p.add_argument("--steps", type=int, default=256, help="optimiser steps per run")
    p.add_argument("--tokens-per-step", type=int, default=4096, help="tokens per optimiser step, every run")
    p.add_argument("--model", default="gpn_m_demo", help="a configs/models name")
    p.add_argument("--vocab", type=int, default=4096, help="the BPE tokenizer's vocabulary")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, every run")
    p.add_argument("--warmup", type=int, default=25, help="warm-up steps, every run")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each stage")
    p.add_argument("--max-files", type=int, help="use this many of the library's files, evenly spaced (smoke runs)")
    p.add_argument("--heldout-streams", type=int, default=8, help="held-out streams (each at least 8 W tokens)")
    p.add_argument("--fact-gap-max", type=int, help="the facts' longest gap between a key and its recalls, in "
                   "tokens (default 2 W; the shortest is 8)")
    p.add_argument("--controls", default="", help="carried windows to train also as shuffled windows from the "
                   "empty state at the same batch (comma-separated): what carrying the state changes, window and B "
                   "held")
    a = p.parse_args(argv)
    study = Study(a.out.resolve(), a.window, int_list("--fractions", a.fractions), int_list("--seeds", a.seeds),
                  a.steps, a.tokens_per_step, a.model, a.vocab, a.lr, a.warmup, a.threads, a.max_files,
                  a.heldout_streams, a.fact_gap_max, int_list("--controls", a.controls))
    check(study)
    study.out.mkdir(parents=True, exist_ok=True)
    record = study.out / "study.json"
    settings = {**asdict(study), "out": str(study.out)}
    if record.exists():
        before = json.loads(record.read_text())
        changed = [k for k in SHAPING if before.get(k) != settings[k]]
        if changed:
            refuse(f"{record}: this study ran with {changed[0]}={before.get(changed[0])!r}, not "
                   f"{settings[changed[0]]!r}; its outputs would mix: use another OUT")
    record.write_text(json.dumps(settings, indent=1))
    started = time.time()
    prepare(study, write_corpus(study))
    plan = [(arm, s) for arm in study.arms() for s in study.seeds]
    results, spent = [], []
    for i, (arm, seed) in enumerate(plan):
        t0 = time.time()
        log(f"run {i + 1}/{len(plan)}: window {arm.label}, {study.streams(arm.window)} in each batch, seed {seed}"
            + (f" (ETA {np.mean(spent) * (len(plan) - i) / 60:.0f} min)" if spent else ""))
        run = train(study, arm, seed)
        results.append(score(study, arm, seed, run))
        spent.append(time.time() - t0)
    report = summarize(study, results)
    (study.out / "report.md").write_text(report)
    (study.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(study, results, study.out / "window_study.png")
    print(report)
    log(f"done in {(time.time() - started) / 60:.1f} min: {study.out / 'report.md'}, {study.out / 'window_study.png'}")


if __name__ == "__main__":
    main()
