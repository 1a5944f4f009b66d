"""`gpn-scale sweep fit`: L(N,D) (approach 3), isoFLOP profiles (approach 2), the compute-optimal
allocation and the families compared, recovered from points drawn from known laws; the CSV's
refusals; `sweep collect` fitting a sweep's runs with the same code."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gpn_scale.cli import main
from gpn_scale.sweep import laws
from gpn_scale.sweep.collect import collect
from gpn_scale.sweep.spec import load_spec, plan, write_point
from support import ROOT

TRUE = {"E": 1.7, "A": 400.0, "B": 1200.0, "alpha": 0.34, "beta": 0.28}
NOISE = 0.003  # log-normal noise on each loss: 0.3%, a seed-to-seed spread of real runs


def law(N, D, E=1.7, A=400.0, B=1200.0, alpha=0.34, beta=0.28):
    return E + A * np.asarray(N, dtype=float) ** -alpha + B * np.asarray(D, dtype=float) ** -beta


def grid_rows(family=None, seed=0, noise=NOISE, sizes=np.geomspace(1e6, 3e8, 6), tpp=(2.5, 5, 10, 20, 40), **true):
    rng = np.random.default_rng(seed)
    rows = []
    for n in sizes:
        for t in tpp:
            row = {"params": n, "tokens": n * t, "loss": float(law(n, n * t, **true) * math.exp(rng.normal(0, noise)))}
            rows.append(row if family is None else {"family": family, **row})
    return rows


def write_csv(path: Path, rows: list[dict], columns=None) -> Path:
    columns = columns or list(rows[0])
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def true_optimum(C, E=1.7, A=400.0, B=1200.0, alpha=0.34, beta=0.28, k=6.0):
    G = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
    N = G * (C / k) ** (beta / (alpha + beta))
    return N, C / k / N


def test_exact_points_give_the_law_back():
    points = laws.families(grid_rows(noise=0.0))["all"]
    fit = laws.fit_joint(points, bootstrap=0)
    assert dict(zip(laws.NAMES, laws.Law.natural(fit.theta))) == pytest.approx(TRUE, rel=1e-4)
    assert fit.warning is None and len(fit.draws) == 0 and fit.interval_warning  # 0 resamples: no interval


def test_noisy_points_are_recovered_within_the_intervals_and_families_compared():
    # Two families from known laws, the second 0.1 nats higher everywhere (E 1.8): 30 points each.
    rows = grid_rows("gpn", seed=1) + grid_rows("tfm", seed=2, E=1.8)
    entries, fitted = laws.fit_all(rows, bootstrap=60, seed=0, single_bootstrap=20)
    for family, true in (("gpn", TRUE), ("tfm", {**TRUE, "E": 1.8})):
        fit = entries[family]["L(N,D)"]
        assert fit["points"] == 30 and fit["bootstrap"] == 60 and fit["warning"] is None
        for name, value in true.items():
            lo, hi = fit["interval_95"][name]
            assert lo < value < hi, (family, name, value, lo, hi)
            assert lo < fit[name] < hi
        width = {name: hi - lo for name, (lo, hi) in fit["interval_95"].items()}
        # Informative, not vacuous: over 30 seeds the median widths were E 0.16, A 245, B 172, alpha 0.05, beta 0.01.
        assert width["E"] < 0.4 and width["A"] < 600 and width["B"] < 430 and width["alpha"] < 0.12, width
        assert width["beta"] < 0.025, width
        assert fit["rmse_log"] < 2 * NOISE
        # The allocation: a = beta / (alpha + beta), and tokens per parameter at each budget, inside their intervals.
        optimal = entries[family]["compute_optimal"]
        a_true = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
        assert optimal["interval_95"]["a"][0] < a_true < optimal["interval_95"]["a"][1]
        assert optimal["a"] + optimal["b"] == pytest.approx(1.0) and optimal["k"] == pytest.approx(6.0)
        assert optimal["budgets_from"].startswith("6 budgets")  # 60 distinct compute values: spread over them
        for row in optimal["budgets"]:
            N, D = true_optimum(row["C"], **true)
            lo, hi = row["tokens_per_param_95"]
            assert lo < D / N < hi and hi / lo < 3, row
            assert row["D_opt"] == pytest.approx(row["C"] / 6 / row["N_opt"])
        assert isinstance(entries[family]["L(N)"], dict) and "pools" in entries[family]["L(N)"]["note"]
        assert entries[family]["isoFLOP"].startswith("not fitted: no compute budget has 3 or more sizes")
    compared = entries["gpn"]["compared"]["tfm"]
    assert [row["C"] for row in compared] == [row["C"] for row in entries["gpn"]["compute_optimal"]["budgets"]]
    inside = [not row["extrapolated"] for row in entries["gpn"]["compute_optimal"]["budgets"]]
    assert 2 <= sum(inside) < len(inside)  # the frontier leaves the points' sizes and token counts at the ends
    for row, within in zip(compared, inside):  # E differs by 0.1, the rest alike: the frontiers differ by 0.1
        lo, hi = row["difference_95"]
        assert lo < -0.1 < hi, row
        if within:  # where the frontier runs through the points the interval is about both E's intervals wide
            assert hi - lo < 0.35, row
    assert any(row["difference_95"][1] < 0 for row, within in zip(compared, inside) if within)  # gpn is lower
    assert entries["tfm"]["compared"]["gpn"][0]["difference"] == pytest.approx(-compared[0]["difference"])
    json.dumps(entries, allow_nan=False)  # strict JSON


def test_flops_column_sets_the_flops_per_token_per_parameter():
    rows = [{**r, "flops": 8.0 * r["params"] * r["tokens"]} for r in grid_rows(noise=0.0, sizes=np.geomspace(1e6, 1e8, 4),
                                                                              tpp=(5, 20, 80))]
    entries, _ = laws.fit_all(rows, bootstrap=20, single_bootstrap=20)
    optimal = entries["all"]["compute_optimal"]
    assert optimal["k"] == pytest.approx(8.0) and "flops column" in optimal["C"]
    for row in optimal["budgets"]:
        N, D = true_optimum(row["C"], k=8.0)
        assert row["N_opt"] == pytest.approx(N, rel=1e-3) and row["D_opt"] == pytest.approx(D, rel=1e-3)


def isoflop_rows(seed=0, noise=0.002, budgets=np.geomspace(1e17, 1e20, 4), spread=np.geomspace(1 / 4, 4, 7)):
    """Seven sizes around each budget's true optimum (the way isoFLOP sweeps are laid out)."""
    rng = np.random.default_rng(seed)
    rows = []
    for C in budgets:
        N_opt, _ = true_optimum(C)
        for n in N_opt * spread:
            d = C / (6 * n)
            rows.append({"params": n, "tokens": d, "loss": float(law(n, d) * math.exp(rng.normal(0, noise)))})
    return rows


