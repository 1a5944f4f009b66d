"""Every Triton kernel compiles with the real compiler for an H100/H200 (sm_90), no GPU needed,
and computes in the state's dtype whatever the dtypes of its inputs.

The interpreter runs kernels as NumPy code, so it accepts some programs the compiler rejects
(types, layouts, unsupported ops); these tests run Triton's full pipeline down to a cubin with
the ptxas Triton ships, in a fresh process (tests/compiled_kernels.py).
"""

from compiled_kernels import ARITH, compiled

KERNELS = sorted([
    "_gate_grads", "_gated_rms_bwd", "_gated_rms_fwd", "_ground", "_head_sums", "_l2n_relu_bwd", "_post_projection",
    "_read_bwd", "_read_fwd", "_residual_rms", "_residual_rms_bwd", "_step_bwd", "_step_fwd", "_write"])


def test_kernels_compile_for_sm90():
    kernels = compiled()
    assert sorted(kernels) == KERNELS == sorted(ARITH)
    assert all(k["cubin"] for k in kernels.values())


def test_loads_are_converted_to_the_state_dtype():
    """Compiled with float64 inputs and a float32 state, and with bfloat16 inputs and a float64
    state, no kernel does arithmetic in a dtype other than the state's: each load is converted
    before use (float64 inputs narrowed, bfloat16 ones widened, nothing fixed at float32)."""
    foreign = {f"{name} ({variant})": ops for name, k in compiled().items() for variant, ops in k["variants"].items() if ops}
    assert not foreign, "\n".join(f"{where}: {ops}" for where, ops in foreign.items())
