"""`gpn-scale sweep SPEC.yaml --backend local|slurm [--dry-run]` and `gpn-scale sweep collect DIR`.

A spec (configs/sweeps/) names families, target parameter counts, token budgets, an LR rule and
seeds; the sizing rule (gpn_scale/sweep/sizing.py) turns each target into a model config. Every
point becomes a run directory with its resolved training config; `local` trains them one after
another (rerunning skips finished points and resumes interrupted ones), `slurm` submits one job
per point with launchers/slurm/train.sbatch. `collect` writes results.csv, fits.json (L(N) and
L(C) per family with 95% bootstrap intervals) and loss_vs_params.png / loss_vs_compute.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpn_scale.errors import UserError
from gpn_scale.helptext import HelpFormatter
from gpn_scale.storage.outputs import SWEEP, check_resumable


def _collect(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale sweep collect", description="results.csv, fits and plots of a sweep")
    ap.add_argument("dir", help="the sweep's output directory")
    args = ap.parse_args(argv)
    from gpn_scale.sweep.collect import collect

    out = Path(args.dir)
    result = collect(out)
    done = sum(r["status"] == "finished" for r in result["rows"])
    print(f"{len(result['rows'])} points ({done} finished) -> {out / 'results.csv'}")
    for family, entry in result["fits"].items():
        for key in ("L(N)", "L(C)"):
            fit = entry[key]
            if isinstance(fit, dict):
                interval = fit["interval_95"]
                ci = "n/a" if interval is None else "[{:.3f}, {:.3f}]".format(*interval["alpha"])
                print(f"  {family:12s} {key}: E {fit['E']:.3f}, A {fit['A']:.4g}, alpha {fit['alpha']:.3f} "
                      f"(95% {ci}), {fit['points']} points")
                for warning in (fit["warning"], fit["interval_warning"]):
                    if warning:
                        print(f"    warning: {warning}")
            else:
                print(f"  {family:12s} {key}: {fit}")
    print(f"fits: {out / 'fits.json'}; plots: {out / 'loss_vs_params.png'}, {out / 'loss_vs_compute.png'}")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "collect":
        return _collect(argv[1:])
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="sweep YAML (or a name in configs/sweeps/)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value for every point's training config "
                                                 "(on top of the spec's `overrides`), e.g. data.train=DIR")
    ap.add_argument("--backend", choices=("local", "slurm"), default="local",
                    help="local: train the points here one after another; slurm: one sbatch job per point")
    ap.add_argument("--out", help="output directory (default: the spec's `out`, else runs/sweeps/<spec name>)")
    ap.add_argument("--nproc", type=int, default=1, help="local backend: training processes per point (torchrun)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; write and run nothing")
    args = ap.parse_intermixed_args(argv)

    from gpn_scale.sweep.run import run_local, submit_slurm
    from gpn_scale.sweep.spec import load_spec, plan, train_config, write_point

    spec, out = load_spec(args.spec)
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"override {item!r}: expected dotted.key=value")
        spec.overrides[key] = value
    out = Path(args.out) if args.out else out
    if args.nproc < 1:
        raise UserError(f"--nproc: expected >= 1, got {args.nproc}")
    check_resumable(out, "--out", "sweep", (SWEEP,))  # a rerun resumes its own sweep; nothing else is written into
    points = plan(spec)
    print(f"sweep {args.spec}: {len(points)} points -> {out}")
    print(f"  {'point':32s} {'params':>13s} {'tokens':>13s} {'steps':>7s} {'lr':>9s}")
    for p in points:
        print(f"  {p.name:32s} {p.params:>13,} {p.tokens:>13,} {p.steps:>7,} {p.lr:>9.3g}")
    for p in points:  # every point's training config is validated, also in a dry run
        train_config(spec, p, out / p.name) if args.dry_run else write_point(spec, p, out)
    if args.backend == "local":
        return run_local(points, out, args.nproc, args.dry_run)
    return submit_slurm(spec, points, out, args.dry_run)
