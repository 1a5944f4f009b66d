"""The stages of scripts/gpu_check.py, each run in a process of its own (`gpu_check.py --stage NAME`):
what each checks is in docs/gpu.md. Also the two modes they run in, on a GPU and (dry) on a CPU.

Imports only the standard library at the top; each stage imports torch, triton, numpy and yaml,
and the engine stage's training processes deepspeed and streaming.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("deepspeed", "streaming", "wandb")  # the model and kernel code must not need them
MODEL_MODULES = ("gpn_scale.models", "gpn_scale.models.core", "kernels.memory.triton", "kernels.memory_chunk.triton",
                 "kernels.step.triton", "kernels.graph")


@dataclasses.dataclass(frozen=True)
class Mode:
    """What each stage runs, on a GPU or (dry) on a CPU."""

    name: str
    budget_s: int
    timeouts: dict
    graph_config: str
    graph_batch: int
    graph_seq_len: int
    graph_steps: int
    graph_core_chunk: int | None
    graph_kernel: str
    kernel_select: str | None
    bench_args: tuple
    engine_steps: int
    engine_seq_len: int
    engine_kernel: str | None

    @property
    def dry(self) -> bool:
        return self.name == "dry"


GPU = Mode(
    name="gpu", budget_s=450,
    timeouts=dict(env=60, graphs=150, kernels=180, bench=200, engine=200),
    graph_config="gpn_m_130m_1l", graph_batch=8, graph_seq_len=256, graph_steps=5, graph_core_chunk=None,
    graph_kernel="triton", kernel_select=None,
    # T 2048 as the benchmark's default; fixed batches (a row halves its batch on running out of memory)
    bench_args=("--steps", "2", "--batch", "gpn_m_triton=64", "--batch", "gpn_m_chunk=64", "--batch", "gpn_m_eager=64",
                "--batch", "gpn_m_torch=64",
                "--batch", "naive=8", "--batch", "transformer=32"),
    engine_steps=20, engine_seq_len=128, engine_kernel=None,
)
DRY = Mode(
    # ~90 s in all on an idle 2-core machine (scripts/env.sh builds DeepSpeed's CPU comm op beforehand; else the engine's first run does, 1-2 min)
    name="dry", budget_s=360,
    timeouts=dict(env=60, graphs=180, kernels=60, bench=60, engine=180),
    # Triton's interpreter costs ~0.2 s per time step of the tiny model: short windows, 2 steps
    # (4 calls: the forward graph replayed on the 2nd to 4th, the backward on the 3rd and 4th)
    graph_config="gpn_m_tiny", graph_batch=2, graph_seq_len=4, graph_steps=2, graph_core_chunk=2,
    # the torch twins: the graphs and the streams' events are what this stage checks, and Triton's
    # interpreter costs ~0.1 s per launch (1,000 launches); the kernels stage runs the interpreter
    graph_kernel="torch",
    # a few of each kind under the interpreter: memory step forward and backward, the elementwise
    # groups, and the accuracy tests but the one that compiles PTX
    kernel_select=("3x4x6x33-dtype1 or triton-3x9x33x1x4x6-all-dtype1 or triton-3x9x33x1x4x6-dtype1 "
                   "or test_nan_inputs_are_not_hidden or test_float64_follows_m or (accuracy and not ptx) "
                   "or test_the_passes_over_dM_match_twin"),
    bench_args=("--device", "cpu", "--seq-len", "4", "--naive-seq-len", "2", "--steps", "1"),
    # the engine runs the torch twins on CPU: the interpreter would take ~7 s per step
    engine_steps=8, engine_seq_len=16, engine_kernel="torch",
)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- stage helpers (run inside the stage's process) -----------------------------------------


class Part:
    """This stage's part of the JSON, rewritten on every update."""

    def __init__(self, out: Path, name: str):
        self.path, self.data = out / "stages" / f"{name}.json", {"status": "RUNNING"}
        self.update()

    def update(self, **kw) -> None:
        self.data.update(kw)
        write_json(self.path, self.data)

    def finish(self, status: str, detail: str, **kw) -> None:
        self.update(status=status, detail=detail, **kw)


