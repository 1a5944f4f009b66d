"""An MDS dataset's index.json, checked before MosaicML Streaming reads it.

Streaming joins each shard's `raw_data.basename` / `zip_data.basename` to the dataset's directory
and opens, downloads to or decompresses into the result, so a crafted index (a basename with
`..`, an absolute path, a name through a symlink that leaves the directory) would make a
training read, or write, a file anywhere. Datasets are shared and fetched from buckets: an index
is untrusted input. `check` reads it with the same JSON parser Streaming then uses and accepts only
what the project's own prep writes: version 2 MDS shards whose every file name is a plain relative
path that stays inside the split's directory (no `.`/`..` part, no duplicate, no symlink leading
out), a `tokens` column of fixed-length integer windows, sizes (and hashes, where the index
lists any) that match the files present, and a shard header that agrees with the sample count.
Streaming writes a fetched or decompressed file to `NAME.tmp` first and then renames it, and an
open for writing follows a symlink: a `NAME.tmp` that is a symlink (or anything but a file left by
an interrupted write) is refused too.
Anything else is one line naming the file, the shard and the field (`UserError`), before
Streaming has read or written anything.

A remote dataset's index is fetched into its cache under a temporary name, checked there, and
only then given its real name (`gpn_scale.storage.mds_datasets`); an index already in the cache is
checked like a local one.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import UserError, read_json

INDEX = "index.json"
TOKENS = "tokens"  # the column the training reads: one window of token ids per sample
SHARD_KEYS = {"column_encodings", "column_names", "column_sizes", "compression", "format", "hashes",
              "raw_data", "samples", "size_limit", "version", "zip_data"}  # MDSReader's fields, no others
TOKEN_ENCODING = re.compile(r"ndarray:(u?int(?:8|16|32|64)):([1-9][0-9]*)")
COMPRESSION = re.compile(r"(br|bz2|gz|snappy|zstd)(:[0-9]+)?")  # Streaming's codecs, with a level
# Cheapest first: one listed hash is checked per file (any other hashlib or xxhash name, if none of these).
HASH_ORDER = ("xxh3_64", "xxh64", "xxh3_128", "xxh128", "xxh32", "md5", "sha1", "sha256", "sha512")
STAGING = ".tmp"  # Streaming's suffix for a file it is writing (download, decompression)
READ_BLOCK = 1 << 22


@dataclass(frozen=True)
class IndexInfo:
    """What a checked index holds."""

    path: Path | str
    shards: int
    samples: int
    seq_len: int | None  # tokens per window (None: no shards)
    dtype: str | None  # numpy dtype of the tokens column


def check(split_dir: str | Path, *, remote: bool = False, hashes: bool = True,
          index_path: Path | None = None, shown: str | None = None) -> IndexInfo:
    """Check `split_dir`'s index (or `index_path`, read as if it lay in `split_dir`; `shown`: the
    name errors give it).

    remote: the shards may be fetched later, so a shard file that is absent is not an error (the
    names it will be fetched to are checked all the same). hashes: check listed hashes of the files
    present (a local leader does; the other ranks of a node check names and sizes only)."""
    split_dir = Path(split_dir)
    path = index_path or split_dir / INDEX
    root = split_dir.resolve()
    if index_path is None and not path.resolve().is_relative_to(root):
        raise UserError(f"{path}: a symlink to {path.resolve()}, outside the dataset's directory {root}")
    obj = read_index(path, shown)
    path = shown or path
    seen: dict[str, int] = {}
    shapes, samples = set(), 0
    for i, shard in enumerate(obj["shards"]):
        where = f"{path}: shard {i}"
        if not isinstance(shard, dict):
            raise UserError(f"{where}: expected a JSON object, got {shard!r:.60}")
        extra = sorted(set(shard) - SHARD_KEYS)
        if extra:
            raise UserError(f"{where}: {extra[0]}: not a field of an MDS shard")
        if shard.get("format") != "mds" or shard.get("version") != 2:
            raise UserError(f"{where}: format/version: expected an MDS shard of version 2, got "
                            f"{shard.get('format')!r} version {shard.get('version')!r}")
        shape = _tokens_column(where, shard)
        if shapes and shape not in shapes:
            (n0, d0), = shapes
            raise UserError(f"{where}: column_encodings: windows of {shape[1]}:{shape[0]}, shard 0's are {d0}:{n0} "
                            "(a dataset holds windows of one length and dtype)")
        shapes.add(shape)
        n = shard.get("samples")
        if type(n) is not int or n < 0:
            raise UserError(f"{where}: samples: expected an integer >= 0, got {n!r:.60}")
        samples += n
        compression = shard.get("compression")
        if compression is not None and not (isinstance(compression, str) and COMPRESSION.fullmatch(compression)):
            raise UserError(f"{where}: compression: expected null or one of Streaming's codecs, got {compression!r:.60}")
        raw = _file_info(where, "raw_data", shard.get("raw_data"), root, seen, i)
        zipped = shard.get("zip_data")
        if zipped is not None:
            if compression is None:
                raise UserError(f"{where}: zip_data: a compressed file with compression null")
            zipped = _file_info(where, "zip_data", zipped, root, seen, i)
        raw_present = _check_present(where, "raw_data", raw, root, hashes)
        zip_present = zipped is not None and _check_present(where, "zip_data", zipped, root, hashes)
        if raw_present:
            _check_header(where, root / raw["basename"], n)
        elif not (zip_present or remote):
            raise UserError(f"{where}: raw_data.basename: {root / raw['basename']} is missing"
                            + (f" (and so is zip_data's {root / zipped['basename']})" if zipped else ""))
    seq_len, dtype = shapes.pop() if shapes else (None, None)
    return IndexInfo(path, len(obj["shards"]), samples, seq_len, dtype)


def read_index(path: Path, shown: str | None = None) -> dict:
    """The index's JSON object with a list of shards, or a one-line error."""
    name = shown or path
    try:
        obj = read_json(path, name)
    except FileNotFoundError:
        raise UserError(f"{name}: missing (not an MDS dataset)") from None
    if not isinstance(obj, dict) or obj.get("version") != 2 or not isinstance(obj.get("shards"), list):
        raise UserError(f"{name}: expected an MDS index: {{\"version\": 2, \"shards\": [...]}}")
    return obj


