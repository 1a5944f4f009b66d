"""Long token streams for carried-state training: each split's documents dealt to S streams, each
stream cut into consecutive windows.

    OUT/docs/{split}/NNNNNN/tokens.bin    a unit's kept documents, tokens end to end (the tokenizer's dtype)
    OUT/docs/{split}/NNNNNN/lengths.npy   their lengths, in order                                  (prep)
    OUT/streams/{split}/                  MDS shards of the stream windows, and streams.json       (merge)

Dealing: documents are taken in the output's order (units in order, documents in input order
within a unit) and each goes whole to the stream that is shortest so far (the lowest-numbered of
equal ones). A document never straddles two streams; streams differ in length by at most one
document. Every stream is then cut into the same number of windows K = min over streams of
floor(length / seq_len): a stream's tokens past its K-th window (its tail, less than one window
plus one document) are dropped and counted.

Order: window-major. Sample `k * S + i` is window k of stream i, so one training step, which reads
window k of every stream, reads S consecutive samples. Everything depends only on the committed
units, which never depend on the worker or node that made them: the bytes are the same for any
number of workers and nodes.
"""

from __future__ import annotations

import heapq
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from data_prep.lazy_streaming import streaming_module

DOCS = "docs"
STREAMS = "streams"
DESCRIPTOR = "streams.json"
ORDER = "window-major: sample k*S + i is window k of stream i"