def tee(cmd, env=None, cwd=ROOT) -> tuple[int, list[str]]:
    """Run cmd with its output streamed into this stage's output (the log); (status, lines)."""
    print(f"$ {' '.join(map(str, cmd))}", flush=True)
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=cwd, errors="replace")
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line.rstrip("\n"))
    return proc.wait(), lines


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# ---- stage: environment and imports ---------------------------------------------------------

_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {forbidden!r}:
            raise ImportError('blocked by gpu_check: ' + name)
sys.meta_path.insert(0, Block())
"""

_IMPORTS = """
import json, sys
for m in {modules!r}:
    __import__(m)
print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))
"""


def stage_env_imports(part: Part, mode: Mode) -> None:
    import numpy
    import pytest
    import torch
    import triton
    import yaml

    info = dict(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
                triton=triton.__version__, numpy=numpy.__version__, pyyaml=yaml.__version__, pytest=pytest.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                cuda_available=torch.cuda.is_available(), gpu=None, gpu_count=0, capability=None, gpu_memory_gib=None,
                driver=None)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), capability=f"sm_{props.major}{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1))
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    part.update(**info)
    print(json.dumps(info, indent=1), flush=True)

    imports = {}
    for label, prelude in (("plain", ""), ("blocked", _BLOCKER.format(forbidden=set(FORBIDDEN)))):
        code = prelude + _IMPORTS.format(modules=MODEL_MODULES)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
        print(f"imports ({label}): status {proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
        if proc.returncode != 0:
            imports[label] = dict(ok=False, error=(proc.stderr.strip().splitlines() or ["?"])[-1])
            continue
        top = json.loads(proc.stdout.strip().splitlines()[-1])
        loaded = sorted(set(top) & set(FORBIDDEN))
        imports[label] = dict(ok=not loaded, forbidden_loaded=loaded, modules=len(top))
    part.update(modules=list(MODEL_MODULES), forbidden=list(FORBIDDEN), imports=imports)

    problems = []
    if not imports["plain"]["ok"]:
        problems.append(imports["plain"].get("error") or f"importing the model loads {', '.join(imports['plain']['forbidden_loaded'])}")
    if not imports["blocked"]["ok"]:
        problems.append(f"with {', '.join(FORBIDDEN)} blocked: {imports['blocked'].get('error')}")
    if not mode.dry and not info["cuda_available"]:
        problems.append("no CUDA device")
    versions = (f"python {info['python']}, torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda'] or '-'}, "
                f"{info['gpu'] or 'no GPU'}" + (f", driver {info['driver']}" if info["driver"] else ""))
    if problems:
        part.finish("FAIL", "; ".join(problems) + f" ({versions})")
    else:
        part.finish("PASS", f"{versions}; model and kernel modules import without {'/'.join(FORBIDDEN)}")


# ---- stage: CUDA graphs against eager -------------------------------------------------------


def rel_error(a, b) -> float:
    """max |a - b| / max |b| (0 when both are zero, inf when only b is)."""
    diff = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def stage_graphs(part: Part, mode: Mode) -> None:
    """Both memory forms; the step form's figures at the top of the stage's JSON, the chunk
    form's under "chunk_form"."""
    results = {}
    for form in ("step", "chunk"):
        results[form] = compare_graphs(part, mode, form)
    step, chunk = results["step"], results["chunk"]
    part.update(**step["fields"], chunk_form=chunk["fields"])
    problems = step["problems"] + [f"chunk form: {p}" for p in chunk["problems"]]
    summary = f"{step['summary']}; chunk form: {chunk['summary']}"
    part.finish("FAIL" if problems else "PASS", "; ".join(problems) if problems else summary,
                bitwise=step["bitwise"] and chunk["bitwise"])


