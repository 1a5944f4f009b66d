"""Triton kernels against their torch twins; on CPU under Triton's interpreter. The step's
elementwise groups also run as the C++ CPU kernels (kernels/step/cpu.py) against the
same twins (marker `cpu_only`); the C++ memory step has its own tests (test_kernels_cpu.py).
The accuracy of exp, sigmoid and softplus over float32's range is test_kernels_accuracy.py's.

Every buffer a launcher allocates, and every `out=` buffer the test passes, is filled with NaN
first, so an element a kernel fails to write fails the comparison (assert_close never lets NaN
pass). Sizes are odd, d_k != d_v, and the column-block loops run several partial blocks.
"""

import dataclasses

import pytest
import torch
from support.triton_kernels import DEVICE, interpreter  # noqa: F401  (the fixture: autouse)
from support.triton_kernels import elementwise as E
from support.triton_kernels import elementwise_cpu as EC
from support.triton_kernels import memory_chunk as KC
from support.triton_kernels import memory_step as K
from support.twins import assert_close, count_calls, memory_inputs

from kernels import layout
from gpn_scale.models import GPN, GPNConfig, GPNState
from kernels.memory import reference as T
from kernels.step import reference as S

# (B, H, dk, dv, tile): with tile 64 and dk <= 8 the kernels take 16 columns at a time, so
# dv = 33 runs two full blocks and a partial one.
SHAPES = [(1, 1, 5, 7, K.TILE), (3, 3, 7, 5, K.TILE), (3, 4, 6, 33, 64), (1, 3, 3, 17, 64)]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float64: 1e-12}


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    def nan_empty(like, shape):
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)

    monkeypatch.setattr(layout, "empty", nan_empty)


def check(got, want, dtype, name, tol=None):
    assert_close(got, want, TOL[dtype] if tol is None else tol, name)


def poisoned_rows(B, n, pad=3, dtype=torch.float32):
    """A (B, n) view into rows of a wider NaN buffer, as the fused core's step buffers are."""
    return torch.full((B, n + pad), float("nan"), dtype=dtype, device=DEVICE)[:, 1 : n + 1]


def inputs(B, H, dk, dv, dtype, seed=0):
    return memory_inputs(B, H, dk, dv, dtype, seed, DEVICE)


