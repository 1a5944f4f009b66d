"""The chunk form's Triton kernels (kernels/memory_chunk/triton.py) against their torch twin, over
whole chunks forward and backward; on CPU under Triton's interpreter.

Every buffer a launcher allocates and every chunk or `out=` buffer the test passes is NaN first,
so an element a kernel fails to write, or a row it reads before it is written, fails the
comparison. Sizes are odd, dk != dv, and the column blocks run full and partial; chunk lengths
cross the 16-row tile (17 rows: a 32-row tile).
"""

import pytest
import torch
from support.triton_kernels import DEVICE, INTERPRET, interpreter  # noqa: F401  (the fixture: autouse)
from support.twins import assert_close

from kernels import layout
from kernels.memory.reference import read_factors
from kernels.memory_chunk import algebra
from kernels.memory_chunk import reference as T

if INTERPRET:  # the kernels are defined under the interpreter, as triton_kernels.py's
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    import kernels.memory.triton as memory_triton  # noqa: E402
    import kernels.memory_chunk.triton as K  # noqa: E402

    del os.environ["TRITON_INTERPRET"]
else:
    import kernels.memory.triton as memory_triton
    import kernels.memory_chunk.triton as K

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-4, torch.float64: 1e-12}  # bf16 inputs, float32 state: the same arithmetic
BF16_OUT = 1e-2  # an output rounded to bf16 (a GEMM's input row): one rounding apart at most
# (B, H, dk, dv, tile): with tile 64 and dk <= 8 the kernels take 16 columns at a time, so dv = 33
# runs two full blocks and a partial one.
SHAPES = [(1, 1, 5, 7, memory_triton.TILE), (2, 3, 7, 33, 64), (3, 2, 4, 5, memory_triton.TILE)]


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    def nan_empty(like, shape):
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)

    monkeypatch.setattr(layout, "empty", nan_empty)


def chunk_inputs(n, layers, B, H, dk, dv, dtype, seed=0):
    """A chunk's inputs: M_c in the state's dtype (float64 for float64, else float32), the step's
    vectors in `dtype`, the decays and betas in the state's."""
    g = torch.Generator().manual_seed(seed)
    state = torch.float64 if dtype == torch.float64 else torch.float32
    r = lambda *s: torch.randn(*s, generator=g, dtype=state)  # noqa: E731
    unit = lambda x: torch.relu(x) / torch.relu(x).norm(dim=-1, keepdim=True).clamp_min(1e-6)  # noqa: E731
    x = dict(M=r(B, H, dk, dv), keys=unit(r(n, B, H, dk)).to(dtype), values=r(n, B, H, dv).to(dtype),
             beta=torch.sigmoid(r(n, B, H)), decays=torch.exp(-r(n, B, H).abs()),
             queries=[unit(r(n, B, H, dk)).to(dtype) for _ in range(layers)], gates=[r(n, B, H * dv).to(dtype) for _ in range(layers)])
    return {k: (v.to(DEVICE) if torch.is_tensor(v) else [t.to(DEVICE) for t in v]) for k, v in x.items()}


def widened(x, dtype):
    return {k: (v.to(dtype) if torch.is_tensor(v) else [t.to(dtype) for t in v]) for k, v in x.items()}


def nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def forward(impl, x, spare=2):
    """Every step of the chunk and its later layers' reads, into NaN chunk buffers and out=
    buffers; the chunk's end M. Returns (outputs in order, K, D, M_end)."""
    M = x["M"]
    n, (B, H, dk, dv) = x["keys"].shape[0], M.shape
    K, D, end = nan(n + spare, B, H, dk, dtype=M.dtype), nan(n + spare, B, H, dv, dtype=M.dtype), torch.full_like(M, float("nan"))
    got = []
    for j in range(n):
        outs = dict(out_e=nan(B, H, dv, dtype=M.dtype), out_o=nan(B, H * dv + 2, dtype=M.dtype)[:, 1:-1],
                    out_y=nan(B, H * dv, dtype=x["gates"][0].dtype))
        got += impl.step(M, K, D, x["decays"], j, x["keys"][j], x["values"][j], x["beta"][j], x["queries"][0][j],
                         x["gates"][0][j], out_M=end if j == n - 1 else None, **outs)
        for layer in range(1, len(x["queries"])):
            got += impl.read(M, K, D, x["decays"], j, x["queries"][layer][j], x["gates"][layer][j])
    return got, K, D, end


