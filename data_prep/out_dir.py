"""The output directory: its layout, the manifest every node agrees on, and the merge.

    OUT/prep.json               settings, tokenizer identity and the full unit list (the manifest)
    OUT/tokenizer.{json,model}  a copy of the tokenizer, so the output decodes on its own
    OUT/units/NNNNNN.json       a unit's stats and the settings that made it; its presence is the
                                unit's commit marker
    OUT/units/NNNNNN.npy        a unit's unigram counts over its train windows
    OUT/{train,val}/NNNNNN/     a unit's MDS shards and index.json
    OUT/{train,val}/index.json  the merged index over every unit, in unit order  (merge)
    OUT/stats.json, OUT/unigram.npy                                              (merge)
    OUT/docs/{split}/NNNNNN/, OUT/streams/{split}/   with --streams: a unit's documents, and the long
                                token streams the merge deals them into (data_prep/document_streams.py)

Everything is written to a temporary name and renamed into place, so a reader (or a rerun after
a crash) sees a file either complete or not at all. A committed unit is trusted only when the
settings it records are this run's and its files are intact (see `read_committed`).
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from data_prep import document_streams
from data_prep import mds_index
from data_prep.errors import UserError, read_json
from data_prep.lazy_streaming import streaming_module

SPLITS = ("train", "val")
MAX_LISTED = 1000  # bad documents listed by name in stats.json; all are counted
EMPTY_TEXT = "empty text"  # the skip reason of an empty document: valid input, skipped, not bad
# Settings in prep.json that decide which units exist (recorded by each unit's "source"), not what
# a unit holds; every other setting is recorded in each unit's marker.
NOT_UNIT_SETTINGS = ("max_docs", "max_tokens")


class DamagedUnit(UserError):
    """A committed unit whose files are not what it recorded (missing, truncated, unparsable)."""

    def __init__(self, uid: str, damage: str):
        super().__init__(f"{damage}: committed unit {uid} is damaged")
        self.uid = uid


@contextmanager
def disk_space_errors(where: Path) -> Iterator[None]:
    """A full disk (or quota) as one line naming the path, instead of a traceback from a writer."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        what = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        raise UserError(f"{e.filename or where}: {what}; free some space and rerun the same command "
                        f"(committed units are kept)") from None


def unit_id(index: int) -> str:
    return f"{index:06d}"


def write_atomic(out: Path, path: Path, data: bytes) -> None:
    """Write via a uniquely named file in OUT/.tmp (nodes may race to write the same file; a crash
    leaves the litter there, where the merge removes it)."""
    tmp = out / ".tmp" / f"{path.name}.{uuid.uuid4().hex}"
    with disk_space_errors(path):
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)


def dump_json(obj) -> bytes:
    return (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode()


def marker(out: Path, uid: str) -> Path:
    return out / "units" / f"{uid}.json"


def unit_settings(manifest: dict) -> dict:
    """What a unit's content depends on besides its source: recorded in its marker at commit."""
    tok = manifest["tokenizer"]
    return {
        "tokenizer": {k: tok[k] for k in ("sha256", "kind", "vocab_size", "eos_id", "bos_id", "dtype")},
        **{k: v for k, v in manifest["config"].items() if k not in NOT_UNIT_SETTINGS},
    }


def read_committed(out: Path, uid: str, manifest: dict, *, legacy_ok: bool = True) -> dict | None:
    """A committed unit's stats, or None if it is not committed.

    Raises UserError when the unit was made with other settings or from another input than
    `manifest` says (or records no settings and `legacy_ok` is false: markers of older versions),
    and DamagedUnit when its marker, index or shards are not what it recorded."""
    path = marker(out, uid)
    try:
        stats = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DamagedUnit(uid, f"{path} is unreadable ({type(e).__name__})") from None
    if not isinstance(stats, dict) or not isinstance(stats.get("splits"), dict):
        raise DamagedUnit(uid, f"{path} is not a unit's stats")
    _check_unit_origin(out, path, uid, stats, manifest, legacy_ok)
    damage = _damage(out, uid, stats, manifest)
    if damage:
        raise DamagedUnit(uid, damage)
    return stats


def _check_unit_origin(out: Path, path: Path, uid: str, stats: dict, manifest: dict, legacy_ok: bool) -> None:
    units, index = manifest["units"], int(uid)
    if index >= len(units):
        raise UserError(f"{path}: this run plans {len(units)} units, none numbered {uid}: the output was "
                        f"prepared from other inputs; use a new --out or the same inputs")
    if stats.get("source") != units[index]:
        raise UserError(f"{path}: this committed unit was prepared from {_describe(stats.get('source'))}, this "
                        f"run's unit {uid} is {_describe(units[index])}; use a new --out or the same inputs")
    recorded = stats.get("settings")
    if not isinstance(recorded, dict):
        if legacy_ok:  # committed under the prep.json this run was checked against
            return
        raise UserError(f"{path}: records no settings (committed by an older gpn-scale) and {out / 'prep.json'} "
                        f"is missing, so nothing shows which settings made it; use a new --out")
    want = unit_settings(manifest)
    for key in sorted(set(want) | set(recorded)):
        old, new = recorded.get(key), want.get(key)
        if key == "tokenizer" and isinstance(old, dict) and old != new:  # name the field that differs
            diff = next(k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k))
            key, old, new = f"tokenizer {diff}", old.get(diff), new.get(diff)
        if old != new:
            raise UserError(f"{path}: this committed unit was prepared with {key}={_short(old)}, this run has "
                            f"{key}={_short(new)}; use a new --out or the settings it was prepared with")


