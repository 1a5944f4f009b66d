"""Generation: tokens/s and memory of GPN+M's decode step against Transformer++'s KV cache, after
prompts of 16, 256, 1K, 4K and 16K tokens, on the CPU.

    PYTHONPATH=. python bench/generate.py                     # the demo models, ~2 min on one thread
    PYTHONPATH=. python bench/generate.py --baselines         # also the generation before the decode step and the HF export's
    PYTHONPATH=. python bench/generate.py --gpn gpn_m_130m_1l --transformer transformer_130m --lengths 256,1024

Both models decode through the same engine (gpn_scale/models/decode.py): the prompt through the
forward once, then one decode step per token, greedy. GPN+M carries a fixed-size state; Transformer++
a KV cache, filled in place, that holds every position. Per prompt length, each model runs in a
fresh process (one model's allocations cannot hide or inflate the other's), and the two take turns:
one timed round of `--tokens` decode steps each per round, every round from the state the prompt
left, so that a slow spell of a shared machine slows both alike. Time per token: the fastest round.

Memory: `state` is the decode state's bytes after the prompt (GPN+M: its vectors and memory M;
Transformer++: the cache's filled positions); `peak` is that plus what decoding adds at its peak:
the process's resident high-water mark while it decodes above its resident set after the prompt
(the mark reset there, the heap's free pages given back with malloc_trim before it). The prompt's
forward leaves a few MB of allocator residue at any length (not the generation's), which this leaves
out; the processes' resident sets before and after the prompt are in the JSON (`--out`).

`--baselines` adds, after a prompt of `--baseline-length`, the generation that came before the decode step
(two forwards per token: one on a placeholder for the distribution, one to advance the state) and
the Hugging Face export's `generate` (`gpn-scale export --to hf`, greedy, its recurrent cache), both
on the GPN+M model, in turns with it. HF's `generate` runs the prompt inside each call: its time per
token is (time for `--tokens` new tokens - time for 1) / (`--tokens` - 1), each the fastest round.

Imports torch and the model package (and, with --baselines, transformers and the export).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpn_scale.config import model_config
from gpn_scale.models import build_model
from gpn_scale.models.decode import PLACEHOLDER, decoder

LENGTHS = "16,256,1024,4096,16384"  # 16: where the two start, for the crossing


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def _reset_hwm() -> None:
    """The resident set's high-water mark back to the current resident set (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _return_free_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def state_bytes(ds) -> int:
    """A decode state's tensors (a KV cache: its filled positions only)."""
    if hasattr(ds, "keys") and hasattr(ds, "length"):
        return sum(x[:, :, : ds.length].nbytes for x in (*ds.keys, *ds.values))
    return sum(x.nbytes for x in torch.utils._pytree.tree_leaves(ds) if isinstance(x, torch.Tensor))


# ---- workers: one model, one prompt length, driven over stdin/stdout ---------------------------


class Greedy:
    """Decode steps from the state the prompt left, greedy."""

    def __init__(self, model, prompt, new_tokens: int):
        self.dec = decoder(model, new_tokens=new_tokens)  # a KV cache with room for a round's tokens
        self.start = self.dec.prefill(prompt)

    def run(self, n: int) -> None:
        logits, ds = self.start
        for _ in range(n):
            logits, ds = self.dec.step(ds, logits.argmax(-1))


class TwoForwards:
    """The generation before the decode step: per token, the forward on a placeholder for the
    distribution, then the forward on the token chosen to advance the state."""

    def __init__(self, model, prompt, new_tokens: int):
        self.model = model
        with torch.no_grad():
            self.state = model(prompt).state

    @torch.no_grad()
    def run(self, n: int) -> None:
        state, placeholder = self.state, torch.full((1, 1), PLACEHOLDER, dtype=torch.long)
        for _ in range(n):
            token = self.model(placeholder, state=state, return_logits=True).logits[0, -1].argmax()
            state = self.model(token.view(1, 1), state=state).state


