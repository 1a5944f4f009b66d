"""The analyses against constructed inputs with known answers, the hooks and ablations against
independent twins, and `gpn-scale analyze` end to end."""

import json
import math

import numpy as np
import pytest
import torch
from support.eval_fixtures import tiny_model, train
from support.mds_fixture import write_windows

from gpn_scale.cli import main
from gpn_scale.eval import geometry, horizons, memory
from gpn_scale.eval.ablations import ProjectOut, SilenceHeads, run_ablations
from gpn_scale.eval.heldout import evaluate_windows
from gpn_scale.eval.states import Recorder, record
from gpn_scale.storage.native import save_native


def planted(n: int, d: int, sigmas: list[float], seed: int = 0) -> np.ndarray:
    """n states in d dims with variance sigmas^2 along len(sigmas) random orthonormal directions."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(d, len(sigmas))))
    return (rng.normal(size=(n, len(sigmas))) * sigmas) @ Q.T + 5.0  # an offset the spectrum must ignore


@pytest.mark.parametrize("sigmas", [[1.0] * 5, [3.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.25]])
def test_planted_rank_gives_the_closed_form_stable_rank_and_participation_ratio(sigmas):
    lam = np.array(sigmas) ** 2
    X = planted(40_000, 48, sigmas)
    spectrum = geometry.covariance_spectrum(X)
    assert geometry.stable_rank(spectrum) == pytest.approx(lam.sum() / lam.max(), rel=0.03)
    assert geometry.participation_ratio(spectrum) == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=0.03)
    assert spectrum[len(sigmas):].max() < 1e-20 * spectrum[0] + 1e-12  # rank exactly len(sigmas)


def test_components_for_variance_fractions_on_an_exact_spectrum():
    spectrum = np.array([50.0, 30.0, 10.0, 5.0, 4.0, 1.0])  # cumulative 0.5, 0.8, 0.9, 0.95, 0.99, 1.0
    assert geometry.components_for(spectrum, 0.90) == 3
    assert geometry.components_for(spectrum, 0.99) == 5
    assert geometry.components_for(spectrum, 0.5) == 1


def test_dead_dimensions_and_correlations():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20_000, 6)) * [1, 2, 3, 4, 5, 6]
    X[:, 4] = 7.0  # constant: dead
    X[:, 5] = -2 * X[:, 0] + 1  # perfectly anti-correlated with dimension 0
    g = geometry.geometry(X)
    assert g["dead_dims"] == 1 and g["dim_std_min"] == 0.0
    assert g["offdiag_abs_corr_max"] == pytest.approx(1.0)
    # among the 4 independent live dims: |r| ~ sqrt(2 / (pi n)); the dead one correlates with nothing
    C = geometry.correlation(X)
    assert np.abs(C[1:4, 1:4][~np.eye(3, dtype=bool)]).max() < 0.03
    assert np.all(C[4] == 0)


def test_spearman_with_ties_against_hand_ranks():
    assert geometry.ranks(np.array([3.0, 1.0, 2.0, 2.0])).tolist() == [4.0, 1.0, 2.5, 2.5]
    a = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert geometry.spearman(a, np.exp(a)) == pytest.approx(1.0)
    assert geometry.spearman(a, -a**3) == pytest.approx(-1.0)
    # hand: ranks [1,2,3,4] vs [1.5,1.5,4,3] -> Pearson of the ranks
    r = np.corrcoef([1, 2, 3, 4], [1.5, 1.5, 4, 3])[0, 1]
    assert geometry.spearman(np.array([1, 2, 3, 4]), np.array([0, 0, 9, 5])) == pytest.approx(r)


def test_planted_mean_gives_its_norm_and_cosines():
    rng = np.random.default_rng(1)
    N, T, d, sigma = 64, 200, 32, 0.5
    m = rng.normal(size=d)
    m *= 6.0 / np.linalg.norm(m)
    states = m + sigma * rng.normal(size=(N, T, d))
    r = geometry.mean_direction(states)
    assert r["sbar_norm"] == pytest.approx(6.0, rel=0.01)
    typical = np.sqrt(36 + d * sigma**2)  # E|m + noise| for a large d, to within ~1%
    assert r["sbar_fraction_of_norm"] == pytest.approx(6.0 / typical, rel=0.02)
    assert r["batch_mean_cosine"] > 0.999
    for k in (10, 100):  # a running mean over k tokens: m plus noise of variance sigma^2 / k per dim
        assert r[f"running_mean_cosine_at_{k}"] == pytest.approx(6.0 / math.sqrt(36 + d * sigma**2 / k), abs=0.01)


def test_horizons_on_a_constant_plus_alternating_sequence():
    """s_t = a_n + (-1)^t b with a_n orthogonal to b and |a_n| = |b|: raw c_k is 1 for even k and 0 for odd
    k; centred, only (-1)^t b is left, so c_k = (-1)^k exactly."""
    d, T = 8, 16
    b = np.eye(d)[0]
    a = np.stack([np.eye(d)[i] for i in range(1, 5)])  # four sequences
    states = a[:, None, :] + ((-1.0) ** np.arange(T))[None, :, None] * b
    h = horizons.similarity_horizon(states, np.array([1, 2, 3, 6, 15]))
    np.testing.assert_allclose(h["raw"], [0, 1, 0, 1, 0], atol=1e-12)
    np.testing.assert_allclose(h["centred"], [-1, 1, -1, 1, -1], atol=1e-12)


def test_constant_decays_give_exact_half_lives_and_pools():
    taus = np.array([1.5, 2.0, 3.0, 20.0, 45.0, 300.0])  # the last one outlives a 64-token window
    decays = np.broadcast_to(-1.0 / taus, (3, 64, len(taus))).copy()
    m = memory.memory_horizon(decays)
    np.testing.assert_allclose(m["half_lives"], taus, rtol=1e-9)
    assert m["extrapolated"] == [False] * 5 + [True]
    assert m["fast_heads"] == [0, 1, 2] and m["slow_heads"] == [3, 4, 5]
    assert 3.0 < m["pool_threshold"] < 20.0


def test_retention_of_data_dependent_decays_is_the_mean_product_over_starts():
    rng = np.random.default_rng(2)
    decays = -rng.uniform(0.01, 2.0, size=(2, 12, 3))
    ks = np.array([0, 1, 2, 5, 11])
    R = memory.retention(decays, ks)
    for i, k in enumerate(ks):  # brute force: every sequence, every start t, the product over t+1..t+k
        products = [np.prod(np.exp(decays[n, t + 1 : t + k + 1]), axis=0) for n in range(2) for t in range(12 - k)]
        np.testing.assert_allclose(R[i], np.mean(products, axis=0), rtol=1e-12)


def test_two_pools_is_the_best_split_of_log_half_lives():
    hl = np.array([1.2, 300.0, 2.5, 9.0, 40.0, 1.0])
    slow, threshold = memory.two_pools(hl)
    x = np.log(hl)
    cost = lambda m: ((x[m] - x[m].mean()) ** 2).sum() + ((x[~m] - x[~m].mean()) ** 2).sum()
    cuts = [x >= c for c in np.sort(x)[1:]]  # every split of the sorted values
    assert cost(slow) == pytest.approx(min(cost(m) for m in cuts))
    assert np.all(hl[slow] > threshold) and np.all(hl[~slow] < threshold)


# ---------------------------------------------------------------- hooks and ablations on a model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    data = write_windows(root / "val", n=24, seq_len=48, vocab=64)
    from gpn_scale.eval.prep_output import open_prep_output, read_windows

    windows = read_windows(open_prep_output(data))
    model = train(tiny_model(64), windows, steps=40)
    save_native(model, root / "ckpt")
    return root, data, windows, model


def test_no_op_hooks_change_nothing_and_see_every_step(trained):
    _, _, windows, model = trained
    with torch.no_grad():
        plain = model(windows[:4], core="naive")
        rec = Recorder()
        hooked = model(windows[:4], hooks=rec)
    assert torch.equal(plain.token_losses, hooked.token_losses)
    assert len(rec.predictions) == len(rec.decays) == windows.shape[1]
    # the recorded predictions decode to the model's own losses
    h = model.decode_hidden(torch.stack(rec.predictions, 1))
    ce = torch.nn.functional.cross_entropy((h @ model.embedding.T).flatten(0, 1), windows[:4].flatten(), reduction="none")
    torch.testing.assert_close(ce.view(4, -1), plain.token_losses, atol=1e-5, rtol=1e-5)
    # recorded decays are gamma = -exp(A_log) * softplus(a @ W_a + dt_bias): negative, finite
    trace = record(model, windows[:4])
    assert trace.decays.shape == (4, windows.shape[1], 4) and bool((trace.decays < 0).all())


def test_memory_off_equals_a_twin_without_the_read_projection(trained):
    _, _, windows, model = trained
    twin = tiny_model(64)
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        twin.layers[0].read_W_o_k.zero_()  # the read never reaches the state
        expected = twin(windows).loss.item()
    off = evaluate_windows(model, windows, hooks=SilenceHeads([0, 1, 2, 3]))
    assert off.loss == pytest.approx(expected, rel=1e-6)
    assert evaluate_windows(model, windows, hooks=SilenceHeads([])).loss == pytest.approx(model(windows).loss.item(), rel=1e-5)


def test_projecting_out_sbar_leaves_no_component_along_it(trained):
    _, _, windows, model = trained
    sbar = record(model, windows).predictions.reshape(-1, 32).mean(0)

    class ProjectAndRecord(ProjectOut):
        def __init__(self, direction):
            super().__init__(direction)
            self.seen = []

        def prediction(self, c):
            c = super().prediction(c)
            self.seen.append(c)
            return c

    hooks = ProjectAndRecord(sbar)
    with torch.no_grad():
        model(windows[:4], hooks=hooks)
    along = torch.stack(hooks.seen) @ (sbar / sbar.norm())
    assert along.abs().max() < 1e-4 * sbar.norm()


def test_run_ablations_reports_deltas_against_the_intact_model(trained):
    _, _, windows, model = trained
    sbar = record(model, windows).predictions.reshape(-1, 32).mean(0)
    r = run_ablations(model, windows, sbar, slow=[2, 3], fast=[0, 1])
    assert r["intact"]["loss"] == pytest.approx(model(windows).loss.item(), rel=1e-5)  # fused core, no hooks
    for arm in ("sbar_projected_out", "slow_pool_reads_zeroed", "fast_pool_reads_zeroed", "memory_reads_off"):
        assert r[arm]["delta_loss"] == pytest.approx(r[arm]["loss"] - r["intact"]["loss"])
        assert r[arm]["delta_loss"] != 0
    assert r["slow_pool_reads_zeroed"]["loss"] == pytest.approx(
        evaluate_windows(model, windows, hooks=SilenceHeads([2, 3])).loss)


def test_analyze_writes_the_report_and_every_figure(trained, tmp_path, capsys):
    root, data, _, _ = trained
    assert main(["analyze", str(root / "ckpt"), "--data", str(data), "--out", str(tmp_path), "--windows", "12"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["heldout"]["windows"] == 12 and report["heldout"]["tokens"] == 12 * 48
    assert len(report["memory"]["half_lives"]) == 4
    assert sorted(report["memory"]["fast_heads"] + report["memory"]["slow_heads"]) == [0, 1, 2, 3]
    assert set(report["ablations"]) == {"intact", "sbar_projected_out", "slow_pool_reads_zeroed",
                                        "fast_pool_reads_zeroed", "memory_reads_off"}
    assert len(report["mean_direction"]["top_tokens"]) == 10
    for name in report["figures"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(report["figures"]) == 8
    md = (tmp_path / "report.md").read_text()
    assert all(f"![]({name})" in md for name in report["figures"])


def test_analyze_says_what_does_not_apply_to_a_gpn_without_memory(trained, tmp_path):
    _, data, _, _ = trained
    save_native(tiny_model(64, family="gpn"), tmp_path / "gpn")
    assert main(["analyze", str(tmp_path / "gpn"), "--data", str(data), "--out", str(tmp_path / "r"), "--windows", "6"]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["memory"].startswith("does not apply")
    assert set(report["ablations"]) == {"intact", "sbar_projected_out"}
    assert "memory_half_lives.png" not in report["figures"]
