"""Execution options that must not change the math, precision, initialisers, configs, CLI."""

import dataclasses
import math

import pytest
import torch

from gpn_scale.cli import main as cli
from gpn_scale.config import model_config
from data_prep.errors import UserError
from gpn_scale.models import GPN, GPNConfig
from gpn_scale.models.ops import linear_cross_entropy, rms_norm, rms_norm_rows

SMALL = GPNConfig(vocab_size=97, d_state=32, d_emb=16, d_ffn=40, n_heads=2, d_key=8, d_val=6, n_layers=2)


def make(cfg=SMALL, seed=0, **changes):
    torch.manual_seed(seed)
    model = GPN(dataclasses.replace(cfg, **changes))
    with torch.no_grad():  # leave the zero-initialised gates and FFN out-projection: every path live
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def loss_and_grads(model, tokens):
    model.zero_grad()
    out = model(tokens)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors autograd keeps for the backward: the activation memory of a forward."""

    def __init__(self):
        self.total = 0
        self.seen = set()

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in self.seen:
                self.seen.add(key)
                self.total += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self):
        super().__enter__()
        return self


@pytest.mark.parametrize("family", ["gpn", "gpn_m"])
def test_recompute_every_and_full_bptt_change_nothing_but_memory(family):
    tokens = torch.randint(0, SMALL.vocab_size, (2, 48))
    base = make(family=family, core="naive")  # recompute_every is the naive core's option
    with SavedBytes() as plain:
        ref_loss, ref_grads = loss_and_grads(base, tokens)
    for changes in (dict(recompute_every=8), dict(recompute_every=7), dict(bptt=48), dict(recompute_every=16, bptt=48)):
        model = make(family=family, core="naive", **changes)
        with SavedBytes() as saved:
            loss, grads = loss_and_grads(model, tokens)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        if "recompute_every" in changes:
            assert saved.total < 0.5 * plain.total, (changes, saved.total, plain.total)


def test_truncated_bptt_equals_windows_with_detached_state():
    L, T = 8, 20  # the last segment is shorter
    tokens = torch.randint(0, SMALL.vocab_size, (2, T))
    loss, grads = loss_and_grads(make(bptt=L), tokens)

    model = make()
    state, total = None, 0.0
    for t0 in range(0, T, L):
        out = model(tokens[:, t0 : t0 + L], state=state)
        total = total + out.token_losses.sum()
        state = out.state.detach()
    (total / tokens.numel()).backward()
    torch.testing.assert_close(loss, total.detach() / tokens.numel())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    _, full = loss_and_grads(make(), tokens)
    assert not torch.allclose(full["write_W_k_k"], grads["write_W_k_k"], rtol=1e-3)


def test_bf16_autocast_is_close_and_keeps_state_in_float32():
    tokens = torch.randint(0, SMALL.vocab_size, (4, 32))
    model = make()
    fp32 = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(tokens)
    assert abs(bf16.loss.item() - fp32.loss.item()) / fp32.loss.item() < 0.01
    assert bf16.state.s.dtype == bf16.state.prev_s.dtype == bf16.state.M.dtype == torch.float32
    bf16.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_rms_norm_rows_is_rms_norm_with_its_own_backward():
    """The same forward numbers as `rms_norm` (float32, and bf16 rows under autocast), and the
    gradients of autograd through `rms_norm` (float64), by finite differences too."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 5, 9, generator=gen, dtype=torch.float64), torch.randn(9, generator=gen, dtype=torch.float64)
    assert torch.equal(rms_norm_rows(x.float(), w.float()), rms_norm(x.float(), w.float()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(rms_norm_rows(x.bfloat16(), w.float()), rms_norm(x.bfloat16(), w.float()))
    x.requires_grad_(), w.requires_grad_()
    g = torch.randn(3, 5, 9, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((rms_norm(x, w) * g).sum(), (x, w))
    got = torch.autograd.grad((rms_norm_rows(x, w) * g).sum(), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(rms_norm_rows, (x, w))


@pytest.mark.parametrize("chunk", [1, 5, 64, 10_000])
def test_chunked_cross_entropy_matches_full_logits(chunk):
    h = torch.randn(37, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 12, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    g = torch.randn(37, dtype=torch.float64)
    ref = torch.nn.functional.cross_entropy(h @ w.T, y, reduction="none")
    dh, dw = torch.autograd.grad((ref * g).sum(), (h, w))
    out = linear_cross_entropy(h, w, y, chunk)
    dh2, dw2 = torch.autograd.grad((out * g).sum(), (h, w))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(dh2, dh)
    torch.testing.assert_close(dw2, dw)


def test_chunked_cross_entropy_under_bf16_rounds_the_float32_softmax_gradient_once():
    """Under bf16 autocast the logits' gradient is computed in float32 from the bf16 GEMM's
    logits and rounded to bf16 once, before the two gradient GEMMs (one chunk here)."""
    gen = torch.Generator().manual_seed(3)
    h, w = torch.randn(37, 12, generator=gen, requires_grad=True), torch.randn(50, 12, generator=gen, requires_grad=True)
    y, g = torch.randint(0, 50, (37,), generator=gen), torch.rand(37, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(h, w, y, 64)
    dh, dw = torch.autograd.grad((out * g).sum(), (h, w))
    hb, wb = h.detach().bfloat16(), w.detach().bfloat16()
    logits = (hb @ wb.T).float()
    p = (logits - torch.logsumexp(logits, -1, keepdim=True)).exp()
    p[torch.arange(37), y] -= 1.0
    d = (p * g[:, None]).bfloat16()
    assert torch.equal(dh, (d @ wb).float()) and torch.equal(dw, (d.T @ hb).float())


def test_logits_only_when_asked_and_consistent_with_loss():
    model = make()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 10))
    assert model(tokens).logits is None
    out = model(tokens, return_logits=True)
    assert out.logits.shape == (2, 10, SMALL.vocab_size)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, SMALL.vocab_size), tokens.reshape(-1))
    torch.testing.assert_close(out.loss, ce)


def test_first_position_is_predicted_from_the_empty_state():
    model = make(use_decoder_bias=False)
    with torch.no_grad():
        model.decode_proj_k.normal_()
    out = model(torch.randint(0, SMALL.vocab_size, (3, 4)), return_logits=True)
    # s^p_1 = Predict(0) = 0, so the first logits are flat: loss log(V) at position 1 everywhere.
    torch.testing.assert_close(out.token_losses[:, 0], torch.full((3,), math.log(SMALL.vocab_size)))


def test_state_continues_the_stream():
    model = make()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 20))
    whole = model(tokens)
    first = model(tokens[:, :12])
    second = model(tokens[:, 12:], state=first.state)
    torch.testing.assert_close(torch.cat([first.token_losses, second.token_losses], 1), whole.token_losses)
    torch.testing.assert_close(second.state.M, whole.state.M)