def backward(impl, x, r, co, dM_end, M_end, dys, gate_fac, io_dtype):
    """The chunk's sweep: later layers' reads, then the write and layer 0's read, step by step
    back, into NaN out= buffers (dv and the gates' gradients in io_dtype, as the core's GEMM
    rows). Returns the outputs in order, phi after each step, and the read gradients."""
    M, state = x["M"], r.delta.dtype
    keys = x["keys"].to(state).contiguous()
    n, (B, H, dk, dv) = keys.shape[0], M.shape
    queries = torch.stack(x["queries"]).to(state).contiguous()
    phi = torch.linalg.vecdot(dM_end.flatten(2), M_end.flatten(2)).to(state)
    read_grads = nan(len(x["queries"]), n + 1, B, H, dv, dtype=state)
    got = []
    for j in reversed(range(n)):
        for layer in reversed(range(1, len(queries))):
            o = r.reads[layer][j]
            f = read_factors(o.reshape(B, -1), x["gates"][layer][j].to(state))
            got += impl.read_backward(M, keys, r.delta, r, j, o, f, dys[layer][j], read_grads[layer], phi,
                                      out_dq=nan(B, H, dk, dtype=state))
            got.append(phi.clone())
        o = r.reads[0][j]
        f = read_factors(o.reshape(B, -1), x["gates"][0][j].to(state))
        outs = dict(out_dk=nan(B, H, dk, dtype=state), out_dq=nan(B, H, dk, dtype=state), out_dbeta=nan(B, H, dtype=state),
                    out_dgamma=nan(B, H, dtype=state), out_dgate=nan(B, H * dv, dtype=state),
                    out_dv=nan(B, H, dv, dtype=io_dtype), gate_fac=gate_fac, out_dgates=nan(B, 2, H, dtype=io_dtype))
        got += impl.step_backward(M, keys, r.delta, r, co, j, x["beta"][j], r.e[j], x["values"][j], queries, o, f, dys[0][j],
                                  read_grads, phi, **outs)
        got += [outs["out_dgates"], phi.clone()]
    return got, read_grads[:, :n]


# (shape, chunk length, layers, dtype): every dtype on the partial-block shape with two layers; a
# chunk of 17 rows (a 32-row tile); single-step chunks.
CASES = [(SHAPES[1], 5, 2, torch.float32), (SHAPES[1], 5, 2, torch.bfloat16), (SHAPES[1], 5, 2, torch.float64),
         (SHAPES[0], 17, 1, torch.float32), (SHAPES[2], 1, 1, torch.float32), (SHAPES[0], 1, 2, torch.bfloat16)]


