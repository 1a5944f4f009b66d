"""The C++ CPU kernels of the memory step (kernels/cpu/memory_step.cpp) and the step's GEMM
(kernels/cpu/gemm.cpp) against their torch twins.

Every `out=` buffer the test passes is NaN-filled first, some of them as rows of a wider buffer
(the fused core's layout) whose other elements must stay NaN, so an element the kernel fails to
write, or writes in the wrong place, fails. Sizes are odd and d_k != d_v.

All of them need the CPU (marker `cpu_only`).
"""

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.twins import assert_close, count_calls, memory_inputs

from gpn_scale.models import GPN, GPNConfig, GPNState
from kernels.memory import reference as T
from kernels import cpu_build
from kernels.step import cpu as elementwise_cpu
from kernels.memory import cpu as K
from kernels import resolve

pytestmark = pytest.mark.cpu_only

SHAPES = [(1, 1, 5, 7), (3, 3, 7, 5), (3, 4, 6, 33), (2, 2, 16, 64)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def check(got, want, dtype, name, tol=None):
    assert_close(got, want, TOL[dtype] if tol is None else tol, name)


def nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def nan_rows(B, n, dtype, pad=3):
    """A (B, n) view into rows of a wider NaN buffer, and the buffer."""
    wide = nan(B, n + pad, dtype=dtype)
    return wide[:, 1 : n + 1], wide


def inputs(B, H, dk, dv, dtype, seed=0):
    return memory_inputs(B, H, dk, dv, dtype, seed)


@pytest.fixture(scope="module", autouse=True)
def built():
    ok, why = cpu_build.available()
    assert ok, f"the C++ kernels did not build: {why}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_twin(shape, dtype):
    B, H, dk, dv = shape
    x = inputs(B, H, dk, dv, dtype)
    ref = T.memory_step(**x)
    out_o, wide_o = nan_rows(B, H * dv, dtype)
    out_y, wide_y = nan_rows(B, H * dv, dtype)
    outs = dict(out_e=nan(B, H, dv, dtype=dtype), out_o=out_o, out_y=out_y, out_M=nan(B, H, dk, dv, dtype=dtype))
    for kwargs in ({}, outs):  # fresh outputs, then poisoned ones, some strided
        got = K.memory_step(**x, **kwargs)
        for name, a, b in zip(("M", "e", "o", "y"), got, ref):
            check(a, b, dtype, name)
    assert got[0] is outs["out_M"] and got[1] is outs["out_e"] and got[2] is out_o and got[3] is out_y
    for wide in (wide_o, wide_y):  # nothing written outside the rows
        assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, -2:]).all()

    o_ref, y_ref = T.memory_read(ref[0], x["q"], x["gate"])
    o, y = K.memory_read(ref[0], x["q"], x["gate"], out_o=nan_rows(B, H * dv, dtype)[0], out_y=nan(B, H * dv, dtype=dtype))
    check(o, o_ref, dtype, "read o")
    check(y, y_ref, dtype, "read y")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_matches_twin(shape, dtype):
    B, H, dk, dv = shape
    x = inputs(B, H, dk, dv, dtype, seed=1)
    M_t, e, o, _ = T.memory_step(**x)
    f = T.read_factors(o, x["gate"])
    g = torch.Generator().manual_seed(2)
    dM = torch.randn(M_t.shape, generator=g, dtype=dtype)
    dy = torch.randn(o.shape, generator=g, dtype=dtype)
    delta = x["beta"][..., None] * e
    names = ("dM_prev", "dk", "dv", "dbeta", "ddecay", "dq", "dgate")
    args = (x["M"], M_t, x["k"], x["beta"], x["decay"], e, delta, x["q"], f)
    ref = T.memory_step_backward(*args, dM.clone(), dy)
    gate_fac = torch.rand(B, 2, H, generator=g, dtype=dtype)
    outs = dict(out_dk=nan_rows(B, H * dk, dtype)[0].view(B, H, dk), out_dq=nan(B, H, dk, dtype=dtype),
                out_dbeta=nan(B, H, dtype=dtype), out_ddecay=nan_rows(B, H, dtype)[0], out_dgate=nan_rows(B, H * dv, dtype)[0],
                out_dM=nan(B, H, dk, dv, dtype=dtype), out_dv=nan_rows(B, H * dv, dtype)[0].view(B, H, dv), gate_fac=gate_fac,
                out_dgates=nan_rows(B, 2 * H, dtype)[0].view(B, 2, H))
    # into another dtype (the GEMM rows of a bf16 step): rounded copies
    narrow = dict(out_dv=nan_rows(B, H * dv, torch.bfloat16)[0].view(B, H, dv), gate_fac=gate_fac,
                  out_dgates=nan_rows(B, 2 * H, torch.bfloat16)[0].view(B, 2, H))
    for kwargs in ({}, outs, narrow):
        dM_in = dM.clone()
        got = K.memory_step_backward(*args, dM_in, dy, **kwargs)
        for name, a, b in zip(names, got, ref):
            check(a, b, dtype, name, tol=2e-2 if kwargs is narrow and name == "dv" else None)
        assert torch.equal(dM_in, dM)  # the incoming gradient is read, not overwritten
    assert torch.equal(narrow["out_dv"], outs["out_dv"].to(torch.bfloat16))
    check(outs["out_dgates"], torch.stack(ref[3:5], 1) * gate_fac, dtype, "dgates")
    assert torch.equal(narrow["out_dgates"], outs["out_dgates"].to(torch.bfloat16))

    ref = T.memory_read_backward(M_t, x["q"], f, dy, dM.clone())
    got = K.memory_read_backward(M_t, x["q"], f, dy, dM, out_dq=nan(B, H, dk, dtype=dtype),
                                 out_dgate=nan_rows(B, H * dv, dtype)[0], out_dM=nan(B, H, dk, dv, dtype=dtype))
    for name, a, b in zip(("read dq", "read dgate", "read dM"), got, ref):
        check(a, b, dtype, name)