def test_initialisers_follow_the_spec():
    torch.manual_seed(0)
    cfg = GPNConfig(vocab_size=500, d_state=256, d_emb=64, d_ffn=200, n_heads=64, d_key=4, d_val=4, n_layers=2)
    m = GPN(cfg)
    assert abs(m.embedding.std().item() - 0.02) < 0.001
    for w in (m.decode_proj_k, m.fuse_proj_k, m.write_W_k_k, m.write_W_v_k, m.layers[0].ffn_w1_k, m.layers[1].read_W_q_k):
        assert abs(w.var().item() * w.shape[0] - 1.0) < 0.08, w.shape  # lecun: variance 1/fan_in
        assert w.abs().max().item() <= 2.0 * math.sqrt(1.0 / w.shape[0]) / 0.8796 + 1e-6  # truncated at 2 std
    for layer in m.layers:
        assert layer.ffn_w2_k.abs().sum() == 0 and layer.pg_gate_k.abs().sum() == 0
        assert abs(layer.read_W_o_k.std().item() - 0.02) < 0.002
    assert m.fg_gate_k.abs().sum() == 0
    a = m.write_A_log.exp()
    assert (a > 0).all() and (a <= 16).all() and a.mean() > 4
    dt = torch.nn.functional.softplus(m.write_dt_bias)
    assert (dt >= 1e-3 * 0.999).all() and (dt <= 0.1 * 1.001).all()


def test_paper_configs_land_at_130m(capsys):
    for name in ("gpn_m_130m_1l", "gpn_m_130m_2l", "gpn_130m_1l"):
        assert cli(["model-info", name]) == 0
        total_line = [l for l in capsys.readouterr().out.splitlines() if "total" in l][0]
        total = int(total_line.split()[1].replace(",", ""))
        assert abs(total - 130e6) / 130e6 < 0.03, (name, total)


def test_model_info_breakdown_sums_to_the_model(capsys):
    assert cli(["model-info", "gpn_m_tiny", "n_layers=2"]) == 0
    out = capsys.readouterr().out
    counts = {l.split()[0]: int(l.split()[-2].replace(",", "")) for l in out.splitlines()[1:-1]}
    model = GPN(model_config("gpn_m_tiny", {"n_layers": 2}))
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 3}, "d_model: unknown key"),
        ({"d_state": "wide"}, "d_state: expected int, got str"),
        ({"use_decoder_bias": 1}, "use_decoder_bias: expected bool"),
        ({"family": "rnn"}, "family: expected one of"),
        ({"n_heads": 0}, "n_heads: expected a positive integer"),
    ],
)
def test_config_errors_name_the_file_and_key(overrides, message):
    with pytest.raises(UserError, match=message) as e:
        model_config("gpn_m_tiny", overrides)
    assert "gpn_m_tiny.yaml" in str(e.value) and "\n" not in str(e.value)


def test_cli_reports_bad_input_in_one_line(capsys):
    assert cli(["model-info", "no_such_model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no_such_model: no such config file") and err.count("\n") == 1
    assert cli(["frobnicate"]) == 2


def test_a_missing_path_is_not_mistaken_for_a_bundled_config(tmp_path):
    with pytest.raises(UserError, match="no such config file$"):
        model_config(tmp_path / "gpn_m_tiny.yaml")
    assert model_config("gpn_m_tiny.yaml").d_state == model_config("gpn_m_tiny").d_state