def compare_graphs(part: Part, mode: Mode, form: str) -> dict:
    """The fused core in one memory form with CUDA graphs against eager, step by step: the
    figures (`fields`, written to the stage's JSON as they come), the problems, a summary."""
    import torch

    from gpn_scale.config import model_config
    from gpn_scale.models import build_model
    from kernels.graph import graphs_of
    from kernels.side_streams import CpuLanes, OneLane

    device = torch.device("cpu" if mode.dry else "cuda")
    cfg = dataclasses.replace(model_config(mode.graph_config), core="fused", kernel=mode.graph_kernel, memory_form=form)
    if mode.graph_core_chunk:
        cfg = dataclasses.replace(cfg, core_chunk=mode.graph_core_chunk)
    B, T, steps, micro = mode.graph_batch, mode.graph_seq_len, mode.graph_steps, 2
    models, opts = {}, {}
    for name, graphs in (("graphs", True), ("eager", False)):
        torch.manual_seed(0)
        models[name] = build_model(dataclasses.replace(cfg, cuda_graphs=graphs)).to(device)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
    models["eager"].load_state_dict(models["graphs"].state_dict())
    # The graphed model runs the reverse sweep's weight gradients on their side stream (CUDA's, or
    # the checking stand-in on a dry run), the eager one on one stream: equal only if every event
    # between the streams is in place.
    for name, lanes in (("graphs", CpuLanes() if mode.dry else None), ("eager", OneLane())):
        if lanes is not None:
            pinned = dataclasses.replace(models[name].backend(device.type), lanes=lanes)
            models[name].backend = lambda device_type, b=pinned: b
    names = [n for n, _ in models["graphs"].named_parameters()]
    tokens = torch.randint(0, cfg.vocab_size, (steps, micro, B, T), generator=torch.Generator().manual_seed(1)).to(device)
    fields = dict(config=mode.graph_config, memory_form=form, device=str(device), autocast="bf16", kernel=mode.graph_kernel, batch=B,
                  seq_len=T, core_chunk=cfg.core_chunk, steps=steps, micro_batches=micro, optimizer="torch AdamW lr 1e-3",
                  params=len(names), tolerance=0.0)
    losses = {m: [] for m in models}
    per_param = dict.fromkeys(names, 0.0)
    per_step, missing = [], []

    def report(**kw):
        fields.update(kw)
        part.update(**(fields if form == "step" else dict(chunk_form=fields)))

    report()
    for step in range(steps):
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        for name in models:
            losses[name].append([])
        for i in range(micro):
            for name, model in models.items():  # forward, backward, forward, backward: accumulation
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(tokens[step, i]).loss
                (loss / micro).backward()
                losses[name][-1].append(loss.item())
        # after accumulating both micro-batches: a graph-owned gradient would have been
        # overwritten by the second micro-batch's replay
        worst, compared = 0.0, 0
        params = {m: dict(models[m].named_parameters()) for m in models}
        for n in names:
            a, b = params["graphs"][n].grad, params["eager"][n].grad
            if a is None or b is None:
                missing.append(f"step {step + 1}: {n} ({'graphs' if a is None else ''}{' and ' if a is None and b is None else ''}"
                               f"{'eager' if b is None else ''} has no gradient)")
                continue
            err = 0.0 if torch.equal(a, b) else rel_error(a, b)
            per_param[n] = max(per_param[n], err)
            worst = max(worst, err)
            compared += 1
        per_step.append(dict(step=step + 1, params_compared=compared, max_rel_error=worst,
                             losses_equal=losses["graphs"][-1] == losses["eager"][-1]))
        for opt in opts.values():
            opt.step()
        report(losses=losses, per_step=per_step, max_rel_error=per_param, missing_gradients=missing)
        print(f"{form} form, step {step + 1}: losses graphs {losses['graphs'][-1]} eager {losses['eager'][-1]}; "
              f"{compared}/{len(names)} gradients compared, max relative error {worst:.3g}", flush=True)
    final = {n: rel_error(a, b) for (n, a), b in zip(models["graphs"].named_parameters(), models["eager"].parameters())}
    g = graphs_of(models["graphs"])
    stats = None if g is None else dict(forward=dict(g.forward.stats), backward=dict(g.backward.stats))
    eager_graphs = graphs_of(models["eager"])
    report(graph_stats=stats, eager_model_has_graphs=eager_graphs is not None, final_params_max_rel_error=max(final.values()),
           worst_param=max(per_param, key=per_param.get) if any(per_param.values()) else None)

    problems = []
    if eager_graphs is not None:
        problems.append("the model with cuda_graphs: false ran graphs")
    if stats is None:
        problems.append("the fused core ran no graphs (graphs_of(model) is None)")
    else:
        for loop in ("forward", "backward"):
            if stats[loop]["replayed"] == 0:
                problems.append(f"{loop} graph never replayed ({stats[loop]})")
            if stats[loop]["failed"]:
                problems.append(f"{stats[loop]['failed']} {loop} capture(s) failed")
    if missing:
        problems.append(f"{len(missing)} missing gradient(s): {missing[0]}")
    if sum(s["params_compared"] for s in per_step) != steps * len(names):
        problems.append("not every parameter's gradient was compared at every step")
    if losses["graphs"] != losses["eager"]:
        problems.append("losses differ")
    bad = {n: e for n, e in per_param.items() if e > 0}
    if bad:
        w = max(bad, key=bad.get)
        problems.append(f"{len(bad)}/{len(names)} gradients differ (worst {w}: {bad[w]:.3g} relative)")
    if any(e > 0 for e in final.values()):
        problems.append("parameters differ after the last step")
    summary = (f"{mode.graph_config} B {B} T {T}, {steps} steps x {micro} micro-batches, {len(names)} params, graphs on two "
               f"streams against eager on one: "
               + ("losses and gradients bitwise equal" if not (bad or losses["graphs"] != losses["eager"]) else "NOT equal"))
    if stats:
        summary += f"; replayed fwd {stats['forward']['replayed']} bwd {stats['backward']['replayed']}"
    return dict(fields=fields, problems=problems, summary=summary, bitwise=not bad)


