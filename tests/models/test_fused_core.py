"""The fused recurrent core against the naive autograd loop, finite differences and its own pieces."""

import copy
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpn_scale.models import GPNConfig, GPNState
from gpn_scale.models.core import fuse_weights
from support.gpn_cases import ODD, assert_same_grads, loss_and_grads, make, rel_err
from kernels.memory.reference import memory_read, memory_read_backward, memory_step, memory_step_backward, read_factors

CASES = {
    "gpn_1l": dict(family="gpn", n_layers=1),
    "gpn_2l": dict(family="gpn", n_layers=2),
    "gpn_m_1l": dict(n_layers=1),
    "gpn_m_1l_bias": dict(n_layers=1, use_decoder_bias=True),
    "gpn_m_2l": dict(n_layers=2),
    "gpn_m_2l_bias": dict(n_layers=2, use_decoder_bias=True),
}


pytestmark = pytest.mark.usefixtures("one_thread")


# Float32 against float64, each core on its own: the relative errors of the loss, the carried state
# and every gradient. Measured on these inputs (AMD EPYC, AVX2, 1 and 2 threads; both memory
# forms): gradients at most 9.8e-6, the loss 9.2e-8, the state 6.4e-7; the fused core's gradient
# error at most 2.7e-6 above twice the naive one's. The bounds are 7x to 16x those.
F32_GRADS, F32_LOSS, F32_STATE, F32_EXCESS = 1e-4, 1e-6, 1e-5, 2e-5


