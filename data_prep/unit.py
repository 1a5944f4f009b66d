"""One work unit: read -> check -> tokenize -> pack -> MDS, written aside and committed at the end."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep import document_streams, out_dir
from data_prep.lazy_streaming import streaming_module
from data_prep.pack import Packer
from data_prep.sources import BadLine, Document, Filters, Unit, UnreadableInput, read_unit
from data_prep.tokenizer import Tokenizer
from data_prep.errors import UserError

LISTED_PER_UNIT = 20  # bad documents a unit names in its stats (all are counted)


@dataclass(frozen=True)
class Settings:
    """Everything a worker needs besides the unit; all of it is recorded in prep.json, and what
    shapes a unit's content also in the unit's marker (`out_dir.unit_settings`)."""

    out: str
    tokenizer_path: str
    eos_token: str | None
    bos_token: str | None
    filters: Filters
    seq_len: int
    add_bos: bool
    val_fraction: float
    val_files: frozenset[str]
    splits: tuple[str, ...]
    compression: str | None
    size_limit: int
    skip_bad: bool
    streams: int | None = None  # train streams (and val_streams) for carried-state training: units keep their documents
    val_streams: int | None = None


def is_val(text_utf8: bytes, fraction: float) -> bool:
    """Deterministic held-out choice from the document's content alone (not its position)."""
    h = int.from_bytes(hashlib.blake2b(text_utf8, digest_size=8).digest(), "little")
    return h < fraction * 2**64


class _Checker:
    """Sorts documents into kept, filtered (by a score flag) and bad (reported or fatal)."""

    def __init__(self, settings: Settings, unit: Unit | None):
        self.settings = settings
        self.row_word = "line" if unit is not None and unit.row_group < 0 else "row"
        self.skipped: Counter[str] = Counter()
        self.filtered: Counter[str] = Counter()
        self.listed: list[dict] = []

    def problem(self, doc: Document) -> str | None:
        text = doc.text
        if isinstance(text, BadLine):
            return text.reason
        if isinstance(text, bytes):
            return "invalid UTF-8"
        if text is None:
            return "text is null"
        if not isinstance(text, str):
            return f"text is {type(text).__name__}, expected a string"
        return None

    def keep(self, doc: Document) -> bytes | None:
        """The document's UTF-8 bytes if it is kept; otherwise counts it (or raises)."""
        if isinstance(doc.text, str) and not doc.text:
            # Valid, just no text: skipped and counted whatever --on-error says, never listed as bad.
            # Whitespace is text (the tokenizer's to encode) and is kept.
            self.skipped[out_dir.EMPTY_TEXT] += 1
            return None
        reason = self.problem(doc)
        if reason is None:
            try:
                utf8 = doc.text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates, e.g. from a JSON "\ud800" escape
                reason = "invalid UTF-8 (lone surrogate)"
        if reason is not None:
            if not self.settings.skip_bad:
                raise UserError(f"{doc.file}: {self.row_word} {doc.row}: {reason} "
                                f"(--on-error skip skips and counts such documents)")
            self.skipped[reason] += 1
            if len(self.listed) < LISTED_PER_UNIT:
                self.listed.append({"file": doc.file, self.row_word: doc.row, "reason": reason})
            return None
        f = self.settings.filters
        for name, value, floor in (("int_score", doc.int_score, f.min_int_score), ("score", doc.score, f.min_score)):
            if floor is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                self.filtered[f"no numeric {name}"] += 1
                return None
            if value < floor:
                self.filtered[f"{name} below {floor}"] += 1
                return None
        return utf8


