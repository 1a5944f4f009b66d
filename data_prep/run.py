"""The prep run on one node: plan the units, prepare this node's share in a worker pool, merge.

Units are dealt to nodes by index modulo the node count, and each worker prepares whole units,
so which process prepared a unit never shows in its bytes.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from data_prep import out_dir
from data_prep import outputs
from data_prep.lock import RunLock
from data_prep.sources import expand_inputs, limit_rows, plan_units
from data_prep.tokenizer import Tokenizer
from data_prep.unit import Settings, prepare_unit

_worker_tokenizer: Tokenizer | None = None


def _init_worker(settings: Settings) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(settings.tokenizer_path, settings.eos_token, settings.bos_token)


def _work(index: int, unit, settings: Settings, recorded: dict) -> dict:
    return prepare_unit(index, unit, settings, _worker_tokenizer, recorded)


def prepare(inputs: list[str], settings: Settings, *, val_inputs: list[str], max_docs: int | None,
            max_tokens: int | None, workers: int, num_nodes: int, node_rank: int,
            allow_empty: bool = False) -> dict | None:
    """Prepare this node's units; on a single node also merge. Returns the merged stats, if merged."""
    out = Path(settings.out)
    tokenizer = Tokenizer(settings.tokenizer_path, settings.eos_token, settings.bos_token)
    files = expand_inputs(inputs + val_inputs)
    units, skipped_files = plan_units(files, settings.filters, settings.skip_bad)
    if not units and skipped_files:  # said before anything is written
        raise out_dir.nothing_kept(out, skipped_files, {}, [])
    if max_docs is not None:
        units = limit_rows(units, max_docs)
    manifest = _manifest(settings, tokenizer, files, units, skipped_files, max_docs, max_tokens)
    outputs.check_resumable(out, "--out", "prep", (outputs.PREP,))  # before anything is written
    # One prep per node and output: a second one would clear the units the first is writing.
    lock = RunLock(out, f"prep.node-{node_rank}.lock", "--out")
    try:
        with out_dir.disk_space_errors(out):
            out_dir.check_manifest(out, manifest)
            _copy_tokenizer(out, tokenizer)

            mine = [i for i in range(len(units)) if i % num_nodes == node_rank]
            started = time.perf_counter()
            with multiprocessing.get_context("fork").Pool(workers, _init_worker, (settings,)) as pool:
                progress = _Progress(len(mine), workers)
                # With one node the cap is known here, so units past it are never started.
                cap = max_tokens if num_nodes == 1 else None
                packed = 0
                for stats, fresh in _in_order(pool, mine, units, settings, manifest, workers,
                                              lambda: cap is None or packed < cap):
                    progress.update(stats, fresh)
                    packed += sum(s["windows"] for s in stats["splits"].values()) * settings.seq_len
                progress.close()
            elapsed = time.perf_counter() - started
    finally:
        lock.release()

    print(progress.summary(elapsed), file=sys.stderr)
    if num_nodes > 1:
        print(f"node {node_rank}/{num_nodes} done; once every node is, run: gpn-scale prep merge {out}"
              + (" --allow-empty" if allow_empty else ""), file=sys.stderr)
        return None
    stats = out_dir.merge(out, allow_empty)
    print(_final_summary(out, stats), file=sys.stderr)
    return stats


def _in_order(pool, indexes: list[int], units, settings: Settings, manifest: dict, workers: int,
              more) -> Iterator[tuple[dict, bool]]:
    """(stats, prepared now) of each unit in order: committed ones read back (after checking they
    were made by these settings; damaged ones are prepared again), the others prepared with at
    most two per worker in flight; no new unit starts once `more()` is false."""
    recorded = out_dir.unit_settings(manifest)
    pending: deque = deque()
    todo = iter(indexes)
    while True:
        while len(pending) < 2 * workers and more() and (index := next(todo, None)) is not None:
            try:
                committed = out_dir.read_committed(Path(settings.out), out_dir.unit_id(index), manifest)
            except out_dir.DamagedUnit as e:
                tqdm.write(f"warning: {e}; preparing it again", file=sys.stderr)
                committed = None
            pending.append(committed or pool.apply_async(_work, (index, units[index], settings, recorded)))
        if not pending:
            return
        head = pending.popleft()
        yield (head, False) if isinstance(head, dict) else (head.get(), True)


