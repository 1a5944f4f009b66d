"""A small real-English corpus that every Python installation carries: the documentation topics
bundled with CPython (`pydoc_data.topics`, ~0.5 MB), written as FineWeb-Edu-schema parquet so the
offline demo goes through exactly the path real data takes.
"""

from __future__ import annotations

import re
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
    """Write the corpus as `N_FILES` parquet files, documents dealt round-robin; return their
    sorted paths (the last is meant as the validation file)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = documents()
    paths = []
    for k in range(N_FILES):
        rows = [(i, topic, text) for i, (topic, text) in enumerate(docs) if i % N_FILES == k]
        path = out / f"pydoc-topics-{k:02d}.parquet"
        table = pa.table({
            "text": [t for _, _, t in rows],
            "id": [f"<urn:pydoc-topics:{i:05d}>" for i, _, _ in rows],
            "dump": ["pydoc_data.topics"] * len(rows),
            "url": [f"https://docs.python.org/3/library/{topic}" for _, topic, _ in rows],
            "date": ["1970-01-01T00:00:00Z"] * len(rows),
            "file_path": [f"pydoc_data/topics.py#{topic}" for _, topic, _ in rows],
            "language": ["en"] * len(rows),
            "language_score": [1.0] * len(rows),
            "token_count": [len(t.split()) for _, _, t in rows],  # whitespace words, not GPT-2 tokens
            "score": [3.0] * len(rows),
            "int_score": [3] * len(rows),
        }, schema=SCHEMA)
        pq.write_table(table, path, row_group_size=64)
        paths.append(path)
    return paths
