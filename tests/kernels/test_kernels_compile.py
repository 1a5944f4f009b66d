"""Every Triton kernel compiles with the real compiler for an H100/H200 (sm_90), no GPU needed,
computes in the state's dtype whatever the dtypes of its inputs, and fits in registers.

The interpreter runs kernels as NumPy code, so it accepts some programs the compiler rejects
(types, layouts, unsupported ops); these tests run Triton's full pipeline down to a cubin with
the ptxas Triton ships, in a fresh process (tests/support/compiled_kernels.py).
"""

from support.compiled_kernels import ARITH, compiled

KERNELS = sorted([
    "_ce_grad", "_ce_lse", "_gate_factors", "_gate_grads", "_gated_rms_bwd", "_gated_rms_fwd", "_ground", "_head_sums", "_l2n_relu_bwd", "_post_projection",
    "_read_bwd", "_read_factors", "_read_fwd", "_residual_rms", "_residual_rms_bwd", "_step_bwd", "_step_fwd", "_write",
    "_chunk_step_fwd", "_chunk_read_fwd", "_chunk_step_bwd", "_chunk_read_bwd", "_chunk_dm_products",
    "_chunk_coefficients", "_chunk_finish", "_chunk_carry_back"])

# Registers per thread at 8 warps (sm_90 has 64K per SM, 255 at most per thread). The kernels
# that move M are bound by its traffic: at 128 or fewer, two 256-thread programs share an
# SM, so one's loads overlap the other's arithmetic (measured at the 130M tile, 128 x 16:
# _step_fwd 58, _step_bwd 62, _read_bwd 40, _write and _read_fwd fewer; a 128 x 32 tile needs 118
# in _step_bwd, 128 x 64 needs 216). The chunk form's, with the chunk's rows beside the tile (32):
# _chunk_step_fwd 128, _chunk_read_fwd 72, _chunk_step_bwd 116, _chunk_read_bwd 76,
# _chunk_dm_products 128, _chunk_carry_back 102. The chunk's once-per-chunk algebra, one program per
# (sequence, head) with its 32 x 32 matrices whole: _chunk_coefficients 177, _chunk_finish 182 (a
# ceiling of 192 keeps them off the spills 32 columns at a time bring). Any other kernel: the
# hardware's limit.
REGISTER_CEILING = {"_step_fwd": 128, "_step_bwd": 128, "_read_bwd": 128, "_read_fwd": 128, "_write": 128,
                    "_chunk_step_fwd": 128, "_chunk_read_fwd": 128, "_chunk_step_bwd": 128, "_chunk_read_bwd": 128,
                    "_chunk_dm_products": 128, "_chunk_carry_back": 128, "_chunk_coefficients": 192, "_chunk_finish": 192}
MAX_REGISTERS = 255


def test_kernels_compile_for_sm90():
    kernels = compiled()
    assert sorted(kernels) == KERNELS == sorted(ARITH)
    assert all(k["cubin"] for k in kernels.values())


def test_no_register_spills_and_registers_under_the_ceiling():
    """From ptxas' report of each kernel's cubin: nothing spilled to local memory (a spill is an
    extra round trip to memory per use, inside the time loop), and registers per thread within
    the kernel's ceiling (a kernel over it runs fewer programs per SM than its traffic needs)."""
    kernels = compiled()
    spills = {name: k["n_spills"] for name, k in kernels.items() if k["n_spills"]}
    assert not spills, f"bytes spilled (stores + loads) per kernel: {spills}"
    over = {name: (k["n_regs"], REGISTER_CEILING.get(name, MAX_REGISTERS)) for name, k in kernels.items()
            if not 0 < k["n_regs"] <= REGISTER_CEILING.get(name, MAX_REGISTERS)}
    assert not over, f"registers per thread (used, ceiling): {over}"


def test_loads_are_converted_to_the_state_dtype():
    """Compiled with float64 inputs and a float32 state, and with bfloat16 inputs and a float64
    state, no kernel does arithmetic in a dtype other than the state's: each load is converted
    before use (float64 inputs narrowed, bfloat16 ones widened, nothing fixed at float32)."""
    foreign = {f"{name} ({variant})": ops for name, k in compiled().items() for variant, ops in k["variants"].items() if ops}
    assert not foreign, "\n".join(f"{where}: {ops}" for where, ops in foreign.items())