def test_other_layouts_are_copied_in_and_out():
    """Inputs in no row layout (a transposed view, another dtype) are copied; an out buffer in
    no row layout receives the result through a copy."""
    B, H, dk, dv = 3, 2, 5, 4
    x = inputs(B, H, dk, dv, torch.float64, seed=4)
    ref = T.memory_step(**x)
    odd = dict(x, q=x["q"].transpose(0, 1).contiguous().transpose(0, 1), k=x["k"].float())  # k loses digits: 1e-6
    out_o = nan(H * dv, B, dtype=torch.float64).t()
    M_t, e, o, y = K.memory_step(**odd, out_o=out_o)
    assert o is out_o
    for name, a, b in zip(("M", "e", "o", "y"), (M_t, e, o, y), ref):
        check(a, b, torch.float64, name, tol=1e-6)


def test_nan_inputs_are_not_hidden_and_bad_buffers_are_named():
    x = inputs(1, 1, 5, 7, torch.float32)
    x["M"][0, 0, 4, 6] = float("nan")
    M_t, e, o, y = K.memory_step(**x)
    assert torch.isnan(M_t[0, 0, :, 6]).all() and torch.isnan(e[0, 0, 6]) and torch.isnan(o).any()
    with pytest.raises(ValueError, match="out_M must be contiguous"):
        K.memory_step(**inputs(2, 2, 3, 4, torch.float32), out_M=nan(2, 2, 4, 3, dtype=torch.float32).transpose(2, 3))
    with pytest.raises(ValueError, match="M must be contiguous"):
        x = inputs(2, 2, 3, 3, torch.float32)
        K.memory_step(**dict(x, M=x["M"].transpose(2, 3)))


