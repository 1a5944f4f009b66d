"""Transformer++ and Gated DeltaNet: sizes, the delta rule's two forms, causality, GPN's token
alignment and state carrying, independent twins, configs, model-info, and training through
`gpn-scale train` (ZeRO-2, 2 processes, exact resume, also with the blocks recomputed)."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gpn_scale.cli import main as cli
from gpn_scale.config import model_config
from data_prep.errors import UserError
from gpn_scale.models import (MODEL_FAMILIES, GatedDeltaNet, GDNConfig, Transformer, TransformerConfig, build_model,
                              param_count)
from gpn_scale.models.gdn import _fla_chunk_kernel, chunk_gated_delta_rule, recurrent_gated_delta_rule
from gpn_scale.storage.checkpoints import load_model
from gpn_scale.storage.native import save_native
from gpn_scale.train.metrics import flops_per_token

TINY_T = TransformerConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, d_ffn=48)
TINY_G = GDNConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=2, d_key=8, d_val=12, d_ffn=48, chunk_size=4)


def make(cfg, seed=0, dtype=torch.float64, noise=0.1, **changes):
    """A model with every parameter moved off its initialiser by `noise` x N(0, 1), so no two weights
    are alike. For the GDN, A_log is lowered so S keeps a long memory and the delta rule's terms are
    not negligible."""
    torch.manual_seed(seed)
    model = build_model(dataclasses.replace(cfg, **changes))
    with torch.no_grad():  # drawn in float32 whatever `dtype`: the same model in every precision
        for name, p in model.named_parameters():
            p.add_(noise * torch.randn_like(p))
            if name.endswith("A_log"):
                p.fill_(-2.0)
    return model.to(dtype)


def loss_and_grads(model, tokens, **kw):
    model.zero_grad()
    out = model(tokens, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_rel(a, b, tol, what=""):
    """max |a - b| <= tol * max |b|: relative to the tensor's scale, not element by element."""
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= tol * scale, f"{what}: {(a - b).abs().max().item()} vs scale {scale}"


# ---- sizes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["transformer_130m", "gdn_130m"])
def test_130m_configs_land_within_3_percent_of_gpn_m_1l(name):
    reference = param_count(model_config("gpn_m_130m_1l"))
    n = param_count(model_config(name))
    assert abs(n / reference - 1) < 0.03, (n, reference)


def test_param_count_is_the_built_models():
    cfg = model_config("gdn_tiny")
    assert param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())


def test_param_count_builds_on_the_meta_device_and_leaves_torch_alone():
    """No initialiser runs (the global RNG does not move) and torch.nn.init is what it was."""
    initialisers = dict(vars(torch.nn.init))
    rng = torch.get_rng_state()
    for name in ("gpn_m_tiny", "transformer_tiny", "gdn_tiny"):
        cfg = model_config(name)
        assert param_count(cfg) == sum(p.numel() for p in build_model(cfg).parameters())
        torch.set_rng_state(rng)
        param_count(cfg)
        assert torch.equal(torch.get_rng_state(), rng), name
    assert dict(vars(torch.nn.init)) == initialisers


@pytest.mark.parametrize("name", ["gpn_tiny", "gpn_m_tiny", "transformer_tiny", "gdn_tiny"])
def test_each_family_declares_its_parameter_groups_and_zero3_external_parameters(name):
    cfg = model_config(name)
    model = build_model(cfg)
    spec = MODEL_FAMILIES[cfg.family]
    groups = spec.param_groups(model)
    params = dict(model.named_parameters())
    ids = lambda ps: sorted(id(p) for p in ps)  # noqa: E731
    assert ids(groups.decay + groups.no_decay) == ids(params.values())  # a partition
    assert ids(groups.decay) == ids(p for p in params.values() if p.ndim == 2)
    external = spec.zero3_external_params(model)
    if cfg.family.startswith("gpn"):  # the fused core reads the layers' weights in the model's own forward
        assert ids(external) == ids(p for n, p in params.items() if n.startswith("layers."))
        assert external
    else:
        assert external == []


