"""Accuracy of the Triton kernels' exp, sigmoid and softplus over float32's range, against
bounds derived from the documented errors of the instructions they compile to
(docs/kernels_accuracy.md), computed per input by the functions below.

On a machine with CUDA the kernels run as compiled for it: ex2.approx, div.full, sqrt.approx
and libdevice's logf, which is what the bounds are derived for. On CPU they run in Triton's
interpreter, whose exp2 and log are numpy's (within an ulp) and whose divides and square roots
are IEEE: the same bounds hold there, with room. `test_ptx_has_the_documented_instructions`
checks, without a GPU, that the PTX compiled for sm_90 uses exactly the instructions the
derivation assumes: a new Triton that lowers an op differently, or a change of formulation
that brings in another instruction, fails it until the derivation is redone.

The C++ CPU kernels (`cpp`) take the same range tests against their own fixed bounds.
"""

import math

import numpy as np
import pytest
import torch
from support.compiled_kernels import compiled
from support.triton_kernels import DEVICE, interpreter  # noqa: F401  (the fixture: autouse)
from support.triton_kernels import elementwise as E
from support.triton_kernels import elementwise_cpu as EC
from support.triton_kernels import memory_step as K
from support.triton_kernels import numerics as N

from kernels.common import RMS_EPS


# ---- the documented errors of the instructions (relative, as fractions of the exact result) ----

U = 2.0**-24  # float32 add, mul, fma, div.rn (and numpy's): rounded to nearest, half an ulp
ULP = 2.0**-23  # one ulp of a float32 is at most this, relative to it
EX2 = 2.5 * ULP  # ex2.approx(.ftz).f32: within 2 ulp of the correctly rounded 2^t (PTX ISA, ex2)
DIV_FULL = 2 * ULP  # div.full.f32, the compiler's `/`: 2 ulp over the full range (PTX ISA, div)
DIV_RN = U  # div.rn.f32 (tl.div_rn): IEEE
SQRT_APPROX = ULP  # sqrt.approx(.ftz).f32, tl.sqrt: 2^-23 relative (PTX ISA, sqrt)
LOGF = ULP  # libdevice's logf, tl.log: 1 ulp (CUDA C++ Programming Guide, mathematical functions)

# ---- kernels/numerics.py's constants as the kernels see them (float32) ---------------------------

LN2 = math.log(2.0)
LOG2E_ERR = abs(float(np.float32(N.LOG2E.value)) * LN2 - 1)  # float32(log2 e): 1.3e-8 relative
LN2_LO_ERR = abs(float(np.float32(N.LN2_LO.value)) - (LN2 - N.LN2_HI.value))  # 5.5e-14 absolute
J_MAX = 129  # |j| = |round(x log2 e)| for a normal e^x, |x| < 88.8
# |f| = |x - j ln 2|: j rounds x log2(e) computed in float32, within |x| log2(e) 2^-23 < 2^-15 of it
F_MAX = LN2 * (0.5 + 2.0**-15)

# e^x (`_exp`), wherever it is a normal float: ex2's error, the reduced argument's rounding
# (f - j ln2_lo: the subtraction and, unfused, the product; ln2_lo's own rounding) and the
# exponent's (f log2(e): float32(log2 e) and the product's rounding, times ln 2).
EXP = (1 + EX2) * math.exp(U * F_MAX + J_MAX * (U * N.LN2_LO.value + LN2_LO_ERR) + F_MAX * (LOG2E_ERR + U)) - 1


def sigmoid_bound(x: torch.Tensor) -> torch.Tensor:
    """`_sigmoid`: z = e^-|x|, then 1 / (1 + z) or z / (1 + z). An error of z moves sigmoid by
    (1 - sigmoid(x)) of it (d log sigmoid / d log z); 1 + z and the divide (div.rn) round once each."""
    return (1 + (1 - torch.sigmoid(x)) * EXP) * (1 + U) * (1 + DIV_RN) - 1


