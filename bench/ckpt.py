"""What a checkpoint's integrity costs: save + manifest + verify against a plain torch.save.

    PYTHONPATH=. python bench/ckpt.py                  # ~1 GB in 4 files (4 ranks' shards), --dir /tmp
    PYTHONPATH=. python bench/ckpt.py --gb 8 --files 8 --dir /scratch/ckpt

The same float32 tensors (`--gb` in all, split into `--files` files, as ranks write their shards)
are saved with torch.save: the baseline, what DeepSpeed does per rank. The checkpoint path then
also hashes the files into a manifest (gpn_scale.manifest: xxh3-128, a thread per file) and
verifies it, as a resume does. Printed: each part's time, the ratio (save + manifest + verify) /
save, and the old path (sha256, one file after another, written and verified) for comparison.
Rounds alternate baseline and checkpoint path so a slow spell of a shared machine hits both;
each time is the fastest of `--rounds`. Hashing reads files just written, from the page cache,
as a rank's own files are after its save.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gpn_scale import manifest


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

    best = {k: float("inf") for k in ("save", "manifest", "verify", "sha256 manifest", "sha256 verify")}
    try:
        for r in range(args.rounds):
            base = root / f"baseline_{r}"
            best["save"] = min(best["save"], timed(lambda: save(base)))
            shutil.rmtree(base)
            ck = root / f"checkpoint_{r}"
            save(ck)
            best["manifest"] = min(best["manifest"], timed(lambda: manifest.write_manifest(ck, names)))
            assert manifest.verify_manifest(ck) is None
            best["verify"] = min(best["verify"], timed(lambda: manifest.verify_manifest(ck)))
            # the previous scheme: sha256, one file after another, at the save and again at the resume
            best["sha256 manifest"] = min(best["sha256 manifest"], timed(
                lambda: [manifest.file_hash(ck / n, "sha256") for n in names]))
            best["sha256 verify"] = min(best["sha256 verify"], timed(
                lambda: [manifest.file_hash(ck / n, "sha256") for n in names]))
            shutil.rmtree(ck)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    size = sum(t.numel() * 4 for t in shards)
    print(f"checkpoint: {size / 1e9:.2f} GB in {args.files} files, {args.dir}; fastest of {args.rounds} rounds")
    for k, v in best.items():
        print(f"  {k:<16} {v:7.3f} s  ({size / v / 1e9:5.2f} GB/s)")
    ratio = (best["save"] + best["manifest"] + best["verify"]) / best["save"]
    old = (best["save"] + best["sha256 manifest"] + best["sha256 verify"]) / best["save"]
    print(f"ratio (save + xxh3 manifest + verify) / save: {ratio:.3f}  (integrity adds {100 * (ratio - 1):.1f}%; "
          f"sha256, serial: {old:.3f})")


if __name__ == "__main__":
    main()