# ---- stage: kernel tests --------------------------------------------------------------------


def junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.findall("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return dict(passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"], failed=n["failures"], errors=n["errors"],
                skipped=n["skipped"], total=n["tests"], failed_tests=failed[:30])


def stage_kernels(part: Part, mode: Mode, out: Path) -> None:
    files = ["tests/kernels/test_kernels.py", "tests/kernels/test_kernels_memory_chunk.py"] + (
        ["tests/kernels/test_kernels_accuracy.py"] if (ROOT / "tests" / "kernels" / "test_kernels_accuracy.py").is_file() else [])
    xml = out / "kernel_tests.xml"
    xml.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cpu_only", *files, f"--junitxml={xml}"]
    if mode.kernel_select:
        cmd += ["-k", mode.kernel_select]
    part.update(files=files, command=" ".join(cmd[1:]), selection=mode.kernel_select)
    rc, lines = tee(cmd)
    if not xml.is_file():
        part.finish("FAIL", f"pytest exited with {rc} and wrote no report: {lines[-1] if lines else ''}", returncode=rc)
        return
    n = junit_counts(xml)
    part.update(returncode=rc, **n)
    detail = f"{n['passed']} passed, {n['failed']} failed, {n['errors']} errors, {n['skipped']} skipped ({', '.join(files)})"
    ok = rc == 0 and n["failed"] == n["errors"] == 0 and n["passed"] > 0
    part.finish("PASS" if ok else "FAIL", detail + ("" if ok else f"; pytest status {rc}"))


# ---- stage: benchmark -----------------------------------------------------------------------


def stage_bench(part: Part, mode: Mode, out: Path) -> None:
    result_path = out / "bench.json"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), *mode.bench_args, "--out", str(result_path)]
    part.update(command=" ".join(["bench/gpu.py", *mode.bench_args, "--out", str(result_path)]))
    rc, lines = tee(cmd)
    starts = [i for i, line in enumerate(lines) if line.startswith("ratio ")]
    table = [line for line in lines[starts[-1]:] if line.strip() and not line.startswith("wrote ")] if starts else []
    result = read_json(result_path)
    part.update(returncode=rc, ratio_table=table, bench_json=str(result_path))
    if result is None:
        part.finish("FAIL", f"bench/gpu.py exited with {rc} and wrote no results")
        return
    rows = {n: dict(batch=r["batch"], seq_len=r["seq_len"], tokens_per_s=r["tokens_per_s"], step_s=r["step_s"],
                    peak_gib=None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30, cuda_graphs=r.get("cuda_graphs"),
                    compile=r.get("compile"))
            for n, r in result["rows"].items()}
    part.update(device=result["device"], rows=rows, failed_rows=result["failed"], ratios=result["ratios"], wall_s=result["wall_s"])
    shown = [r for r in result["ratios"] if r["target"] is not None]
    detail = "; ".join(f"{r['name'].replace(' tokens/s', '').replace(' bandwidth', '')} {r['value']:.3g}"
                       f" ({'meets' if r['value'] >= r['target'] else 'misses'} >= {r['target']:g})" for r in shown)
    if rc != 0 or result["failed"]:
        part.finish("FAIL", f"rows failed: {result['failed'] or '?'} (status {rc}); {detail}")
    else:
        part.finish("PASS", f"{len(rows)} rows; {detail}")