class HFGenerate:
    """The HF export's `generate`, greedy, exactly n new tokens."""

    def __init__(self, model, prompt, new_tokens: int):
        from transformers import AutoModelForCausalLM

        from data_prep.tokenizer import train_bpe
        from gpn_scale.export import export
        from gpn_scale.storage.native import save_native

        self.tmp = tempfile.TemporaryDirectory()
        root = Path(self.tmp.name)
        save_native(model, root / "native")
        train_bpe(["a small text to give the export a tokenizer"] * 4, 280, str(root / "tok.json"))
        export(root / "native", "hf", root / "hf", str(root / "tok.json"))
        self.model = AutoModelForCausalLM.from_pretrained(root / "hf", trust_remote_code=True).eval()
        self.prompt = prompt

    @torch.no_grad()
    def run(self, n: int) -> None:
        out = self.model.generate(self.prompt, attention_mask=torch.ones_like(self.prompt), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == self.prompt.shape[1] + n


KINDS = {"decode": Greedy, "two_forwards": TwoForwards, "hf_generate": HFGenerate}


def run_worker(args) -> None:
    torch.manual_seed(0)
    model = build_model(model_config(args.config)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, args.length))
    kind = KINDS[args.worker]
    kind(model, prompt[:, :8], 8).run(8)  # kernels loaded, first-call allocations made: not the prompt's memory
    _return_free_heap()
    before = _rss_bytes()
    t0 = time.perf_counter()
    runner = kind(model, prompt, args.tokens)
    prefill_s = time.perf_counter() - t0
    _return_free_heap()
    after = _rss_bytes()
    _reset_hwm()
    state = state_bytes(runner.start[1]) if isinstance(runner, Greedy) else 0
    print(json.dumps(dict(prefill_s=prefill_s, state_bytes=state, rss_before_prompt=before, rss_after_prompt=after)),
          flush=True)
    for line in sys.stdin:
        n = int(line)
        t0 = time.perf_counter()
        runner.run(n)
        print(json.dumps(dict(n=n, s=time.perf_counter() - t0, peak_bytes=state + max(0, _hwm_bytes() - after))), flush=True)


class Worker:
    def __init__(self, name: str, config: str, kind: str, length: int, threads: int, tokens: int):
        self.name, self.length, self.times, self.peak, self.error = name, length, {}, 0, None
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, "--config", config, "--length",
                                      str(length), "--threads", str(threads), "--tokens", str(tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.result = self._read() or {}

    def _read(self):
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line)
        self.proc.wait()
        self.error = ((self.proc.stderr.read().strip().splitlines() or ["no output"])[-1])
        return None

    def time(self, n: int) -> None:
        if self.error is None:
            self.proc.stdin.write(f"{n}\n")
            self.proc.stdin.flush()
            out = self._read()
            if out is not None:
                self.times.setdefault(n, []).append(out["s"])
                self.peak = max(self.peak, out["peak_bytes"])

    def close(self) -> None:
        if self.error is None:
            self.proc.stdin.close()
            self.proc.wait()

    def fastest(self, n: int) -> float:
        return min(self.times[n])


# ---- the parent --------------------------------------------------------------------------------