@pytest.mark.parametrize("shape,n,layers,dtype", CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_chunk_kernels_match_twin(shape, n, layers, dtype, monkeypatch):
    B, H, dk, dv, tile = shape
    monkeypatch.setattr(memory_triton, "TILE", tile)
    x = chunk_inputs(n, layers, B, H, dk, dv, dtype, seed=n + layers)
    state = x["M"].dtype
    M_before = x["M"].clone()
    got, K_got, D_got, end_got = forward(K, x)
    want, K_want, D_want, end_want = forward(T, widened(x, state))
    for i, (a, b) in enumerate(zip(got, want)):  # a read's output y may be the next GEMM's bf16
        assert_close(a, b, BF16_OUT if a.dtype == torch.bfloat16 else TOL[dtype], f"forward output {i}")
    assert_close(end_got, end_want, TOL[dtype], "M at the chunk's end")
    assert_close(K_got[:n], K_want[:n], TOL[dtype], "keys")
    assert_close(D_got[:n], D_want[:n], TOL[dtype], "deltas")
    assert K_got[n:].isnan().all() and D_got[n:].isnan().all()  # no row past the chunk's is written
    torch.testing.assert_close(x["M"], M_before, rtol=0, atol=0)

    g = torch.Generator().manual_seed(7)
    dys = [torch.randn(n, B, H * dv, generator=g, dtype=state).to(DEVICE) for _ in range(layers)]
    dM_end = torch.randn(x["M"].shape, generator=g, dtype=state).to(DEVICE)
    gate_fac = torch.rand(B, 2, H, generator=g, dtype=state).to(DEVICE)
    w = widened(x, state)
    queries = torch.stack(w["queries"])
    r = algebra.rebuild(w["M"], w["keys"], w["values"], w["beta"], w["decays"], queries)
    co = algebra.coefficients(*T.dm_products(dM_end, w["keys"], r.delta), w["keys"], r, w["beta"], queries)
    io = torch.bfloat16 if dtype == torch.bfloat16 else state
    got, rg_got = backward(K, x, r, co, dM_end, end_want, dys, gate_fac, io)
    want, rg_want = backward(T, w, r, co, dM_end, end_want, dys, gate_fac, io)
    # Each output over the whole chunk: a step's scalar (its dL/dgamma, say) may be near zero
    # where the chunk's are not, and float32 errors are relative to the chunk's sums.
    per_step = len(got) // n
    for i in range(per_step):
        a, b = torch.stack(got[i::per_step]), torch.stack(want[i::per_step])
        assert_close(a, b, BF16_OUT if a.dtype == torch.bfloat16 else TOL[dtype], f"backward output {i}")
    assert_close(rg_got, rg_want, TOL[dtype], "read gradients")


def test_products_of_M_c_in_bf16_match_twin(monkeypatch):
    """memory_reads: compute: the per-step products read a bf16 copy of M_c (forward `M_read`, the
    backward's M_c argument), the arithmetic and the chunk's end M in float32; the chunk's last
    step also writes the next chunk's copy (`out_M_read`), bit for bit the float32 end M cast."""
    monkeypatch.setattr(memory_triton, "TILE", 64)
    n, B, H, dk, dv = 5, 2, 3, 7, 33
    x = chunk_inputs(n, 2, B, H, dk, dv, torch.float32, seed=4)
    low = x["M"].to(torch.bfloat16)
    outputs = {}
    for name, impl in (("triton", K), ("twin", T)):
        Kb, Db, end = nan(n, B, H, dk, dtype=torch.float32), nan(n, B, H, dv, dtype=torch.float32), torch.full_like(x["M"], float("nan"))
        end_low = torch.full_like(low, float("nan"))
        got = []
        for j in range(n):
            last = j == n - 1
            got += impl.step(x["M"], Kb, Db, x["decays"], j, x["keys"][j], x["values"][j], x["beta"][j], x["queries"][0][j],
                             x["gates"][0][j], out_M=end if last else None, M_read=low, out_M_read=end_low if last else None)
            got += impl.read(x["M"], Kb, Db, x["decays"], j, x["queries"][1][j], x["gates"][1][j], M_read=low)
        assert torch.equal(end_low, end.to(torch.bfloat16)), name
        outputs[name] = (got, end)
    for i, (a, b) in enumerate(zip(*(outputs[n][0] for n in ("triton", "twin")))):
        assert_close(a, b, TOL[torch.float32], f"forward output {i}")
        assert a.dtype == torch.float32
    assert_close(outputs["triton"][1], outputs["twin"][1], TOL[torch.float32], "M at the chunk's end")
    _, _, _, end32 = forward(T, x)
    assert 0 < (outputs["twin"][1] - end32).abs().max() < 1e-2 * end32.abs().max()  # bf16 reads, float32 M

    g = torch.Generator().manual_seed(7)
    dys = [torch.randn(n, B, H * dv, generator=g) for _ in range(2)]
    dM_end, gate_fac = torch.randn(x["M"].shape, generator=g), torch.rand(B, 2, H, generator=g)
    queries = torch.stack(x["queries"])
    r = algebra.rebuild(x["M"], x["keys"], x["values"], x["beta"], x["decays"], queries)
    co = algebra.coefficients(*T.dm_products(dM_end, x["keys"], r.delta), x["keys"], r, x["beta"], queries)
    low_x = dict(x, M=low)
    got, _ = backward(K, low_x, r, co, dM_end, end32, dys, gate_fac, torch.float32)
    want, _ = backward(T, low_x, r, co, dM_end, end32, dys, gate_fac, torch.float32)
    per_step = len(got) // n
    for i in range(per_step):
        a, b = torch.stack(got[i::per_step]), torch.stack(want[i::per_step])
        assert a.dtype == b.dtype and a.dtype == torch.float32, i
        assert_close(a, b, TOL[torch.float32], f"backward output {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_passes_over_dM_match_twin(dtype, monkeypatch):
    """Once per chunk: dM_end's products with the chunk's keys and deltas, and dL/dM_c carried
    back (rows in several blocks of CARRY_ROWS, a partial column block)."""
    monkeypatch.setattr(memory_triton, "TILE", 64)
    monkeypatch.setattr(K, "CARRY_ROWS", 16)
    B, H, dk, dv, n, R = 2, 3, 7, 33, 5, 37
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE)  # noqa: E731
    dM, keys, deltas = r(B, H, dk, dv), r(n, B, H, dk), r(n, B, H, dv)
    for name, a, b in zip(("U0", "V0"), K.dm_products(dM, keys, deltas), T.dm_products(dM, keys, deltas)):
        assert_close(a, b, TOL[dtype], name)
    terms = algebra.CarryBack(torch.rand(B, H, generator=g, dtype=dtype).to(DEVICE), r(B, H, R, dk), r(B, H, R, dv))
    dM_before = dM.clone()
    out = torch.full_like(dM, float("nan"))
    assert K.carry_back(dM, terms, out=out) is out
    assert_close(out, T.carry_back(dM, terms), TOL[dtype], "dL/dM_c")
    torch.testing.assert_close(dM, dM_before, rtol=0, atol=0)


@pytest.mark.parametrize("n,layers,dtype,hard", [(5, 2, torch.float32, False), (5, 2, torch.float64, False),
                                                 (17, 1, torch.float32, False), (1, 2, torch.float32, False),
                                                 (16, 1, torch.float64, False), (32, 2, torch.float32, False),
                                                 (32, 1, torch.float64, True), (33, 1, torch.float32, False)])
def test_the_chunk_algebra_matches_twin(n, layers, dtype, hard, monkeypatch):
    """Once per chunk before its sweep, and `finish` after it: the C x C algebra (decay products,
    T = L^-1, the keys' Gram matrix) and the coefficients the sweep reads, in one kernel per
    (sequence, head), against `algebra.from_forward` + `algebra.coefficients` and `algebra.finish`:
    chunks inside one 16-row tile, across it (17 rows: a 32-row tile), of 32 rows (the longest the
    kernels take), of 33 (the twin's algebra, run by the launchers) and of one step; the keys in two
    column blocks, U0 and the deltas in three, the last partial; one head's decays so small that
    running products underflow (products over ranges do not); `hard`: betas near 1, no decay and
    nearly parallel keys, the sums of T's rows cancelling."""
    monkeypatch.setattr(memory_triton, "TILE", 64)
    monkeypatch.setattr(K, "ALGEBRA_COLUMNS", 16)
    B, H, dk, dv = 2, 3, 19, 33
    state = torch.float64 if dtype == torch.float64 else torch.float32
    x = widened(chunk_inputs(n, layers, B, H, dk, dv, dtype, seed=n), state)
    g = torch.Generator().manual_seed(11)
    if hard:
        x["beta"].fill_(0.99)
        x["decays"].fill_(1.0)
        base = torch.rand(dk, generator=g, dtype=state).to(DEVICE)
        keys = base + 0.05 * torch.rand(n, B, H, dk, generator=g, dtype=state).to(DEVICE)
        x["keys"] = keys / keys.norm(dim=-1, keepdim=True)
    x["decays"][:, 1, 2] = 1e-30  # G(-1, b) underflows past two steps; G(b - 1, b) does not
    dM_end = torch.randn(x["M"].shape, generator=g, dtype=state).to(DEVICE)
    deltas, e = (torch.randn(n, B, H, dv, generator=g, dtype=state).to(DEVICE) for _ in range(2))
    queries = torch.stack(x["queries"])
    args = (dM_end, x["keys"], x["beta"], x["decays"], deltas, e, [q * 2 for q in x["queries"]], queries)
    inputs = [a.clone() if torch.is_tensor(a) else a for a in args]
    (r_got, co_got), (r_want, co_want) = K.algebra(*args), T.algebra(*args)
    if hard:  # nearly parallel keys: L's entries below the diagonal near beta, T's alternating
        assert r_want.KK.min() > 0.95
    for name in ("gam", "T", "KK"):
        assert_close(getattr(r_got, name), getattr(r_want, name), TOL[dtype], name)
    assert r_got.delta is deltas and r_got.e is e and r_got.reads is args[6]
    for name in co_want._fields:
        a, b = getattr(co_got, name), getattr(co_want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_close(a, b, TOL[dtype], name)
    # the underflowing head on its own scale: G(b - 1, b) = d_b and G(b, b) = 1 exactly, G(-1, b) 0
    # past b = 2 in float32 (1e-90)
    steps = torch.arange(n)
    torch.testing.assert_close(r_got.gam[1, 2, steps, steps], x["decays"][:, 1, 2], rtol=0, atol=0)
    assert (r_got.gam[1, 2, steps + 1, steps] == 1).all() and not r_got.gam.isnan().any()
    assert state == torch.float64 or (r_got.gam[1, 2, 0, 2:] == 0).all()
    for a, b in zip(args, inputs):
        if torch.is_tensor(a):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # inputs unchanged

    # after the sweep: what dL/dM_c is made of, from read gradients in a buffer longer than the chunk,
    # from the twin's algebra and from the kernel's
    read_grads = torch.randn(layers, n + 2, B, H, dv, generator=g, dtype=state).to(DEVICE)[:, :n]
    want = algebra.finish(x["keys"], r_want, co_want, x["beta"], queries, read_grads)
    for r, co in ((r_want, co_want), (r_got, co_got)):
        got = K.finish(x["keys"], r, co, x["beta"], queries, read_grads)
        for name in want._fields:
            a, b = getattr(got, name), getattr(want, name)
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert_close(a, b, TOL[dtype], name)


def test_the_chunk_algebra_refuses_rows_it_cannot_address():
    n, B, H, dk, dv = 3, 2, 2, 5, 4
    x = chunk_inputs(n, 1, B, H, dk, dv, torch.float32)
    dM, deltas = torch.randn(B, H, dk, dv), torch.randn(n, B, H, dv)
    queries = torch.randn(1, n + 1, B, H, dk)  # a row more than the chunk's
    with pytest.raises(ValueError, match="queries must be per layer 3 time-major rows"):
        K.algebra(dM, x["keys"], x["beta"], x["decays"], deltas, deltas, [], queries)
    with pytest.raises(ValueError, match="must share their"):
        K.algebra(dM, x["keys"], x["beta"][:, :1].contiguous(), x["decays"], deltas, deltas, [], queries[:, :n])

def test_launchers_refuse_chunk_buffers_they_cannot_address():
    x = chunk_inputs(3, 1, 2, 2, 3, 4, torch.float32)
    M = x["M"]
    K_strided = torch.zeros(4, 2, 2, 6)[..., ::2]
    with pytest.raises(ValueError, match="contiguous time-major chunk buffer"):
        K.step(M, K_strided, torch.zeros(4, 2, 2, 4), x["decays"], 0, x["keys"][0], x["values"][0], x["beta"][0],
               x["queries"][0][0], x["gates"][0][0])
    with pytest.raises(ValueError, match="decays must be rows of packed"):
        K.step(M, torch.zeros(4, 2, 2, 3), torch.zeros(4, 2, 2, 4), x["decays"].transpose(1, 2), 0, x["keys"][0],
               x["values"][0], x["beta"][0], x["queries"][0][0], x["gates"][0][0])
