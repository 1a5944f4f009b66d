"""`gpn-scale launch [--nproc N] [--nnodes N|MIN:MAX ...] CONFIG [key=value ...]`: torchrun, spelled out.

Prints the exact torchrun command, then runs it. One node by default (`--standalone`); with
`--nnodes` and `--rdzv-endpoint` it is the multi-node / elastic form that launchers/elastic.sh
and launchers/slurm/train.sbatch use. The trainer always gets `--resume auto`, so relaunching
the same command continues the run from its newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys

from data_prep.errors import UserError
from data_prep.helptext import HelpFormatter


def torchrun_command(config: str, overrides: list[str], nproc: int, nnodes: str | None = None,
                     rdzv_endpoint: str | None = None, rdzv_id: str = "gpn-scale", max_restarts: int = 0,
                     start: tuple[str, ...] = ("--resume", "auto")) -> list[str]:
    cmd = [sys.executable, "-m", "gpn_scale.train.torchrun"]  # torchrun, a refusal ending as one line and exit 2
    if nnodes is None:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        if not re.fullmatch(r"\d+(:\d+)?", nnodes):
            raise UserError(f"--nnodes: expected N or MIN:MAX, got {nnodes!r}")
        if not rdzv_endpoint:
            raise UserError("--rdzv-endpoint: required with --nnodes (HOST:PORT of the rendezvous, e.g. the first node)")
        cmd += ["--nnodes", nnodes, "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    cmd += ["--nproc-per-node", str(nproc), "-m", "gpn_scale", "train", config, *overrides, *start]
    return cmd


def _default_nproc() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="training YAML (or a name in configs/train/)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value, as for `gpn-scale train`")
    ap.add_argument("--nproc", type=int, help="processes on this node (default: GPUs here, else 1)")
    ap.add_argument("--nnodes", help="N, or MIN:MAX for elastic membership (default: this node only)")
    ap.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (with --nnodes)")
    ap.add_argument("--rdzv-id", default="gpn-scale", help="the run's rendezvous id, the same on every node")
    ap.add_argument("--max-restarts", type=int, default=0, help="worker-group restarts after a failure (elastic)")
    ap.add_argument("--dry-run", action="store_true", help="print the command only (its config checked, not the data)")
    args = ap.parse_intermixed_args(argv)  # key=value overrides may come after flags

    from gpn_scale.train.config import load_train_config

    cfg = load_train_config(args.config, args.overrides)  # bad configs fail here, not in N processes
    nproc = args.nproc or _default_nproc()
    if nproc < 1:
        raise UserError(f"--nproc: expected >= 1, got {nproc}")
    if not args.dry_run:  # and the data and run.dir, as `gpn-scale train --check` (the launch scripts) checks them
        from gpn_scale.config import resolve_config_path
        from gpn_scale.train import preflight

        preflight.check(cfg, "auto", resolve_config_path(args.config, "train"), world=nproc if args.nnodes is None else None)
    cmd = torchrun_command(args.config, args.overrides, nproc, args.nnodes, args.rdzv_endpoint, args.rdzv_id,
                           args.max_restarts)
    print("+ " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(cmd, env=env).returncode