# ---- stage: engine --------------------------------------------------------------------------

# streaming imports these at import time for classes its MDS reader never uses (a tokenizer for
# its C4/Pile datasets, batch types for its own loader, a base class for its vision datasets);
# where the machine lacks them, these stand-ins satisfy the imports and fail if ever used.
STAND_INS = {
    "transformers/__init__.py": '"""Stand-in written by scripts/gpu_check.py: streaming imports transformers at import time."""\n',
    "transformers/feature_extraction_utils.py": "class BatchFeature(dict):\n    pass\n",
    "transformers/tokenization_utils_base.py": "class BatchEncoding(dict):\n    pass\n",
    "transformers/models/__init__.py": "",
    "transformers/models/auto/__init__.py": "",
    "transformers/models/auto/tokenization_auto.py": (
        "class AutoTokenizer:\n    @classmethod\n    def from_pretrained(cls, *args, **kwargs):\n"
        "        raise ImportError('transformers is a stand-in here (scripts/gpu_check.py)')\n"),
    "torchvision/__init__.py": '"""Stand-in written by scripts/gpu_check.py: streaming imports torchvision at import time."""\n',
    "torchvision/datasets/__init__.py": (
        "import torch.utils.data\n\n\nclass VisionDataset(torch.utils.data.Dataset):\n    def __init__(self, *args, **kwargs):\n"
        "        raise ImportError('torchvision is a stand-in here (scripts/gpu_check.py)')\n"),
    "torchvision/transforms/__init__.py": "",
    "torchvision/transforms/functional.py": (
        "def to_tensor(*args, **kwargs):\n    raise ImportError('torchvision is a stand-in here (scripts/gpu_check.py)')\n"),
}

_ENGINE_IMPORTS = ("import json, deepspeed, streaming; from streaming import MDSWriter, StreamingDataset; "
                   "print(json.dumps(dict(deepspeed=deepspeed.__version__, streaming=streaming.__version__, "
                   "deepspeed_file=deepspeed.__file__)))")


def _importable(modules, env) -> tuple[bool, str]:
    code = "import importlib.util, sys; missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]; print(','.join(missing))"
    proc = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=env)
    missing = proc.stdout.strip()
    return proc.returncode == 0 and not missing, missing or proc.stderr.strip()[-300:]


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """The wheels into `site` without network; pip when there is one, else unpacked as they are."""
    files = sorted(wheels.glob("*.whl"))
    site.mkdir(parents=True, exist_ok=True)
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).returncode == 0
    if pip:
        rc, lines = tee([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                         "--disable-pip-version-check", "--target", site, *files])
        if rc != 0:
            raise RuntimeError(f"pip install --target {site} failed: {lines[-1] if lines else rc}")
    else:  # a wheel is a zip of site-packages entries; refuse ones built for another interpreter
        import zipfile

        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename

        ours = set(sys_tags())
        for f in files:
            if not parse_wheel_filename(f.name)[3] & ours:
                raise RuntimeError(f"{f.name} is not built for this Python ({platform.python_version()})")
            with zipfile.ZipFile(f) as z:
                z.extractall(site)
            print(f"unpacked {f.name}", flush=True)
    return [f.name for f in files]