def softplus_bound(x: torch.Tensor) -> torch.Tensor:
    """`_softplus`: u = e^x, w = 1 + u, log(w) u / (w - 1) (x itself above 20, exact).

    An error of u moves the result by k = u / ((1 + u) log1p(u)) <= 1 of it. w's rounding
    changes log1p(v) / v, v = w - 1, by at most U (Goldberg's log1p: its log-derivative times
    (1 + v) is within [1/2, 1]); w - 1 is exact while w < 2^24 (x < 16.6), else rounds. Then
    logf, the divide (div.rn) and the product. Where w rounds to 1 the result is u itself,
    within EXP + 2^-25 of log1p(u), below this bound."""
    u = torch.exp(x)
    k = torch.where(u > 0, u / ((1 + u) * torch.log1p(u)), 1.0)
    w_rounds = x > math.log(2.0**24 - 1)
    bound = (1 + k * EXP) * (1 + U) * (1 + LOGF) * (1 + DIV_RN) * (1 + U) * (1 + U * w_rounds) - 1
    return torch.where(x > 20, 0.0, bound)


def rms_of_ones_bound() -> float:
    """sqrt(sum(o^2) / n + eps) for o = 1: the sum is exact, / n is div.full, + eps rounds,
    then sqrt.approx."""
    return math.sqrt((1 + DIV_FULL) * (1 + U)) * (1 + SQRT_APPROX) - 1


def gated_bound(g: torch.Tensor) -> torch.Tensor:
    """y = (g sigmoid(g)) (o / r) with o = 1: the sigmoid, o / r (div.full, and r's error), two products."""
    return (1 + sigmoid_bound(g)) * (1 + DIV_FULL) / (1 - rms_of_ones_bound()) * (1 + U) ** 2 - 1


# The C++ kernels' fixed bounds (exp of their own within a few ulp, libm's log1p).
CPP_BOUND = {"sigmoid": 4e-7, "softplus": 1e-6}

IMPLS = {"triton": E, "cpp": EC}
impls = pytest.mark.parametrize("impl", ["triton", pytest.param("cpp", marks=pytest.mark.cpu_only)])
# Triton's interpreter computes with the extreme inputs in numpy, which warns on overflow.
overflow_ok = pytest.mark.filterwarnings("ignore:overflow encountered in:RuntimeWarning")


def worst(err, bound, x):
    """A message naming the input whose error is the largest multiple of its bound."""
    i = (err / bound).argmax()
    return f"error {err[i].item():.3g} > bound {bound[i].item():.3g} at x = {x[i].item()!r}"


# ---- the instructions --------------------------------------------------------------------------

# The PTX instructions with a documented accuracy that each kernel compiles to (float types):
# `_exp`'s ex2 (through libdevice's exp2f), `_div`'s div.rn, the norms' sqrt (libdevice's
# sqrtf, approximate) and `/` (div.full). The memory kernels and the backward products use none.
SIGMOID = {"ex2.approx.ftz.f32", "div.rn.f32"}
NORM = {"sqrt.approx.ftz.f32", "div.full.f32"}
EXPECTED = {
    "_step_fwd": set(), "_write": set(), "_read_fwd": set(), "_read_bwd": set(), "_step_bwd": set(), "_head_sums": set(),
    "_gate_grads": set(), "_l2n_relu_bwd": set(),
    "_gated_rms_fwd": SIGMOID | NORM,  # silu(gate) o / rms(o)
    "_read_factors": SIGMOID | NORM,  # the same, and o / rms(o), silu'(gate)'s products
    "_gated_rms_bwd": {"div.full.f32"},  # / N, / rms
    "_residual_rms_bwd": {"div.full.f32"},
    "_gate_factors": SIGMOID,  # the SwiGLU's and the predict gate's sigmoid
    "_post_projection": SIGMOID | NORM,  # SwiGLU's and beta's sigmoid, softplus's exp and divide, the decay's exp, the heads' l2 norm
    "_residual_rms": SIGMOID | NORM,
    "_ground": SIGMOID | NORM,
    "_ce_lse": {"ex2.approx.ftz.f32"},  # `_exp` (and tl.log: libdevice's logf, no approximate instruction)
    "_ce_grad": {"ex2.approx.ftz.f32"},  # `_exp`
    # the memory's chunk form: products, sums and dots only
    "_chunk_step_fwd": set(), "_chunk_read_fwd": set(), "_chunk_step_bwd": set(), "_chunk_read_bwd": set(),
    "_chunk_dm_products": set(), "_chunk_coefficients": set(), "_chunk_finish": set(),
    "_chunk_carry_back": set(),
}


