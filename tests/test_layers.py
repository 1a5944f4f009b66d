"""The direction of imports (docs/architecture.md): kernels and data_prep are leaves, the models import only
kernels, inference (eval, generate, analyze, native checkpoints, conversion) never the trainer,
and no import cycle anywhere: not between modules, not between gpn_scale's packages.

Imports are read from the syntax tree, nested ones (inside functions) included, so a lazy import
cannot hide an edge; `importlib` is refused where a module name would hide in a string.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path
from support import ROOT


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, at any depth; relative ones resolved."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def offending(files, refused) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line}: {name}" for p in files for line, name in imported_modules(p)
            if any(name == r or name.startswith(r + ".") for r in refused)]


def py_files(*parts) -> list[Path]:
    files = []
    for part in parts:
        p = ROOT / part
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return files


def test_the_scan_sees_nested_and_relative_imports(tmp_path):
    f = tmp_path / "kernels" / "memory" / "x.py"
    f.parent.mkdir(parents=True)
    f.write_text("import torch\n\ndef f():\n    if True:\n        from gpn_scale.models import ops\n\n"
                 "class C:\n    def g(self):\n        import gpn_scale.train.engine as e\n\nfrom ..common import rms\n")
    assert sorted(name for _, name in imported_modules(f, tmp_path)) == ["gpn_scale.models.ops", "gpn_scale.train.engine",
                                                                          "kernels.common.rms", "torch"]


def test_kernels_import_nothing_of_gpn_scale_nor_importlib():
    files = py_files("kernels")
    assert len(files) >= 10
    assert offending(files, ["gpn_scale", "importlib"]) == []


def test_models_import_only_themselves_and_kernels():
    files = py_files("gpn_scale/models")
    bad = [line for line in offending(files, ["gpn_scale"]) if not line.split(": ")[-1].startswith("gpn_scale.models")]
    assert bad == []
    assert offending(files, ["importlib"]) == []


def test_inference_imports_nothing_of_the_trainer():
    files = py_files("gpn_scale/eval", "gpn_scale/storage/native.py", "gpn_scale/storage/checkpoints.py", "gpn_scale/export/convert.py",
                     "gpn_scale/model_info.py")
    assert offending(files, ["gpn_scale.train"]) == []


BLOCKED_RUN = r"""
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "gpn_scale" or name.startswith("gpn_scale."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)

sys.meta_path.insert(0, Blocked())
import pkgutil
import torch
import kernels
names = [m.name for m in pkgutil.walk_packages(kernels.__path__, "kernels.")]
for name in names:
    importlib.import_module(name)