def _short(value) -> str:
    return repr(value[:12] + "...") if isinstance(value, str) and len(value) == 64 else repr(value)  # a sha256


def _describe(source) -> str:
    if not isinstance(source, dict):
        return repr(source)
    if source.get("row_group", -1) < 0:
        return f"{source.get('file')} (jsonl)"
    return f"{source.get('file')} row group {source.get('row_group')} rows {source.get('start')}-{source.get('stop')}"


def _damage(out: Path, uid: str, stats: dict, manifest: dict) -> str | None:
    """What is wrong with a committed unit's files, if anything: each split's index must pass the
    readers' check (plain names inside the unit, each shard of the size its index records: MDS
    records no hashes, so that is the check), before the merge joins it into the root index."""
    for split in stats["splits"]:
        try:
            mds_index.check(out / split / uid, hashes=False)
        except UserError as e:
            return str(e)
    npy = out / "units" / f"{uid}.npy"
    try:
        shape = np.load(npy, mmap_mode="r").shape
    except (OSError, ValueError) as e:
        return f"{npy} is missing or unreadable ({type(e).__name__})"
    if shape != (manifest["tokenizer"]["vocab_size"],):
        return f"{npy} has shape {shape}, expected ({manifest['tokenizer']['vocab_size']},)"
    if manifest["config"].get("streams"):
        for split in stats["splits"]:
            damage = document_streams.document_damage(document_streams.docs_dir(out, split, uid), np.dtype(manifest["tokenizer"]["dtype"]))
            if damage:
                return damage
    return None


def clear_unit(out: Path, uid: str) -> None:
    """Remove whatever an interrupted attempt at this unit left behind."""
    for path in [out / ".tmp" / uid] + [out / split / uid for split in SPLITS] + [document_streams.docs_dir(out, split, uid)
                                                                                  for split in SPLITS]:
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
        if (tmp / document_streams.DOCS / split).exists():
            document_streams.docs_dir(out, split, uid).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / document_streams.DOCS / split, document_streams.docs_dir(out, split, uid))
    with open(tmp / "unigram.npy", "wb") as f:
        np.save(f, unigram)
    os.replace(tmp / "unigram.npy", out / "units" / f"{uid}.npy")
    write_atomic(out, marker(out, uid), dump_json(stats))
    shutil.rmtree(tmp)


def check_manifest(out: Path, manifest: dict) -> None:
    """Write the manifest, or check that an existing one (an earlier run, another node) agrees."""
    path = out / "prep.json"
    if not path.exists():
        # Units committed before prep.json went missing: each must record this run's settings.
        for unit_marker in sorted((out / "units").glob("*.json")):
            if unit_marker.stem.isdigit():
                try:
                    read_committed(out, unit_marker.stem, manifest, legacy_ok=False)
                except DamagedUnit:
                    pass  # prepared again when its turn comes
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out, path, dump_json(manifest))
        return
    old = read_json(path)
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
        if (out / "units").is_dir():
            raise UserError(f"{path}: missing; rerun `gpn-scale prep` with this output's arguments to write it "
                            f"again (it checks every committed unit against them)")
        raise UserError(f"{out}: no prep.json; not a prep output directory (run `gpn-scale prep` first)")
    return read_json(path)


