"""The memory's chunk form (kernels/memory_chunk) against the step form it replaces: one chunk of
writes and reads, forward and backward, held to autograd through the plain step-by-step memory.

The fused core's own tests (tests/models/test_fused_core.py) hold the whole model in the chunk form to
the naive core; these hold the chunk algebra by itself, on its edge cases."""

import pytest
import torch
import torch.nn.functional as F

from kernels.common import rms
from kernels.memory.reference import read_factors
from kernels.memory_chunk import algebra
from kernels.memory_chunk import reference as chunk


def step_form(M, keys, values, beta, decays, queries, gates):
    """The memory step by step (docs/model.md): per step the write, then every layer's read and
    its output. Returns (errors, reads per layer, outputs per layer, M at the end)."""
    errors, reads, outputs = [], [[] for _ in queries], [[] for _ in queries]
    for j in range(keys.shape[0]):
        e = values[j] - torch.einsum("bhkv,bhk->bhv", M, keys[j])
        M = decays[j][..., None, None] * M + keys[j][..., :, None] * (beta[j][..., None] * e)[..., None, :]
        errors.append(e)
        for layer, (q, gate) in enumerate(zip(queries, gates)):
            o = torch.einsum("bhkv,bhk->bhv", M, q[j]).flatten(1)
            reads[layer].append(o)
            outputs[layer].append(F.silu(gate[j]) * o / rms(o))
    return errors, reads, outputs, M