def overtake(lengths, ratios) -> str:
    """Where GPN+M's time per token falls below Transformer++'s (ratio = T++ / GPN+M time > 1)."""
    if ratios[0] >= 1:
        return f"GPN+M is faster at every prompt length measured (from {lengths[0]:,} tokens)"
    for (l0, r0), (l1, r1) in zip(zip(lengths, ratios), zip(lengths[1:], ratios[1:])):
        if r1 >= 1:  # log-log interpolation between the two lengths around the crossing
            at = math.exp(math.log(l0) + (math.log(l1) - math.log(l0)) * -math.log(r0) / (math.log(r1) - math.log(r0)))
            return f"GPN+M overtakes Transformer++ between {l0:,} and {l1:,} tokens of prompt (about {at:,.0f})"
    return f"Transformer++ stays faster up to {lengths[-1]:,} tokens of prompt"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpn", default="gpn_m_demo", help="GPN+M model config (a configs/models name or YAML)")
    parser.add_argument("--transformer", default="transformer_demo", help="Transformer++ model config")
    parser.add_argument("--lengths", default=LENGTHS, help="comma-separated prompt lengths")
    parser.add_argument("--tokens", type=int, default=128, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (the fastest counts)")
    parser.add_argument("--baselines", action="store_true",
                        help="also two forwards per token and the HF export's generate")
    parser.add_argument("--baseline-length", type=int, default=256, help="the baselines' prompt length")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--worker", choices=list(KINDS), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        run_worker(args)
        return 0

    lengths = [int(x) for x in args.lengths.split(",")]
    threads = args.threads or torch.get_num_threads()
    # Every (model, length) process is started first, then all take turns, round by round: a slow
    # spell of a shared machine slows every length and model alike.
    workers = [Worker(name, config, "decode", length, threads, args.tokens)
               for length in lengths for name, config in (("gpn_m", args.gpn), ("transformer", args.transformer))]
    if args.baselines:
        workers += [Worker(kind, args.gpn, kind, args.baseline_length, threads, args.tokens)
                    for kind in ("two_forwards", "hf_generate")]
        if args.baseline_length not in lengths:  # the decode step after the same prompt, in the same turns
            workers.append(Worker("gpn_m", args.gpn, "decode", args.baseline_length, threads, args.tokens))
    for _ in range(args.rounds):
        for w in workers:
            w.time(args.tokens)
            if w.name == "hf_generate":
                w.time(1)
    for w in workers:
        w.close()
    failed = [f"{w.name} at {w.length}: {w.error}" for w in workers if w.error]
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    found = {(w.name, w.length): w for w in workers}
    rows = [dict(length=length, **{
        name: dict(ms_per_token=1e3 * w.fastest(args.tokens) / args.tokens, peak_bytes=w.peak, **w.result)
        for name in ("gpn_m", "transformer") for w in [found[name, length]]}) for length in lengths]
    extra = []
    for w in workers[2 * len(lengths):]:
        if w.name == "gpn_m":
            continue
        per_token = w.fastest(args.tokens) / args.tokens
        if w.name == "hf_generate" and args.tokens > 1:  # its prompt runs inside each call
            per_token = (w.fastest(args.tokens) - w.fastest(1)) / (args.tokens - 1)
        decode = found["gpn_m", w.length]
        extra.append(dict(name=w.name, length=w.length, ms_per_token=1e3 * per_token,
                          decode_ms_per_token=1e3 * decode.fastest(args.tokens) / args.tokens))

    print(f"GPN+M: {args.gpn}; Transformer++: {args.transformer}; greedy decode steps after each prompt, "
          f"{args.tokens} per round, fastest of {args.rounds} rounds in turns; CPU, {threads} thread(s)")
    print(f"{'prompt':>7s} | {'GPN+M tok/s':>11s} {'state MB':>8s} {'peak MB':>7s} | {'T++ tok/s':>9s} {'cache MB':>8s} "
          f"{'peak MB':>7s} | {'speed GPN+M/T++':>15s} {'peak T++/GPN+M':>14s}")
    for r in rows:
        g, t = r["gpn_m"], r["transformer"]
        mb = lambda x: x / 2**20  # noqa: E731
        print(f"{r['length']:7,d} | {1e3 / g['ms_per_token']:11,.0f} {mb(g['state_bytes']):8.2f} {mb(g['peak_bytes']):7.1f} | "
              f"{1e3 / t['ms_per_token']:9,.0f} {mb(t['state_bytes']):8.2f} {mb(t['peak_bytes']):7.1f} | "
              f"{t['ms_per_token'] / g['ms_per_token']:14.2f}x {t['peak_bytes'] / max(g['peak_bytes'], 1):13.2f}x")
    times = [r["gpn_m"]["ms_per_token"] for r in rows]
    states = [r["gpn_m"]["state_bytes"] for r in rows]
    peaks = [r["gpn_m"]["peak_bytes"] for r in rows]
    print(f"GPN+M across prompt lengths: time per token max/min {max(times) / min(times):.2f}x, "
          f"state max/min {max(states) / min(states):.2f}x, peak max - min {(max(peaks) - min(peaks)) / 2**20:.1f} MB")
    ratios = [r["transformer"]["ms_per_token"] / r["gpn_m"]["ms_per_token"] for r in rows]
    crossing = overtake(lengths, ratios)
    print(crossing)
    for e in extra:
        label = {"two_forwards": "two forwards per token (before the decode step)",
                 "hf_generate": "the HF export's generate"}[e["name"]]
        print(f"prompt {e['length']:,}: GPN+M decode step vs {label}: {1e3 / e['ms_per_token']:,.0f} tok/s, "
              f"the decode step {1e3 / e['decode_ms_per_token']:,.0f} tok/s, {e['ms_per_token'] / e['decode_ms_per_token']:.2f}x faster")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows, baselines=extra, overtake=crossing, tokens=args.tokens,
                                                  rounds=args.rounds, threads=threads), indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