def widened(x: dict) -> dict:
    """The twin's inputs: everything in M's dtype (the kernels widen on load the same way)."""
    return {n: t.to(x["M"].dtype) for n, t in x.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_forward_matches_twin(shape, dtype, monkeypatch):
    B, H, dk, dv, tile = shape
    monkeypatch.setattr(K, "TILE", tile)
    x = inputs(B, H, dk, dv, dtype)
    ref = T.memory_step(**widened(x))
    # Once into fresh buffers, once into poisoned strided out= buffers (the core's layout).
    wide_o = torch.full((B, H * dv + 3), float("nan"), device=DEVICE)
    outs = dict(out_e=torch.full((B, H, dv), float("nan"), device=DEVICE), out_o=wide_o[:, 1 : H * dv + 1],
                out_y=poisoned_rows(B, H * dv))
    for kwargs in ({}, outs):
        got = K.memory_step(**x, **kwargs)
        for name, a, b in zip(("M", "e", "o", "y"), got, ref):
            check(a, b, dtype, name)
    for name, buf in outs.items():
        assert got[list(outs).index(name) + 1] is buf, name
    assert torch.isnan(wide_o[:, 0]).all() and torch.isnan(wide_o[:, -2:]).all()  # nothing written outside the rows

    M_t = ref[0]
    o_ref, y_ref = T.memory_read(M_t, widened(x)["q"], widened(x)["gate"])
    o, y = K.memory_read(M_t, x["q"], x["gate"], out_o=poisoned_rows(B, H * dv), out_y=poisoned_rows(B, H * dv))
    check(o, o_ref, dtype, "read o")
    check(y, y_ref, dtype, "read y")

    delta = (x["beta"][..., None] * ref[1]).to(dtype)
    check(K.decay_and_write(x["M"], x["k"], delta, x["decay"]),
          T.decay_and_write(x["M"], widened(x)["k"], delta.to(x["M"].dtype), x["decay"]), dtype, "decay_and_write")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_backward_matches_twin(shape, dtype, monkeypatch):
    B, H, dk, dv, tile = shape
    monkeypatch.setattr(K, "TILE", tile)
    x = inputs(B, H, dk, dv, dtype, seed=1)
    w = widened(x)
    M_t, e, o, _ = T.memory_step(**w)
    f = T.read_factors(o, w["gate"])
    g = torch.Generator().manual_seed(2)
    dM = torch.randn(M_t.shape, generator=g, dtype=M_t.dtype).to(DEVICE)
    dy = torch.randn(o.shape, generator=g).to(DEVICE).to(dtype)
    delta = w["beta"][..., None] * e
    names = ("dM_prev", "dk", "dv", "dbeta", "ddecay", "dq", "dgate")
    ref = T.memory_step_backward(w["M"], M_t, w["k"], w["beta"], w["decay"], e, delta, w["q"], f, dM, dy.to(M_t.dtype))
    outs = dict(out_dk=torch.full((B, H, dk), float("nan"), device=DEVICE), out_dq=torch.full((B, H, dk), float("nan"), device=DEVICE),
                out_dbeta=torch.full((B, H), float("nan"), device=DEVICE), out_ddecay=torch.full((B, H), float("nan"), device=DEVICE),
                out_dgate=poisoned_rows(B, H * dv))
    # dv and the gates' factored gradients into rows of the projection's gradient, in the vectors' dtype
    gate_fac = torch.rand(B, 2, H, generator=g).to(DEVICE)
    rows = dict(out_dv=poisoned_rows(B, H * dv, dtype=dtype).view(B, H, dv), gate_fac=gate_fac,
                out_dgates=poisoned_rows(B, 2 * H, dtype=dtype).view(B, 2, H))
    for kwargs in ({}, outs, rows):
        got = K.memory_step_backward(x["M"], M_t, x["k"], x["beta"], x["decay"], e, delta, x["q"], f, dM, dy, **kwargs)
        for name, a, b in zip(names, got, ref):
            check(a, b, dtype, name)
    assert got[2] is rows["out_dv"]
    check(rows["out_dgates"], torch.stack(ref[3:5], 1) * gate_fac, dtype, "dgates")

    ref = T.memory_read_backward(M_t, w["q"], f, dy.to(M_t.dtype), dM)
    got = K.memory_read_backward(M_t, x["q"], f, dy, dM, out_dq=torch.full((B, H, dk), float("nan"), device=DEVICE),
                                 out_dgate=poisoned_rows(B, H * dv))
    for name, a, b in zip(("read dq", "read dgate", "read dM"), got, ref):
        check(a, b, dtype, name)


class _Grids:
    """A kernel whose launches record their grids."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def test_backward_runs_a_program_per_column_block(monkeypatch):
    """The backward kernels split M's columns across programs as the forward does (B 3, H 4,
    d_k 6, d_v 33, 64-element tiles: 8 rows, 16 columns a block, 3 blocks per head), and one
    program per (sequence, head) adds the blocks' column sums."""
    B, H, dk, dv = 3, 4, 6, 33
    monkeypatch.setattr(K, "TILE", 64)
    grids = {name: _Grids(getattr(K, name)) for name in ("_step_fwd", "_step_bwd", "_read_bwd", "_head_sums")}
    for name, g in grids.items():
        monkeypatch.setattr(K, name, g)
    x = inputs(B, H, dk, dv, torch.float32, seed=4)
    M_t, e, o, _ = K.memory_step(**x)
    f = T.read_factors(o, x["gate"])
    K.memory_step_backward(x["M"], M_t, x["k"], x["beta"], x["decay"], e, x["beta"][..., None] * e, x["q"], f,
                           torch.ones_like(M_t), torch.ones_like(o))
    K.memory_read_backward(M_t, x["q"], f, torch.ones_like(o), torch.ones_like(M_t))
    assert grids["_step_fwd"].grids == grids["_step_bwd"].grids == grids["_read_bwd"].grids == [(B * H, 3)]
    assert grids["_head_sums"].grids == [(B * H,), (B * H,)]


