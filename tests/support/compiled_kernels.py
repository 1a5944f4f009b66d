"""Every Triton kernel compiled with the real compiler for an H100/H200 (sm_90), no GPU needed,
once per test process (`compiled()`), for tests/kernels/test_kernels_compile.py and
tests/kernels/test_kernels_accuracy.py.

The compiler runs in a fresh process: TRITON_INTERPRET, which the kernel tests set around their
imports, must be unset when kernels are defined. Each kernel is compiled three times:

- with float32 pointers, down to a cubin with the ptxas Triton ships; from its PTX, the
  floating-point instructions whose accuracy is documented per instruction (ex2, lg2, rcp,
  sqrt, rsqrt, div, sin, cos, tanh) and the libdevice functions it inlines; from ptxas' own
  report (`ptxas -v`, which Triton runs and prints when asked), the registers per thread and the
  bytes spilled to local memory. Triton's compiled kernel has `n_regs` and `n_spills` only once
  a GPU driver has loaded it, so the report is read instead, compiled afresh (a cached kernel
  runs no ptxas);
- with the state's tensors (ARITH: the outputs, and M for the memory kernels) in float32 and
  every other tensor in float64, and
- with the state's tensors in float64 and every other tensor in bfloat16: from the Triton IR
  of both (as the front end makes it, without the rest of the pipeline), the arithmetic done in
  a dtype other than the state's. The kernels compute in the
  state's dtype, so every load must be converted to it before any arithmetic: an input in
  float64 that is not narrowed makes float64 arithmetic (or, in a loop, fails to compile), two
  bfloat16 inputs multiplied unconverted make bfloat16 arithmetic, a hard-coded float32 shows
  up as float32 arithmetic in a float64 kernel.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from support import ROOT

# The pointer arguments in the state's dtype: the outputs (the launchers allocate them like the
# state), and M's blocks for the memory kernels; for the groups whose outputs may be the next
# GEMM's bf16, the state-dtype inputs their arithmetic follows. Every other pointer is an input,
# converted on load (or an output, rounded on store).
ARITH = {
    "_step_fwd": {"M", "M_out", "E", "O"},
    "_write": {"M", "M_out"},
    "_read_fwd": {"M", "O"},
    "_gated_rms_fwd": {"O"},  # y may be the next GEMM's bf16
    "_gated_rms_bwd": {"DO"},  # dgate may be the next GEMM's bf16
    "_read_factors": {"O", "R", "O_HAT", "SILU_GATE", "TO_GATE"},  # the gate may be the projection's bf16, y the next GEMM's
    "_read_bwd": {"M", "DM_OUT", "PART"},
    "_step_bwd": {"M_PREV", "DM_PREV", "DV_OUT", "PART"},
    "_head_sums": {"PART", "DQ", "DK_OUT", "DBETA", "DDECAY"},
    "_post_projection": {"FFN", "NQ", "NN", "BETA", "GAMMA", "DECAY"},
    "_residual_rms": {"OUT", "HAT", "R"},
    "_ground": {"FG", "G", "HAT", "R"},
    "_residual_rms_bwd": {"OUT"},
    "_gate_grads": {"FAC", "PGF"},  # the outputs may be bf16, the next GEMM's input
    "_gate_factors": {"FAC", "PGO", "PGF"},  # the SwiGLU's output may be bf16, the next GEMM's input
    "_l2n_relu_bwd": {"Y", "MASK"},
    "_ce_lse": {"LSE"},
    "_ce_grad": {"LSE"},  # the logits' gradient may be bf16, the next GEMMs' input
    # the memory's chunk form: the chunk buffers of keys and deltas are the state's, written by the step
    # (M_c itself may be read in a narrower dtype: an input, converted on load)
    "_chunk_step_fwd": {"KC", "DC", "M_OUT", "E", "O"},
    "_chunk_read_fwd": {"O"},
    "_chunk_read_bwd": {"PHI", "DQ"},
    "_chunk_step_bwd": {"PHI", "DV_OUT", "DQ", "DK_OUT", "DBETA", "DGAMMA"},
    "_chunk_dm_products": {"DM", "U0", "V0"},
    "_chunk_coefficients": {"GAM", "T_OUT", "KK_OUT", "BM_OUT", "U_OUT", "V_OUT", "C_OUT", "H_OUT"},
    "_chunk_finish": {"SCALE", "ROWS", "W"},
    "_chunk_carry_back": {"DM", "OUT"},
}
# (state dtype, input dtype) of the two variants
VARIANTS = {"float64 inputs": ("fp32", "fp64"), "bfloat16 inputs, float64 state": ("fp64", "bf16")}

SCRIPT = r"""
import contextlib
import io
import json
import re
import sys

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.step.triton as E
import kernels.memory.triton as K
import kernels.memory_chunk.triton as C

ARITH = {k: set(v) for k, v in json.loads(sys.argv[1]).items()}
VARIANTS = json.loads(sys.argv[2])
HELPERS = {"_rms_out", "_residual", "_grounded", "_decays_to", "_row", "_rows", "_g_column",
           "_row_rms", "_square"}  # called from kernels, compiled with them (as kernels/numerics.py's)
