"""`gpn-scale prep`: FineWeb-Edu-schema parquet, jsonl or text -> tokenized, packed MDS shards
(and, with `--streams`, long document streams cut into consecutive windows); resumable, and
the same bytes for any number of workers and nodes. `gpn_scale.data` reads what this writes."""