def _tokens_column(where: str, shard: dict) -> tuple[int, str]:
    names, encodings, sizes = shard.get("column_names"), shard.get("column_encodings"), shard.get("column_sizes")
    if not (isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)
            and len(names) == len(encodings) == len(sizes) and all(isinstance(x, str) for x in names + encodings)):
        raise UserError(f"{where}: column_names/column_encodings/column_sizes: expected three lists of one length")
    if TOKENS not in names:
        raise UserError(f"{where}: column_names: no {TOKENS!r} column (columns: {', '.join(map(repr, names)) or 'none'})")
    for name, encoding in zip(names, encodings):
        if encoding in ("pkl", "pickle"):  # decoding a pickle runs code
            raise UserError(f"{where}: column_encodings: column {name!r} is a pickle; refused")
    encoding = encodings[names.index(TOKENS)]
    match = TOKEN_ENCODING.fullmatch(encoding)
    if match is None:
        raise UserError(f"{where}: column_encodings: {TOKENS!r} is {encoding!r}, expected "
                        f"'ndarray:<integer dtype>:<window length>' (as `gpn-scale prep` writes)")
    return int(match.group(2)), match.group(1)


def _file_info(where: str, field: str, info, root: Path, seen: dict[str, int], shard: int) -> dict:
    if not isinstance(info, dict):
        raise UserError(f"{where}: {field}: expected an object with basename, bytes and hashes, got {info!r:.60}")
    name, size, hashes = info.get("basename"), info.get("bytes"), info.get("hashes", {})
    if not isinstance(name, str) or not _plain_relative(name):
        raise UserError(f"{where}: {field}.basename: {name!r:.80} is not a plain relative file name inside "
                        f"the dataset's directory")
    # Resolving follows every symlink on the way, those of directories included.
    if not (root / name).resolve().is_relative_to(root):
        raise UserError(f"{where}: {field}.basename: {root / name} leads outside the dataset's directory {root} "
                        "(a symlink)")
    staging = root / (name + STAGING)
    if staging.is_symlink() or (os.path.lexists(staging) and not staging.is_file()):
        raise UserError(f"{where}: {field}.basename: {staging}, where Streaming writes {name} before renaming it, "
                        "is a symlink or not a file (a write through it would land elsewhere)")
    if name in seen:
        raise UserError(f"{where}: {field}.basename: {name!r} is also shard {seen[name]}'s file")
    seen[name] = shard
    if type(size) is not int or size < 0:
        raise UserError(f"{where}: {field}.bytes: expected an integer >= 0, got {size!r:.60}")
    if not isinstance(hashes, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in hashes.items()):
        raise UserError(f"{where}: {field}.hashes: expected an object of algorithm names to hex digests")
    return info


