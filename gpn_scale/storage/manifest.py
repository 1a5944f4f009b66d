"""`manifest.json`: the size and hash of each file of a checkpoint directory, written last.

Shared by training checkpoints (`gpn_scale/train/checkpoint_writer.py`) and native ones
(`gpn_scale/storage/native.py`), which load without the trainer package.

A manifest lists every file of its directory, so a directory verifies only when each file listed
is there with its size and hash and no file is there that it does not list (a file added beside
a checkpoint, or an emptied manifest, is caught like a damaged one).

The hash is xxh3-128: it detects corruption (a truncated, torn or bit-flipped file) at memory
speed, several times faster than sha256, which matters when a checkpoint holds tens of GB of
optimiser state and is hashed at every save and resume. It is for integrity, not against
tampering: a forger regenerates the manifest anyway, and what protects a run from a planted file
is torch's restricted unpickler (`gpn_scale/storage/safe_load.py`). Manifests written with sha256 still verify.
Files are hashed by a pool of threads (the hashes release the GIL), each from a memory map of
the file: no copy into Python's buffers, ~1.6x faster than reading it in blocks. A writer that
knows a file's bytes as it writes them (`write_hashed`) hashes them then, at no extra read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import xxhash

from gpn_scale.storage import atomic

MANIFEST = "manifest.json"
HASH = "xxh3_128"
_HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # sha256: manifests written before xxh3


def file_hash(path: Path, name: str = HASH) -> str:
    h = _HASHES[name]()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                h.update(mapped)
    return h.hexdigest()


class _HashingFile:
    """A file open for writing that hashes the bytes written through it, in order.

    A large block is hashed on a helper thread while the calling thread writes it (both release
    the GIL), so the hash costs little beyond the write. No `fileno()`: a writer that finds one
    (torch.save) writes to the descriptor directly, past the hash.
    """

    _OVERLAP = 1 << 20  # blocks smaller than this are hashed inline: a thread hand-off costs more

    def __init__(self, f: BinaryIO, pool: ThreadPoolExecutor):
        self._f, self._pool = f, pool
        self.hash, self.bytes = _HASHES[HASH](), 0

    def write(self, block) -> int:
        view = memoryview(block).cast("B")
        if view.nbytes >= self._OVERLAP:
            hashed = self._pool.submit(self.hash.update, view)
            written = self._f.write(view)
            hashed.result()  # before returning: the caller may reuse the block
        else:
            self.hash.update(view)
            written = self._f.write(view)
        self.bytes += view.nbytes
        return written

    def flush(self) -> None:
        self._f.flush()


def write_hashed(path: Path, write: Callable[[BinaryIO], None]) -> dict:
    """Create `path`, let `write` fill it through a file object, and return its manifest entry
    (as hash_files makes it), hashed from the bytes as they were written instead of read back."""
    with open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        hashing = _HashingFile(f, pool)
        write(hashing)  # type: ignore[arg-type]  # the file methods a serialiser calls: write, flush
    return {"bytes": hashing.bytes, HASH: hashing.hash.hexdigest()}


def _threads(n_files: int) -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)), n_files))


def hash_files(directory: str | Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size, HASH: hex}} of files under `directory`, hashed in parallel."""
    directory = Path(directory)

    def entry(name: str) -> dict:
        return {"bytes": (directory / name).stat().st_size, HASH: file_hash(directory / name)}

    with ThreadPoolExecutor(_threads(len(names))) as pool:
        return dict(zip(names, pool.map(entry, names)))


def write_entries(directory: str | Path, entries: dict[str, dict]) -> Path:
    """The manifest of `entries` (as hash_files makes them), atomically, after the files are written."""
    directory = Path(directory)
    return atomic.write_text(directory / MANIFEST, json.dumps({"files": dict(sorted(entries.items()))}, indent=1))


def write_manifest(directory: str | Path, names: list[str]) -> Path:
    """Hash the files `names` (relative to `directory`) and record them."""
    return write_entries(directory, hash_files(directory, names))