def engine_problems(codes: dict[str, int], logs: dict[str, str], graphs: dict[str, dict | None],
                    first: dict[int, float], a: dict[int, float], b: dict[int, float], total: int, stop: int) -> list[str]:
    """What is wrong with the engine stage's three runs (exit codes, logs, graph counts, and the
    losses by step of the stopped run's first half, the uninterrupted run and the resumed run)."""
    problems = []
    for n, c in codes.items():
        if c != 0:
            tail = logs[n].strip().splitlines()
            problems.append(f"{n} run exited with {c}: {tail[-1] if tail else ''}")
    if "resumed" not in codes:
        problems.append("the resumed run did not start")
    elif codes["resumed"] == 0 and "resumed from" not in logs["resumed"]:
        problems.append("the second run did not resume from a checkpoint")
    if sorted(first) != list(range(1, stop + 1)):
        problems.append(f"the stopped run logged steps {sorted(first)}, expected 1..{stop}")
    if sorted(a) != list(range(1, total + 1)):
        problems.append(f"the uninterrupted run logged {len(a)} of {total} steps")
    elif sorted(b) != sorted(a):
        problems.append(f"the stopped and resumed runs logged steps {sorted(b)}, expected 1..{total}")
    elif a != b:
        diff = max(abs(a[s] - b[s]) for s in a)
        problems.append(f"losses differ from the uninterrupted run (max |diff| {diff:.3g})")
    for n, stats in graphs.items():  # a run whose loops silently ran eagerly proves less than it seems to
        if codes[n] == 0 and not (stats and stats.get("forward", {}).get("replayed") and stats.get("backward", {}).get("replayed")):
            problems.append(f"the {n} run replayed no fused core graphs ({stats})")
    return problems