@pytest.mark.parametrize("rows", [1, 3, 6, 8, 13, 16])
@pytest.mark.parametrize("K_, N", [(7, 5), (300, 61), (517, 200)], ids=["7x5", "300x61", "517x200"])
def test_packed_mm_matches_torch(rows, K_, N):
    """W row-major (the forward's) and a transposed view (the backward's), packed; with and
    without bias, into a fresh tensor and into rows of a wider NaN buffer, from rows of a wider
    input. N leaves a partial last panel (or is one)."""
    g = torch.Generator().manual_seed(rows * 1000 + K_)
    x = torch.randn(rows, K_ + 4, generator=g)[:, 2 : 2 + K_]
    bias = torch.randn(N, generator=g)
    for W in (torch.randn(K_, N, generator=g), torch.randn(N, K_, generator=g).t()):
        packed = elementwise_cpu.pack(W, steps=elementwise_cpu.PACK_MIN_STEPS, rows=2)
        assert isinstance(packed, elementwise_cpu.Packed)
        want = x.double() @ W.double()
        check(elementwise_cpu.mm(x, packed), want, torch.float32, "x @ W")
        out, wide = nan_rows(rows, N, torch.float32)
        assert elementwise_cpu.mm(x, packed, out=out, bias=bias) is out
        check(out, want + bias.double(), torch.float32, "bias + x @ W into rows")
        assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, N + 1 :]).all()


def test_mm_leaves_other_cases_to_torch_and_the_kernel_names_bad_input():
    """Short windows, one row (a matrix-vector product) and other dtypes are not packed; many
    rows go to torch (same result); the kernel names what it was given."""
    W = torch.randn(9, 6)
    for steps, rows, w in ((1, 8, W), (100, 1, W), (100, 8, W.double())):
        assert elementwise_cpu.pack(w, steps, rows) is w
    packed = elementwise_cpu.pack(W, steps=100, rows=8)
    x = torch.randn(40, 9)
    for a in (x, x[:5]):
        check(elementwise_cpu.mm(a, packed), a.double() @ W.double(), torch.float32, "mm")
    ext = cpu_build.load()
    with pytest.raises(ValueError, match=r"packed_mm: expected a 2-D float32 x, got \[5, 9\] Double"):
        ext.packed_mm(x[:5].double(), packed.data, 6, None, None)
    with pytest.raises(ValueError, match=r"packed_mm: the weights are not pack_weights of a \(8, 6\) float32 matrix"):
        ext.packed_mm(x[:5, :8], packed.data, 6, None, None)