@dataclass(frozen=True)
class StreamLayout:
    """What a split's streams.json says about its samples: sample k * streams + i is window k of
    stream i, each window `seq_len` tokens."""

    streams: int
    windows_per_stream: int
    seq_len: int

    @classmethod
    def read(cls, directory: str | Path) -> "StreamLayout":
        """One line naming the file when it is missing or not the prep's."""
        from data_prep.errors import UserError, read_json

        path = Path(directory) / DESCRIPTOR
        if not path.is_file():
            raise UserError(f"{directory}: no {DESCRIPTOR}, so not the prep's streams (OUT/streams/SPLIT of "
                            f"`gpn-scale prep --streams S`)")
        record = read_json(path)
        try:
            layout = cls(int(record["streams"]), int(record["windows_per_stream"]), int(record["seq_len"]))
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: expected streams, windows_per_stream and seq_len (the prep's {DESCRIPTOR})") from None
        if min(layout.streams, layout.windows_per_stream, layout.seq_len) < 1:
            raise UserError(f"{path}: no windows in the streams")
        return layout


def docs_dir(out: Path, split: str, uid: str) -> Path:
    return out / DOCS / split / uid


class DocumentWriter:
    """A unit's kept documents of one split, written as they come (a unit's tokens are never all held)."""

    def __init__(self, directory: Path, dtype: np.dtype):
        directory.mkdir(parents=True)
        self.directory, self.dtype = directory, dtype
        self._tokens = open(directory / "tokens.bin", "wb")  # noqa: SIM115 (closed by finish)
        self._lengths: list[int] = []

    def add(self, parts: list[np.ndarray], lengths: list[int]) -> None:
        """`parts`: the documents' pieces end to end ([BOS] ids EOS each); `lengths`: per document."""
        for part in parts:
            self._tokens.write(np.ascontiguousarray(part, self.dtype).tobytes())
        self._lengths += lengths

    def finish(self) -> None:
        self._tokens.close()
        with open(self.directory / "lengths.npy", "wb") as f:
            np.save(f, np.asarray(self._lengths, np.int64))


def document_damage(directory: Path, dtype: np.dtype) -> str | None:
    """What is wrong with a committed unit's documents, if anything."""
    lengths = directory / "lengths.npy"
    try:
        n = np.load(lengths, mmap_mode="r")
    except (OSError, ValueError) as e:
        return f"{lengths} is missing or unreadable ({type(e).__name__})"
    tokens = directory / "tokens.bin"
    want = int(n.sum()) * np.dtype(dtype).itemsize
    size = tokens.stat().st_size if tokens.is_file() else None
    if size != want:
        return f"{tokens} holds {size} bytes, its lengths.npy says {want}"
    return None


@dataclass(frozen=True)
class Segment:
    """A document's place: unit `unit`'s tokens [start, start + length)."""

    unit: int
    start: int
    length: int


def deal(lengths: list[np.ndarray], streams: int) -> list[list[Segment]]:
    """Each document, in order, to the shortest stream so far (ties: the lowest index).
    `lengths[u]` are unit u's document lengths."""
    heap = [(0, i) for i in range(streams)]
    dealt: list[list[Segment]] = [[] for _ in range(streams)]
    for unit, unit_lengths in enumerate(lengths):
        start = 0
        for n in unit_lengths.tolist():
            total, i = heapq.heappop(heap)
            dealt[i].append(Segment(unit, start, n))
            heapq.heappush(heap, (total + n, i))
            start += n
    return dealt


class _Reader:
    """One stream's tokens in order, taken a window at a time from the units' token files."""

    def __init__(self, segments: list[Segment], files: list[np.ndarray]):
        self.segments, self.files = iter(segments), files
        self.piece = np.empty(0, files[0].dtype if files else np.int32)

    def take(self, n: int) -> np.ndarray:
        pieces, have = [], 0
        while have < n:
            if not len(self.piece):
                s = next(self.segments)
                self.piece = self.files[s.unit][s.start : s.start + s.length]
                continue
            part = self.piece[: n - have]
            self.piece = self.piece[len(part):]
            pieces.append(part)
            have += len(part)
        return np.concatenate(pieces) if len(pieces) != 1 else np.array(pieces[0])


@dataclass(frozen=True)
class StreamStats:
    streams: int
    seq_len: int
    windows_per_stream: int
    documents: int
    tokens: int  # in the windows
    dropped_tail_tokens: int
    shortest: int  # tokens of the shortest and longest stream before the cut
    longest: int

    def to_json(self) -> dict:
        return {"streams": self.streams, "seq_len": self.seq_len, "windows_per_stream": self.windows_per_stream,
                "windows": self.streams * self.windows_per_stream, "documents": self.documents, "tokens": self.tokens,
                "dropped_tail_tokens": self.dropped_tail_tokens, "shortest_stream_tokens": self.shortest,
                "longest_stream_tokens": self.longest, "order": ORDER}


def plan(out: Path, split: str, uids: list[str], streams: int, seq_len: int) -> tuple[list[list[Segment]], StreamStats]:
    lengths = [np.load(docs_dir(out, split, uid) / "lengths.npy") for uid in uids]
    dealt = deal(lengths, streams)
    totals = [sum(s.length for s in segs) for segs in dealt]
    k = min(totals) // seq_len
    documents = sum(len(x) for x in lengths)
    stats = StreamStats(streams, seq_len, k, documents, streams * k * seq_len, sum(totals) - streams * k * seq_len,
                        min(totals), max(totals))
    return dealt, stats


def write(out: Path, split: str, uids: list[str], dealt: list[list[Segment]], stats: StreamStats, dtype: str,
          compression: str | None, size_limit: int, dump_json, progress=None) -> None:
    """Write OUT/streams/{split} from the plan: the shards and streams.json, in a scratch folder
    that replaces the split's old streams in one rename at the end (a rerun of the merge writes
    them again; a reader never sees a half-written split)."""
    MDSWriter = streaming_module("base.format.mds.writer").MDSWriter

    files = [np.memmap(docs_dir(out, split, uid) / "tokens.bin", dtype=dtype, mode="r") if
             os.path.getsize(docs_dir(out, split, uid) / "tokens.bin") else np.empty(0, dtype) for uid in uids]
    tmp = out / ".tmp" / f"{STREAMS}.{split}.{uuid.uuid4().hex}"
    columns = {"tokens": f"ndarray:{dtype}:{stats.seq_len}", "stream": "int32", "window": "int32"}
    readers = [_Reader(segs, files) for segs in dealt]
    with MDSWriter(out=str(tmp), columns=columns, compression=compression, size_limit=size_limit) as writer:
        for k in range(stats.windows_per_stream):
            for i, reader in enumerate(readers):
                writer.write({"tokens": reader.take(stats.seq_len), "stream": i, "window": k})
            if progress is not None:
                progress(stats.streams)
    (tmp / DESCRIPTOR).write_bytes(dump_json(stats.to_json()))
    final = out / STREAMS / split
    final.parent.mkdir(exist_ok=True)
    old = None
    if final.exists():  # the previous merge's streams: replaced only once the new ones are complete
        old = out / ".tmp" / f"{STREAMS}.{split}.old.{uuid.uuid4().hex}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)