def inputs(n, layers, B=2, H=3, dk=5, dv=6, dtype=torch.float64, seed=0, decay_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    unit = lambda x: torch.relu(x) / torch.relu(x).norm(dim=-1, keepdim=True).clamp_min(1e-6)  # noqa: E731
    return dict(M=r(B, H, dk, dv), keys=unit(r(n, B, H, dk)), values=r(n, B, H, dv), beta=torch.sigmoid(r(n, B, H)),
                decays=torch.exp(-decay_scale * r(n, B, H).abs()), queries=[unit(r(n, B, H, dk)) for _ in range(layers)],
                gates=[r(n, B, H * dv) for _ in range(layers)])


def chunk_forward(x, spare=3):
    """The chunk form's steps over the whole chunk, into chunk buffers `spare` rows longer than it
    (as the core's, sized by its longest chunk). Returns (errors, reads, outputs, M at the end)."""
    M, keys = x["M"], x["keys"]
    n, (B, H, dk, dv) = keys.shape[0], M.shape
    K, D = M.new_full((n + spare, B, H, dk), float("nan")), M.new_full((n + spare, B, H, dv), float("nan"))
    errors, reads, outputs = [], [[] for _ in x["queries"]], [[] for _ in x["queries"]]
    end = torch.full_like(M, float("nan"))
    for j in range(n):
        e, o, y = chunk.step(M, K, D, x["decays"], j, keys[j], x["values"][j], x["beta"][j], x["queries"][0][j],
                             x["gates"][0][j], out_M=end if j == n - 1 else None)
        errors.append(e)
        reads[0].append(o)
        outputs[0].append(y)
        for layer in range(1, len(x["queries"])):
            o, y = chunk.read(M, K, D, x["decays"], j, x["queries"][layer][j], x["gates"][layer][j])
            reads[layer].append(o)
            outputs[layer].append(y)
    return errors, reads, outputs, end


def chunk_backward(x, dys, dM_end, M_end):
    """The chunk form's reverse sweep over the chunk, as the fused core runs it: the chunk's values
    formed again from M_c, dM_end's coefficients, the steps backwards (later layers' reads, then
    the write and layer 0's read), and dL/dM_c. Returns a dict of stacked gradients."""
    M, keys, queries = x["M"], x["keys"], x["queries"]
    n, (B, H, dk, dv) = keys.shape[0], M.shape
    r = algebra.rebuild(M, keys, x["values"], x["beta"], x["decays"], queries)
    co = algebra.coefficients(*chunk.dm_products(dM_end, keys, r.delta), keys, r, x["beta"], queries)
    phi = torch.linalg.vecdot(dM_end.flatten(2), M_end.flatten(2))
    read_grads = [M.new_full((n + 2, B, H, dv), float("nan")) for _ in queries]
    got = {name: [None] * n for name in ("k", "v", "beta", "gamma", "q0", "gate0", "q1", "gate1")}
    for j in reversed(range(n)):
        for layer in reversed(range(1, len(queries))):
            o = r.reads[layer][j]
            f = read_factors(o.reshape(B, -1), x["gates"][layer][j])
            got[f"q{layer}"][j], got[f"gate{layer}"][j] = chunk.read_backward(
                M, keys, r.delta, r, j, o, f, dys[layer][j], read_grads[layer], phi)
        o = r.reads[0][j]
        f = read_factors(o.reshape(B, -1), x["gates"][0][j])
        dk, dv, dbeta, dgamma, dq, dgate = chunk.step_backward(
            M, keys, r.delta, r, co, j, x["beta"][j], r.e[j], x["values"][j], queries, o, f, dys[0][j], read_grads, phi)
        for name, value in zip(("k", "v", "beta", "gamma", "q0", "gate0"), (dk, dv, dbeta, dgamma, dq, dgate)):
            got[name][j] = value
    got = {name: torch.stack(v) for name, v in got.items() if v[0] is not None}
    got["M"] = chunk.carry_back(dM_end, algebra.finish(keys, r, co, x["beta"], queries, [g[:n] for g in read_grads]))
    got["phi"] = phi  # now <dL/dM_c, M_c>
    return got, r


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("n,layers", [(1, 1), (2, 2), (7, 1), (7, 2), (32, 2)])
def test_chunk_form_matches_the_step_form_in_float64(n, layers):
    x = inputs(n, layers, seed=n)
    errors, reads, outputs, M_end = step_form(**x)
    got_e, got_o, got_y, got_M = chunk_forward(x)
    assert rel(got_M, M_end) < 1e-12
    assert rel(torch.stack(got_e), torch.stack(errors)) < 1e-12
    for layer in range(layers):
        assert rel(torch.stack(got_o[layer]), torch.stack(reads[layer])) < 1e-12
        assert rel(torch.stack(got_y[layer]), torch.stack(outputs[layer])) < 1e-12

    # backward: autograd through the step form, from random gradients of every output and of M_end
    g = torch.Generator().manual_seed(100 + n)
    dys = [torch.randn(n, *x["gates"][0].shape[1:], generator=g, dtype=torch.float64) for _ in range(layers)]
    dM_end = torch.randn(x["M"].shape, generator=g, dtype=torch.float64)
    leaves = {name: x[name].clone().requires_grad_() for name in ("M", "keys", "values", "beta", "decays")}
    queries = [q.clone().requires_grad_() for q in x["queries"]]
    gates = [q.clone().requires_grad_() for q in x["gates"]]
    _, _, outs, end = step_form(**leaves, queries=queries, gates=gates)
    loss = sum((dys[l][j] * outs[l][j]).sum() for l in range(layers) for j in range(n)) + (dM_end * end).sum()
    want = dict(zip(list(leaves) + [f"q{l}" for l in range(layers)] + [f"gate{l}" for l in range(layers)],
                    torch.autograd.grad(loss, list(leaves.values()) + queries + gates)))
    got, r = chunk_backward(x, dys, dM_end, M_end)
    assert rel(r.delta, x["beta"][..., None] * torch.stack(errors)) < 1e-12  # the rebuild, from M_c alone
    assert rel(got["M"], want["M"]) < 1e-12
    assert rel(got["k"], want["keys"]) < 1e-12
    assert rel(got["v"], want["values"]) < 1e-12
    assert rel(got["beta"], want["beta"]) < 1e-12
    assert rel(got["gamma"], want["decays"] * x["decays"]) < 1e-12  # dL/dgamma = dL/ddecay * decay
    for l in range(layers):
        assert rel(got[f"q{l}"], want[f"q{l}"]) < 1e-12
        assert rel(got[f"gate{l}"], want[f"gate{l}"]) < 1e-12
    assert rel(got["phi"], torch.linalg.vecdot(got["M"].flatten(2), x["M"].flatten(2))) < 1e-12


def test_fast_decays_underflow_to_zero_not_nan():
    """Decays of 1e-20 per step: their products over a chunk underflow float32, and must do so as
    products (0), not as ratios of running products (0 / 0)."""
    x = inputs(12, 2, dtype=torch.float32, seed=3, decay_scale=0.0)
    x["decays"] = torch.full_like(x["decays"], 1e-20)
    gam = algebra.decay_products(x["decays"])
    assert torch.isfinite(gam).all() and gam[..., 0, -1].eq(0).all() and gam[..., -2, -1].eq(1e-20).all()
    errors, reads, _, M_end = step_form(**x)
    got_e, got_o, _, got_M = chunk_forward(x)
    assert rel(got_M, M_end) < 1e-5 and rel(torch.stack(got_e), torch.stack(errors)) < 1e-5
    dys = [torch.randn(12, *x["gates"][0].shape[1:]) for _ in range(2)]
    got, _ = chunk_backward(x, dys, torch.randn_like(x["M"]), M_end)
    assert all(torch.isfinite(v).all() for v in got.values())


def test_steps_fill_the_chunk_buffers_and_leave_the_rest():
    """A step writes its key and delta into row j of the chunk buffers and reads nothing beyond
    it (NaN there would show); M_c is left as it was."""
    x = inputs(4, 1, seed=5)
    M_before = x["M"].clone()
    errors, *_ = step_form(**x)
    _, _, _, _ = chunk_forward(x, spare=2)
    torch.testing.assert_close(x["M"], M_before, rtol=0, atol=0)
    n, (B, H, dk, dv) = 4, x["M"].shape
    K, D = x["M"].new_full((6, B, H, dk), float("nan")), x["M"].new_full((6, B, H, dv), float("nan"))
    for j in range(n):
        chunk.step(x["M"], K, D, x["decays"], j, x["keys"][j], x["values"][j], x["beta"][j], x["queries"][0][j], x["gates"][0][j])
    torch.testing.assert_close(K[:n], x["keys"], rtol=0, atol=0)
    torch.testing.assert_close(D[:n], x["beta"][..., None] * torch.stack(errors), rtol=1e-12, atol=1e-12)
    assert K[n:].isnan().all() and D[n:].isnan().all()