def test_transformer_130m_count_by_hand():
    d, f, V, L = 768, 2752, 32000, 12
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # q k v o, SwiGLU, two norms; no biases
    assert param_count(model_config("transformer_130m")) == V * d + L * per_layer + d + d  # + final norm, start


def test_gdn_130m_count_by_hand():
    d, H, dk, dv, f, V, L, conv = 768, 6, 160, 320, 2048, 32000, 10, 4
    K, Vd = H * dk, H * dv
    mixer = d * (2 * K + 2 * Vd + 2 * H) + Vd * d + conv * (2 * K + Vd) + 2 * H + dv  # + A_log, dt_bias, o_norm
    per_layer = mixer + 3 * d * f + 2 * d
    assert param_count(model_config("gdn_130m")) == V * d + L * per_layer + d + d


# ---- the gated delta rule: chunked == recurrent -------------------------------------------------------------


def _delta_inputs(B, T, H, K, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    logdecay = -torch.rand(B, T, H, generator=g, dtype=dtype) * 3.0  # up to exp(-3) per step: strong decay too
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    S0 = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, logdecay, beta, S0)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("T, chunk", [(13, 4), (16, 16), (5, 8)])
def test_chunk_form_equals_recurrent_form_with_an_incoming_state(dtype, tol, T, chunk):
    inputs = _delta_inputs(2, T, 3, 8, 5, dtype)
    outs = {}
    for form in ("recurrent", "chunk"):
        o, S = (recurrent_gated_delta_rule(*inputs) if form == "recurrent"
                else chunk_gated_delta_rule(*inputs, chunk=chunk))
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        (o * weights).sum().add((S * S).sum()).backward()
        outs[form] = [o.detach(), S.detach()] + [x.grad.clone() for x in inputs]
        for x in inputs:
            x.grad = None
    names = ["o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"]
    for name, a, b in zip(names, outs["chunk"], outs["recurrent"]):
        assert_rel(a, b, tol, name)


def _published_gated_delta_rule(q, k, v, logdecay, beta, S0):
    """The paper's form, S as d_val x d_key: S_t = S_{t-1} a_t (I - b_t k_t k_t^T) + b_t v_t k_t^T."""
    S = S0.transpose(-1, -2)
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[1]):
        kt, a, b = k[:, t], logdecay[:, t].exp()[..., None, None], beta[:, t][..., None, None]
        S = S @ (a * (eye - b * kt[..., :, None] * kt[..., None, :])) + b * v[:, t][..., :, None] * kt[..., None, :]
        outs.append((S @ q[:, t][..., None])[..., 0])
    return torch.stack(outs, 1), S.transpose(-1, -2)


def test_recurrent_form_is_the_published_update():
    inputs = [x.detach() for x in _delta_inputs(2, 9, 2, 6, 4, torch.float64)]
    o, S = recurrent_gated_delta_rule(*inputs)
    o_ref, S_ref = _published_gated_delta_rule(*inputs)
    assert_rel(o, o_ref, 1e-12, "o")
    assert_rel(S, S_ref, 1e-12, "S")


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_delta_rule_recalls_and_overwrites_associations(form):
    """Closed form: with beta = 1 and no decay, writing (k, v) replaces whatever k held, so a query
    with an orthonormal key returns exactly the last value written under it."""
    n, K, V = 4, 6, 3
    keys = torch.linalg.qr(torch.randn(K, K, dtype=torch.float64))[0][:n]  # orthonormal rows
    first, last = torch.randn(n, V, dtype=torch.float64), torch.randn(n, V, dtype=torch.float64)
    zeros_k = torch.zeros(n, K, dtype=torch.float64)
    # Writes of `first`, then `last` under the same keys, then n reads (k = 0 writes nothing).
    k = torch.cat([keys, keys, zeros_k])[None, :, None]
    v = torch.cat([first, last, torch.zeros(n, V, dtype=torch.float64)])[None, :, None]
    q = torch.cat([zeros_k, zeros_k, keys])[None, :, None]
    beta, g = torch.ones(1, 3 * n, 1, dtype=torch.float64), torch.zeros(1, 3 * n, 1, dtype=torch.float64)
    S0 = torch.randn(1, 1, K, V, dtype=torch.float64)  # old contents under the keys are replaced too
    args = (q, k, v, g, beta, S0)
    o, _ = recurrent_gated_delta_rule(*args) if form == "recurrent" else chunk_gated_delta_rule(*args, chunk=5)
    assert_rel(o[0, 2 * n :, 0], last, 1e-12, "recalled values")