def _plain_relative(name: str) -> bool:
    parts = name.split("/")
    return (bool(name) and "\\" not in name and not any(ord(c) < 32 or ord(c) == 127 for c in name)
            and not name.startswith("/")
            and not re.match(r"[A-Za-z]:", name) and all(p not in ("", ".", "..") for p in parts))


def _check_present(where: str, field: str, info: dict, root: Path, hashes: bool) -> bool:
    """Whether the file is there; if so, that it is a regular file of the listed size (and hash)."""
    path = root / info["basename"]
    if not os.path.lexists(path):
        return False
    if not path.is_file():
        raise UserError(f"{where}: {field}.basename: {path} is not a regular file")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise UserError(f"{where}: {field}.bytes: the index lists {info['bytes']}, {path} holds {size} bytes")
    if hashes and info.get("hashes"):
        algo = next((a for a in HASH_ORDER if a in info["hashes"]), None) or next(
            (a for a in sorted(info["hashes"]) if _supported(a)), None)
        if algo is None:
            raise UserError(f"{where}: {field}.hashes: none of {sorted(info['hashes'])} is a hash gpn-scale checks "
                            f"(hashlib's or xxhash's, e.g. {', '.join(HASH_ORDER[:3])})")
        digest = _digest(path, algo)
        if digest != info["hashes"][algo].lower():
            raise UserError(f"{where}: {field}.hashes.{algo}: {path} hashes to {digest}, the index lists "
                            f"{info['hashes'][algo]}")
    return True


def _supported(algo: str) -> bool:
    import xxhash

    return algo in xxhash.algorithms_available or (algo in hashlib.algorithms_available and not algo.startswith("shake"))


def _digest(path: Path, algo: str) -> str:
    if algo.startswith("xxh"):
        import xxhash  # Streaming's own dependency, as its hashing uses it

        h = getattr(xxhash, algo)()
    else:
        h = hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def _check_header(where: str, path: Path, samples: int) -> None:
    """An MDS file starts with its sample count (uint32) and then samples + 1 offsets."""
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) < 4 or int(np.frombuffer(head, np.uint32)[0]) != samples:
        found = "too short" if len(head) < 4 else f"holds {int(np.frombuffer(head, np.uint32)[0])} samples"
        raise UserError(f"{where}: samples: the index lists {samples}, {path} {found}")


def prep_root(split: Path) -> Path | None:
    """The prep output directory (the one holding stats.json) of a split it wrote: OUT for OUT/train
    and OUT/val, OUT for the streams' OUT/streams/train and OUT/streams/val (`--streams`); also OUT
    itself. None where no stats.json is there."""
    candidates = [split, split.parent]
    if (split / "streams.json").is_file():
        candidates.append(split.parent.parent)
    return next((root for root in candidates if (root / "stats.json").is_file()), None)