INTS = {"H", "DK", "DV", "N", "NF", "ND", "NHEADS", "NG", "NB", "NL", "NR"}  # runtime sizes; other lower-case names are strides
INDICES = {"TGT"}  # pointers to integer indices (the cross-entropy's targets)
CONSTEXPRS = {"BK": 128, "BV": 16, "BN": 1024, "BF": 1024, "BH": 16, "BHEADS": 32, "HEADS": True, "GATES": True,
              "HAS_HAT": True, "HAS_EXTRA": True, "HAS_LOW": True, "HAS_LOW_FAC": True, "L2EPS": 1e-12,
              "STEP": True,  # `_head_sums` for the step's backward: its code holds the read's as a part
              "BC": 32, "CLOSE": True, "BL": 2, "BR": 32, "APART": True,  # the chunk form at chunks of 32, its last step (which writes M)
              "COPY": True, "WRITE_Y": True, "BD": 16}
TARGET = GPUTarget("cuda", 90, 32)
knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed to stdout
knobs.compilation.always_compile = True  # a kernel from Triton's cache runs no ptxas
# Instructions with a documented accuracy (PTX ISA, floating-point instructions), float types only.
APPROX = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ex2|lg2|rcp|sqrt|rsqrt|div|sin|cos|tanh)\.[\w.]*?\.(?:f16|bf16|f32|f64)(?:x2)?)\s", re.M)
REGISTERS = re.compile(r"Used (\d+) registers")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
ARITH_OP = re.compile(r"= (arith\.(?:addf|subf|mulf|divf|remf|negf|maximumf|minimumf|maxnumf|minnumf|cmpf)|math\.\w+|tt\.precise_\w+)\b[^:]*:\s*(.*?)\s*(?:loc\(|$)")


def signature(name, fn, state, inputs):
    sig, constexprs = {}, {}
    for arg in fn.arg_names:
        if arg in CONSTEXPRS:
            sig[arg], constexprs[arg] = "constexpr", CONSTEXPRS[arg]
        elif arg == "eps":
            sig[arg] = "fp32"
        elif arg in INTS or arg[0].islower():
            sig[arg] = "i32"
        elif arg in INDICES:
            sig[arg] = "*i64"
        else:
            sig[arg] = "*" + (state if arg in ARITH.get(name, ()) else inputs)
    return sig, constexprs


def frontend_ir(fn, sig, constexprs):
    # The Triton IR as the front end makes it, before any pass: what triton.compile starts
    # from, in a fraction of its time (it goes on to a cubin). Through the compiler's own steps
    # (Triton 3.6 to 3.8); where those differ, the whole compile's TTIR.
    src = ASTSource(fn, sig, constexprs)
    try:
        from triton._C.libtriton import ir
        from triton.compiler import make_backend

        backend = make_backend(TARGET)
        options = backend.parse_options({"num_warps": 8})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        return str(src.make_ir(TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(), context))
    except (ImportError, AttributeError, TypeError):  # another compiler API (a kernel's own errors are CompilationError)
        return triton.compile(src, target=TARGET, options={"num_warps": 8}).asm["ttir"]


def foreign_arithmetic(ttir, state):
    dtypes = {"fp32": "f32", "fp64": "f64"}
    found = []
    for line in ttir.splitlines():
        m = ARITH_OP.search(line)
        if m and set(re.findall(r"bf16|f16|f32|f64", m.group(2))) - {dtypes[state]}:
            found.append(m.group(1) + " : " + m.group(2))
    return sorted(set(found))


def compile_with_report(fn, sig, constexprs):
    # The compiled kernel and, from ptxas' report of it, registers per thread and bytes spilled.
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, sig, constexprs), target=TARGET, options={"num_warps": 8})
    regs, spills = REGISTERS.findall(log.getvalue()), SPILLS.findall(log.getvalue())
    assert len(regs) == len(spills) == 1, log.getvalue()
    return kernel, int(regs[0]), sum(map(int, spills[0]))


out = {}
for module in (K, E, C):
    for name, fn in vars(module).items():
        if not isinstance(fn, triton.runtime.jit.JITFunction) or name in HELPERS or fn.fn.__module__ != module.__name__:
            continue
        sig, constexprs = signature(name, fn, "fp32", "fp32")
        kernel, n_regs, n_spills = compile_with_report(fn, sig, constexprs)
        ptx = kernel.asm["ptx"]
        entry = {"cubin": bool(kernel.asm["cubin"]), "n_regs": n_regs, "n_spills": n_spills,
                 "approx": sorted(set(APPROX.findall(ptx))),
                 "libdevice": sorted(set(re.findall(r"__nv_[a-z0-9_]+", ptx))), "variants": {}}
        for variant, (state, inputs) in VARIANTS.items():
            try:
                sig, constexprs = signature(name, fn, state, inputs)
                entry["variants"][variant] = foreign_arithmetic(frontend_ir(fn, sig, constexprs), state)
            except Exception as exc:  # e.g. a loop-carried value whose dtype changes
                cause = exc.__cause__ or exc
                entry["variants"][variant] = [f"does not compile: {type(cause).__name__}: {str(cause).strip()[-300:]}"]
        out[name] = entry
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def compiled() -> dict:
    """{kernel name: {"cubin": bool, "n_regs": registers per thread, "n_spills": bytes spilled
    (stores and loads), "approx": [PTX opcodes], "libdevice": [functions],
    "variants": {variant: [arithmetic in a dtype other than the state's]}}}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    arith = json.dumps({k: sorted(v) for k, v in ARITH.items()})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, arith, json.dumps(VARIANTS)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