# float32 rounding, amplified through the backward of the strongly perturbed model, reaches ~2e-5 in
# either form alone (measured against float64): there the forms are compared in float64, and in
# float32 on the initialised model (A_log lowered), where each form is within ~3e-6 of float64.
@pytest.mark.parametrize("dtype, noise, tol", [(torch.float32, 0.0, 1e-5), (torch.float64, 0.1, 1e-10)])
def test_gdn_model_chunk_and_recurrent_cores_agree_on_loss_and_every_gradient(dtype, noise, tol):
    tokens = torch.randint(0, TINY_G.vocab_size, (2, 11))  # 11 = two chunks of 4 and a ragged 3
    ref_out, ref_grads = loss_and_grads(make(TINY_G, dtype=dtype, noise=noise, core="recurrent"), tokens)
    out, grads = loss_and_grads(make(TINY_G, dtype=dtype, noise=noise, core="chunk"), tokens)
    assert abs(out.loss.item() - ref_out.loss.item()) <= tol * abs(ref_out.loss.item())
    assert_rel(out.token_losses, ref_out.token_losses, tol, "token_losses")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert ref_grads[name].abs().max() > 0, f"{name} has no gradient: the comparison would be empty"
        assert_rel(grads[name], ref_grads[name], tol, name)


@pytest.mark.skipif(not torch.cuda.is_available() or _fla_chunk_kernel() is None,
                    reason="flash-linear-attention's kernel runs on CUDA only, with the fla package installed")
def test_fla_kernel_matches_the_torch_chunk_form_on_cuda():
    model = make(TINY_G, dtype=torch.float32, noise=0.0, d_model=128, d_key=64, d_val=64, chunk_size=64).cuda()
    tokens = torch.randint(0, TINY_G.vocab_size, (2, 200), device="cuda")  # three chunks and a ragged tail
    results = {}
    for kernel in ("torch", "auto"):  # the model's layers share its config object
        model.config.kernel = kernel
        results[kernel] = loss_and_grads(model, tokens)
    (ref, ref_grads), (out, grads) = results["torch"], results["auto"]
    assert_rel(out.token_losses, ref.token_losses, 1e-3, "token_losses")  # the kernel may use TF32 matmuls
    for name in ref_grads:
        assert_rel(grads[name], ref_grads[name], 1e-2, name)


# ---- independent twins of the whole models ------------------------------------------------------------------


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _twin_inputs(model, tokens):
    """[start, emb[x_0], ..., emb[x_{T-2}]], written out by hand."""
    rows = [model.start] + [model.embedding[tokens[:, t]] for t in range(tokens.shape[1] - 1)]
    return torch.stack([r.expand(tokens.shape[0], -1) for r in rows], 1)