ops = kernels.backend("torch", "cpu", graphs=False)
M = torch.zeros(1, 1, 2, 3)
k = torch.tensor([[[0.6, 0.8]]])
M_t, e, o, y = ops.memory.memory_step(M, k, torch.ones(1, 1, 3), torch.ones(1, 1), torch.ones(1, 1), k, torch.zeros(1, 3))
assert torch.allclose(M_t[0, 0], k[0, 0, :, None] * torch.ones(3)), M_t
assert not any(m == "gpn_scale" or m.startswith("gpn_scale.") for m in sys.modules)
print(len(names), "modules")
"""


def test_kernels_import_and_run_where_gpn_scale_cannot_be_found(tmp_path):
    """Only kernels/ on the path (the repository root is not), and gpn_scale refused even where an
    installed copy could be found: every kernels module imports, the reference backend runs."""
    (tmp_path / "kernels").symlink_to(ROOT / "kernels")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", BLOCKED_RUN], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-2]) >= 10


def module_graph(root: Path = ROOT, packages=("gpn_scale", "kernels", "data_prep")) -> dict[str, set[str]]:
    """{module: the project's modules it imports}, a package named by its `__init__`; an import of
    a name inside a module (`from a.b import f`) is an edge to that module."""
    files = {}
    for package in packages:
        for p in sorted((root / package).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def owner(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    return {m: {t for _, n in imported_modules(p, root) if (t := owner(n)) and t != m} for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def parts_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen from gpn_scale's root: each of its packages and loose modules one node,
    kernels one node, data_prep one node."""
    def part(m: str) -> str:
        return m.split(".")[0] if m.split(".")[0] in ("kernels", "data_prep") else ".".join(m.split(".")[:2])

    parts: dict[str, set[str]] = {}
    for m, targets in graph.items():
        parts.setdefault(part(m), set()).update(part(t) for t in targets if part(t) != part(m))
    return parts


def test_no_import_cycle_between_modules_nor_between_packages():
    graph = module_graph()
    assert len(graph) > 100 and "data_prep.cli" in graph and "gpn_scale.storage.safe_load" in graph
    assert cycles(graph) == []
    parts = parts_graph(graph)
    assert {"gpn_scale.storage", "data_prep", "gpn_scale.train", "kernels"} <= set(parts)
    assert cycles(parts) == []
    assert all(not t.startswith("gpn_scale") for t in parts["kernels"])
    assert parts["data_prep"] == set()  # a leaf: gpn_scale imports data_prep, never the reverse


def test_a_cycle_added_anywhere_is_found(tmp_path):
    """The checks above on a copy of the tree with one import added: module to module (eval's CLI and
    the harness model, which once imported each other), and package to package (prep reading the
    trainer's config, while the trainer reads prep's stream layout)."""
    import shutil

    for package in ("gpn_scale", "kernels", "data_prep"):
        shutil.copytree(ROOT / package, tmp_path / package, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "configs", "launchers"))
    assert cycles(module_graph(tmp_path)) == []
    harness = tmp_path / "gpn_scale/eval/lm_eval_model.py"
    harness.write_text(harness.read_text() + "\n\ndef _cli():\n    from gpn_scale.eval.cli import eval_main\n")
    assert ["gpn_scale.eval.cli", "gpn_scale.eval.lm_eval_model"] in cycles(module_graph(tmp_path))
    harness.write_text(harness.read_text().replace("from gpn_scale.eval.cli import eval_main", "pass"))
    streams = tmp_path / "data_prep/document_streams.py"
    streams.write_text(streams.read_text() + "\n\ndef _config():\n    from gpn_scale.train.config import load_train_config\n")
    assert cycles(module_graph(tmp_path)) == []  # no module cycle ...
    assert any({"data_prep", "gpn_scale.train"} <= set(c) for c in cycles(parts_graph(module_graph(tmp_path))))


def test_the_root_holds_the_cli_config_and_packages():
    loose = sorted(p.name for p in (ROOT / "gpn_scale").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(loose) <= 6, loose
    assert {"cli.py", "config.py"} <= set(loose)


def test_data_prep_imports_nothing_of_gpn_scale_and_storage_nothing_of_training_or_evaluation():
    files = py_files("data_prep")
    assert len(files) >= 10
    assert offending(files, ["gpn_scale", "kernels"]) == []
    storage = py_files("gpn_scale/storage")
    assert ROOT / "gpn_scale/storage/mds_datasets.py" in storage
    assert offending(storage, ["gpn_scale.train", "gpn_scale.eval", "gpn_scale.cli"]) == []


def test_the_trainer_imports_nothing_of_eval():
    assert offending(py_files("gpn_scale/train"), ["gpn_scale.eval"]) == []


def test_no_function_of_the_models_takes_more_than_eight_parameters():
    """The fused core's state travels in named structures (`Weights`, `Span`, `ChunkRows`, ...):
    a change to what a chunk carries touches one structure, not every signature."""
    wide = []
    for p in py_files("gpn_scale/models"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
                n = len(names) - (names[:1] in (["self"], ["cls"], ["ctx"]))
                if n > 8:
                    wide.append(f"{p.relative_to(ROOT)}:{node.lineno}: {node.name} ({n})")
    assert wide == []


def test_the_models_structures_name_their_fields_for_what_they_hold():
    """A structure of gpn_scale/models (a NamedTuple or dataclass) names its fields for what they
    hold: at most 5 of them may be a symbol of one to three capital letters (M, the memory, is free)."""
    import re

    symbolic = []
    for p in py_files("gpn_scale/models"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ClassDef):
                fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                capitals = [f for f in fields if re.fullmatch(r"[A-Z]{1,3}", f) and f != "M"]
                if len(capitals) > 5:
                    symbolic.append(f"{p.relative_to(ROOT)}:{node.lineno}: {node.name} {capitals}")
    assert symbolic == []