def _manifest(settings: Settings, tokenizer: Tokenizer, files, units, skipped_files, max_docs, max_tokens) -> dict:
    info = tokenizer.info
    return {
        "tokenizer": {"path": settings.tokenizer_path, "sha256": info.sha256, "kind": info.kind,
                      "vocab_size": info.vocab_size, "eos_id": info.eos_id, "bos_id": info.bos_id,
                      "dtype": info.dtype.name, "copy": info.filename},
        "config": {
            "seq_len": settings.seq_len, "add_bos": settings.add_bos, "splits": list(settings.splits),
            "text_column": settings.filters.text_column, "min_int_score": settings.filters.min_int_score,
            "min_score": settings.filters.min_score, "val_fraction": settings.val_fraction,
            "val_files": sorted(settings.val_files), "max_docs": max_docs, "max_tokens": max_tokens,
            "compression": settings.compression, "size_limit": settings.size_limit,
            "on_error": "skip" if settings.skip_bad else "fail",
            "streams": settings.streams, "val_streams": settings.val_streams,
        },
        "inputs": files,
        "skipped_files": skipped_files,
        "units": [u.to_json() for u in units],
    }


def _copy_tokenizer(out: Path, tokenizer: Tokenizer) -> None:
    dest = out / tokenizer.info.filename
    if not dest.exists():  # same bytes whenever it exists: check_manifest compared the sha256
        out_dir.write_atomic(out, dest, Path(tokenizer.path).read_bytes())


class _Progress:
    """A bar over this node's units with documents/s and tokens/s, in total and per worker."""

    def __init__(self, units: int, workers: int):
        self.bar = tqdm(total=units, unit="unit", desc="prep", disable=None, file=sys.stderr)
        self.workers = workers
        self.started = time.perf_counter()
        self.docs = self.tokens = self.resumed = 0
        self.busy = 0.0  # seconds workers spent on units this run

    def update(self, stats: dict, fresh: bool) -> None:
        if fresh:
            self.docs += sum(s["documents"] for s in stats["splits"].values())
            self.tokens += sum(s["tokens"] for s in stats["splits"].values())
            self.busy += stats["seconds"]
        else:
            self.resumed += 1
        wall = max(time.perf_counter() - self.started, 1e-9)
        busy = max(self.busy, 1e-9)
        self.bar.set_postfix_str(f"{self.docs / wall:,.0f} docs/s {self.tokens / wall:,.0f} tok/s; per worker "
                                 f"{self.docs / busy:,.0f} docs/s {self.tokens / busy:,.0f} tok/s", refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()

    def summary(self, elapsed: float) -> str:
        return (f"prep: {self.bar.total} units ({self.resumed} already committed), {self.docs:,} documents, "
                f"{self.tokens:,} tokens in {elapsed:.1f}s: {self.tokens / max(elapsed, 1e-9):,.0f} tok/s total, "
                f"{self.tokens / max(self.busy, 1e-9):,.0f} tok/s per worker ({self.workers} workers)")


def _final_summary(out: Path, stats: dict) -> str:
    lines = [f"wrote {out}:"]
    for split, s in stats["splits"].items():
        lines.append(f"  {split:5} {s['documents']:>12,} docs {s['tokens']:>15,} tokens {s['windows']:>12,} "
                     f"windows of {stats['seq_len']}, {s['dropped_tail_tokens']:,} tail tokens dropped")
    for split, s in stats.get("streams", {}).items():
        lines.append(f"  {split:5} {s['streams']:>12,} streams of {s['windows_per_stream']:,} windows in "
                     f"{out / 'streams' / split}, {s['dropped_tail_tokens']:,} tail tokens dropped")
    skipped = sum(stats["skipped"]["documents"].values())
    if skipped or stats["skipped"]["files"]:
        lines.append(f"  skipped {skipped:,} documents {stats['skipped']['documents']} and "
                     f"{len(stats['skipped']['files'])} files (see stats.json)")
    if stats["filtered"]:
        lines.append(f"  filtered {stats['filtered']}")
    return "\n".join(lines)
