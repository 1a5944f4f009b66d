"""Corpora that every Python installation carries, written as FineWeb-Edu-schema parquet so the
offline runs go through exactly the path real data takes:

- the documentation topics bundled with CPython (`pydoc_data.topics`, ~0.5 MB of English, ~128K
  tokens): the demo's corpus;
- the standard library's own source (`stdlib_documents`, every `.py` file outside the test suites
  and the bundled applications, ~11 MB, a few million tokens): large enough that a study of a
  million tokens per run never reads a document twice. It is the running interpreter's library:
  the same bytes wherever that library is the same, which a Python version alone does not promise
  (distributions patch it), so `stdlib_fingerprint` names the bytes.
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

N_FILES = 4  # the last one is the natural validation file ("the last, unused bin")
MIN_DOC_CHARS = 200

SCHEMA = pa.schema([
    ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
    ("date", pa.string()), ("file_path", pa.string()), ("language", pa.string()),
    ("language_score", pa.float64()), ("token_count", pa.int64()), ("score", pa.float64()),
    ("int_score", pa.int64()),
])


def documents() -> list[tuple[str, str]]:
    """(topic, text) pairs: each topic split at its section headings into documents."""
    from pydoc_data.topics import topics

    docs = []
    for topic in sorted(topics):
        # A heading is a line followed by a row of '*' or '=' of the same length.
        parts = re.split(r"\n(?=[^\n]+\n[*=]{3,}\n)", topics[topic].strip())
        merged: list[str] = []
        for part in parts:
            if merged and len(merged[-1]) < MIN_DOC_CHARS:
                merged[-1] += "\n" + part
            else:
                merged.append(part)
        docs += [(topic, text.strip()) for text in merged if text.strip()]
    return docs


def write_embedded_corpus(out_dir: str | Path) -> list[Path]:
    """Write the documentation topics as `N_FILES` parquet files, documents dealt round-robin;
    return their sorted paths (the last is meant as the validation file)."""
    docs = [(f"https://docs.python.org/3/library/{topic}", f"pydoc_data/topics.py#{topic}", text)
            for topic, text in documents()]
    return write_documents(out_dir, docs, "pydoc-topics", N_FILES, dump="pydoc_data.topics")


# Directories of the standard library that are test suites, third-party code, GUI applications
# (idlelib, turtledemo) or the deprecated lib2to3 tool with its grammar fixers, not the library itself.
STDLIB_EXCLUDED = {"test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib", "turtledemo",
                   "__pycache__", "lib2to3"}


def stdlib_documents(root: str | Path | None = None) -> list[tuple[str, str, str]]:
    """(url, file path, text) of every `.py` file of the standard library at `root` (default: the
    running interpreter's) outside its test suites, sorted by relative path; files that are empty
    (three in CPython 3.11's tree) or not UTF-8 are left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if STDLIB_EXCLUDED.intersection(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append((f"python-stdlib://{rel.as_posix()}", f"Lib/{rel.as_posix()}", text))
    return docs


def stdlib_fingerprint(docs: list[tuple[str, str, str]]) -> str:
    """The running interpreter's version and a hash of every document's path and text: two corpora
    with the same fingerprint are the same bytes."""
    h = hashlib.blake2b(digest_size=8)
    for url, _, text in docs:
        h.update(url.encode())
        h.update(text.encode())
    return f"python-{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}-{h.hexdigest()}"


def write_documents(out_dir: str | Path, docs: list[tuple[str, str, str]], name: str, n_files: int,
                    dump: str) -> list[Path]:
    """Write (url, file path, text) documents as `n_files` parquet files named `name-KK.parquet`,
    dealt round-robin, `dump` naming their source; return their sorted paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(n_files):
        rows = [(i, url, file_path, text) for i, (url, file_path, text) in enumerate(docs) if i % n_files == k]
        path = out / f"{name}-{k:02d}.parquet"
        table = pa.table({
            "text": [t for *_, t in rows],
            "id": [f"<urn:{name}:{i:05d}>" for i, *_ in rows],
            "dump": [dump] * len(rows),
            "url": [url for _, url, _, _ in rows],
            "date": ["1970-01-01T00:00:00Z"] * len(rows),
            "file_path": [fp for _, _, fp, _ in rows],
            "language": ["en"] * len(rows),
            "language_score": [1.0] * len(rows),
            "token_count": [len(t.split()) for *_, t in rows],  # whitespace words, not GPT-2 tokens
            "score": [3.0] * len(rows),
            "int_score": [3] * len(rows),
        }, schema=SCHEMA)
        pq.write_table(table, path, row_group_size=64)
        paths.append(path)
    return paths