def _twin_mlp(mlp, x):
    return (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T


def transformer_twin(model: Transformer, tokens):
    """Logits by explicit softmax attention; RoPE as a complex rotation of the pairs (i, i + D/2)."""
    cfg = model.config
    B, T = tokens.shape
    Dh = cfg.d_model // cfg.n_heads
    freqs = cfg.rope_theta ** (-torch.arange(0, Dh, 2, dtype=torch.float64) / Dh)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * freqs
    rot = torch.polar(torch.ones_like(angles), angles)

    def rope(x):  # (B, T, H, Dh)
        z = torch.complex(x[..., : Dh // 2], x[..., Dh // 2 :]) * rot[:, None, :]
        return torch.cat([z.real, z.imag], -1)

    x = _twin_inputs(model, tokens)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for layer in model.layers:
        a, h = layer.mixer, _rms(x, layer.mixer_norm.weight)
        q, k, v = ((h @ p.weight.T).view(B, T, cfg.n_heads, Dh) for p in (a.q_proj, a.k_proj, a.v_proj))
        scores = torch.einsum("bqhd,bkhd->bhqk", rope(q), rope(k)) / math.sqrt(Dh)
        att = scores.masked_fill(future, -math.inf).softmax(-1)
        x = x + torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, -1) @ a.o_proj.weight.T
        x = x + _twin_mlp(layer.mlp, _rms(x, layer.mlp_norm.weight))
    return _rms(x, model.norm.weight) @ model.embedding.T


def gdn_twin(model: GatedDeltaNet, tokens):
    """Logits with the conv as an explicit sum over taps and the published delta-rule update."""
    cfg = model.config
    B, T = tokens.shape
    H = cfg.n_heads
    x = _twin_inputs(model, tokens)
    for layer in model.layers:
        m, h = layer.mixer, _rms(x, layer.mixer_norm.weight)
        pre = torch.cat([h @ m.q_proj.weight.T, h @ m.k_proj.weight.T, h @ m.v_proj.weight.T], -1)
        K = cfg.conv_size
        conv = sum(m.conv_weight[:, K - 1 - j] * F.pad(pre, (0, 0, j, 0))[:, :T] for j in range(K))
        q, k, v = F.silu(conv).split([H * cfg.d_key, H * cfg.d_key, H * cfg.d_val], -1)
        q = F.normalize(q.reshape(B, T, H, -1), dim=-1, eps=0) / math.sqrt(cfg.d_key)
        k = F.normalize(k.reshape(B, T, H, -1), dim=-1, eps=0)
        beta = torch.sigmoid(h @ m.b_proj.weight.T)
        logdecay = -m.A_log.exp() * F.softplus(h @ m.a_proj.weight.T + m.dt_bias)
        S0 = torch.zeros(B, H, cfg.d_key, cfg.d_val, dtype=x.dtype)
        o, _ = _published_gated_delta_rule(q, k, v.reshape(B, T, H, -1), logdecay, beta, S0)
        o = (_rms(o, m.o_norm_w).reshape(B, T, -1) * F.silu(h @ m.g_proj.weight.T)) @ m.o_proj.weight.T
        x = x + o
        x = x + _twin_mlp(layer.mlp, _rms(x, layer.mlp_norm.weight))
    return _rms(x, model.norm.weight) @ model.embedding.T


@pytest.mark.parametrize("cfg, twin", [(TINY_T, transformer_twin), (TINY_G, gdn_twin)], ids=["transformer", "gdn"])
def test_logits_and_losses_match_an_independent_twin(cfg, twin):
    model = make(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10))
    out = model(tokens, return_logits=True)
    with torch.no_grad():
        ref = twin(model, tokens)
    assert_rel(out.logits, ref, 1e-10, "logits")
    ce = F.cross_entropy(ref.flatten(0, 1), tokens.flatten(), reduction="none").view(tokens.shape)
    assert_rel(out.token_losses, ce, 1e-10, "token_losses")
    assert out.loss.item() == pytest.approx(ce.mean().item(), rel=1e-10)


# ---- causality, alignment, state ----------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY_T, TINY_G], ids=["transformer", "gdn"])
def test_changing_a_token_changes_no_earlier_logit(cfg):
    model = make(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    base = model(tokens, return_logits=True).logits
    for t in (0, 5, 10):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        logits = model(changed, return_logits=True).logits
        # Position t predicts token t from tokens < t: positions <= t must not see token t ...
        assert torch.equal(logits[:, : t + 1], base[:, : t + 1]), t
        # ... and position t + 1 must (else the test would pass for a model that sees nothing).
        assert not torch.allclose(logits[:, t + 1], base[:, t + 1]), t


@pytest.mark.parametrize("cfg", [TINY_T, TINY_G], ids=["transformer", "gdn"])
def test_position_zero_is_predicted_from_an_empty_context(cfg):
    model = make(cfg)
    a = torch.randint(0, cfg.vocab_size, (1, 6))
    b = torch.randint(0, cfg.vocab_size, (1, 6))
    la, lb = model(a, return_logits=True).logits, model(b, return_logits=True).logits
    assert torch.equal(la[:, 0], lb[:, 0])  # no token of the window reaches position 0
    expected = F.log_softmax(la[0, 0], -1)
    assert model(a).token_losses[0, 0].item() == pytest.approx(-expected[a[0, 0]].item(), rel=1e-12)


@pytest.mark.parametrize("cfg", [TINY_T, TINY_G], ids=["transformer", "gdn"])
def test_a_carried_state_continues_the_stream_exactly(cfg):
    model = make(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 15))
    whole = model(tokens).token_losses
    parts, state = [], None
    for a, b in ((0, 6), (6, 7), (7, 15)):  # odd pieces: one shorter than the conv, one not a chunk multiple
        out = model(tokens[:, a:b], state=state)
        parts.append(out.token_losses)
        state = out.state.detach()
    assert_rel(torch.cat(parts, 1), whole, 1e-12, "token_losses")


@pytest.mark.parametrize("cfg", [TINY_T, TINY_G], ids=["transformer", "gdn"])
def test_a_state_for_another_depth_is_refused(cfg):
    model = make(cfg)
    state = model(torch.zeros(1, 3, dtype=torch.long)).state
    shallow = make(cfg, n_layers=1)
    with pytest.raises(ValueError, match="state: expected"):
        shallow(torch.zeros(1, 3, dtype=torch.long), state=state)


@pytest.mark.parametrize("cfg", [TINY_T, TINY_G], ids=["transformer", "gdn"])
def test_bf16_autocast_stays_close_to_fp32(cfg):
    model = make(cfg, dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    ref = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens)
    assert out.token_losses.dtype == torch.float32
    assert abs(out.loss.item() - ref.loss.item()) < 0.02 * ref.loss.item()
    if isinstance(model, GatedDeltaNet):
        assert all(S.dtype == torch.float32 for _, S in out.state.layers)  # the delta rule is never low precision


# ---- initialisation -----------------------------------------------------------------------------------------


def test_initialisation_scales_the_residual_projections():
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(TINY_T, d_model=256, d_ffn=512, n_layers=8, vocab_size=300))
    std = lambda t: t.detach().std().item()  # noqa: E731
    assert std(model.embedding) == pytest.approx(0.02, rel=0.05)
    assert std(model.layers[0].mixer.q_proj.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.layers[0].mixer.o_proj.weight) == pytest.approx(0.02 / 4, rel=0.05)  # 0.02 / sqrt(2 x 8)
    assert std(model.layers[0].mlp.down_proj.weight) == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(256))
    gdn = GatedDeltaNet(dataclasses.replace(TINY_G, n_heads=64))
    A = gdn.layers[0].mixer.A_log.exp()
    assert A.min() >= 1.0 and A.max() <= 16.0
    dt = F.softplus(gdn.layers[0].mixer.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001


# ---- configs, CLI, checkpoints, FLOPs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, override, message",
    [
        ("transformer_tiny", {"n_head": 4}, "n_head: unknown key"),
        ("transformer_tiny", {"n_heads": 3}, "n_heads: d_model (64) / n_heads (3) must be an even integer"),
        ("transformer_tiny", {"d_ffn": "wide"}, "d_ffn: expected int, got str"),
        ("gdn_tiny", {"core": "scan"}, "core: expected one of"),
        ("gdn_tiny", {"kernel": "fla"}, "kernel: expected one of"),
        ("gdn_tiny", {"chunk_size": 0}, "chunk_size: expected a positive integer"),
        ("gdn_tiny", {"rope_theta": 1.0}, "rope_theta: unknown key"),
    ],
)
def test_config_errors_are_one_line_and_name_the_key(name, override, message):
    with pytest.raises(UserError, match=re.escape(message)) as e:
        model_config(name, override)
    assert f"{name}.yaml" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["transformer_tiny", "gdn_tiny"])
