"""exp, sigmoid and softplus for the Triton kernels, accurate to a few float32 ulps over the
whole float range on the GPU, not only under Triton's interpreter.

On an NVIDIA GPU `tl.exp(x)` compiles to `ex2.approx.f32(x * log2(e))`: the product's rounding
moves the exponent by up to |x log2(e)| 2^-24, a relative error of |x| 2^-24 in the result (and
float32's log2(e) adds |x| 1.3e-8): 6.5e-6 at |x| = 85, on top of ex2's own 2 ulp. `_exp`
reduces the argument first, as libm does: x = j ln2 + f with j an integer and |f| <= ln2 / 2,
ln2 in two parts so that x - j ln2_hi is exact; then e^x = ex2(f log2(e)) 2^j, the power of two
written into the exponent bits. The reduced exponent is below 1/2, so its rounding costs at
most 2.5e-8, and e^x is within 2.5 ulp plus 4.6e-8 (3.44e-7 relative) wherever it is a normal
float.

The derivation of each function's bound from the documented errors of the instructions it
compiles to is in docs/kernels_accuracy.md; tests/kernels/test_kernels_accuracy.py computes the bounds
per input from the same constants, checks the kernels against them and checks that the
compiled PTX uses exactly the instructions the derivation assumes.

In float64 (the gradient checks) these are `tl.exp`, `/`: libdevice's exp and an IEEE divide
in double, far below float32's errors.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ln 2 = LN2_HI + LN2_LO: LN2_HI has 15 significant bits, so j * LN2_HI is exact for |j| < 2^9.
LN2_HI = tl.constexpr(0.693145751953125)
LN2_LO = tl.constexpr(1.4286068202862268e-06)
LOG2E = tl.constexpr(1.4426950408889634)
# Below EXP_MIN e^x is 0 in float32 (e^-104 rounds to 0), above EXP_MAX it is inf: clamped there,
# the reduced argument's j stays within [-217, 129], whose halves are normal powers of two.
EXP_MIN = tl.constexpr(-150.0)
EXP_MAX = tl.constexpr(89.0)


@triton.jit
def _exp(x):
    """e^x: within 2.5 ulp plus 4.6e-8 relative wherever e^x is a normal float; subnormal results
    are rounded once, inf above 88.7, NaN stays NaN."""
    if x.dtype == tl.float64:
        r = tl.exp(x)
    else:
        xc = tl.where(x > EXP_MIN, tl.where(x < EXP_MAX, x, EXP_MAX), EXP_MIN)  # NaN -> EXP_MIN, restored below
        j = tl.floor(xc * LOG2E + 0.5)
        f = (xc - j * LN2_HI) - j * LN2_LO  # the first difference is exact (Sterbenz), fused or not
        p = tl.exp2(f * LOG2E)  # 2^-0.5 <= p <= 2^0.5
        ji = j.to(tl.int32)
        h = ji >> 1  # 2^j = 2^h 2^(j - h): both normal, so p 2^h is exact and the last product rounds once
        s1 = ((h + 127) << 23).to(tl.float32, bitcast=True)
        s2 = ((ji - h + 127) << 23).to(tl.float32, bitcast=True)
        r = tl.where(x == x, p * s1 * s2, x)
    return r


@triton.jit
def _div(a, b):
    """a / b rounded once (div.rn: IEEE), where the compiler's `/` is div.full.f32 (2 ulp)."""
    if a.dtype == tl.float64:
        q = a / b
    else:
        q = tl.div_rn(a, b)
    return q


@triton.jit
def _sigmoid(x):
    """1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below: exp of -|x| <= 0 only, which never
    overflows, and one correctly rounded divide."""
    z = _exp(-tl.abs(x))
    return _div(tl.where(x >= 0, 1.0, z), 1.0 + z)


@triton.jit
def _softplus(x):
    """log(1 + e^x) as torch's (x itself above 20), with log1p(u) = log(1 + u) u / ((1 + u) - 1):
    exact to rounding for tiny u, where log(1 + u) alone loses all digits. NaN stays NaN."""
    u = _exp(tl.where(x > 20.0, 20.0, x))  # not tl.minimum: min.f32 and the interpreter's fmin drop a NaN
    w = 1.0 + u
    tiny = w == 1.0
    log1p = tl.where(tiny, u, tl.log(w) * _div(u, tl.where(tiny, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _rounded(x, DT: tl.constexpr):
    """x (float32 or float64) as DT, bf16 rounded to nearest even by hand: the GPU's conversion
    does that, Triton's interpreter truncates, and a kernel must give the same numbers on both
    (and the same as torch's `.to(bfloat16)`, which the twins use). NaN stays NaN."""
    if DT == tl.bfloat16:
        u = x.to(tl.float32).to(tl.uint32, bitcast=True)
        hi = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        hi = tl.where(x != x, 0x7FC0, hi)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)