def _f32(x: torch.Tensor) -> torch.Tensor:
    """x (float64) rounded to float32 once, as one float32 instruction rounds its exact result."""
    return x.float().double()


def _ex2(t: torch.Tensor, ulps: int) -> torch.Tensor:
    """2^t correctly rounded, then `ulps` float32 steps off: ex2.approx's documented worst case."""
    r = torch.exp2(t).float()
    for _ in range(abs(ulps)):
        r = torch.nextafter(r, torch.full_like(r, math.inf if ulps > 0 else 0.0))
    return r.double()


def test_sigmoid_bound_tells_the_formulations_apart():
    """A float32 model of the GPU's arithmetic: every instruction rounds its exact result once
    (float64 holds these products and fma's exactly), ex2.approx and div.full are off by their
    documented 2 ulp either way. `_sigmoid` as compiled (PTX in kernels/numerics.py) stays within
    sigmoid_bound; 1 / (1 + exp(-x)) with tl.exp's lowering, ex2(x * log2 e), exceeds it about
    eight times over at |x| ~ 85 (3.9e-6; an H200 measures about 4e-6), so the range test on a
    GPU tells the two apart."""
    x = _f32(torch.linspace(-85, 85, 20001, dtype=torch.float64))
    want = torch.sigmoid(x)
    bound = sigmoid_bound(x)
    log2e, ln2_lo = float(np.float32(N.LOG2E.value)), float(np.float32(N.LN2_LO.value))
    for ulps in (-2, 0, 2):
        a = -x.abs()  # _exp(-|x|): the argument reduction as compiled (three fma's, then a product)
        j = torch.floor(_f32(a * log2e + 0.5))
        f = _f32(_f32(a - j * N.LN2_HI.value) - j * ln2_lo)
        z = _ex2(_f32(f * log2e), ulps) * 2.0**j
        ours = _f32(torch.where(x >= 0, 1.0, z) / _f32(1 + z))  # div.rn
        assert ((ours - want).abs() / want <= bound).all()
        u = _ex2(_f32(-x * log2e), ulps)  # tl.exp(-x)
        naive = _f32(1 / _f32(1 + u)) * (1 + ulps * ULP)  # div.full, off as far as ex2
        assert ((naive - want).abs() / want / bound).max() > 5


def test_ptx_has_the_documented_instructions():
    kernels = compiled()
    assert sorted(kernels) == sorted(EXPECTED)
    got = {name: set(k["approx"]) for name, k in kernels.items()}
    assert got == EXPECTED, {name: sorted(got[name] ^ EXPECTED[name]) for name in EXPECTED if got[name] != EXPECTED[name]}
    # tl.log is libdevice's logf (a polynomial of exact fma's, 1 ulp), not lg2.approx (2^-22 absolute,
    # no relative accuracy for log(1 + u) near 1): inlined, it leaves its name in a label.
    assert "__nv_logf" in kernels["_post_projection"]["libdevice"] and "__nv_logf" in kernels["_ce_lse"]["libdevice"]


# ---- the functions over float32's range ---------------------------------------------------------