def test_native_checkpoint_round_trip(name, tmp_path):
    model = build_model(model_config(name))
    save_native(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert type(loaded) is type(model) and loaded.config == model.config
    tokens = torch.randint(0, model.config.vocab_size, (2, 7))
    assert torch.equal(loaded(tokens).token_losses, model(tokens).token_losses)


def test_model_info_prints_each_baselines_breakdown(capsys):
    assert cli(["model-info", "gdn_130m"]) == 0
    out = capsys.readouterr().out
    assert "family gdn, 10 layer(s)" in out and "gated delta rule" in out and "MLP (SwiGLU)" in out
    assert "131,010,296" in out  # the same total test_gdn_130m_count_by_hand computes
    assert cli(["model-info", "transformer_130m"]) == 0
    out = capsys.readouterr().out
    assert "attention" in out and "128,994,816" in out


def test_flops_per_token_counts_what_parameters_do_not():
    t = build_model(TINY_T)
    n_t = sum(p.numel() for p in t.parameters())
    # 2 layers x (q.k + weights x v: 4 FLOPs per key and channel) x 32 channels x 8.5 keys on average, x3
    assert flops_per_token(t, 16) == 6 * n_t + 3 * 2 * 4 * 32 * 8.5
    g = build_model(TINY_G)
    n_g = sum(p.numel() for p in g.parameters())
    assert flops_per_token(g, 16) == flops_per_token(g, 2048) == 6 * n_g + 3 * 2 * 6 * 2 * 8 * 12
    m = build_model(model_config("gpn_m_tiny"))  # GPN+M's count is unchanged: one write, one read per layer
    assert flops_per_token(m, 16) == 6 * sum(p.numel() for p in m.parameters()) + 3 * (4 + 2) * 4 * 16 * 16


def test_model_info_cli_runs_as_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "gpn_scale", "model-info", "transformer_tiny", "n_heads=5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "error:" in proc.stderr and "n_heads" in proc.stderr


# ---- training through `gpn-scale train` ---------------------------------------------------------------------

TOTAL = 6


def _train(config, data, run_dir, *overrides, resume=None):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "gpn_scale", "train", config, f"run.dir={run_dir}", f"data.train={data / 'train'}",
           f"data.val={data / 'val'}", "data.log_sample_ids=true", f"train.total_steps={TOTAL}", "train.save_every=3",
           "zero.stage=2", *overrides] + (["--resume", resume] if resume else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-8000:]
    return proc


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, [r for r in rows if "val_loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["transformer", "gdn"])
def test_zero2_two_process_training_stops_and_resumes_bitwise(family, tmp_path):
    from support.mds_fixture import write_windows

    data = tmp_path / "data"
    write_windows(data / "train", 200, 32, 512)
    write_windows(data / "val", 8, 32, 512, seed=1)
    config = f"{family}_tiny"
    ref, run = tmp_path / "ref", tmp_path / "run"
    proc = _train(config, data, ref)
    assert f"training {family} (" in proc.stdout  # the run's report goes to stdout
    ref_losses, ref_val = _metrics(ref)
    assert sorted(ref_losses) == list(range(1, TOTAL + 1))
    assert ref_losses[TOTAL] < ref_losses[1]  # it learns the fixture's repeating pattern

    # The run stopped at the middle checkpoint: a copy of the reference without its last checkpoint,
    # its metrics and sample log cut there (what a run stopped at that step leaves).
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / f"step_{TOTAL:08d}")
    for log in ("metrics.jsonl", "samples.jsonl"):
        lines = (run / log).read_text().splitlines()
        (run / log).write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= TOTAL // 2))
    # Resumed with the blocks recomputed (model.recompute, an execution key): on a CPU the recomputation
    # rebuilds the very activations the reference kept, so the second half still repeats it bit for bit.
    proc = _train(config, data, run, "model.recompute=true", resume="auto")
    assert f"at step {TOTAL // 2}" in proc.stdout + proc.stderr
    losses, val = _metrics(run)
    assert losses == ref_losses  # bitwise: exact float equality at every step
    assert val == ref_val
    assert (run / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()

    # The trained model loads from the run directory and scores the validation windows as the run did.
    model = load_model(run)
    assert type(model).__name__ == {"transformer": "Transformer", "gdn": "GatedDeltaNet"}[family]