def merge(out: Path, allow_empty: bool = False) -> dict:
    """Write the root indexes, stats.json and unigram.npy from the committed units; return stats.

    Refuses (UserError) when nothing was kept because every input was bad, and when the train
    documents never fill one window. A split without windows (no documents reached it, or too few
    tokens) is refused too, before any root index is written, unless `allow_empty`: then it is
    written empty, with a warning. The committed units stay either way (a rerun merges them)."""
    with disk_space_errors(out):
        return _merge(out, allow_empty)


def _merge(out: Path, allow_empty: bool) -> dict:
    manifest = read_manifest(out)
    config, n_units = manifest["config"], len(manifest["units"])
    kept, missing, tokens = [], [], 0
    for index in range(n_units):
        uid = unit_id(index)
        if config["max_tokens"] is not None and tokens >= config["max_tokens"]:
            clear_unit(out, uid)  # prepared past the cap (another node, in flight): not part of the output
            continue
        try:
            stats = read_committed(out, uid, manifest)
        except DamagedUnit as e:
            raise UserError(f"{e}; rerun `gpn-scale prep` with the same arguments (on the node preparing it) "
                            f"to prepare it again") from None
        if stats is None:
            missing.append(uid)
            continue
        kept.append((uid, stats))
        tokens += sum(s["windows"] for s in stats["splits"].values()) * config["seq_len"]
    if missing:
        raise UserError(f"{out}: {len(missing)} of {n_units} work units are not committed yet (first: "
                        f"{', '.join(missing[:3])}); run prep on every node (reruns resume) before merging")
    stats = _aggregate(manifest, [s for _, s in kept])
    stats["warnings"] = _check_windows(out, stats, [s for _, s in kept])
    if stats["warnings"] and not allow_empty:
        raise UserError(f"{out}: {stats['warnings'][0]}; nothing merged (the prepared units are kept): pass "
                        f"--allow-empty to write the empty split anyway")

    for split in config["splits"]:
        (out / split).mkdir(exist_ok=True)  # absent when no unit was planned
        _merge_split_index(out, out / split, [uid for uid, _ in kept])

    unigram = np.zeros(manifest["tokenizer"]["vocab_size"], np.int64)
    for uid, _ in kept:
        unigram += np.load(out / "units" / f"{uid}.npy")
    with io.BytesIO() as f:
        np.save(f, unigram)
        write_atomic(out, out / "unigram.npy", f.getvalue())

    if config.get("streams"):
        stats["streams"] = _merge_streams(out, manifest, [uid for uid, _ in kept], allow_empty, stats["warnings"])

    write_atomic(out, out / "stats.json", dump_json(stats))
    shutil.rmtree(out / ".tmp", ignore_errors=True)
    for warning in stats["warnings"]:
        print(f"warning: {out}: {warning}", file=sys.stderr)
    return stats


def _merge_streams(out: Path, manifest: dict, uids: list[str], allow_empty: bool, warnings: list[str]) -> dict:
    """Deal each split's documents into its streams and write them (data_prep/document_streams.py)."""
    from tqdm import tqdm

    config = manifest["config"]
    counts = {"train": config["streams"], "val": config.get("val_streams") or config["streams"]}
    written = {}
    for split in config["splits"]:
        dealt, s = document_streams.plan(out, split, uids, counts[split], config["seq_len"])
        if s.windows_per_stream == 0:
            total, least = s.tokens + s.dropped_tail_tokens, s.streams * s.seq_len
            if s.documents < s.streams:  # some stream gets no document at all
                why = (f"{split} streams: 0 windows: {s.documents:,} documents for {s.streams:,} streams; each stream "
                       f"needs a document and a window of --seq-len {s.seq_len} tokens: at least {s.streams:,} "
                       f"documents and {least:,} tokens ({total:,} here)")
            else:
                why = (f"{split} streams: 0 windows: the shortest of {s.streams:,} streams holds {s.shortest:,} tokens, "
                       f"less than --seq-len {s.seq_len} ({s.documents:,} documents, {total:,} tokens in all; "
                       f"every stream needs a window: at least {least:,} tokens)")
            if split == "train" or not allow_empty:
                raise UserError(f"{out}: {why}; use fewer streams (--streams/--val-streams) or more documents"
                                + ("" if split == "train" else ", or pass --allow-empty"))
            warnings.append(why)
        with tqdm(total=s.streams * s.windows_per_stream, unit="window", desc=f"streams {split}", disable=None,
                  file=sys.stderr) as bar:
            document_streams.write(out, split, uids, dealt, s, manifest["tokenizer"]["dtype"], config["compression"],
                          config["size_limit"], dump_json, bar.update)
        written[split] = s.to_json()
    return written