@overflow_ok
@impls
def test_sigmoid_is_accurate_over_floats_range(impl):
    """The kernels' sigmoid against torch's in float64, element by element: within its bound
    where sigmoid is a normal float, saturating beyond, NaN kept."""
    x = torch.cat([torch.linspace(-85, 85, 20001), torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4, float("inf"), -float("inf"), float("nan")])])
    x = x.to(DEVICE)[None]
    fg = torch.full_like(x, float("nan"))
    IMPLS[impl].ground(x, torch.ones_like(x), torch.zeros_like(x), fg)
    xd = x.double()
    want = torch.sigmoid(xd)
    normal = x.abs() <= 85
    err = ((fg.double() - want).abs() / want)[normal]
    bound = sigmoid_bound(xd)[normal] if impl == "triton" else torch.full_like(err, CPP_BOUND["sigmoid"])
    assert (err <= bound).all(), worst(err, bound, xd[normal])
    assert (fg.double() - want)[~normal & ~x.isnan()].abs().max() < 1e-36
    assert fg[x.isnan()].isnan().all()


def gates(impl, a, A):
    """post_projection's write gates for rows of a: (beta, gamma = softplus(a) A, decay = e^gamma)."""
    out = [torch.full_like(a, float("nan")) for _ in range(3)]
    ffn = torch.empty(1, 1, device=DEVICE)
    IMPLS[impl].post_projection(ffn, ffn, ffn, beta=a, a=a, A=A, out_beta=out[0], out_gamma=out[1], out_decay=out[2])
    return out


@overflow_ok
@impls
def test_softplus_keeps_digits_for_tiny_and_large_inputs(impl):
    """The write's decay rate softplus(a) is ~1e-3..1e-1 at init and can be far smaller: within
    its bound relative to torch's in float64 over float32's range, NaN kept."""
    a = torch.cat([torch.linspace(-87, 87, 3481), torch.tensor([-30.0, -16.0, -9.0, -3.0, 0.0, 0.5, 19.0, 21.0, 60.0, float("nan")])])
    a = a.to(DEVICE)[None]
    gamma = gates(impl, a, torch.ones(a.shape[1], device=DEVICE))[1]  # A = 1: gamma is softplus(a), no rounding
    ad = a.double()
    want = torch.nn.functional.softplus(ad)
    ok = ~a.isnan()
    err = ((gamma.double() - want).abs() / want)[ok]
    bound = softplus_bound(ad)[ok] if impl == "triton" else torch.full_like(err, CPP_BOUND["softplus"])
    assert (err <= bound).all(), worst(err, bound, ad[ok])
    assert gamma[~ok].isnan().all()


@overflow_ok
def test_decay_is_exp_of_gamma():
    """decay = e^gamma, gamma = -softplus(a) from 0 to -87: within EXP of e^gamma plus gamma's own
    error carried through (|gamma| times its relative error)."""
    a = torch.linspace(-30, 87, 2341, device=DEVICE)[None]
    _, gamma, decay = gates("triton", a, -torch.ones(a.shape[1], device=DEVICE))
    ad = a.double()
    want = torch.exp(-torch.nn.functional.softplus(ad))
    err = (decay.double() - want).abs() / want
    bound = (1 + EXP) * torch.exp(gamma.double().abs() * softplus_bound(ad)) - 1
    assert (err <= bound).all(), worst(err[0], bound[0], ad[0])


@overflow_ok
def test_read_gate_is_accurate_over_floats_range():
    """The memory read's y = silu(gate) o / rms(o) (kernels/memory/triton.py) with o = 1, against
    float64: within the sigmoid's bound plus the norm's and the products'."""
    B, n = 8, 2500
    g = torch.linspace(-85, 85, B * n, dtype=torch.float64).view(B, n)
    M = torch.ones(B, 1, 1, n, device=DEVICE)  # one head, d_k = 1: o = M^T q = 1
    o, y = K.memory_read(M, torch.ones(B, 1, 1, device=DEVICE), g.float().to(DEVICE))
    assert (o == 1).all()
    gd = g.float().double().to(DEVICE)
    want = gd * torch.sigmoid(gd) / math.sqrt(1 + RMS_EPS)
    err = (y.double() - want).abs() / want.abs()
    bound = gated_bound(gd)
    assert (err <= bound).all(), worst(err.flatten(), bound.flatten(), gd.flatten())