@pytest.mark.parametrize("form", ["step", "chunk"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_is_as_accurate_as_naive_in_float32(case, form):
    """Both cores against float64, not against each other: their float32 results differ by the
    rounding of different (equally valid) orders of operations, which depends on the CPU's
    vector width and threads; the distance of each from float64 does not, to within the bounds.

    Not on all inputs: where a read o = M^T q is tiny, rms(o; w) amplifies rounding ~1/sqrt(eps),
    and both cores drift from float64 by up to 1e-3, the fused one less. The float64 tests below
    show the math is the same to rounding.
    """
    model = make(**CASES[case], memory_form=form)
    tokens = torch.randint(0, ODD.vocab_size, (3, 21))
    grads, outs = {}, {}
    for core, m in [("fused", model), ("naive", model), ("float64", copy.deepcopy(model).double())]:
        m.zero_grad()
        outs[core] = m(tokens, core="naive" if core == "float64" else core)
        outs[core].loss.backward()
        grads[core] = {n: p.grad.double() for n, p in m.named_parameters()}
    truth = outs["float64"]
    for core in ("fused", "naive"):
        assert rel_err(outs[core].loss.double(), truth.loss) < F32_LOSS, core
        for a, b in zip(outs[core].state, truth.state):
            if b is not None:
                assert rel_err(a.double(), b) < F32_STATE, core
    for name, want in grads["float64"].items():
        fused, naive = rel_err(grads["fused"][name], want), rel_err(grads["naive"][name], want)
        assert naive < F32_GRADS and fused < F32_GRADS, (name, fused, naive)
        assert fused <= 2 * naive + F32_EXCESS, (name, fused, naive)  # and as accurate as the naive core


CHUNKING = [dict(), dict(core_chunk=1), dict(core_chunk=5), dict(core_chunk=21), dict(core_chunk=64), dict(bptt=4),
            dict(bptt=5, core_chunk=3), dict(bptt=1)]
# The memory's chunk form at chunk lengths 1, 7 and 32 (T = 21: the last chunk is short, or the
# only one), with truncated BPTT cutting inside chunks (bptt 5 with chunks of 7: a chunk ends at each cut).
CHUNK_FORM = [dict(core_chunk=1), dict(core_chunk=7), dict(core_chunk=32), dict(core_chunk=7, bptt=5),
              dict(core_chunk=32, bptt=8)]


@pytest.mark.parametrize("case,changes", [(case, dict(memory_form="step", **c)) for case in ("gpn_2l", "gpn_m_1l", "gpn_m_2l_bias")
                                          for c in CHUNKING]
                         + [(case, dict(memory_form="chunk", **c)) for case in ("gpn_m_1l", "gpn_m_2l_bias") for c in CHUNK_FORM]
                         + [("gpn_2l", dict(core_chunk=7, core_projections="keep"))]
                         + [("gpn_m_2l_bias", dict(memory_form=f, core_chunk=7, bptt=5, core_projections="keep"))
                            for f in ("step", "chunk")],
                         ids=str)
def test_fused_matches_naive_exactly_in_float64(case, changes):
    """In float64 the two cores agree to rounding: the math is the same, chunking and truncation included."""
    tokens = torch.randint(0, ODD.vocab_size, (2, 21))
    model = make(torch.float64, **CASES[case], **changes)
    fused, grads = loss_and_grads(model, tokens, "fused")
    naive, ref = loss_and_grads(model, tokens, "naive")
    assert rel_err(fused.loss, naive.loss) < 1e-12
    assert_same_grads(grads, ref, 1e-10)


@pytest.mark.parametrize("case", ["gpn_1l", "gpn_m_2l", "gpn_m_2l_chunk"])
def test_incoming_state_gets_the_same_gradients(case):
    """A state carried from a window before: its s, prev_s and M get the naive core's gradients."""
    model = make(torch.float64, **CASES[case.removesuffix("_chunk")], **(dict(memory_form="chunk", core_chunk=3)
                                                                         if case.endswith("_chunk") else {}))
    tokens = torch.randint(0, ODD.vocab_size, (2, 9))
    with torch.no_grad():
        carried = model(tokens, core="naive").state
    grads = {}
    for core in ("fused", "naive"):
        state = GPNState(*(None if x is None else x.clone().requires_grad_() for x in carried))
        _, grads[core] = loss_and_grads(model, torch.randint(0, ODD.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)), core, state)
        for name, x in zip(("s", "prev_s", "M"), state):
            if x is not None and x.grad is not None:  # GPN has no M and never reads prev_s
                grads[core][name] = x.grad
    assert_same_grads(grads["fused"], grads["naive"], 1e-10)
    if case != "gpn_1l":  # the memory's first key reads the incoming previous state
        assert grads["fused"]["prev_s"].abs().max() > 0


@pytest.mark.parametrize("form", ["step", "chunk"])
def test_gradients_match_finite_differences_in_float64(form):
    cfg = dict(vocab_size=7, d_state=6, d_emb=4, d_ffn=5, n_heads=2, d_key=3, d_val=2, n_layers=2, use_decoder_bias=True, core_chunk=3,
               memory_form=form)
    model = make(torch.float64, **cfg)
    tokens = torch.randint(0, 7, (2, 7))
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        state = model(tokens[:, :3], core="naive").state
    state = [x.clone().requires_grad_() for x in state]

    def loss(*inputs):
        params = dict(zip(names, inputs[: len(names)]))
        out = torch.func.functional_call(model, params, (tokens,), dict(state=GPNState(*inputs[len(names) :]), core="fused"))
        return out.loss + out.state.M.square().sum() + out.state.s.sum() + out.state.prev_s.square().sum()

    inputs = [p.detach().clone().requires_grad_() for p in model.parameters()] + state
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("form", ["step", "chunk"])
def test_bf16_autocast_keeps_state_in_float32_and_is_as_accurate_as_naive(form):
    model = make(**CASES["gpn_m_2l"], memory_form=form)
    tokens = torch.randint(0, ODD.vocab_size, (4, 21))
    _, exact = loss_and_grads(model, tokens, "fused")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, grads = loss_and_grads(model, tokens, "fused")
        naive, ref = loss_and_grads(model, tokens, "naive")
    assert fused.state.s.dtype == fused.state.prev_s.dtype == fused.state.M.dtype == torch.float32
    assert rel_err(fused.loss, naive.loss) < 0.01
    for name in ref:  # bf16 GEMMs round differently in the two cores: compare their errors
        assert torch.isfinite(grads[name]).all()
        err, naive_err = (grads[name] - exact[name]).norm(), (ref[name] - exact[name]).norm()
        assert err <= 2 * naive_err + 0.01 * exact[name].norm(), name


def test_chunk_reads_in_the_compute_dtype_stay_within_bf16_of_float32_reads():
    """memory_reads: compute (the chunk form's per-step products read a bf16 copy of M_c, made
    once per chunk) under bf16 autocast: the loss and gradients within bf16's rounding of the
    float32 reads', M itself still float32; without autocast it changes nothing at all."""
    tokens = torch.randint(0, ODD.vocab_size, (4, 21))
    model = make(**CASES["gpn_m_2l"], memory_form="chunk", core_chunk=7)
    out32, exact = loss_and_grads(model, tokens, "fused")
    low = copy.deepcopy(model)
    low.config = dataclasses.replace(model.config, memory_reads="compute")
    out, grads = loss_and_grads(low, tokens, "fused")
    assert out.loss == out32.loss and all(torch.equal(grads[n], exact[n]) for n in exact)  # float32: nothing to narrow
    results = {}
    for m in (model, low):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[m.config.memory_reads] = loss_and_grads(m, tokens, "fused")
    (state, g_state), (compute, g_compute) = results["state"], results["compute"]
    assert compute.state.M.dtype == torch.float32 and compute.loss != state.loss  # the option is in effect
    assert rel_err(compute.loss, out32.loss) < 0.01 and rel_err(compute.state.M, out32.state.M) < 0.05
    for name in exact:  # as far from float32 as bf16 reads of M_c are, no further than bf16 GEMMs already take it
        assert (g_compute[name] - exact[name]).norm() <= 2 * (g_state[name] - exact[name]).norm() + 0.01 * exact[name].norm(), name


def test_chunk_reads_in_the_compute_dtype_keep_only_the_copy_of_each_chunks_M():
    """With memory_reads: compute the forward keeps, per chunk, only the bf16 copy of M_c its steps
    read (half M's bytes), and it is M at the chunk's start rounded: the M a window ending there
    returns, cast. The window's last M, which the backward reads too, is a buffer of its own (not
    a slot of the two the forward writes in turn, which would keep both alive)."""
    model = make(**CASES["gpn_m_2l"], memory_form="chunk", core_chunk=5, memory_reads="compute")
    tokens = torch.randint(0, ODD.vocab_size, (2, 13))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        S = _fused_node(model(tokens).loss).S
        starts = [model(tokens[:, :c0]).state.M for c0 in (5, 10)]
    assert len(S.M) == 3 and all(m.dtype == torch.bfloat16 for m in S.M)
    assert S.M_end.untyped_storage().nbytes() == S.M_end.nbytes
    assert torch.equal(S.M[0], model.initial_state(2, tokens.device).M.to(torch.bfloat16))
    for m, start in zip(S.M[1:], starts):
        assert start.dtype == torch.float32 and torch.equal(m, start.to(torch.bfloat16))


@pytest.mark.parametrize("form", ["step", "chunk"])
def test_kept_projections_are_saved_per_step_and_not_recomputed(form, monkeypatch):
    """core_projections: keep: the forward keeps every step's fused projection (each layer's, in the
    GEMMs' dtype) and the backward reads them, running no projection GEMM of its own (only the
    fuse gate's, per chunk); the loss and gradients those of recomputing them, to float32's
    rounding of GEMMs of other shapes."""
    from gpn_scale.models import core

    calls, real = [], core._mm

    def counted(x, w, *args, **kwargs):
        calls.append(tuple(w.shape))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(core, "_mm", counted)
    model = make(**CASES["gpn_m_2l"], memory_form=form, core_chunk=5)
    tokens = torch.randint(0, ODD.vocab_size, (2, 13))
    results = {}
    for projections in ("recompute", "keep"):
        model.config = dataclasses.replace(model.config, core_projections=projections)
        calls.clear()
        out = model(tokens)
        S = _fused_node(out.loss).S
        out, grads = loss_and_grads(model, tokens, "fused")
        results[projections] = (out, grads, len(calls), S)
    (out_r, g_r, n_r, S_r), (out_k, g_k, n_k, S_k) = results["recompute"], results["keep"]
    cfg, chunks = model.config, 3
    hk, hv, rest = cfg.n_heads * cfg.d_key, cfg.n_heads * cfg.d_val, 2 * cfg.d_ffn + cfg.d_state
    widths = [2 * hk + 2 * hv + 2 * cfg.n_heads + rest] + [hk + hv + rest] * (cfg.n_layers - 1)  # [k] q gate [v beta a] ffn pg
    assert [tuple(y.shape) for y in S_k.proj] == [(13, 2, n) for n in widths] and all(y.shape[0] == 2 for y in S_r.proj)
    # per chunk: the layers' projections and the fuse gate, or the gate alone
    assert n_r == chunks * (cfg.n_layers + 1) and n_k == chunks
    assert rel_err(out_k.loss, out_r.loss) < 1e-6
    assert_same_grads(g_k, g_r, 1e-4)

class NewTensors(TorchDispatchMode):
    """Records the shape of every tensor an op returns in storage that none of its inputs (nor
    its out= argument) holds: the tensors it allocated."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        self.shapes += [tuple(x.shape) for x in tree_flatten(out)[0]
                        if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in given]
        return out


def test_bf16_weight_gradients_allocate_nothing_weight_sized_per_chunk():
    """Under bf16 the weight-gradient GEMMs run in bf16 into float32 gradients; however many chunks
    the backward sweeps, it allocates the same weight-sized tensors (those made once per window)."""
    T, B = 6, 4  # B * chunk rows (8, 24) is no weight's dimension
    made = {}
    for chunk in (6, 2):  # one chunk, three
        model = make(**CASES["gpn_m_2l"], core_chunk=chunk)
        with torch.no_grad():  # the matrices the core's GEMMs read: its fused weights
            layers, fg_W, _ = fuse_weights(model)
        weights = {tuple(w.shape) for w in [fg_W, *(w for L in layers for w in (L.W, L.W2o))]}
        weights |= {s[::-1] for s in weights}
        tokens = torch.randint(0, ODD.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, core="fused").loss
        with NewTensors() as new:
            loss.backward()
        made[chunk] = sorted(s for s in new.shapes if s in weights)
    assert made[6] and made[2] == made[6]


@pytest.mark.parametrize("form", ["step", "chunk"])
def test_inference_path_gives_the_same_outputs(form):
    model = make(**CASES["gpn_m_2l"], memory_form=form)
    tokens = torch.randint(0, ODD.vocab_size, (2, 21))
    with_grad = model(tokens)
    with torch.no_grad():
        no_grad = model(tokens)
    torch.testing.assert_close(no_grad.token_losses, with_grad.token_losses.detach(), rtol=0, atol=0)
    for a, b in zip(no_grad.state, with_grad.state):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_core_is_validated():
    with pytest.raises(ValueError, match="core: expected one of"):
        GPNConfig(core="fast")
    with pytest.raises(ValueError, match="core: expected one of"):
        make()(torch.zeros(1, 2, dtype=torch.long), core="fast")
    with pytest.raises(ValueError, match="core_chunk: expected a positive integer"):
        GPNConfig(core_chunk=0)
    with pytest.raises(ValueError, match="memory_form: expected one of"):
        GPNConfig(memory_form="chunked")


def test_memory_form_auto_is_the_chunk_form_on_cuda_and_the_step_form_elsewhere():
    auto = GPNConfig()
    assert auto.memory_form == "auto"
    assert auto.memory_form_on("cuda") == "chunk" and auto.memory_form_on("cpu") == "step"
    for form in ("step", "chunk"):
        assert GPNConfig(memory_form=form).memory_form_on("cuda") == GPNConfig(memory_form=form).memory_form_on("cpu") == form
    tokens = torch.randint(0, ODD.vocab_size, (2, 9))
    node = _fused_node(make(**CASES["gpn_m_1l"])(tokens).loss)  # auto, on the CPU
    assert node.spec.chunked is False and node.S.delta is None


# ---- the memory step's torch implementation: the contract a kernel keeps ----------------------


def _memory_inputs(B=2, H=3, dk=4, dv=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    return dict(M=r(B, H, dk, dv), k=unit(r(B, H, dk)), v=r(B, H, dv), beta=torch.sigmoid(r(B, H)),
                decay=torch.exp(-torch.rand(B, H, generator=g, dtype=torch.float64)), q=unit(r(B, H, dk)), gate=r(B, H * dv))


def test_memory_step_matches_the_spec():
    x = _memory_inputs()
    M, e, o, y = memory_step(**x)
    k, v, beta, decay = x["k"], x["v"], x["beta"], x["decay"]
    pred = torch.einsum("bhkv,bhk->bhv", x["M"], k)
    M_ref = decay[..., None, None] * x["M"] + beta[..., None, None] * torch.einsum("bhk,bhv->bhkv", k, v - pred)
    o_ref = torch.einsum("bhkv,bhk->bhv", M_ref, x["q"]).flatten(1)
    y_ref = torch.nn.functional.silu(x["gate"]) * o_ref * torch.rsqrt(o_ref.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(M, M_ref)
    torch.testing.assert_close(e, v - pred)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(y, y_ref)


def test_memory_step_backward_matches_autograd():
    x = {n: t.requires_grad_() for n, t in _memory_inputs().items()}
    M, e, o, y = memory_step(**x)
    dM, dy = torch.randn_like(M), torch.randn_like(y)
    names = ["M", "k", "v", "beta", "decay", "q", "gate"]
    ref = torch.autograd.grad((M * dM).sum() + (y * dy).sum(), [x[n] for n in names])
    with torch.no_grad():
        f = read_factors(o, x["gate"])
        got = memory_step_backward(x["M"], M, x["k"], x["beta"], x["decay"], e, x["beta"][..., None] * e, x["q"], f, dM, dy)
    dM_prev, dk, dv, dbeta, ddecay, dq, dgate = got
    for name, a in zip(names, [dM_prev, dk, dv, dbeta, ddecay, dq, dgate]):
        torch.testing.assert_close(a, ref[names.index(name)], msg=name)


def test_memory_read_backward_matches_autograd():
    x = _memory_inputs(seed=1)
    M, q, gate = (x[n].requires_grad_() for n in ("M", "q", "gate"))
    o, y = memory_read(M, q, gate)
    dy, dM_in = torch.randn_like(y), torch.randn_like(M)
    ref = torch.autograd.grad((y * dy).sum(), [q, gate, M])
    with torch.no_grad():
        dq, dgate, dM = memory_read_backward(M, q, read_factors(o, gate), dy, dM_in)
    torch.testing.assert_close(dq, ref[0])
    torch.testing.assert_close(dgate, ref[1])
    torch.testing.assert_close(dM, dM_in + ref[2])


def test_memory_functions_write_into_given_buffers():
    """The core keeps M and dL/dM in two buffers written in turn: with out_M / out_dM the results
    land in the buffer given, equal to a fresh computation, and the input is left as it was."""
    x = _memory_inputs(seed=2)
    M_in = x["M"].clone()
    ref = memory_step(**x)
    buf = torch.full_like(x["M"], float("nan"))
    got = memory_step(**x, out_M=buf)
    assert got[0] is buf
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(x["M"], M_in, rtol=0, atol=0)

    M, e, o, _ = ref
    f = read_factors(o, x["gate"])
    dM, dy = torch.randn_like(M), torch.randn_like(o)
    args = (x["M"], M, x["k"], x["beta"], x["decay"], e, x["beta"][..., None] * e, x["q"], f, dM.clone(), dy)
    want = memory_step_backward(*args)
    buf = torch.full_like(M, float("nan"))
    got = memory_step_backward(*args, out_dM=buf)
    assert got[0] is buf
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(args[9], dM, rtol=0, atol=0)  # the incoming dM is not overwritten

    want = memory_read_backward(M, x["q"], f, dy, dM)
    buf = torch.full_like(M, float("nan"))
    got = memory_read_backward(M, x["q"], f, dy, dM, out_dM=buf)
    assert got[2] is buf
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _fused_node(loss):
    """The FusedCore node of loss's graph (a custom Function's node is its ctx)."""
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if type(node).__name__ == "FusedCoreBackward":
            return node
        seen.add(node)
        todo.extend(f for f, _ in node.next_functions)
    raise AssertionError("no FusedCore node in the graph")


@pytest.mark.parametrize("case", ["gpn_2l", "gpn_m_2l", "gpn_m_2l_chunk"])
def test_fused_core_saves_only_narrow_per_step_vectors(case):
    """Per step the forward keeps the normalised inputs of layers after the first, their rms and
    the write's three gates, besides references to its own input u and output P; everything else
    (layer 0's input included) is recomputed per chunk. M is kept once per chunk. The chunk form
    also keeps each step's reads, the write's error and delta (H d_v each), which its backward
    takes as they were, and a reference to the window's last M, its output."""
    chunked = case.endswith("_chunk")
    model = make(**CASES[case.removesuffix("_chunk")], memory_form="chunk" if chunked else "step")
    cfg, (B, T) = model.config, (2, 21)
    S = _fused_node(model(torch.randint(0, ODD.vocab_size, (B, T))).loss).S
    tensors = [x for v in vars(S).values() for x in (v if isinstance(v, list) else [v]) if isinstance(x, torch.Tensor)]
    per_step = sum(x.numel() for x in tensors if x.dim() and x.shape[0] == T and x is not S.preds and x is not S.u)
    memory = 3 * cfg.n_heads + (cfg.n_layers + 2) * cfg.n_heads * cfg.d_val * chunked if cfg.memory else 0
    assert per_step == T * B * ((cfg.n_layers - 1) * (cfg.d_state + 1) + memory)
    assert S.preds.shape == S.u.shape == (T, B, cfg.d_state)
    if cfg.memory:
        assert len(S.M) == -(-T // cfg.core_chunk)