def _merge_split_index(out: Path, split_dir: Path, uids: list[str]) -> None:
    """Write split_dir/index.json over the units' indexes, in unit order, with streaming's merge.

    The library moves its merged file into the directory it is given (and fails if one is there
    already), so it writes into a fresh directory in OUT/.tmp and the result replaces the old root
    index in one rename: a reader never sees a partial index, and a rerun's merge replaces it."""
    tmp = out / ".tmp" / f"index.{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    if uids:
        with _root_logger_quiet():
            streaming_module("base.util").merge_index([str(split_dir / uid / "index.json") for uid in uids], str(tmp))
    else:  # the library writes nothing for an empty list; an output without documents has an empty index
        (tmp / "index.json").write_bytes(dump_json({"shards": [], "version": 2}))
    os.replace(tmp / "index.json", split_dir / "index.json")
    tmp.rmdir()


@contextmanager
def _root_logger_quiet() -> Iterator[None]:
    """merge_index reports its scratch folder through `logging.warning`, which would also install a
    stderr handler on the root logger for the rest of the process; a handler of ours prevents both."""
    root, handler = logging.getLogger(), logging.NullHandler()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


def nothing_kept(out: Path, files: list[dict], bad: dict, listed: list[dict]) -> UserError:
    """The error of a run whose every input was skipped as bad (files or documents)."""
    parts = []
    if files:
        parts.append(f"{len(files)} unreadable file{'s' * (len(files) != 1)}, first {files[0]['file']}: "
                     f"{files[0]['reason']}")
    n_bad = sum(bad.values())
    if n_bad:
        first = next((d for d in listed if d["reason"] != EMPTY_TEXT), None)
        where = ""
        if first is not None:
            word = "line" if "line" in first else "row"
            where = f", first {first['file']} {word} {first[word]}: {first['reason']}"
        parts.append(f"{n_bad} bad document{'s' * (n_bad != 1)}{where}")
    return UserError(f"{out}: nothing prepared: no document was kept, every input was skipped under "
                     f"--on-error skip ({'; '.join(parts)})")


def _check_windows(out: Path, stats: dict, units: list[dict]) -> list[str]:
    """Refuse an output with nothing kept but bad input, or train documents filling no window;
    return warnings for splits without windows."""
    splits, seq_len = stats["splits"], stats["seq_len"]
    bad = {reason: n for reason, n in stats["skipped"]["documents"].items() if reason != EMPTY_TEXT}
    if not any(s["documents"] for s in splits.values()) and (bad or stats["skipped"]["files"]):
        raise nothing_kept(out, stats["skipped"]["files"], bad, stats["skipped"]["listed"])
    warnings = []
    for split, s in splits.items():
        if s["windows"]:
            continue
        if s["documents"]:
            biggest = max(u["splits"][split]["tokens"] for u in units)
            why = (f"the {split} documents hold {s['tokens']:,} tokens in all, at most {biggest:,} in one work "
                   f"unit, and each unit's tail shorter than --seq-len {seq_len} is dropped")
            if split == "train":  # an output without train windows is of no use
                raise UserError(f"{out}: no train window: {why}; use a smaller --seq-len (and a new --out)")
            warnings.append(f"{split}: 0 windows: {why}")
        elif kept := sum(s["documents"] for s in splits.values()):
            warnings.append(f"{split}: 0 windows: none of the {kept:,} kept documents went to it")
        else:
            dropped = {**stats["skipped"]["documents"], **stats["filtered"]}
            warnings.append(f"{split}: 0 windows: no document was kept"
                            + (f" (not kept: {dropped})" if dropped else " (the inputs hold no documents)"))
    return warnings


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
