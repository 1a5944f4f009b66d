"""`gpn-scale eval | analyze | generate`: argument parsing and the checks between a checkpoint, its
data and its tokenizer; the work is in the modules beside this one."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from data_prep.errors import UserError
from data_prep.helptext import HelpFormatter, json_stdout
from gpn_scale.eval.codec import Codec
from gpn_scale.eval.loading import DATA_OR_TOKENIZER, check_device, load_checkpoint
from gpn_scale.eval.prep_output import (PrepOutput, check_model_fits, choose_tokenizer, open_prep_output, open_streams,
                                        read_windows, training_prep)
from data_prep.outputs import LM_EVAL, check_new, check_resumable, identify, new_directory

STATES_TARGET = 16384  # analyze: enough windows for this many states by default (the paper used 16k)


def _device_flag(ap) -> None:
    ap.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda (default: cpu)")


def _check_positive(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")


def _open_checked(args, model, trained: PrepOutput | None):
    data = open_prep_output(args.data)
    windows = read_windows(data, args.windows)
    check_model_fits(model, data, windows, trained.tokenizer_sha256 if trained else None)
    return data, windows


def eval_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale eval", description="held-out perplexity and LAMBADA of a checkpoint")
    ap.add_argument("checkpoint", help="a native checkpoint, a training checkpoint or a run directory")
    ap.add_argument("--data", help="held-out MDS windows: a prep output (its val split) or a split directory")
    ap.add_argument("--windows", type=int, default=None, help="evaluate the first N windows (default: all)")
    ap.add_argument("--lambada", help="LAMBADA jsonl (one {\"text\": ...} per line)")
    ap.add_argument("--tokenizer", help="tokenizer for --lambada (default: the one recorded with --data, the training data or "
                    "a native export)")
    ap.add_argument("--context", type=int, metavar="N",
                    help="score held-out streams to N tokens, the state carried from window to window: loss by position "
                         "(--data: a prep output made with --streams, or its streams/val)")
    ap.add_argument("--streams", type=int, help="with --context: the first N streams (default: all)")
    ap.add_argument("--reset-on-eos", action="store_true",
                    help="with --context: the empty state after every EOS, each document read alone (as a run trained "
                         "with train.reset_on_eos reads)")
    ap.add_argument("--passkey", type=int, metavar="N",
                    help="passkey retrieval at distances 256, 512, ... N tokens: accuracy and key log-probability")
    ap.add_argument("--passkey-trials", type=int, default=10, help="prompts (keys) per passkey distance")
    ap.add_argument("--batch", type=int, default=16, help="windows (or LAMBADA examples) per forward")
    ap.add_argument("--out", default=None, help="a new directory for metrics.json and the loss-by-position curve "
                    "(default: ./eval, or the first free ./eval-N when that is taken)")
    ap.add_argument("--json", action="store_true", help="print one JSON object with the metrics, alone on stdout "
                    "(what libraries print goes to stderr)")
    _device_flag(ap)
    args = ap.parse_args(argv)
    with json_stdout(args.json) as stdout:
        return _eval(ap, args, stdout)


def _eval(ap, args, stdout) -> int:
    """eval_main's work; `stdout`: where --json's object goes (everything else printed meanwhile
    goes to stderr with --json)."""
    if not args.data and not args.lambada and not args.passkey:
        ap.error("nothing to evaluate: pass --data, --lambada and/or --passkey")
    _check_positive(args, "windows", "batch", "context", "streams", "passkey", "passkey_trials")
    if args.context and not args.data:
        raise UserError("--context: needs --data, the held-out streams (a prep output made with --streams)")
    if args.streams and not args.context:
        raise UserError("--streams: counts the streams of --context; pass --context N")
    if args.reset_on_eos and not args.context:
        raise UserError("--reset-on-eos: resets the state in the streams of --context; pass --context N")
    if args.context:
        from data_prep.document_streams import StreamLayout
        from gpn_scale.eval import long_context

        streams = open_streams(args.data)
        layout = StreamLayout.read(streams.split_dir)
        long_context.check_context(streams.split_dir, layout, args.context)  # before the model loads
        eos = long_context.eos_id(streams) if args.reset_on_eos else None
    from gpn_scale.eval.heldout import evaluate_windows
    from gpn_scale.eval.lambada import make_examples, read_lambada, score_lambada

    out = _eval_out(args.out)  # before the evaluation: a refusal costs nothing
    model = load_checkpoint(args.checkpoint, args.device)
    trained = training_prep(args.checkpoint)  # the data (and tokenizer) the model was trained on, when recorded
    metrics, data, per_position, examples = {}, None, None, None
    if args.passkey:  # the prompts first: a --passkey they cannot be made for is refused before any scoring
        from gpn_scale.eval import long_context

        given = open_prep_output(args.data) if args.data else None
        codec, framing = choose_tokenizer(args.checkpoint, args.tokenizer, given, trained, model, DATA_OR_TOKENIZER)
        items = long_context.make_passkeys(codec.encode, args.passkey, args.passkey_trials, bos=framing.prompt_bos)
    if args.data:
        data, windows = _open_checked(args, model, trained)
        held = evaluate_windows(model, windows, args.batch)
        metrics.update(ppl=held.ppl, loss=held.loss, tokens=held.tokens, windows=len(windows))
        per_position = held.per_position
        metrics["loss_by_position"] = str(out / "loss_by_position.csv")
    context = passkeys = None
    if args.context:
        tokens = long_context.stream_tokens(streams.split_dir, layout, args.context, args.streams)
        check_model_fits(model, streams, tokens, trained.tokenizer_sha256 if trained else None)
        if eos is not None:
            long_context.check_resettable(model)
        curve = long_context.carried_losses(model, tokens, layout.seq_len, args.batch, eos)
        bins = long_context.PositionBins.of(curve)
        context = (curve, bins)
        metrics["context"] = {"tokens": args.context, "streams": len(tokens), "window": layout.seq_len,
                              "data": str(streams.split_dir), "reset_on_eos": eos is not None, "loss": float(curve.mean()),
                              "bins": bins.to_json(),
                              "loss_by_position": str(out / "context_loss_by_position.csv"),
                              "plot": str(out / "context.png")}
    if args.passkey:
        chunk = (trained and trained.stats and trained.stats["seq_len"]) or (data and data.stats and data.stats["seq_len"]) or 2048
        passkeys = long_context.passkey_table(model, items, chunk)
        metrics["passkey"] = {"trials": args.passkey_trials, "chunk": chunk, "bos": framing.prompt_bos,
                              "chance": long_context.CHANCE, "by_distance": passkeys, "plot": str(out / "passkey.png")}
    if args.lambada:
        texts = read_lambada(args.lambada)
        codec, framing = choose_tokenizer(args.checkpoint, args.tokenizer, data, trained, model, DATA_OR_TOKENIZER)
        lam = score_lambada(model, make_examples(texts, codec.encode, framing.prompt_bos, args.lambada), args.batch)
        metrics.update({k: v for k, v in lam.items() if k != "per_example"})
        per = lam["per_example"]
        examples = "".join(
            json.dumps({"example": i, "correct": c, "target_logprob": lp, "target_mean_ce": ce}) + "\n"
            for i, (c, lp, ce) in enumerate(zip(per["correct"], per["word_logprob"], per["word_ce"]), 1))
        metrics["lambada_per_example"] = str(out / "lambada_examples.jsonl")
    with new_directory(out, "--out", "eval") as staging:
        if per_position is not None:
            np.savetxt(staging / "loss_by_position.csv", np.c_[np.arange(1, len(per_position) + 1), per_position],
                       delimiter=",", header="position,mean_loss", comments="", fmt=["%d", "%.6f"])
        if examples is not None:
            (staging / "lambada_examples.jsonl").write_text(examples)
        if context is not None:
            curve, bins = context
            np.savetxt(staging / "context_loss_by_position.csv", np.c_[np.arange(1, len(curve) + 1), curve],
                       delimiter=",", header="position,mean_loss", comments="", fmt=["%d", "%.6f"])
            long_context.plot_context(curve, bins, staging / "context.png",
                                      f"Loss by position, state carried ({len(tokens)} streams)")
        if passkeys is not None:
            long_context.plot_passkey(passkeys, staging / "passkey.png", f"Passkey ({args.passkey_trials} keys per distance)")
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=1))
    if args.json:
        print(json.dumps(metrics), file=stdout)
    else:
        if "ppl" in metrics:
            print(f"held-out: loss {metrics['loss']:.4f} nats, PPL {metrics['ppl']:.3f} over {metrics['tokens']:,} tokens "
                  f"({metrics['windows']} windows); loss by position in {metrics['loss_by_position']}")
        if "context" in metrics:
            c = metrics["context"]
            print(f"context {c['tokens']:,} tokens over {c['streams']} streams, state carried: loss {c['loss']:.4f}; "
                  + ", ".join(f"{b['positions'][0]}-{b['positions'][1]}: {b['loss']:.3f}" for b in c["bins"]))
        if "passkey" in metrics:
            p = metrics["passkey"]
            print("passkey accuracy, mean log p(key) by distance: "
                  + ", ".join(f"{r['distance']}: {r['accuracy']:.2f}, {r['mean_key_logprob']:.2f}" for r in p["by_distance"])
                  + f"; chance (a uniform guess of {p['chance']['keys']:,} keys): {p['chance']['accuracy']:.2g}, "
                  f"{p['chance']['key_logprob']:.2f} nats")
        if "lambada_acc" in metrics:
            print(f"LAMBADA: accuracy {metrics['lambada_acc']:.4f}, PPL {metrics['lambada_ppl']:.3f} "
                  f"over {metrics['lambada_examples']} examples")
        print(f"metrics: {out / 'metrics.json'}")
    return 0


def _eval_out(given: str | None) -> Path:
    """--out checked (new or empty), or by default ./eval, else the first free ./eval-N."""
    if given is not None:
        check_new(given, "--out", "eval")
        return Path(given)
    n = 1
    while True:
        out = Path("eval" if n == 1 else f"eval-{n}")
        if not out.exists() and not out.is_symlink():
            return out
        n += 1


def analyze_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale analyze", description="the paper's state and memory analyses, "
                                 "plus ablations, on held-out data: report.json, report.md and figures")
    ap.add_argument("checkpoint", help="a native checkpoint, a training checkpoint or a run directory")
    ap.add_argument("--data", required=True, help="held-out MDS windows: a prep output (its val split) or a split")
    ap.add_argument("--out", required=True, help="the report's directory, to create (must not exist, or be empty)")
    ap.add_argument("--windows", type=int, default=None,
                    help=f"analyse the first N windows (default: enough for {STATES_TARGET} states)")
    ap.add_argument("--batch", type=int, default=16, help="windows (or LAMBADA examples) per forward")
    _device_flag(ap)
    args = ap.parse_args(argv)
    _check_positive(args, "windows", "batch")
    from gpn_scale.eval.analyze import analyze
    from gpn_scale.eval.report import write_report

    check_new(args.out, "--out", "analyze")  # before the analysis: a refusal costs nothing
    model = load_checkpoint(args.checkpoint, args.device)
    if args.windows is None:
        data = open_prep_output(args.data)
        seq_len = data.stats["seq_len"] if data.stats else len(read_windows(data, 1)[0])
        args.windows = math.ceil(STATES_TARGET / seq_len)
    data, windows = _open_checked(args, model, training_prep(args.checkpoint))
    codec = Codec(data.tokenizer_path) if data.tokenizer_path is not None else None
    results, arrays = analyze(model, windows, codec, data.unigram(), args.batch)
    with new_directory(args.out, "--out", "analyze") as staging:
        write_report(results, arrays, staging, f"`{args.checkpoint}` on `{data.split_dir}`")
    print(f"report: {(Path(args.out) / 'report.md').resolve()} (and report.json and the figures beside it)")
    return 0


def generate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale generate", description="sample text from a checkpoint, streamed "
                                 "as it is produced, with constant memory per token")
    ap.add_argument("checkpoint", help="a native checkpoint, a training checkpoint or a run directory")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    ap.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0: greedy")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only; 0: all")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens with this mass")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="keep generating past the tokenizer's end-of-text token (default: stop there)")
    ap.add_argument("--tokenizer", help="tokenizer file (default: the one recorded with --data, the training data "
                    "or a native export)")
    ap.add_argument("--data", help="a prep output whose recorded tokenizer to use")
    _device_flag(ap)
    args = ap.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature: expected a finite number >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # a NaN fails this too
        raise UserError(f"--top-p: expected a number in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens: expected >= 0, got {args.max_new_tokens}")
    if args.top_k < 0:
        raise UserError(f"--top-k: expected >= 0 (0: all tokens), got {args.top_k}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise UserError("--prompt: not valid UTF-8 text") from None
    from gpn_scale.eval.codec import IncrementalDecoder
    from gpn_scale.eval.generate import generate_tokens

    model = load_checkpoint(args.checkpoint, args.device)
    data = open_prep_output(args.data) if args.data else None
    codec, framing = choose_tokenizer(args.checkpoint, args.tokenizer, data, training_prep(args.checkpoint), model,
                                       DATA_OR_TOKENIZER)
    bos = framing.prompt_bos
    prompt = ([] if bos is None else [bos]) + codec.encode(args.prompt)
    decoder = IncrementalDecoder(codec)
    sys.stdout.write(args.prompt)
    # What ended every training document, else the tokenizer's own end-of-text token
    eos = None if args.ignore_eos else (codec.eos_id if framing.eos_id is None else framing.eos_id)
    for token, _ in generate_tokens(model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                                    args.top_k):
        if token == eos:
            break
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    return 0


def lm_eval_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale lm-eval",
        description="lm-evaluation-harness on a checkpoint, as the harness model `gpn-scale`: its tasks (or your own "
                    "task YAMLs), scored with the recurrent state carried, results written as `lm-eval run` writes them")
    ap.add_argument("checkpoint", help="a native checkpoint, a training checkpoint or a run directory")
    ap.add_argument("--tasks", "-t", required=True,
                    help="comma-separated task or group names (globs allowed) or task YAML files")
    ap.add_argument("--include_path", "--include-path", dest="include_path",
                    help="a directory of task YAMLs of your own (default: the harness's tasks only)")
    ap.add_argument("--num_fewshot", "--num-fewshot", "-f", dest="num_fewshot", type=int,
                    help="few-shot examples per prompt (default: each task's own)")
    ap.add_argument("--limit", "-L", type=float, help="the first N documents per task; below 1, that fraction "
                    "(default: all)")
    ap.add_argument("--batch_size", "--batch-size", "-b", dest="batch_size", default="16",
                    help="requests per forward; 'auto' is 16 (a recurrent model's memory does not grow with the context)")
    ap.add_argument("--output_path", "--output-path", "-o", dest="output_path",
                    help="directory for results_*.json (and samples_*.jsonl) (default: print only)")
    ap.add_argument("--log_samples", "--log-samples", "-s", dest="log_samples", action="store_true",
                    help="also write every request with the model's response (needs --output_path)")
    ap.add_argument("--gen_kwargs", "--gen-kwargs", dest="gen_kwargs",
                    help="generation settings for generate_until tasks, e.g. temperature=0,max_gen_toks=64")
    ap.add_argument("--seed", type=int, default=0, help="seed of the harness's sampling and of generation")
    ap.add_argument("--bootstrap_iters", "--bootstrap-iters", dest="bootstrap_iters", type=int, default=100000,
                    help="bootstrap iterations for the metrics' standard errors (0: none)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer file (default: the one recorded with --data, the training data or a native "
                         "export)")
    ap.add_argument("--data", default=None, help="a prep output whose recorded tokenizer (and BOS) to use")
    _device_flag(ap)
    args = ap.parse_args(argv)
    if not Path(args.checkpoint).exists():
        raise UserError(f"{args.checkpoint}: no such checkpoint")
    if args.log_samples and not args.output_path:
        raise UserError("--log_samples: needs --output_path (where the samples are written)")
    if args.limit is not None and not args.limit > 0:
        raise UserError(f"--limit: expected a number > 0, got {args.limit}")
    _check_harness_output(args.output_path)
    try:
        from gpn_scale.eval.lm_eval_model import GPNScaleLM
        from lm_eval.utils import make_table
    except ImportError:
        raise UserError("lm-eval needs lm-evaluation-harness: pip install 'gpn-scale[eval]'") from None
    from gpn_scale.eval.lm_eval_run import HarnessRun, evaluate, resolve_tasks

    run = HarnessRun(tasks=[t for t in args.tasks.split(",") if t], include_path=args.include_path,
                     num_fewshot=args.num_fewshot, limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
                     batch_size=args.batch_size, output_path=args.output_path, log_samples=args.log_samples,
                     gen_kwargs=args.gen_kwargs, seed=args.seed, bootstrap_iters=args.bootstrap_iters)
    resolved = resolve_tasks(run)  # an unknown task stops here, before the model is loaded
    lm = GPNScaleLM(str(Path(args.checkpoint).resolve()), args.tokenizer, args.data, args.batch_size, args.device,
                    args.seed)
    results = evaluate(lm, run, resolved)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def _check_harness_output(path: str | None) -> None:
    """The harness's --output_path is a directory of its own results (it adds time-stamped files,
    never overwriting): new, empty or an earlier one; with a .json name it writes beside it, so that
    directory must not be another output gpn-scale knows (a run, a prep output, an export...)."""
    if path is None:
        return
    if Path(path).suffix != ".json":
        check_resumable(path, "--output_path", "lm-eval", (LM_EVAL,))
        return
    found = identify(Path(path).parent) if Path(path).parent.is_dir() else None
    if found is not None and found[0] is not LM_EVAL:
        raise UserError(f"--output_path {path}: its directory holds {found[0].name} ({found[0].writer}'s {found[1]}); "
                        "the harness writes its results there: choose another --output_path")
