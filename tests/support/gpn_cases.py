"""The fused core's test models: odd sizes everywhere (no width a multiple of another), every path live,
and their losses and gradients compared (tests/models/test_fused_core.py, test_core_streams.py,
tests/train/test_carry.py, tests/models/test_resets.py)."""

import dataclasses

import torch

from gpn_scale.models import GPN, GPNConfig

# Odd sizes everywhere; T = 21 is not a multiple of any chunk length used below. The core runs the
# reference twins (kernels/*/reference.py): the Triton and C++ kernels are held to them elsewhere.
ODD = GPNConfig(vocab_size=53, d_state=22, d_emb=9, d_ffn=15, n_heads=3, d_key=5, d_val=7, core_chunk=8, kernel="torch")


def make(dtype=torch.float32, seed=0, **changes):
    torch.manual_seed(seed)
    model = GPN(dataclasses.replace(ODD, **changes)).to(dtype)
    with torch.no_grad():  # move the zero-initialised gates and FFN out-projection: every path live
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def loss_and_grads(model, tokens, core, state=None):
    model.zero_grad()
    out = model(tokens, state=state, core=core)
    # Weight the positions unevenly and use the carried state, so every output's gradient matters.
    w = torch.linspace(0.5, 1.5, tokens.shape[1], dtype=out.token_losses.dtype)
    total = (out.token_losses * w).mean() + out.state.s.square().mean() + 0.5 * out.state.prev_s.square().mean()
    if out.state.M is not None:
        total = total + out.state.M.square().mean()
    total.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_same_grads(grads, ref, tol):
    assert grads.keys() == ref.keys()
    errors = {n: rel_err(grads[n], ref[n]) for n in ref}
    assert max(errors.values()) < tol, {n: e for n, e in errors.items() if e >= tol}
