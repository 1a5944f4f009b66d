"""What a checkpoint's integrity costs: save + manifest + verify against a plain torch.save.

    PYTHONPATH=. python bench/ckpt.py                  # ~1 GB in 4 files (4 ranks' shards), --dir /tmp
    PYTHONPATH=. python bench/ckpt.py --gb 8 --files 8 --dir /scratch/ckpt

The same float32 tensors (`--gb` in all, split into `--files` files, as ranks write their shards)
are saved with torch.save: the baseline, what DeepSpeed does per rank. The checkpoint path saves
them as the trainer's DeepSpeed engine does, hashing each file as it is written
(gpn_scale.storage.manifest.write_hashed: xxh3-128), writes the manifest from those entries, and verifies
it as a resume does (every file read back and hashed, a thread per file). Printed: each part's
time, the ratio (hashed save + manifest + verify) / save, and two older paths for comparison:
hashing by reading the files back after a plain save (xxh3, threads), and sha256 one file after
another, at the save and again at the resume. Rounds alternate baseline and checkpoint path so a
slow spell of a shared machine hits both; each time is the fastest of `--rounds`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gpn_scale.storage import manifest


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (10^9 bytes)")
    ap.add_argument("--files", type=int, default=4, help="files it is split into (one per rank)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (a filesystem like the run's)")
    args = ap.parse_args()

    per_file = int(args.gb * 1e9 / 4 / args.files)
    shards = [torch.randn(per_file, generator=torch.Generator().manual_seed(i)) for i in range(args.files)]
    names = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in range(args.files)]
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))

    def save(d: Path) -> None:
        d.mkdir()
        for name, tensor in zip(names, shards):
            torch.save({"state": tensor}, d / name)

    def hashed_save(d: Path) -> dict[str, dict]:
        d.mkdir()
        return {name: manifest.write_hashed(d / name, lambda f, t=tensor: torch.save({"state": t}, f))
                for name, tensor in zip(names, shards)}

    best = {k: float("inf") for k in ("save", "hashed save", "manifest", "verify", "xxh3 read-back", "sha256 manifest",
                                      "sha256 verify")}
    try:
        for r in range(args.rounds):
            base = root / f"baseline_{r}"
            best["save"] = min(best["save"], timed(lambda: save(base)))
            # the previous scheme: files read back and hashed after the save (xxh3 in threads, or sha256 serially)
            best["xxh3 read-back"] = min(best["xxh3 read-back"], timed(lambda: manifest.hash_files(base, names)))
            for k in ("sha256 manifest", "sha256 verify"):
                best[k] = min(best[k], timed(lambda: [manifest.file_hash(base / n, "sha256") for n in names]))
            shutil.rmtree(base)
            ck = root / f"checkpoint_{r}"
            entries: dict[str, dict] = {}
            best["hashed save"] = min(best["hashed save"], timed(lambda: entries.update(hashed_save(ck))))
            best["manifest"] = min(best["manifest"], timed(lambda: manifest.write_entries(ck, entries)))
            assert manifest.verify_manifest(ck) is None
            best["verify"] = min(best["verify"], timed(lambda: manifest.verify_manifest(ck)))
            shutil.rmtree(ck)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    size = sum(t.numel() * 4 for t in shards)
    print(f"checkpoint: {size / 1e9:.2f} GB in {args.files} files, {args.dir}; fastest of {args.rounds} rounds")
    for k, v in best.items():
        print(f"  {k:<16} {v:7.3f} s  ({size / v / 1e9:5.2f} GB/s)")
    ratio = (best["hashed save"] + best["manifest"] + best["verify"]) / best["save"]
    read_back = (best["save"] + best["xxh3 read-back"] + best["verify"]) / best["save"]
    old = (best["save"] + best["sha256 manifest"] + best["sha256 verify"]) / best["save"]
    print(f"ratio (hashed save + manifest + verify) / save: {ratio:.3f}  (integrity adds {100 * (ratio - 1):.1f}%; "
          f"xxh3 read back after the save: {read_back:.3f}; sha256, serial: {old:.3f})")

if __name__ == "__main__":
    main()