def entry_point_calls():
    """(name, wrapper, arguments of a valid call on CPU) for every C++ entry point, through the
    Python wrappers: every tensor argument given, out buffers included."""
    B, H, dk, dv, nf, nb = 2, 2, 3, 4, 5, 2
    x = inputs(B, H, dk, dv, torch.float32)
    M_t, e, o, _ = T.memory_step(**x)
    f = T.read_factors(o, x["gate"])
    r = lambda *s: torch.randn(*s)  # noqa: E731
    n = H * dv
    outs = lambda **shapes: {k: nan(*s, dtype=torch.float32) for k, s in shapes.items()}  # noqa: E731
    W = r(9, 6)
    packed = elementwise_cpu.pack(W, steps=elementwise_cpu.PACK_MIN_STEPS, rows=2)
    return [
        ("memory_step", K.memory_step, dict(x, **outs(out_e=(B, H, dv), out_o=(B, n), out_y=(B, n), out_M=(B, H, dk, dv)))),
        ("memory_read", K.memory_read, dict(M=M_t, q=x["q"], gate=x["gate"], **outs(out_o=(B, n), out_y=(B, n)))),
        ("memory_read_backward", K.memory_read_backward,
         dict(M=M_t, q=x["q"], f=f, dy=r(B, n), dM=r(B, H, dk, dv), **outs(out_dq=(B, H, dk), out_dgate=(B, n), out_dM=(B, H, dk, dv)))),
        ("memory_step_backward", K.memory_step_backward,
         dict(M_prev=x["M"], M=M_t, k=x["k"], beta=x["beta"], decay=x["decay"], e=e, delta=x["beta"][..., None] * e, q=x["q"], f=f,
              dM=r(B, H, dk, dv), dy=r(B, n), gate_fac=r(B, 2, H),
              **outs(out_dk=(B, H, dk), out_dq=(B, H, dk), out_dbeta=(B, H), out_ddecay=(B, H), out_dgate=(B, n),
                     out_dM=(B, H, dk, dv), out_dv=(B, H, dv), out_dgates=(B, 2, H)))),
        ("post_projection", elementwise_cpu.post_projection,
         dict(h1=r(B, nf), h2=r(B, nf), out_ffn=nan(B, nf, dtype=torch.float32), heads=r(B, nb, H, dk), beta=r(B, H), a=r(B, H), A=-r(H).exp(),
              **outs(out_heads=(B, nb, H, dk), out_norms=(B, nb, H, 1), out_beta=(B, H), out_gamma=(B, H), out_decay=(B, H)))),
        ("residual_rms", elementwise_cpu.residual_rms, dict(y=r(B, n), pg=r(B, n), c=r(B, n), **outs(out=(B, n), out_hat=(B, n), out_rms=(B, 1)))),
        ("ground", elementwise_cpu.ground, dict(y_fg=r(B, n), c=r(B, n), u=r(B, n), **outs(out_fg=(B, n), out_hat=(B, n), out_rms=(B, 1)))),
        ("residual_rms_backward", elementwise_cpu.residual_rms_backward,
         dict(x_hat=r(B, n), r=r(B, 1).abs(), dx_hat=r(B, n), dc=r(B, n), gate=r(B, n), extra=r(B, n), **outs(out=(B, n)))),
        ("gate_grads", elementwise_cpu.gate_grads,
         dict(dz_ffn=r(B, 1, nf), ffn_fac=r(B, 2, nf), dc=r(B, n), pg_fac=r(B, n), **outs(out_dffn=(B, 2, nf), out_dpg=(B, n)))),
        ("l2n_relu_backward", elementwise_cpu.l2n_relu_backward,
         dict(y=r(B, nb, H, dk), mask_over_norm=r(B, nb, H, dk), dy=r(B, nb, H, dk), **outs(out=(B, nb, H, dk)))),
        ("pack_weights", lambda W: elementwise_cpu.pack(W, steps=elementwise_cpu.PACK_MIN_STEPS, rows=2), dict(W=W)),
        ("packed_mm", lambda x, packed, bias, out: elementwise_cpu.mm(x, elementwise_cpu.Packed(packed, W), out=out, bias=bias),
         dict(x=r(3, 9), packed=packed.data, bias=r(6), out=nan(3, 6, dtype=torch.float32))),
    ]


def test_entry_points_refuse_tensors_off_the_cpu():
    """A tensor on another device (here `meta`, which every machine has; on a GPU machine a CUDA
    tensor, whose memory the kernels would read as host memory) is refused with a one-line
    ValueError naming the entry point, the argument and the device, whichever argument it is."""
    calls = entry_point_calls()
    assert sorted(name for name, _, _ in calls) == sorted(n for n in dir(cpu_build.load()) if not n.startswith("_"))
    for name, fn, kwargs in calls:
        fn(**kwargs)  # valid on CPU
        args = [(arg, {**kwargs, arg: t.to("meta")}) for arg, t in kwargs.items() if isinstance(t, torch.Tensor)]
        if "f" in kwargs:  # the read's factors, passed on one by one
            args += [(field, {**kwargs, "f": kwargs["f"]._replace(**{field: t.to("meta")})}) for field, t in kwargs["f"]._asdict().items()]
        for arg, bad in args:
            with pytest.raises(ValueError) as info:
                fn(**bad)
            message = str(info.value)
            assert message == f"{name}: {arg} is on meta; the C++ kernels take CPU tensors", message


ODD = GPNConfig(vocab_size=29, d_state=14, d_emb=6, d_ffn=9, n_heads=3, d_key=5, d_val=4, core_chunk=3)