def files_under(directory: str | Path, besides: tuple[str, ...] = ()) -> list[str]:
    """Every file under `directory` (through linked directories, as a loader follows them) but its
    manifest and what lies under the top-level names `besides`, relative, sorted."""
    directory = Path(directory)
    found = []
    for root, dirs, names in os.walk(directory, followlinks=True):
        rel_root = Path(root).relative_to(directory)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if d not in besides]
            names = [n for n in names if n not in besides and n != MANIFEST]
        found += [str(rel_root / n) for n in names if (Path(root) / n).is_file()]
    return sorted(found)


def link_outside(directory: str | Path, besides: tuple[str, ...] = ()) -> str | None:
    """The first entry under `directory` (but the top-level names `besides`) that is a symlink
    leading out of it, as "NAME is a symlink to TARGET, outside DIR"; None when there is none. A
    loader follows links, so a link out would load (or verify) a file the checkpoint does not hold."""
    directory = Path(directory)
    root = directory.resolve()
    seen: set[Path] = set()
    for here, dirs, names in os.walk(directory, followlinks=True):
        real_here = Path(here).resolve()
        if real_here in seen:  # reached again through a link: its entries were looked at
            dirs[:] = []
            continue
        seen.add(real_here)
        rel_here = Path(here).relative_to(directory)
        if rel_here == Path("."):
            dirs[:] = [d for d in dirs if d not in besides]
            names = [n for n in names if n not in besides]
        for name in sorted(dirs + names):
            path = Path(here) / name
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(root):
                    return f"{rel_here / name} is a symlink to {target}, outside {directory}"
                if target.is_dir() and real_here.is_relative_to(target):  # a loop: walked forever by a loader
                    return f"{rel_here / name} is a symlink to {target}, a directory that holds it"
    return None


def _entries(directory: Path) -> dict[str, dict] | str:
    """The manifest's entries, or what is wrong with it."""
    try:
        entries = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable (expected {{\"files\": {{name: {{\"bytes\": ..., \"{HASH}\": ...}}}}}})"
    if not isinstance(entries, dict):
        return f"{MANIFEST}: files: expected an object of file names"
    for rel, want in entries.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not rel:
            return f"{MANIFEST}: {rel!r} is not a file inside the checkpoint"
        if not isinstance(want, dict) or type(want.get("bytes")) is not int:
            return f"{MANIFEST}: {rel}: expected its bytes and hash"
        if not any(isinstance(want.get(name), str) for name in _HASHES):
            return f"{MANIFEST}: {rel} has no hash (expected one of {', '.join(_HASHES)})"
    return entries


def verify_manifest(directory: str | Path, required: tuple[str, ...] = (), besides: tuple[str, ...] = ()) -> str | None:
    """None when `directory`'s manifest lists exactly its files (but those under `besides`, see
    files_under), each with its size and hash, and lists every name in `required`; else what is
    wrong, in a few words (the caller names the directory). Sizes are checked first (a truncated
    file costs no hashing), then the hashes, in parallel."""
    directory = Path(directory)
    outside = link_outside(directory, besides)
    if outside:
        return outside
    entries = _entries(directory)
    if isinstance(entries, str):
        return entries
    for name in required:
        if name not in entries:
            return f"{MANIFEST} does not list {name}"
    unlisted = sorted(set(files_under(directory, besides)) - set(entries))
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        return f"{unlisted[0]}{more} is there but not listed in {MANIFEST}"
    for rel, want in sorted(entries.items()):
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {want['bytes']}"

    def problem(item: tuple[str, dict]) -> str | None:
        rel, want = item
        name = next(name for name in _HASHES if isinstance(want.get(name), str))
        if file_hash(directory / rel, name) != want[name]:
            return f"{rel} does not match its {name} hash (corrupted)"
        return None

    with ThreadPoolExecutor(_threads(len(entries))) as pool:
        return next((p for p in pool.map(problem, sorted(entries.items())) if p), None)
