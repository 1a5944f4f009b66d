"""Input documents: FineWeb-Edu parquet or `.jsonl[.zst]`, local or behind any fsspec URL.

Work is cut into *units*: a slice of at most `UNIT_ROWS` rows of one parquet row group, or one
whole jsonl file (it cannot be indexed without reading it). Units are enumerated from the sorted
file list, so every machine derives the same list, and each unit is tokenized and packed on its
own, which is what makes the output independent of how units are spread over workers and nodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from data_prep.errors import UserError

UNIT_ROWS = 20_000  # bounds a unit's memory and the tail it drops; part of the output's identity
PARQUET = (".parquet",)
JSONL = (".jsonl", ".jsonl.zst", ".jsonl.gz")
BATCH = 512  # documents tokenized per call


class UnreadableInput(UserError):
    """A file (or part of one) that cannot be read at all, as opposed to one bad document."""


@dataclass(frozen=True)
class Unit:
    """One independently prepared piece of input: rows [start, stop) of a parquet row group,
    or a whole jsonl file (row_group -1, stop -1 meaning "to the end")."""

    file: str
    row_group: int
    start: int
    stop: int
    first_row: int  # index within the file of the unit's first row, for messages

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass
class Document:
    file: str
    row: int  # where in the file, for messages: its row index (parquet, from 0) or line number (jsonl, from 1)
    text: object  # str when valid; anything else is reported as a bad document
    int_score: object = None
    score: object = None


@dataclass(frozen=True)
class Filters:
    text_column: str = "text"
    min_int_score: int | None = None
    min_score: float | None = None


def _has_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _kind(url: str) -> str | None:
    if url.endswith(PARQUET):
        return "parquet"
    if url.endswith(JSONL):
        return "jsonl"
    return None


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files named by `patterns` (file, directory or glob; any fsspec URL), sorted, deduplicated."""
    found = set()
    for pattern in patterns:
        try:
            fs, path = fsspec.core.url_to_fs(pattern)
            if _has_glob(path):
                paths = fs.glob(path)
            elif fs.isdir(path):
                paths = [p for p in fs.find(path) if _kind(p)]
            elif fs.exists(path):
                paths = [path]
            else:
                raise UserError(f"{pattern}: no such file or directory")
        except (ImportError, ValueError, OSError) as e:  # unknown scheme, missing backend, credentials
            raise UserError(f"{pattern}: cannot list ({type(e).__name__}: {_first_line(e)})") from None
        matched = [fs.unstrip_protocol(p) for p in paths if _kind(p)]
        if not matched:
            raise UserError(f"{pattern}: matched no {', '.join(PARQUET + JSONL)} files")
        found.update(matched)
    return sorted(found)


def _parquet_units(url: str, filters: Filters) -> list[Unit]:
    try:
        with fsspec.open(url, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except Exception as e:  # pyarrow raises several types for truncated or foreign files
        raise UnreadableInput(f"{url}: not a readable parquet file ({type(e).__name__}: {_first_line(e)})") from None
    _check_schema(url, schema, filters)
    units, first = [], 0
    for rg in range(meta.num_row_groups):
        rows = meta.row_group(rg).num_rows
        units += [Unit(url, rg, s, min(s + UNIT_ROWS, rows), first + s) for s in range(0, rows, UNIT_ROWS)]
        first += rows
    return units


def _check_schema(url: str, schema: pa.Schema, filters: Filters) -> None:
    col = filters.text_column
    if col not in schema.names:
        raise UserError(f"{url}: no column {col!r} (columns: {', '.join(schema.names)}); pass --text-column")
    kind = schema.field(col).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)):
        raise UserError(f"{url}: column {col!r} has type {kind}, expected string")
    for name, flag in (("int_score", filters.min_int_score), ("score", filters.min_score)):
        if flag is not None and name not in schema.names:
            raise UserError(f"{url}: no column {name!r}, needed by --min-{name.replace('_', '-')}")


def plan_units(files: list[str], filters: Filters, skip_bad: bool) -> tuple[list[Unit], list[dict]]:
    """All units of `files` in order, and the files skipped as unreadable (when `skip_bad`)."""

    def units_of(url: str) -> list[Unit] | UserError:
        if _kind(url) == "jsonl":
            return [Unit(url, -1, 0, -1, 0)]
        try:
            return _parquet_units(url, filters)
        except UserError as e:
            return e

    units, skipped = [], []
    with ThreadPoolExecutor(8) as pool:  # footers of remote files: latency-bound
        for url, got in zip(files, pool.map(units_of, files)):
            if isinstance(got, UserError):
                if not skip_bad:
                    raise got
                skipped.append({"file": url, "reason": str(got).removeprefix(f"{url}: ")})
            else:
                units += got
    return units, skipped


