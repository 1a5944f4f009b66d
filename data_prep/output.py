"""The output directory: its layout, the manifest every node agrees on, and the merge.

    OUT/prep.json               settings, tokenizer identity and the full unit list (the manifest)
    OUT/tokenizer.{json,model}  a copy of the tokenizer, so the output decodes on its own
    OUT/units/NNNNNN.json       a unit's stats; its presence is the unit's commit marker
    OUT/units/NNNNNN.npy        a unit's unigram counts over its train windows
    OUT/{train,val}/NNNNNN/     a unit's MDS shards and index.json
    OUT/{train,val}/index.json  the merged index over every unit, in unit order  (merge)
    OUT/stats.json, OUT/unigram.npy                                              (merge)

Everything is written to a temporary name and renamed into place, so a reader (or a rerun after
a crash) sees a file either complete or not at all.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

from gpn_scale.errors import UserError

SPLITS = ("train", "val")
MAX_LISTED = 1000  # bad documents listed by name in stats.json; all are counted


def unit_id(index: int) -> str:
    return f"{index:06d}"


def write_atomic(out: Path, path: Path, data: bytes) -> None:
    """Write via a uniquely named file in OUT/.tmp (nodes may race to write the same file; a crash
    leaves the litter there, where the merge removes it)."""
    tmp = out / ".tmp" / f"{path.name}.{uuid.uuid4().hex}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def dump_json(obj) -> bytes:
    return (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode()


def marker(out: Path, uid: str) -> Path:
    return out / "units" / f"{uid}.json"


def read_unit_stats(out: Path, uid: str) -> dict | None:
    path = marker(out, uid)
    return json.loads(path.read_text()) if path.exists() else None


def clear_unit(out: Path, uid: str) -> None:
    """Remove whatever an interrupted attempt at this unit left behind."""
    for path in [out / ".tmp" / uid] + [out / split / uid for split in SPLITS]:
        shutil.rmtree(path, ignore_errors=True)
    for path in (marker(out, uid), out / "units" / f"{uid}.npy"):
        path.unlink(missing_ok=True)


def commit_unit(out: Path, uid: str, tmp: Path, stats: dict, unigram: np.ndarray) -> None:
    """Move a finished unit into place; the stats file goes last and is the commit point."""
    (out / "units").mkdir(exist_ok=True)
    for split in SPLITS:
        if (tmp / split).exists():
            (out / split).mkdir(exist_ok=True)
            os.replace(tmp / split, out / split / uid)
    with open(tmp / "unigram.npy", "wb") as f:
        np.save(f, unigram)
    os.replace(tmp / "unigram.npy", out / "units" / f"{uid}.npy")
    write_atomic(out, marker(out, uid), dump_json(stats))
    tmp.rmdir()


def check_manifest(out: Path, manifest: dict) -> None:
    """Write the manifest, or check that an existing one (an earlier run, another node) agrees."""
    path = out / "prep.json"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out, path, dump_json(manifest))
        return
    old = json.loads(path.read_text())
    old_tok, new_tok = old["tokenizer"], manifest["tokenizer"]
    # The tokenizer first: the likeliest mistake. Its path may differ between machines.
    if (old_tok["sha256"], old_tok["vocab_size"]) != (new_tok["sha256"], new_tok["vocab_size"]):
        raise UserError(
            f"{path}: existing output was prepared with another tokenizer ({old_tok['path']}, vocab "
            f"{old_tok['vocab_size']}, sha256 {old_tok['sha256'][:12]}); this run's is {new_tok['path']}, vocab "
            f"{new_tok['vocab_size']}, sha256 {new_tok['sha256'][:12]}. Use a new --out or the same tokenizer")
    for key, value in manifest["config"].items():
        if old["config"].get(key) != value:
            raise UserError(f"{path}: existing output was prepared with {key}={old['config'].get(key)!r}, "
                            f"this run has {value!r}; use a new --out or the same settings")
    for key in ("inputs", "units", "skipped_files"):
        if old[key] != manifest[key]:
            raise UserError(f"{path}: existing output was prepared from other input files (or they changed "
                            f"since: {key} differ); use a new --out or the same inputs")


def read_manifest(out: Path) -> dict:
    path = out / "prep.json"
    if not path.exists():
        raise UserError(f"{out}: no prep.json; not a prep output directory (run `gpn-scale prep` first)")
    return json.loads(path.read_text())


def merge(out: Path) -> dict:
    """Write the root indexes, stats.json and unigram.npy from the committed units; return stats."""
    manifest = read_manifest(out)
    config, n_units = manifest["config"], len(manifest["units"])
    kept, missing, tokens = [], [], 0
    for index in range(n_units):
        uid = unit_id(index)
        if config["max_tokens"] is not None and tokens >= config["max_tokens"]:
            clear_unit(out, uid)  # prepared past the cap (another node, in flight): not part of the output
            continue
        stats = read_unit_stats(out, uid)
        if stats is None:
            missing.append(uid)
            continue
        kept.append((uid, stats))
        tokens += sum(s["windows"] for s in stats["splits"].values()) * config["seq_len"]
    if missing:
        raise UserError(f"{out}: {len(missing)} of {n_units} work units are not committed yet (first: "
                        f"{', '.join(missing[:3])}); run prep on every node (reruns resume) before merging")

    for split in config["splits"]:
        shards = []
        for uid, _ in kept:
            index_path = out / split / uid / "index.json"
            for shard in json.loads(index_path.read_text())["shards"]:
                for key in ("raw_data", "zip_data"):
                    if shard.get(key):
                        shard[key]["basename"] = f"{uid}/{shard[key]['basename']}"
                shards.append(shard)
        write_atomic(out, out / split / "index.json", dump_json({"shards": shards, "version": 2}))

    unigram = np.zeros(manifest["tokenizer"]["vocab_size"], np.int64)
    for uid, _ in kept:
        unigram += np.load(out / "units" / f"{uid}.npy")
    with io.BytesIO() as f:
        np.save(f, unigram)
        write_atomic(out, out / "unigram.npy", f.getvalue())

    stats = _aggregate(manifest, [s for _, s in kept])
    write_atomic(out, out / "stats.json", dump_json(stats))
    shutil.rmtree(out / ".tmp", ignore_errors=True)
    return stats


def _aggregate(manifest: dict, units: list[dict]) -> dict:
    config, tok = manifest["config"], manifest["tokenizer"]
    splits = {}
    for split in config["splits"]:
        total = Counter()
        for u in units:
            total.update(u["splits"][split])
        splits[split] = {k: total[k] for k in ("documents", "tokens", "windows", "dropped_tail_tokens")}
    skipped, filtered, listed, files = Counter(), Counter(), [], list(manifest["skipped_files"])
    for u in units:
        skipped.update(u["skipped"])
        filtered.update(u["filtered"])
        listed += u["skipped_documents"]
        files += u["skipped_files"]
    return {
        "seq_len": config["seq_len"],
        "vocab_size": tok["vocab_size"],
        "eos_id": tok["eos_id"],
        "bos_id": tok["bos_id"],
        "add_bos": config["add_bos"],
        "dtype": tok["dtype"],
        "tokenizer": {"path": tok["path"], "sha256": tok["sha256"], "kind": tok["kind"], "copy": tok["copy"]},
        "columns": {"tokens": f"ndarray:{tok['dtype']}:{config['seq_len']}"},
        "splits": splits,
        "units": len(units),
        "skipped": {
            "documents": dict(sorted(skipped.items())),
            "files": files,
            "listed": listed[:MAX_LISTED],
        },
        "filtered": dict(sorted(filtered.items())),
        "tail_rule": "each work unit's tail shorter than seq_len is dropped, per split",
        "order": "units in order (input files sorted, then row groups, then rows); within a unit "
                 "documents in input order, each as [BOS] tokens EOS",
    }