def test_float64_follows_m():
    """In float64 the kernels compute in float64: they agree with the twin to rounding."""
    x = inputs(3, 4, 6, 9, torch.float64, seed=3)
    for name, a, b in zip(("M", "e", "o", "y"), K.memory_step(**x), T.memory_step(**x)):
        assert a.dtype == torch.float64
        check(a, b, torch.float64, name)


def test_nan_inputs_are_not_hidden():
    """A NaN in M reaches the outputs (masked loads must not replace real elements)."""
    x = inputs(1, 1, 5, 7, torch.float32)
    x["M"][0, 0, 4, 6] = float("nan")
    M_t, e, o, y = K.memory_step(**x)
    assert torch.isnan(M_t[0, 0, :, 6]).all() and torch.isnan(e[0, 0, 6]) and torch.isnan(o).any()
    with pytest.raises(AssertionError):
        check(M_t, T.memory_step(**inputs(1, 1, 5, 7, torch.float32))[0], torch.float32, "M")


# ---- the step's elementwise groups ------------------------------------------------------------


IMPLS = {"triton": E, "cpp": EC}
# The C++ kernels run on CPU only (deselected on a GPU machine by -m 'not cpu_only').
impls = pytest.mark.parametrize("impl", [pytest.param("cpp", marks=pytest.mark.cpu_only), "triton"])


def run_both(impl, name, make, dtype):
    """Call NAME of the kernels `impl` and of its twin on the same inputs; `make(poison)` returns
    (args, kwargs, outs): inputs, and the out buffers the call writes (NaN-filled for the
    kernel, zeros for the twin). Compares the outs and the return values."""
    results = []
    for module, poison in ((IMPLS[impl], True), (S, False)):
        args, kwargs, outs = make(poison)
        ret = getattr(module, name)(*args, **kwargs)
        results.append((ret, outs))
    (ret, outs), (ret_ref, outs_ref) = results
    for i, (a, b) in enumerate(zip(outs, outs_ref)):
        check(a, b, dtype, f"{name} out {i}")
    if ret_ref is not None:
        check(ret, ret_ref, dtype, f"{name} result")


def buf(poison, *shape, dtype=torch.float32):
    return torch.full(shape, float("nan") if poison else 0.0, dtype=dtype, device=DEVICE)


def rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# (B, d, F, n_blocks, H, dk, block): block 16 runs the row loops over several partial blocks.
EW_SHAPES = [(1, 37, 45, 1, 1, 5, E.BLOCK), (3, 22, 19, 2, 3, 5, 16), (3, 9, 33, 1, 4, 6, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", ["ffn", "heads", "all"])
@pytest.mark.parametrize("shape", EW_SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
@impls
def test_post_projection_matches_twin(impl, shape, groups, dtype, monkeypatch):
    B, d, nf, nb, H, dk, block = shape
    monkeypatch.setattr(E, "BLOCK", block)
    hk = nb * H * dk
    Y = rand(B, hk + 2 * H + 2 * nf + 3, seed=4) * 2  # [heads | beta | a | h1 | h2 | pad], as the core's projection row
    A = -torch.exp(rand(H, seed=5))

    def make(poison):
        y = Y.to(dtype) if poison else Y.to(dtype).float()  # the twin sees the same (rounded) values in float32
        ffn = buf(poison, B, nf + 4)[:, 2 : nf + 2]
        kw, outs = {}, [ffn]
        if groups != "ffn":
            nq, nn = buf(poison, nb, B, H, dk).transpose(0, 1), buf(poison, nb, B, H, 1).transpose(0, 1)
            kw.update(heads=y[:, :hk].view(B, nb, H, dk), out_heads=nq, out_norms=nn)
            outs += [nq, nn]
        if groups == "all":
            gates = [buf(poison, B, H) for _ in range(3)]
            kw.update(beta=y[:, hk : hk + H], a=y[:, hk + H : hk + 2 * H], A=A, out_beta=gates[0], out_gamma=gates[1], out_decay=gates[2])
            outs += gates
        h = y[:, hk + 2 * H :]
        return (h[:, :nf], h[:, nf : 2 * nf], ffn), kw, outs

    run_both(impl, "post_projection", make, dtype)


@impls
def test_nan_in_a_head_is_not_hidden(impl):
    """A NaN in a head's input stays NaN through the relu, as in the twin (torch.relu), and makes
    that head's norm and outputs NaN, the others' not (a max with 0 would turn it into 0)."""
    heads = rand(2, 2, 3, 5, seed=20)
    heads[1, 0, 2, 3] = float("nan")
    nq, nn = buf(True, 2, 2, 3, 5), buf(True, 2, 2, 3, 1)
    h = rand(2, 4, seed=21)
    IMPLS[impl].post_projection(h, h, buf(True, 2, 4), heads=heads, out_heads=nq, out_norms=nn)
    bad = torch.zeros(2, 2, 3, dtype=torch.bool, device=DEVICE)
    bad[1, 0, 2] = True
    assert nq.isnan().all(-1).eq(bad).all() and nq.isnan().any(-1).eq(bad).all() and nn[..., 0].isnan().eq(bad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", EW_SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
@impls
def test_residual_rms_and_ground_match_twin(impl, shape, dtype):
    B, d = shape[:2]
    Y = rand(B, 2 * d + 3, seed=6)
    c, u = rand(B, d, seed=7), rand(B, d, seed=8)

    def make_residual(poison, to_out=True):
        y = Y.to(dtype) if poison else Y.to(dtype).float()
        out, hat, r = buf(poison, 2, B, d)[1], buf(poison, B, d + 3)[:, 1 : d + 1], buf(poison, B, 1)
        return (y[:, :d], y[:, d + 1 : 2 * d + 1], c, out if to_out else None, hat, r), {}, [hat, r] + ([out] if to_out else [])

    run_both(impl, "residual_rms", make_residual, dtype)
    run_both(impl, "residual_rms", lambda p: make_residual(p, to_out=False), dtype)

    def make_ground(poison, with_hat=True, in_place=False):
        y_fg = (Y.to(dtype) if poison else Y.to(dtype).float())[:, 1 : d + 1].float().clone()  # the fuse-gate GEMM's row
        fg = y_fg if in_place else buf(poison, B, d + 2)[:, 1 : d + 1]  # the gates over it, or into another row
        hat, r = buf(poison, B, d + 3)[:, 2 : d + 2], buf(poison, B, 1)
        return (y_fg, c, u, fg, hat if with_hat else None, r if with_hat else None), {}, [fg] + ([hat, r] if with_hat else [])

    run_both(impl, "ground", make_ground, dtype)
    run_both(impl, "ground", lambda p: make_ground(p, in_place=True), dtype)
    run_both(impl, "ground", lambda p: make_ground(p, with_hat=False), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", EW_SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
@impls
def test_backward_groups_match_twin(impl, shape, dtype, monkeypatch):
    B, d, nf, nb, H, dk, block = shape
    monkeypatch.setattr(E, "BLOCK", block)
    x = rand(B, d, seed=9)
    x_hat, r = x / x.square().mean(-1, keepdim=True).add(1e-6).sqrt(), x.square().mean(-1, keepdim=True).add(1e-6).sqrt()
    dX = rand(B, d + 2, seed=10)
    dc, gate, extra = rand(B, d, seed=11), torch.sigmoid(rand(B, d, seed=12)), rand(B, d, seed=13)

    def make_rms(poison, with_extra, low_fac=None):
        dx = (dX.to(dtype) if poison else dX.to(dtype).float())[:, 1 : d + 1]
        out, low = buf(poison, B, d), buf(poison, B, d + 2, dtype=dtype)[:, 1 : d + 1]
        if low_fac is None:
            return (x_hat, r, dx, dc, gate, extra if with_extra else None), dict(out=out), [out]
        return (x_hat, r, dx, dc, gate, extra if with_extra else None), dict(out=out, out_low=low, low_fac=low_fac), [out, low]

    run_both(impl, "residual_rms_backward", lambda p: make_rms(p, True), dtype)
    run_both(impl, "residual_rms_backward", lambda p: make_rms(p, False), dtype)
    run_both(impl, "residual_rms_backward", lambda p: make_rms(p, False, low_fac=rand(B, d + 1, seed=19)[:, 1:]), dtype)

    dZ, fac, pg_fac = rand(B, nf + d + 1, seed=14), rand(B, 2, nf, seed=15), rand(B, d, seed=16)

    def make_gates(poison):
        dz = dZ.to(dtype) if poison else dZ.to(dtype).float()
        dffn, dpg = buf(poison, B, 2 * nf + d + 1)[:, 1 : 2 * nf + 1].view(B, 2, nf), buf(poison, B, d)
        return (dz[:, None, :nf], fac, dffn, dc, pg_fac, dpg), {}, [dffn, dpg]

    run_both(impl, "gate_grads", make_gates, dtype)

    z = torch.relu(rand(nb, B, H, dk, seed=17)).transpose(0, 1)
    norm = (z.square().sum(-1, keepdim=True) + 1e-12).sqrt()
    y, mask = z / norm, (z > 0) / norm
    dQ = rand(B, nb * H * dk + 2, seed=18)

    def make_l2n(poison):
        dq = (dQ.to(dtype) if poison else dQ.to(dtype).float())[:, 1 : nb * H * dk + 1].view(B, nb, H, dk)
        out = buf(poison, B, nb * H * dk + 3)[:, 2 : nb * H * dk + 2].view(B, nb, H, dk)
        return (y, mask, dq), dict(out=out), [out]

    run_both(impl, "l2n_relu_backward", make_l2n, dtype)
    run_both(impl, "l2n_relu_backward", lambda p: ((y[:, 0], mask[:, 0], dQ[:, : H * dk].view(B, H, dk)), {}, []), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", EW_SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
def test_gate_factors_match_twin(shape, dtype, monkeypatch):
    """The chunk's SwiGLU and predict-gate factors from the recomputed projection's rows (in its
    GEMM's dtype, read in place: [h1 | h2 | pg | pad]), with the SwiGLU's output into a column
    slice of the second GEMM's input rows (in its dtype) and every other output a fresh
    NaN-filled buffer: rows of F and of d in blocks that leave partial ones, F above and below d."""
    B, d, nf, *_, block = shape
    monkeypatch.setattr(E, "BLOCK", block)
    rows = 2 * B + 1  # a chunk's steps times its sequences
    Y = rand(rows, 2 * nf + d + 3, seed=50) * 3
    x = rand(rows, d, seed=51)
    r = x.square().mean(-1, keepdim=True).add(1e-6).sqrt()

    def make(poison):
        y = Y.to(dtype)
        fac, z = buf(poison, rows, 2, nf), buf(poison, rows, nf + d + 2, dtype=dtype)
        pg, pg_fac = buf(poison, rows, d), buf(poison, rows, d)
        args = (y[:, :nf], y[:, nf : 2 * nf], y[:, 2 * nf : 2 * nf + d], x / r, r, fac, z[:, 1 : nf + 1], pg, pg_fac)
        return args, {}, [fac, z[:, 1 : nf + 1], pg, pg_fac]

    run_both("triton", "gate_factors", make, dtype)

    def gate_alone(poison):  # the fuse gate's: no FFN
        args, _, outs = make(poison)
        return (None, None, *args[2:5], None, None, *args[7:]), {}, outs[2:]

    run_both("triton", "gate_factors", gate_alone, dtype)
    args = make(True)[0]
    wide = buf(True, rows, nf + d + 2, dtype=dtype)
    fac, z = args[5], wide[:, 1 : nf + 1]
    E.gate_factors(*args[:6], z, *args[7:])
    assert wide[:, 0].isnan().all() and wide[:, nf + 1 :].isnan().all()  # nothing written outside the slice
    if dtype == torch.bfloat16:  # the SwiGLU's output rounded to nearest, once, from the float32 factors
        silu_h2 = (fac[:, 1] * Y[:, nf : 2 * nf].to(dtype).float()).double()
        assert ((z.double() - silu_h2).abs() <= silu_h2.abs() * 2 ** -8 + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [K.ROW_BLOCK, 32])
def test_read_factors_match_twin(block, dtype, monkeypatch):
    """The chunk's read factors from its raw reads and the gate read in place from the recomputed
    projection's rows (in its GEMM's dtype), with the read outputs into a column slice of the
    second GEMM's input rows (in its dtype): against the twin's, which widens the gate first; a
    block of 32 runs each row over several blocks, the last partial. Without out_y nothing but the
    factors is written."""
    monkeypatch.setattr(K, "ROW_BLOCK", block)
    rows, n = 7, 3 * 33
    o = rand(rows, n, seed=60) * 2
    Y = rand(rows, n + 5, seed=61).mul(3).to(dtype)
    got_z, want_z = buf(True, rows, n + 4, dtype=dtype), buf(False, rows, n + 4, dtype=dtype)
    got = K.read_factors(o, Y[:, 2 : n + 2], out_y=got_z[:, 3 : n + 3])
    want = T.read_factors(o, Y[:, 2 : n + 2], out_y=want_z[:, 3 : n + 3])
    for name, a, b in zip(got._fields, got, want):
        check(a, b, torch.float32, name)
    check(got_z[:, 3 : n + 3], want_z[:, 3 : n + 3], dtype, "y")
    assert got_z[:, :3].isnan().all() and got_z[:, n + 3 :].isnan().all()  # nothing written outside the slice
    alone = K.read_factors(o, Y[:, 2 : n + 2])
    assert all(torch.equal(a, b) for a, b in zip(alone, got))


@pytest.mark.parametrize("shape", EW_SHAPES[1:], ids=lambda s: "x".join(map(str, s[:6])))
@impls
def test_narrow_outputs_are_rounded_to_nearest_even(impl, shape):
    """The outputs the core keeps in the step GEMMs' bf16 (`narrow_io`) are the float32 results
    rounded to nearest even, as torch's `.to(bfloat16)` (and the GPU's conversion) rounds; a
    truncating store (Triton's interpreter's own bf16 conversion) differs in about half of them."""
    B, d = shape[:2]
    x = rand(B, d, seed=30) * 3
    r = x.square().mean(-1, keepdim=True).add(1e-6).sqrt()
    args = (x / r, r, rand(B, d, seed=31), rand(B, d, seed=32), torch.sigmoid(rand(B, d, seed=33)))
    out, low = buf(True, B, d), buf(True, B, d + 2, dtype=torch.bfloat16)[:, 1 : d + 1]
    IMPLS[impl].residual_rms_backward(*args, out=out, out_low=low)
    assert torch.equal(low, out.to(torch.bfloat16))
    fac = rand(B, d, seed=36)
    IMPLS[impl].residual_rms_backward(*args, out=out, out_low=low, low_fac=fac)  # through a factor first
    assert torch.equal(low, (out * fac).to(torch.bfloat16))
    if impl == "triton":  # the groups that write a GEMM's bf16 input or read its output in place
        wide, narrow = (buf(True, B, d), buf(True, B, 1)), (buf(True, B, d, dtype=torch.bfloat16), buf(True, B, 1))
        y, pg = rand(B, d, seed=34).to(torch.bfloat16), rand(B, d, seed=35).to(torch.bfloat16)
        E.residual_rms(y, pg, x, None, *wide)
        E.residual_rms(y, pg, x, None, *narrow)
        assert torch.equal(narrow[0], wide[0].to(torch.bfloat16)) and torch.equal(narrow[1], wide[1])


def test_step_backward_rounds_dv_and_gate_gradients_into_narrow_rows():
    """dv and the gates' factored gradients written into bf16 rows (the projection GEMM's
    gradient, `out_dv`, `out_dgates`) are the float32 results rounded to nearest even."""
    B, H, dk, dv = 3, 3, 7, 33
    x = inputs(B, H, dk, dv, torch.float32, seed=5)
    M_t, e, o, _ = T.memory_step(**x)
    f = T.read_factors(o, x["gate"])
    g = torch.Generator().manual_seed(6)
    dM, dy = (torch.randn(t.shape, generator=g).to(DEVICE) for t in (M_t, o))
    gate_fac = torch.rand(B, 2, H, generator=g).to(DEVICE)
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        rows = dict(out_dv=poisoned_rows(B, H * dv, dtype=dtype).view(B, H, dv), gate_fac=gate_fac,
                    out_dgates=poisoned_rows(B, 2 * H, dtype=dtype).view(B, 2, H))
        K.memory_step_backward(x["M"], M_t, x["k"], x["beta"], x["decay"], e, x["beta"][..., None] * e, x["q"], f, dM, dy,
                               **rows)
        got[dtype] = rows
    for name in ("out_dv", "out_dgates"):
        assert torch.equal(got[torch.bfloat16][name], got[torch.float32][name].to(torch.bfloat16)), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_kernels_match_twin(dtype):
    """The log-sum-exp of rows of logits (in their GEMM's dtype) and their gradients
    (softmax - onehot) g rounded once into the compute dtype, against the twin: rows wider than
    two blocks and not a multiple of one, row-strided logits, a broadcast g (a mean's gradient),
    every output element written (fresh buffers filled with NaN), and a NaN logit kept."""
    rows, n = 5, 2 * E.CE_BLOCK + 37
    g = torch.Generator().manual_seed(40)
    wide = (torch.randn(rows, n + 3, generator=g, dtype=torch.float64) * 4).to(dtype).to(DEVICE)
    logits = wide[:, 1 : n + 1]
    targets = torch.randint(0, n, (rows,), generator=g).to(DEVICE)
    targets[0] = n - 1  # the last block's last column
    grads = (torch.full((1,), 0.3, dtype=torch.promote_types(dtype, torch.float32)).expand(rows)).to(DEVICE)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    with _nan_filled_empties():
        lse = E.ce_lse(logits)
        assert lse.dtype == torch.promote_types(dtype, torch.float32)
        assert_close(lse, S.ce_lse(logits), tol, "lse")
        d = E.ce_grad(logits, lse, targets, grads, dtype)
    want = S.ce_grad(logits, lse, targets, grads, torch.promote_types(dtype, torch.float32))
    assert d.dtype == dtype
    assert_close(d, want, 2 ** -8 if dtype == torch.bfloat16 else tol, "dlogits")
    if dtype == torch.bfloat16:  # rounded once, to nearest: within half a bf16 ulp of the twin's float32
        assert ((d.double() - want.double()).abs() <= want.double().abs() * 2 ** -8 + 1e-30).all()
    logits = logits.clone()
    logits[2, 7] = float("nan")
    lse = E.ce_lse(logits)
    assert lse[2].isnan() and not lse[[0, 1, 3, 4]].isnan().any()
    assert E.ce_grad(logits, lse, targets, grads, dtype)[2].isnan().all()


class _nan_filled_empties:
    """torch.empty's memory filled with NaN (torch's deterministic mode): an output element a
    kernel never writes stays NaN."""

    def __enter__(self):
        self.saved = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.saved[0])
        torch.utils.deterministic.fill_uninitialized_memory = self.saved[1]


# ---- the whole model: kernel = triton against kernel = torch ----------------------------------

ODD = GPNConfig(vocab_size=29, d_state=14, d_emb=6, d_ffn=9, n_heads=3, d_key=5, d_val=4, core_chunk=3)


def _triton_against_torch(cfg: GPNConfig, mode: str):
    """The model of cfg with kernel = torch and kernel = triton, from one carried state: loss,
    carried state, and the gradients of every parameter and of the incoming state, compared."""
    dtype = torch.float64 if mode == "float64" else torch.float32
    torch.manual_seed(0)
    model = GPN(cfg).to(DEVICE, dtype)
    with torch.no_grad():  # move the zero-initialised gates and out-projections: every path live
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        carried = model(torch.randint(0, ODD.vocab_size, (2, 4), device=DEVICE)).state
    tokens = torch.randint(0, ODD.vocab_size, (2, 7), device=DEVICE)
    results = {}
    for kernel in ("torch", "triton"):
        model.config.kernel = kernel
        model.zero_grad()
        state = GPNState(*(None if x is None else x.clone().requires_grad_() for x in carried))
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=mode == "bf16"):
            out = model(tokens, state=state)
        total = out.loss + out.state.s.square().mean() + (out.state.M.square().mean() if out.state.M is not None else 0)
        total.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        grads.update({f"state.{n}": x.grad for n, x in zip(("s", "prev_s", "M"), state) if x is not None and x.grad is not None})
        results[kernel] = (out, grads)
    (a, ga), (b, gb) = results["triton"], results["torch"]
    tol = {"float64": 1e-10, "float32": 1e-4, "bf16": 2e-2}[mode]
    check(a.loss, b.loss, dtype, "loss", tol)
    for name, x, y in zip(("s", "prev_s", "M"), a.state, b.state):
        if y is not None:
            check(x, y, dtype, name, tol)
    assert ga.keys() == gb.keys() and "state.s" in gb and ("state.M" in gb) == model.config.memory
    for name in gb:
        check(ga[name], gb[name], dtype, name, tol)
    return model, tokens


@pytest.mark.parametrize("mode", ["float64", "float32", "bf16"])
@pytest.mark.parametrize("case", [dict(family="gpn", n_layers=1), dict(n_layers=1), dict(n_layers=2, bptt=4)],
                         ids=["gpn_1l", "gpn_m_1l", "gpn_m_2l_bptt"])
def test_model_with_triton_kernels_matches_torch(case, mode, monkeypatch):
    """Loss, carried state, and the gradients of every parameter and of the incoming state."""
    calls = []
    count_calls(monkeypatch, K, ("memory_step", "memory_read", "decay_and_write", "memory_step_backward", "memory_read_backward"),
                calls)
    count_calls(monkeypatch, E, ("post_projection", "residual_rms", "ground", "residual_rms_backward", "gate_grads",
                                 "gate_factors", "l2n_relu_backward", "ce_lse", "ce_grad"), calls)
    model, tokens = _triton_against_torch(dataclasses.replace(ODD, **case), mode)
    assert {"post_projection", "residual_rms", "ground", "residual_rms_backward", "gate_grads", "gate_factors", "ce_lse",
            "ce_grad"} <= set(calls)
    if model.config.memory:  # the kernels ran, in the forward and the reverse sweep
        assert {"memory_step", "memory_step_backward", "l2n_relu_backward"} <= set(calls)
        assert calls.count("memory_step") > tokens.shape[1]  # the forward's steps and the rebuild's
        assert ("memory_read" in calls) == ("memory_read_backward" in calls) == (model.config.n_layers > 1)


@pytest.mark.parametrize("mode", ["float64", "float32", "bf16"])
def test_chunk_form_with_triton_kernels_matches_torch(mode, monkeypatch):
    """The memory's chunk form (`memory_form: chunk`, M_c's reads in the compute dtype under bf16)
    through the whole model: chunks of 3 over 7 steps (the last one short), two layers, a
    truncated-BPTT cut; every chunk kernel ran, the once-per-chunk algebra included."""
    calls = []
    count_calls(monkeypatch, KC, ("step", "read", "step_backward", "read_backward", "algebra", "finish", "carry_back"), calls)
    reads = "compute" if mode == "bf16" else "state"
    _triton_against_torch(dataclasses.replace(ODD, n_layers=2, bptt=6, memory_form="chunk", memory_reads=reads), mode)
    assert set(calls) == {"step", "read", "step_backward", "read_backward", "algebra", "finish", "carry_back"}
    assert calls.count("algebra") == calls.count("finish") == 3  # chunks 0-2, 3-5, 6


def test_kernel_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="kernel: expected one of"):
        GPNConfig(kernel="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = GPN(dataclasses.replace(ODD, kernel="triton"))
    with pytest.raises(ValueError, match="runs only in Triton's interpreter"):
        model(torch.zeros(1, 3, dtype=torch.long))