@pytest.mark.parametrize("mode", ["float64", "float32"])
@pytest.mark.parametrize("case", [dict(n_layers=1), dict(n_layers=2, bptt=4)], ids=["gpn_m_1l", "gpn_m_2l_bptt"])
def test_model_with_cpp_kernels_matches_torch(case, mode, monkeypatch):
    """Loss, carried state, and the gradients of every parameter and of the incoming state."""
    calls = []
    count_calls(monkeypatch, K, ("memory_step", "memory_read", "memory_step_backward", "memory_read_backward"), calls)
    dtype = torch.float64 if mode == "float64" else torch.float32
    torch.manual_seed(0)
    model = GPN(dataclasses.replace(ODD, **case)).to(dtype)
    with torch.no_grad():  # move the zero-initialised gates and out-projections: every path live
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        carried = model(torch.randint(0, ODD.vocab_size, (2, 4))).state
    tokens = torch.randint(0, ODD.vocab_size, (2, 19))  # >= PACK_MIN_STEPS: the packed GEMMs run in float32
    results = {}
    for kernel in ("torch", "cpp"):
        model.config.kernel = kernel
        model.zero_grad()
        state = GPNState(*(x.clone().requires_grad_() for x in carried))
        out = model(tokens, state=state)
        (out.loss + out.state.s.square().mean() + out.state.M.square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        grads.update({f"state.{n}": x.grad for n, x in zip(("s", "prev_s", "M"), state)})
        results[kernel] = (out, grads)
    (a, ga), (b, gb) = results["cpp"], results["torch"]
    tol = {"float64": 1e-10, "float32": 1e-5}[mode]
    check(a.loss, b.loss, dtype, "loss", tol)
    for name, x, y in zip(("s", "prev_s", "M"), a.state, b.state):
        check(x, y, dtype, name, tol)
    assert ga.keys() == gb.keys()
    for name in gb:
        check(ga[name], gb[name], dtype, name, tol)
    assert calls.count("memory_step") > tokens.shape[1]  # the forward's steps and the rebuild's
    assert calls.count("memory_step_backward") == tokens.shape[1]
    assert ("memory_read" in calls) == ("memory_read_backward" in calls) == (model.config.n_layers > 1)


def test_auto_picks_the_cpp_kernels_on_cpu():
    assert resolve("auto", "cpu") == "cpp"
    with pytest.raises(ValueError, match="'cpp' runs on CPU"):
        resolve("cpp", "cuda")


def test_without_a_compiler_auto_falls_back_to_the_twins_with_a_warning(monkeypatch):
    monkeypatch.setattr(cpu_build, "_ext", None)
    monkeypatch.setattr(cpu_build, "_error", "CalledProcessError: no C++ compiler")
    with pytest.warns(UserWarning, match="could not be built .*no C\\+\\+ compiler.*torch twins"):
        assert resolve("auto", "cpu") == "torch"
    with pytest.raises(RuntimeError, match="kernel 'cpp': the C\\+\\+ CPU kernels could not be built"):
        K.memory_step(**inputs(1, 1, 2, 3, torch.float32))


def test_two_checkouts_sharing_one_cache_build_once(tmp_path):
    """A second checkout of the same sources loads the build the first made (no '[kernels]
    building' line); a checkout whose sources differ gets a build of its own name, so the two
    never rebuild each other's."""
    import torch

    arch = torch.backends.cpu.get_cpu_capability()
    other = tmp_path / "other_checkout"
    shutil.copytree(Path(cpu_build.__file__).parent, other / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    from torch.utils import cpp_extension

    name = cpu_build.build_name(arch)
    built = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    stamp = built.stat().st_mtime_ns
    probe = ("import torch, kernels; from kernels import cpu_build; cpu_build.load(); "
             "print(kernels.__file__, cpu_build.build_name(torch.backends.cpu.get_cpu_capability()))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=other,
                          env=dict(os.environ, PYTHONPATH=str(other)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, other_name = proc.stdout.split()
    assert where == str(other / "kernels" / "__init__.py")  # the copy ran, not this checkout
    assert other_name == name
    assert "[kernels] building" not in proc.stderr, proc.stderr
    assert built.stat().st_mtime_ns == stamp  # this checkout's build loaded, not rebuilt

    with open(other / "kernels" / "cpu" / "layout.h", "a") as f:  # an edited checkout
        f.write("\n// edited\n")
    spec = importlib.util.spec_from_file_location("edited_cpu_build", other / "kernels" / "cpu_build.py")
    edited = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edited)  # hashes the files beside it: the edited checkout's
    assert edited.build_name(arch) != cpu_build.build_name(arch)
    assert edited.build_name(arch).startswith(f"gpn_cpu_kernels_{arch.lower()}_")