def _train(cmd, env, log_path: Path):
    log = open(log_path, "w")
    return subprocess.Popen(list(map(str, cmd)), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log


def _graph_stats(log_text: str) -> dict | None:
    """The engine's closing line "fused core graphs: forward 1 eager, ...; backward ..." as numbers."""
    m = re.search(r"^fused core graphs: (.*)$", log_text, re.M)
    if not m:
        return None
    stats = {}
    for loop in m.group(1).split(";"):
        name, _, counts = loop.strip().partition(" ")
        stats[name] = {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", counts)}
    return stats


def _losses(run_dir: Path) -> dict[int, float]:
    from gpn_scale.storage.jsonl import read_jsonl  # the standard library only, as the engine's own reader

    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


def stage_engine(part: Part, mode: Mode, out: Path, wheels: Path) -> None:
    work = out / "engine"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    env = dict(os.environ)
    found, missing = _importable(["deepspeed", "streaming"], env)
    source = "installed"
    if not found:
        whl = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
        if not whl:
            part.finish("SKIP", f"deepspeed/streaming not installed ({missing}) and no wheels in {wheels} "
                                "(make them with scripts/gpu_wheels.sh on a machine with network)")
            return
        site = work / "site"
        part.update(wheels=install_wheels(wheels, site))
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        source = f"wheels from {wheels}"
    stand_ins = []
    for pkg in ("transformers", "torchvision"):
        ok, _ = _importable([pkg], env)
        if not ok:
            stand_ins.append(pkg)
    if stand_ins:
        shim = work / "stand_ins"
        for rel, text in STAND_INS.items():
            if rel.split("/")[0] in stand_ins:
                (shim / rel).parent.mkdir(parents=True, exist_ok=True)
                (shim / rel).write_text(text)
        env["PYTHONPATH"] = os.pathsep.join([env.get("PYTHONPATH", ""), str(shim)]).lstrip(os.pathsep)
    part.update(source=source, stand_ins=stand_ins)
    proc = subprocess.run([sys.executable, "-c", _ENGINE_IMPORTS], capture_output=True, text=True, env=env)
    print(proc.stdout + proc.stderr[-3000:], flush=True)
    if proc.returncode != 0:
        part.finish("FAIL", f"importing deepspeed and streaming failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return
    part.update(versions=json.loads(proc.stdout.strip().splitlines()[-1]))

    total, stop, T = mode.engine_steps, mode.engine_steps // 2, mode.engine_seq_len
    data = work / "data"
    code = ("import sys; from pathlib import Path; from support.mds_fixture import write_windows; "
            f"write_windows(Path(sys.argv[1]) / 'train', {max(200, 8 * total)}, {T}, 512); "
            f"write_windows(Path(sys.argv[1]) / 'val', 16, {T}, 512, seed=1)")
    data_env = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(ROOT / "tests")]))
    rc, lines = tee([sys.executable, "-c", code, data], env=data_env)
    if rc != 0:
        part.finish("FAIL", f"writing the MDS shards failed: {lines[-1] if lines else rc}")
        return

    env.update(DS_ACCELERATOR="cpu" if mode.dry else "cuda", WANDB_MODE="disabled")
    base = [sys.executable, "-m", "gpn_scale", "train", "configs/train/gpn_m_tiny.yaml", f"data.train={data / 'train'}",
            f"data.val={data / 'val'}", f"train.total_steps={total}", f"train.save_every={stop}", "precision=bf16",
            "zero.stage=2", "logging.wandb=disabled"] + ([f"model.kernel={mode.engine_kernel}"] if mode.engine_kernel else [])
    ref, run = work / "uninterrupted", work / "resumed"
    part.update(config="configs/train/gpn_m_tiny.yaml", precision="bf16", zero_stage=2, steps=total, stopped_at=stop,
                seq_len=T, backend="gloo" if mode.dry else "nccl", command=" ".join(base[1:]))
    runs = dict(uninterrupted=base + [f"run.dir={ref}"], stopped=base + [f"run.dir={run}", f"train.stop_at_step={stop}"],
                resumed=base + [f"run.dir={run}", "--resume", "auto"])
    codes, seconds, logs = {}, {}, {}

    def launch(names):
        t0, jobs = time.monotonic(), {}
        for n in names:
            jobs[n] = _train(runs[n], env, work / f"{n}.log")
        while jobs:
            for n, (p, f) in list(jobs.items()):
                if p.poll() is None:
                    continue
                codes[n], seconds[n] = p.returncode, round(time.monotonic() - t0, 1)
                f.close()
                del jobs[n]
                logs[n] = (work / f"{n}.log").read_text()
                print(f"----- {n} run (status {codes[n]}, {seconds[n]} s):\n{logs[n][-6000:]}", flush=True)
            time.sleep(0.1)

    # the uninterrupted run and the first half of the interrupted one are independent: run them together
    launch(["uninterrupted", "stopped"])
    first = _losses(run)
    if codes["stopped"] == 0:
        launch(["resumed"])
    a, b = _losses(ref), _losses(run)
    graphs = {n: _graph_stats(text) for n, text in logs.items()}
    diffs = [abs(a[s] - b[s]) for s in a if s in b]
    part.update(returncodes=codes, run_s=seconds, graph_stats=graphs, losses_equal=bool(a) and a == b,
                max_abs_loss_diff=max(diffs) if diffs else None,
                losses_uninterrupted=[a[s] for s in sorted(a)], losses_resumed=[b[s] for s in sorted(b)])
    problems = engine_problems(codes, logs, graphs, first, a, b, total, stop)
    how = f"ZeRO-2 {part.data['backend']} bf16, {total} steps stopped at {stop} and resumed"
    extra = f"; stand-ins for {', '.join(stand_ins)}" if stand_ins else ""
    replays = (graphs.get("uninterrupted") or {}).get("forward", {}).get("replayed")
    part.finish("FAIL" if problems else "PASS", ("; ".join(problems) if problems else
                f"{how}: losses equal to the uninterrupted run at all {total} steps, "
                f"{replays} forward graph replays") + f" ({source}{extra})")


# ---- stage entry ----------------------------------------------------------------------------


def _end_with_parent() -> None:
    """A stage whose orchestrator is gone (killed outright) ends its process group too."""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(2)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def run_one(args) -> int:
    """Runs the stage `args.stage` (gpu_check.py --stage NAME) in this process."""
    _end_with_parent()
    out = Path(args.out)
    (out / "stages").mkdir(parents=True, exist_ok=True)
    part = Part(out, args.stage)
    mode = args.mode
    try:
        if args.stage == "env":
            stage_env_imports(part, mode)
        elif args.stage == "graphs":
            stage_graphs(part, mode)
        elif args.stage == "kernels":
            stage_kernels(part, mode, out)
        elif args.stage == "bench":
            stage_bench(part, mode, out)
        elif args.stage == "engine":
            stage_engine(part, mode, out, Path(args.wheels))
    except Exception as e:  # the stage fails with its error; the traceback goes to the log
        import traceback

        traceback.print_exc()
        part.finish("FAIL", first_line(e))
    return 0