def prepare_unit(index: int, unit: Unit, settings: Settings, tokenizer: Tokenizer, recorded: dict) -> dict:
    """Prepare and commit one unit; return its stats (plus this attempt's timing). `recorded` is
    `out_dir.unit_settings` of the run's manifest, stored in the unit's marker."""
    started = time.perf_counter()
    out, uid = Path(settings.out), out_dir.unit_id(index)
    tmp = out / ".tmp" / uid
    with out_dir.disk_space_errors(tmp):
        out_dir.clear_unit(out, uid)
        tmp.mkdir(parents=True)
        try:
            stats, unigram = _pack(unit, settings, tokenizer, tmp)
        except UnreadableInput as e:
            if not settings.skip_bad:
                raise
            # Whatever was read before the damage is dropped with it: the file is skipped as a whole.
            shutil.rmtree(tmp)
            tmp.mkdir()
            stats, unigram = _pack(None, settings, tokenizer, tmp)
            stats["skipped_files"] = [{"file": unit.file, "reason": str(e).removeprefix(f"{unit.file}: ")}]
        stats = {"unit": uid, "source": unit.to_json(), "settings": recorded, **stats}
        out_dir.commit_unit(out, uid, tmp, stats, unigram)
    return {**stats, "seconds": time.perf_counter() - started, "pid": os.getpid()}


def _pack(unit: Unit | None, settings: Settings, tokenizer: Tokenizer, tmp: Path) -> tuple[dict, np.ndarray]:
    """Write the unit's windows under `tmp` (an empty output for `None`); return stats and unigram."""
    info = tokenizer.info
    columns = {"tokens": f"ndarray:{info.dtype.name}:{settings.seq_len}"}
    MDSWriter = streaming_module("base.format.mds.writer").MDSWriter
    writers = {s: MDSWriter(out=str(tmp / s), columns=columns, compression=settings.compression,
                            size_limit=settings.size_limit) for s in settings.splits}
    packers = {s: Packer(settings.seq_len, info.dtype) for s in settings.splits}
    counts = {s: Counter(documents=0, tokens=0, windows=0, dropped_tail_tokens=0) for s in settings.splits}
    unigram = np.zeros(info.vocab_size, np.int64)
    checker = _Checker(settings, unit)
    documents = ({s: document_streams.DocumentWriter(tmp / document_streams.DOCS / s, info.dtype) for s in settings.splits}
                 if settings.streams else {})
    whole_file_val = unit is not None and unit.file in settings.val_files
    prefix = np.array([info.bos_id] if settings.add_bos else [], info.dtype)
    eos = np.array([info.eos_id], info.dtype)

    def emit(split: str, windows: np.ndarray) -> None:
        counts[split]["windows"] += len(windows)
        if split == "train":
            unigram[:] += np.bincount(windows.ravel(), minlength=info.vocab_size)
        for window in windows:
            writers[split].write({"tokens": window})

    for batch in read_unit(unit, settings.filters) if unit is not None else ():
        kept, routes = [], []
        for doc in batch:
            utf8 = checker.keep(doc)
            if utf8 is not None:
                kept.append(doc.text)
                val = whole_file_val or (settings.val_fraction > 0 and is_val(utf8, settings.val_fraction))
                routes.append("val" if val else "train")
            del utf8  # a copy of the text: not kept while the batch is tokenized
        # Each document as [BOS] ids EOS, in segments the packer joins once: no copy per document.
        segments: dict[str, list[np.ndarray]] = {s: [] for s in settings.splits}
        lengths: dict[str, list[int]] = {s: [] for s in settings.splits}
        encoded = tokenizer.encode(kept)
        for split, ids in zip(routes, encoded):
            segments[split] += [prefix, ids, eos]
            lengths[split].append(len(prefix) + len(ids) + 1)
            counts[split]["documents"] += 1
            counts[split]["tokens"] += len(prefix) + len(ids) + 1
        del encoded
        for split, parts in segments.items():
            if parts:
                if documents:
                    documents[split].add(parts, lengths[split])
                emit(split, packers[split].add(parts))

    for split in settings.splits:
        counts[split]["dropped_tail_tokens"] = packers[split].finish()
        writers[split].finish()
        if documents:
            documents[split].finish()
    stats = {
        "splits": {s: dict(c) for s, c in counts.items()},
        "skipped": dict(sorted(checker.skipped.items())),
        "skipped_documents": checker.listed,
        "skipped_files": [],
        "filtered": dict(sorted(checker.filtered.items())),
    }
    return stats, unigram
