"""Every Triton kernel compiles with the real compiler for an H100/H200 (sm_90), no GPU needed.

The interpreter runs kernels as NumPy code, so it accepts some programs the compiler rejects
(types, layouts, unsupported ops); this test runs Triton's full pipeline down to a cubin with
the ptxas Triton ships, in a fresh process (TRITON_INTERPRET must be unset when kernels are
defined).
"""

import os
import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.elementwise as E
import kernels.memory_step as K

INTS = {"H", "DK", "DV", "N", "NF", "ND", "NHEADS", "NG"}  # runtime sizes; other lower-case names are strides
CONSTEXPRS = {"BK": 128, "BV": 16, "BN": 4096, "BF": 1024, "BH": 16, "BHEADS": 32, "HEADS": True, "GATES": True,
              "HAS_HAT": True, "HAS_EXTRA": True, "L2EPS": 1e-12}
compiled = []
for module in (K, E):
    for name, fn in vars(module).items():
        if not isinstance(fn, triton.runtime.jit.JITFunction) or name in ("_sigmoid", "_softplus", "_rms_out"):
            continue  # helpers called from kernels are compiled with them
        signature, constexprs = {}, {}
        for arg in fn.arg_names:
            if arg in CONSTEXPRS:
                signature[arg], constexprs[arg] = "constexpr", CONSTEXPRS[arg]
            elif arg == "eps":
                signature[arg] = "fp32"
            elif arg in INTS or arg[0].islower():
                signature[arg] = "i32"
            else:
                signature[arg] = "*fp32"
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert kernel.asm["cubin"], name
        compiled.append(name)
print(" ".join(sorted(compiled)))
"""


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == sorted([
        "_gate_grads", "_gated_rms_bwd", "_gated_rms_fwd", "_ground", "_l2n_relu_bwd", "_post_projection", "_read_bwd",
        "_read_fwd", "_residual_rms", "_residual_rms_bwd", "_step_bwd", "_step_fwd", "_write"])
