"""`gpn-scale prep`: FineWeb-Edu-schema parquet, jsonl or text -> tokenized, packed MDS shards
(and, with `--streams`, long document streams cut into consecutive windows); resumable, and
the same bytes for any number of workers and nodes. gpn_scale reads what this writes
(`gpn_scale.storage.mds_datasets` opens it).

A leaf: nothing here imports gpn_scale (which imports this package), DeepSpeed, Triton or wandb,
so a prep runs where only its own dependencies are installed. Besides the prep, the pieces every
gpn-scale command shares live here, below all of them: one-line errors (`errors`), help
formatting (`helptext`), who may write where (`outputs`), one writer per output (`lock`), and the
MDS index check (`mds_index`)."""