def test_isoflop_profiles_recover_a_and_b():
    points = laws.families(isoflop_rows())["all"]
    iso = laws.fit_isoflop(points, bootstrap=100)
    a_true = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    entry = iso.to_dict()
    assert len(entry["budgets"]) == 4 and all(b["sizes"] == 7 and "N_opt" in b for b in entry["budgets"])
    for key, true in (("a", a_true), ("b", 1 - a_true)):
        lo, hi = entry["interval_95"][key]
        assert lo < true < hi and hi - lo < 0.1 and entry[key] == pytest.approx(true, abs=0.02), (key, entry)
    for budget in entry["budgets"]:  # each budget's minimum lands near the true optimum
        assert budget["N_opt"] == pytest.approx(true_optimum(budget["C"])[0], rel=0.15)
    # Budgets with fewer than 3 sizes give no profile: the reason is a string, never an exception.
    few = laws.families(grid_rows())["all"]
    assert laws.fit_isoflop(few, bootstrap=20).startswith("no compute budget has 3 or more sizes")


def test_fit_cli_writes_fits_and_plots_and_prints_a_summary(tmp_path, capsys):
    rows = grid_rows("gpn", seed=3, sizes=np.geomspace(1e6, 1e8, 4), tpp=(5, 20, 80))
    rows += grid_rows("tfm", seed=4, sizes=np.geomspace(1e6, 1e8, 4), tpp=(5, 20, 80), E=1.8)
    path = write_csv(tmp_path / "points.csv", [{**r, "note": "ignored"} for r in rows])
    assert main(["sweep", "fit", str(path), "--out", str(tmp_path / "fits"), "--bootstrap", "20"]) == 0
    out = capsys.readouterr().out
    fits = json.loads((tmp_path / "fits" / "fits.json").read_text())
    assert set(fits) == {"gpn", "tfm"} and fits["gpn"]["L(N,D)"]["bootstrap"] == 20
    assert "L(N,D) = E + A/N^alpha + B/D^beta: E 1.7" in out and "compute-optimal: N_opt ~ C^a, a 0.4" in out
    assert "tokens/param" in out and "gpn - tfm, loss at equal compute" in out
    for png in ("loss_vs_params.png", "loss_vs_compute.png", "loss_vs_tokens.png", "compute_optimal.png"):
        assert (tmp_path / "fits" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    iso = write_csv(tmp_path / "iso.csv", isoflop_rows())
    assert main(["sweep", "fit", str(iso), "--bootstrap", "20"]) == 0  # --out: the CSV's directory
    assert (tmp_path / "isoflop.png").read_bytes()[:4] == b"\x89PNG" and "isoFLOP (4 budgets): a 0.4" in \
        capsys.readouterr().out


def test_fit_json_is_alone_on_stdout(tmp_path):
    path = write_csv(tmp_path / "points.csv", grid_rows(sizes=np.geomspace(1e6, 1e8, 3), tpp=(5, 20, 80)))
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "sweep", "fit", str(path), "--json", "--bootstrap", "20"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fits = json.loads(proc.stdout)
    assert fits["all"]["L(N,D)"]["points"] == 9 and fits["all"]["compared"] == "one family only"


ROWS = "params,tokens,loss\n" + "".join(f"{n:g},{n * t:g},{law(n, n * t):.5f}\n" for n in (1e6, 1e7, 1e8) for t in (5, 20))


def edit(line: int, column: int, value: str, text: str = ROWS) -> str:
    """ROWS with one field replaced (line numbers as a file's, the header on line 1)."""
    lines = text.splitlines()
    fields = lines[line - 1].split(",")
    fields[column] = value
    lines[line - 1] = ",".join(fields)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text, message", [
    ("", "points.csv: empty (expected a header with columns params, tokens, loss (optional: family, flops))"),
    ("params,tokens,loss\n", "points.csv: no rows after the header"),
    ("params,tokens,val_loss\n1,2,3\n", "points.csv: no column 'loss' (expected columns params, tokens, loss"),
    ("params,loss\n1,3\n", "points.csv: no column 'tokens'"),
    (edit(2, 1, "five"), "points.csv: line 2: tokens: expected a finite positive number, got 'five'"),
    (edit(4, 0, "-1e7"), "points.csv: line 4: params: expected a finite positive number, got '-1e7'"),
    (edit(6, 2, "0"), "points.csv: line 6: loss: expected a finite positive number, got '0'"),
    (edit(4, 1, "inf"), "line 4: tokens: expected a finite positive number, got 'inf'"),
    (edit(5, 2, "nan"), "line 5: loss: expected a finite positive number, got 'nan'"),
    (edit(3, 1, ""), "line 3: tokens: expected a finite positive number, got nothing"),
    ("params,tokens,loss,flops\n1,2,3,-4\n", "line 2: flops: expected a finite positive number, got '-4'"),
    ("family,params,tokens,loss\n" + "".join(f"x,{line}\n" for line in ROWS.splitlines()[1:4])
     + "".join(f" ,{line}\n" for line in ROWS.splitlines()[4:]), "line 5: family: expected a name, got nothing"),
    ("params,tokens,loss\n1e6,5e6,3\n1e7,1e7,2.5\n1e8,1e9,2.2\n", "points.csv: 3 points: L(N,D) = E + A/N^alpha + "
                                                                  "B/D^beta has 5 parameters, so it needs at least 6"),
    ("params,tokens,loss\n" + "1e6,5e6,3\n1e7,1e7,2.5\n1e8,1e9,2.2\n" * 3, "points.csv: 9 points at 3 distinct "
                                                                          "(params, tokens): L(N,D)"),
    ("params,tokens,loss\n" + "".join(f"1e7,{d},3\n" for d in (1e8, 2e8, 4e8, 8e8, 1e9, 2e9)),
     "points.csv: one size only (params 1e+07): L(N,D) needs at least 3 distinct params"),
    ("params,tokens,loss\n" + "".join(f"{n},{d},3\n" for n in (1e6, 1e7) for d in (1e8, 2e8, 4e8)),
     "points.csv: 2 sizes only (params 1e+06, 1e+07): L(N,D) needs at least 3 distinct params"),
    ("params,tokens,loss\n" + "".join(f"{n},{d},3\n" for n in (1e6, 1e7, 1e8) for d in (1e8, 2e8)),
     "points.csv: 2 token budgets only (tokens 1e+08, 2e+08): L(N,D) needs at least 3 distinct tokens"),
    ("params,tokens,loss\n" + "".join(f"{n},{20 * n},3\n" for n in (1e6, 2e6, 4e6, 8e6, 1.6e7, 3.2e7)),
     "points.csv: tokens are proportional to params (one tokens-per-parameter ratio, 20,"),
    ("family,params,tokens,loss\n" + "".join(f"x,{n},{n * t},3\n" for n in (1e6, 1e7, 1e8) for t in (5, 20, 80))
     + "y,1e6,5e6,3\n", "points.csv: family 'y': 1 point: L(N,D)"),
])
def test_bad_csvs_are_refused_in_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "points.csv"
    path.write_text(text)
    assert main(["sweep", "fit", str(path), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {tmp_path}") and message in captured.err, captured.err
    assert len(captured.err.splitlines()) == 1 and captured.out == ""
    assert not (tmp_path / "out").exists()  # nothing written


def test_missing_file_and_bad_flags_are_one_line(tmp_path, capsys):
    assert main(["sweep", "fit", str(tmp_path / "none.csv")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'none.csv'}: no such file\n"
    path = tmp_path / "points.csv"
    path.write_text(ROWS)
    assert main(["sweep", "fit", str(path), "--bootstrap", "5"]) == 2
    assert capsys.readouterr().err.startswith("error: --bootstrap: expected an integer >= 20")
    assert main(["sweep", "fit", str(path), "--loss", "val_loss"]) == 2
    assert "no column 'val_loss'" in capsys.readouterr().err


def test_fit_help_shows_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "fit", "--help"])
    out = capsys.readouterr().out
    for option in ("--out", "--loss", "--bootstrap", "--seed", "--json"):
        assert option in out
    assert "(default: 200)" in out and "(default: 0)" in out and "95% bootstrap intervals" in out


def test_collect_fits_a_sweep_with_several_token_budgets_the_way_fit_does(tmp_path):
    """Runs stood in for by their records: collect's results.csv, read as `sweep fit --loss val_loss`
    reads it, gives the fits collect wrote (one code path)."""
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({
        "train": str(ROOT / "configs" / "train" / "gpn_m_tiny.yaml"),
        "overrides": {"data.train": str(tmp_path / "train"), "data.val": str(tmp_path / "val")},
        "families": ["gpn_m_1l"], "params": [40e3, 90e3, 200e3], "tokens_per_param": [1, 4, 16], "seq_len": 32,
        "global_batch": 4, "lr": {"base": 3e-3}, "seeds": [0], "out": str(tmp_path / "sweep")}))
    spec, out = load_spec(spec_path)
    rng = np.random.default_rng(0)
    for point in plan(spec):
        run_dir = write_point(spec, point, out)
        loss = float(law(point.params, point.tokens, E=2.0, A=60.0, B=300.0) * math.exp(rng.normal(0, 0.003)))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": point.steps, "loss": loss, "tokens": point.tokens})
                                               + "\n" + json.dumps({"step": point.steps, "val_loss": loss}) + "\n")
        (run_dir / "status.json").write_text(json.dumps({"status": "finished"}))
    result = collect(out, bootstrap=20, single_bootstrap=20)
    fits = result["fits"]["gpn_m_1l"]
    assert fits["points"] == 9 and isinstance(fits["L(N)"], dict) and isinstance(fits["L(N,D)"], dict)
    assert fits["compute_optimal"]["k"] > 6  # the flops column: GPN+M's memory work on top of 6 N D
    assert (out / "loss_vs_tokens.png").exists() and (out / "compute_optimal.png").exists()
    refit = laws.fit_all(laws.read_csv(out / "results.csv", loss="val_loss"), 20, single_bootstrap=20)[0]
    refit = refit["gpn_m_1l"]["L(N,D)"]  # what `sweep fit results.csv --loss val_loss` writes
    for name in laws.NAMES:
        assert refit[name] == pytest.approx(fits["L(N,D)"][name], rel=1e-6)
