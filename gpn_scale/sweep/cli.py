"""`gpn-scale sweep SPEC.yaml --backend local|srun|slurm [--slots N] [--dry-run]` and
`gpn-scale sweep collect DIR`.

A spec (configs/sweeps/) names families, target parameter counts, token budgets, an LR rule and
seeds; the sizing rule (gpn_scale/sweep/sizing.py) turns each target into a model config. Every
point becomes a run directory with its resolved training config; `local` trains them here, N at
once on their own GPUs or cores, `srun` as job steps of the SLURM allocation it runs in (a dead
point is started again from its checkpoint; rerunning skips finished points and resumes the
rest: gpn_scale/sweep/run.py), `slurm` submits one job per point with launchers/slurm/train.sbatch.
`collect` writes results.csv, fits.json and the plots.

`gpn-scale sweep fit RESULTS.csv [--out DIR]` fits any CSV with columns params, tokens, loss
(optional family, flops) the way `collect` fits a sweep's runs (gpn_scale/sweep/laws.py): per
family L(N,D) = E + A/N^alpha + B/D^beta (Huber on log-loss, L-BFGS-B), the compute-optimal
allocation it implies, isoFLOP profiles where the points allow them, L(N) and L(C), and the
families compared at equal compute, all with 95% bootstrap intervals; fits.json and plots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from data_prep.errors import UserError
from data_prep.helptext import HelpFormatter
from data_prep.outputs import SWEEP, check_resumable


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
    _print_laws(result["fits"])
    print(f"fits: {out / 'fits.json'}; plots: {', '.join(str(p) for p in result['plots'])}")
    return 0


def _f(value, fmt: str) -> str:
    """A number of fits.json (None where a law overflowed far outside its points) as text."""
    return "n/a" if value is None else format(value, fmt)


def _range(values, fmt: str) -> str:
    return "" if values is None else " [" + ", ".join(_f(v, fmt) for v in values) + "]"


def _interval(entry: dict, key: str, fmt: str) -> str:
    interval = entry.get("interval_95")
    return "" if not interval or key not in interval else _range(interval[key], fmt)


def _print_laws(fits: dict) -> None:
    """Per family: L(N,D) with its intervals, the compute-optimal allocation, isoFLOP's a and b;
    then the families compared at equal compute."""
    for family, entry in fits.items():
        law, optimal, iso = entry["L(N,D)"], entry["compute_optimal"], entry["isoFLOP"]
        print(f"  {family} ({entry['points']} points)")
        if not isinstance(law, dict):
            print(f"    L(N,D): {law}")
        else:
            values = ", ".join(f"{name} {law[name]:{fmt}}{_interval(law, name, fmt)}" for name, fmt in
                               (("E", ".3f"), ("A", ".4g"), ("B", ".4g"), ("alpha", ".3f"), ("beta", ".3f")))
            print(f"    L(N,D) = E + A/N^alpha + B/D^beta: {values} (95%, {law['bootstrap']} resamples)")
            for warning in (law["warning"], law["interval_warning"]):
                if warning:
                    print(f"    warning: {warning}")
            print(f"    compute-optimal: N_opt ~ C^a, a {optimal['a']:.3f}{_interval(optimal, 'a', '.3f')}; "
                  f"D_opt ~ C^b, b {optimal['b']:.3f}{_interval(optimal, 'b', '.3f')}; {optimal['C']}")
            for row in optimal["budgets"]:
                print(f"      C {row['C']:.3g}: N_opt {_f(row['N_opt'], '.3g')}, D_opt {_f(row['D_opt'], '.3g')}, "
                      f"{_f(row['tokens_per_param'], '.3g')}{_range(row['tokens_per_param_95'], '.3g')} tokens/param, "
                      f"loss {_f(row['loss'], '.3f')}" + (" (extrapolated)" if row["extrapolated"] else ""))
        if isinstance(iso, dict):
            used = sum("N_opt" in b for b in iso["budgets"])
            print(f"    isoFLOP ({used} budgets): a {iso['a']:.3f}{_interval(iso, 'a', '.3f')}, "
                  f"b {iso['b']:.3f}{_interval(iso, 'b', '.3f')}")
            if iso["interval_warning"]:
                print(f"    warning: {iso['interval_warning']}")
        else:
            print(f"    isoFLOP: {iso}")
    shown = set()
    for family, entry in fits.items():
        compared = entry.get("compared")
        for other, rows in compared.items() if isinstance(compared, dict) else ():
            if (other, family) in shown:  # each pair once
                continue
            shown.add((family, other))
            if isinstance(rows, str):
                print(f"  {family} vs {other}: {rows}")
                continue
            print(f"  {family} - {other}, loss at equal compute along their compute-optimal frontiers:")
            for row in rows:
                print(f"      C {row['C']:.3g}: {_f(row['difference'], '+.3f')}{_range(row['difference_95'], '+.3f')} "
                      f"({_f(row['loss'], '.3f')} vs {_f(row['loss_other'], '.3f')})")


def _fit(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale sweep fit",
        description="Scaling laws from a CSV of points, per family: L(N,D) = E + A/N^alpha + B/D^beta (Huber on "
                    "log-loss, L-BFGS-B), the compute-optimal allocation, isoFLOP profiles, L(N) and L(C), and the "
                    "families compared at equal compute, with 95% bootstrap intervals. Writes fits.json and plots; "
                    "docs/sweep.md describes them.")
    ap.add_argument("csv", help="CSV with columns params, tokens, loss (optional: family, flops = training FLOPs; "
                                "other columns are ignored), one row per point")
    ap.add_argument("--out", metavar="DIR", help="directory for fits.json and the plots (default: the CSV's directory)")
    ap.add_argument("--loss", metavar="COLUMN", default="loss",
                    help="the loss column (val_loss for a sweep's results.csv)")
    ap.add_argument("--bootstrap", metavar="N", type=int, default=200,
                    help="resamples of the points for the 95%% intervals")
    ap.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the resamples (default: 0)")
    ap.add_argument("--json", action="store_true", help="print fits.json's content alone on stdout, no summary")
    args = ap.parse_args(argv)
    if args.bootstrap < 20:
        raise UserError(f"--bootstrap: expected an integer >= 20 (a 95% interval's tails need resamples), "
                        f"got {args.bootstrap}")
    from gpn_scale.sweep.collect import write_fits
    from gpn_scale.sweep.laws import families, read_csv, why_not_joint

    path = Path(args.csv)
    rows = read_csv(path, args.loss)
    named = any("family" in r for r in rows)
    for family, points in families(rows).items():
        reason = why_not_joint(points)
        if reason:
            raise UserError(f"{path}: " + (f"family {family!r}: " if named else "") + reason)
    out = Path(args.out) if args.out else path.parent
    fits, plots = write_fits(rows, out, args.bootstrap, args.seed)
    if args.json:
        print(json.dumps(fits, indent=1))
        return 0
    print(f"{path}: {len(rows)} points, {len(fits)} famil{'ies' if len(fits) != 1 else 'y'} -> {out / 'fits.json'}")
    _print_laws(fits)
    print(f"plots: {', '.join(str(p) for p in plots)}")
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "collect":
        return _collect(argv[1:])
    if argv and argv[0] == "fit":
        return _fit(argv[1:])
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="gpn-scale sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="sweep YAML (or a name in configs/sweeps/)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value for every point's training config "
                                                 "(on top of the spec's `overrides`), e.g. data.train=DIR")
    ap.add_argument("--backend", choices=("local", "srun", "slurm"), default="local",
                    help="local: train the points here, --slots at once; srun: inside a SLURM allocation, each point "
                         "an `srun --exact` job step, --slots at once; slurm: one sbatch job per point")
    ap.add_argument("--out", help="output directory (default: the spec's `out`, else runs/sweeps/<spec name>)")
    ap.add_argument("--slots", type=int, default=1,
                    help="points running at once, each on its own GPUs (--gpus-per-point) or, on CPUs, its own "
                         "equal share of the cores")
    ap.add_argument("--gpus-per-point", type=int,
                    help="GPUs each point runs on (default: the visible GPUs / --slots; srun: none unless given)")
    ap.add_argument("--cpus-per-point", type=int,
                    help="srun: CPUs of each job step (default: the allocation's CPUs / --slots)")
    ap.add_argument("--nproc", type=int,
                    help="training processes per point (torchrun; default: --gpus-per-point where there are GPUs, else 1)")
    ap.add_argument("--retries", type=int, default=2,
                    help="times a point whose process dies is started again from its newest checkpoint")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; write and run nothing")
    args = ap.parse_intermixed_args(argv)

    from gpn_scale.sweep.run import Launcher, local_slots, run_points, srun_slots, submit_slurm
    from gpn_scale.sweep.spec import load_spec, plan, plan_cost, train_config, write_point

    spec, out = load_spec(args.spec)
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"override {item!r}: expected dotted.key=value")
        spec.overrides[key] = value
    out = Path(args.out) if args.out else out
    for flag in ("slots", "gpus_per_point", "cpus_per_point", "nproc"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')}: expected >= 1, got {value}")
    if args.retries < 0:
        raise UserError(f"--retries: expected >= 0, got {args.retries}")
    slots, launcher = [], None  # where the points run: refused here, before anything is written
    if args.backend == "srun":
        slots, cpus = srun_slots(args.slots, args.cpus_per_point, args.dry_run)
        launcher = Launcher("srun", args.nproc or args.gpus_per_point or 1, cpus, args.gpus_per_point)
    elif args.backend == "local":
        slots = local_slots(args.slots, args.gpus_per_point)
        launcher = Launcher("local", args.nproc or len(slots[0].gpus) or 1)
    check_resumable(out, "--out", "sweep", (SWEEP,))  # a rerun resumes its own sweep; nothing else is written into
    points = plan(spec)
    print(f"sweep {args.spec}: {len(points)} points -> {out}")
    print(f"  {'point':32s} {'params':>13s} {'tokens':>13s} {'steps':>7s} {'lr':>9s}")
    for p in points:
        print(f"  {p.name:32s} {p.params:>13,} {p.tokens:>13,} {p.steps:>7,} {p.lr:>9.3g}")
    for p in points:  # every point's training config is validated, also in a dry run
        train_config(spec, p, out / p.name) if args.dry_run else write_point(spec, p, out)
    if spec.schedule == "wsd":
        scheduled, separate = plan_cost(points)
        print(f"wsd: each size's largest budget trained once, the others its decay branches: {scheduled:.3e} "
              f"training FLOPs against {separate:.3e} for one run per point ({1 - scheduled / separate:.0%} saved)")
    if args.backend == "slurm":
        return submit_slurm(spec, points, out, args.dry_run)
    return run_points(points, out, launcher, slots, args.retries, args.dry_run)