def limit_rows(units: list[Unit], max_docs: int) -> list[Unit]:
    """The first `max_docs` input rows, in unit order. A jsonl unit's length is unknown, so its
    limit is applied while reading (stop = remaining rows)."""
    out, left = [], max_docs
    for u in units:
        if left <= 0:
            break
        if u.row_group < 0:
            out.append(Unit(u.file, -1, 0, left, 0))
            break  # how many rows it holds is unknown until it is read
        n = min(u.stop - u.start, left)
        out.append(Unit(u.file, u.row_group, u.start, u.start + n, u.first_row))
        left -= n
    return out


def read_unit(unit: Unit, filters: Filters) -> Iterator[list[Document]]:
    """The unit's documents in order, in batches."""
    if unit.row_group < 0:
        yield from _batched(_read_jsonl(unit, filters))
    else:
        yield from _read_parquet(unit, filters)


def _batched(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _read_parquet(unit: Unit, filters: Filters) -> Iterator[list[Document]]:
    columns = [filters.text_column]
    columns += [c for c, flag in (("int_score", filters.min_int_score), ("score", filters.min_score)) if flag is not None]
    try:
        with fsspec.open(unit.file, "rb") as f:
            table = pq.ParquetFile(f).read_row_group(unit.row_group, columns=columns)
    except Exception as e:
        raise UnreadableInput(f"{unit.file}: row group {unit.row_group} unreadable ({type(e).__name__}: {_first_line(e)})") from None
    table = table.slice(unit.start, unit.stop - unit.start)
    for lo in range(0, table.num_rows, BATCH):
        part = table.slice(lo, BATCH)
        texts = _texts(part.column(filters.text_column))
        ints = part.column("int_score").to_pylist() if filters.min_int_score is not None else [None] * len(texts)
        scores = part.column("score").to_pylist() if filters.min_score is not None else [None] * len(texts)
        yield [Document(unit.file, unit.first_row + lo + i, t, a, s) for i, (t, a, s) in enumerate(zip(texts, ints, scores))]


def _texts(column: pa.ChunkedArray) -> list[object]:
    """Python strings; binary cells decoded as UTF-8, invalid ones kept as bytes to be reported."""
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        return [_decode(b) for b in column.to_pylist()]
    try:
        return column.to_pylist()
    except UnicodeDecodeError:  # a string column holding invalid UTF-8 (written unchecked)
        return [_decode(b) for b in column.cast(pa.large_binary()).to_pylist()]


def _decode(raw: bytes | None) -> object:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


class BadLine:
    """A jsonl line that is not a JSON object: reported like a bad document."""

    def __init__(self, reason: str):
        self.reason = reason


def _read_jsonl(unit: Unit, filters: Filters) -> Iterator[Document]:
    try:
        for line_no, raw in enumerate(_lines(unit.file)):
            if unit.stop >= 0 and line_no >= unit.stop:
                return
            if not raw.strip():
                continue  # a blank line holds no document
            doc = _jsonl_document(unit.file, line_no + 1, raw, filters)  # lines are counted from 1
            del raw  # not kept while the document is tokenized (a document may be large)
            yield doc
    except (OSError, EOFError, ValueError, zstandard.ZstdError) as e:  # missing, truncated, corrupt
        raise UnreadableInput(f"{unit.file}: unreadable ({type(e).__name__}: {_first_line(e)})") from None


def _lines(url: str) -> Iterator[bytes]:
    if not url.endswith(".zst"):
        with fsspec.open(url, "rb", compression="infer") as f:
            yield from f
        return
    # zstandard's stream reader ends quietly on a truncated frame, which would lose documents
    # silently; a decompressobj per frame tells a complete stream from a cut one.
    with fsspec.open(url, "rb") as f:
        dobj, fed, pending = zstandard.ZstdDecompressor().decompressobj(), False, b""
        while chunk := f.read(1 << 20):
            while chunk:
                pending += dobj.decompress(chunk)
                fed = True
                chunk = b""
                if dobj.eof:  # a frame ended; the next one (if any) starts in unused_data
                    chunk, dobj, fed = dobj.unused_data, zstandard.ZstdDecompressor().decompressobj(), False
            *lines, pending = pending.split(b"\n")
            yield from (line + b"\n" for line in lines)
        if fed:
            raise EOFError("zstd stream ends inside a frame (truncated file?)")
        if pending:
            yield pending


def _jsonl_document(file: str, line_no: int, raw: bytes, filters: Filters) -> Document:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Document(file, line_no, raw)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return Document(file, line_no, BadLine(f"not valid JSON ({e.msg})"))
    if not isinstance(record, dict) or filters.text_column not in record:
        return Document(file, line_no, BadLine(f"no field {filters.text_column!r}"))
    return Document(file, line_no, record[filters.text_column], record.get("int_score"), record.get("score"))


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
