"""`gpn-scale prep ...`: prepare MDS shards, train a tokenizer, or merge a multi-node output.

    gpn-scale prep INPUT... --out DIR --tokenizer PATH --seq-len N [options]
    gpn-scale prep train-tokenizer INPUT... --vocab-size V --out PATH
    gpn-scale prep merge DIR
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from data_prep.errors import UserError
from data_prep.helptext import HelpFormatter
from data_prep.lazy_streaming import streaming_module


def main(argv: list[str]) -> int:
    if argv and argv[0] == "train-tokenizer":
        return _train_tokenizer(argv[1:])
    if argv and argv[0] == "merge":
        return _merge(argv[1:])
    return _prep(argv)


def _prep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="gpn-scale prep", description=(
        "Tokenize FineWeb-Edu parquet or jsonl[.zst] (paths, directories, globs or fsspec URLs), pack into "
        "fixed windows and write MDS shards to OUT/train and OUT/val. Also: `gpn-scale prep train-tokenizer "
        "--help`, `gpn-scale prep merge DIR`."))
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="FineWeb-Edu parquet or .jsonl[.zst] files, local or any fsspec URL")
    p.add_argument("--out", required=True, help="output directory: new, empty, or an earlier prep output to resume "
                   "(a shared filesystem for multi-node runs)")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model or Hugging Face tokenizer.json")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per window (2048 in the paper)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    p.add_argument("--num-nodes", type=int, help="default: SLURM_ARRAY_TASK_COUNT or SLURM_NNODES, else 1")
    p.add_argument("--node-rank", type=int, help="default: from SLURM_ARRAY_TASK_ID or SLURM_NODEID, else 0")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=0.0,
                     help="fraction of documents held out for val, chosen by a hash of their text")
    val.add_argument("--val-files", nargs="+", default=[], metavar="INPUT",
                     help="these files (also read as inputs) are the val split, e.g. the last file")
    p.add_argument("--on-error", choices=("fail", "skip"), default="fail",
                   help="bad file or document: stop with an error, or skip it and count it in stats.json")
    p.add_argument("--text-column", default="text", help="the column (or jsonl field) holding the text")
    p.add_argument("--min-int-score", type=int, help="keep documents with int_score >= this")
    p.add_argument("--min-score", type=float, help="keep documents with score >= this")
    p.add_argument("--max-docs", type=int, help="read only the first N input rows (in input order)")
    p.add_argument("--max-tokens", type=int, help="stop after the first unit at which the packed tokens reach N")
    p.add_argument("--bos", action="store_true", help="prepend BOS to each document (EOS is always appended)")
    p.add_argument("--eos-token", help="EOS token of a tokenizer.json (default: a usual name, e.g. <|endoftext|>)")
    p.add_argument("--bos-token", help="BOS token of a tokenizer.json (default: a usual name, e.g. <s>)")
    p.add_argument("--compression", default="zstd", help="MDS shard compression, e.g. zstd, zstd:7, none")
    p.add_argument("--size-limit", type=int, default=1 << 26, help="MDS shard size limit in bytes")
    p.add_argument("--streams", type=int, metavar="S",
                   help="also deal each split's documents into S long streams cut into consecutive windows, in "
                        "OUT/streams/{train,val}, for training with train.carry_state; S a multiple of the run's "
                        "global batch, which reads one window of each of that many streams per step (the carried "
                        "recipe: 1024 at --seq-len 256; docs/prep.md, 'Streams')")
    p.add_argument("--val-streams", type=int, metavar="S", help="streams of the val split (default: --streams)")
    p.add_argument("--allow-empty", action="store_true",
                   help="write a split that gets no window (no document reached it) instead of refusing")
    return p


def _node_defaults() -> tuple[int, int]:
    env = os.environ
    if "SLURM_ARRAY_TASK_COUNT" in env and "SLURM_ARRAY_TASK_ID" in env:
        first = int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        return int(env["SLURM_ARRAY_TASK_COUNT"]), int(env["SLURM_ARRAY_TASK_ID"]) - first
    if "SLURM_NNODES" in env and "SLURM_NODEID" in env:
        return int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])
    return 1, 0


def _prep(argv: list[str]) -> int:
    from data_prep.run import prepare
    from data_prep.sources import Filters, expand_inputs
    from data_prep.unit import Settings

    a = _prep_parser().parse_args(argv)
    default_nodes, default_rank = _node_defaults()
    num_nodes = a.num_nodes if a.num_nodes is not None else default_nodes
    node_rank = a.node_rank if a.node_rank is not None else default_rank
    for flag, value, ok, want in (
        ("--seq-len", a.seq_len, a.seq_len >= 1, "at least 1"),
        ("--workers", a.workers, a.workers >= 1, "at least 1"),
        ("--num-nodes", num_nodes, num_nodes >= 1, "at least 1"),
        ("--node-rank", node_rank, 0 <= node_rank < num_nodes, f"in [0, {num_nodes})"),
        ("--val-fraction", a.val_fraction, 0.0 <= a.val_fraction < 1.0, "in [0, 1)"),
        ("--max-docs", a.max_docs, a.max_docs is None or a.max_docs >= 1, "at least 1"),
        ("--max-tokens", a.max_tokens, a.max_tokens is None or a.max_tokens >= 1, "at least 1"),
        ("--size-limit", a.size_limit, a.size_limit >= 1 << 10, "at least 1024"),
        ("--min-score", a.min_score, a.min_score is None or math.isfinite(a.min_score), "a finite number"),
        ("--streams", a.streams, a.streams is None or a.streams >= 1, "at least 1"),
        ("--val-streams", a.val_streams, a.val_streams is None or a.val_streams >= 1, "at least 1"),
    ):
        if not ok:
            raise UserError(f"{flag}: got {value}, expected {want}")
    if a.val_streams is not None and a.streams is None:
        raise UserError("--val-streams: given without --streams; pass --streams S as well")
    compression = None if a.compression == "none" else a.compression
    if compression is not None:
        is_compression = streaming_module("base.compression").is_compression

        if not is_compression(compression):
            raise UserError(f"--compression: unknown {a.compression!r}; expected e.g. zstd, zstd:7, gz, none")

    val_files = expand_inputs(a.val_files) if a.val_files else []
    settings = Settings(
        out=str(Path(a.out)),
        tokenizer_path=a.tokenizer,
        eos_token=a.eos_token,
        bos_token=a.bos_token,
        filters=Filters(a.text_column, a.min_int_score, a.min_score),
        seq_len=a.seq_len,
        add_bos=a.bos,
        val_fraction=a.val_fraction,
        val_files=frozenset(val_files),
        splits=("train", "val") if (a.val_fraction > 0 or val_files) else ("train",),
        compression=compression,
        size_limit=a.size_limit,
        skip_bad=a.on_error == "skip",
        streams=a.streams,
        val_streams=a.val_streams,
    )
    if a.bos:
        from data_prep.tokenizer import Tokenizer

        if Tokenizer(a.tokenizer, a.eos_token, a.bos_token).info.bos_id is None:
            raise UserError(f"{a.tokenizer}: --bos given but the tokenizer has no BOS token; pass --bos-token")
    prepare(a.inputs, settings, val_inputs=a.val_files, max_docs=a.max_docs, max_tokens=a.max_tokens,
            workers=a.workers, num_nodes=num_nodes, node_rank=node_rank, allow_empty=a.allow_empty)
    return 0


def _train_tokenizer(argv: list[str]) -> int:
    from data_prep.sources import Filters, expand_inputs, limit_rows, plan_units, read_unit
    from data_prep.tokenizer import train_bpe

    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="gpn-scale prep train-tokenizer",
                                description="Train a byte-level BPE tokenizer.json on the inputs' text.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="parquet or .jsonl[.zst] files to train on")
    p.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, special tokens included")
    p.add_argument("--out", required=True, help="path of the tokenizer.json to write (must not exist)")
    p.add_argument("--text-column", default="text", help="the column (or jsonl field) holding the text")
    p.add_argument("--max-docs", type=int, help="train on the first N documents only")
    a = p.parse_args(argv)
    if not a.out.endswith(".json"):
        raise UserError(f"--out: {a.out!r} should end in .json (a Hugging Face tokenizer.json)")
    from data_prep.outputs import check_new_file

    check_new_file(a.out, "--out")
    filters = Filters(a.text_column)
    units, _ = plan_units(expand_inputs(a.inputs), filters, skip_bad=False)
    if a.max_docs is not None:
        units = limit_rows(units, a.max_docs)

    def texts():
        for unit in units:
            for batch in read_unit(unit, filters):
                for doc in batch:
                    if isinstance(doc.text, str) and doc.text:  # bad documents do not teach the vocabulary
                        yield doc.text

    reached = train_bpe(texts(), a.vocab_size, a.out)
    short = f" (asked for {a.vocab_size}: the text has no more merges)" if reached < a.vocab_size else ""
    print(f"wrote {a.out}: byte-level BPE, vocab {reached}{short}, EOS <|endoftext|>")
    return 0


def _merge(argv: list[str]) -> int:
    from data_prep.out_dir import merge

    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="gpn-scale prep merge",
                                description="Write OUT's root indexes and stats once every node's units are committed.")
    p.add_argument("out", metavar="DIR", help="the output directory every node's `prep` wrote to")
    p.add_argument("--allow-empty", action="store_true",
                   help="write a split that gets no window (no document reached it) instead of refusing")
    a = p.parse_args(argv)
    stats = merge(Path(a.out), a.allow_empty)
    windows = ", ".join(f"{s['windows']:,} {name} windows" for name, s in stats["splits"].items())
    print(f"merged {a.out}: {stats['units']} units, {windows}")
    return 0
