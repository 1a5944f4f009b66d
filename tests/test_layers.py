"""The direction of imports (docs/architecture.md): kernels is a leaf, the models import only
kernels, and inference (eval, generate, analyze, native checkpoints, conversion) never the trainer.

Imports are read from the syntax tree, nested ones (inside functions) included, so a lazy import
cannot hide an edge; `importlib` is refused where a module name would hide in a string.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    files = py_files("gpn_scale/eval", "gpn_scale/native.py", "gpn_scale/checkpoints.py", "gpn_scale/convert.py",
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


def test_the_trainer_imports_nothing_of_eval():
    assert offending(py_files("gpn_scale/train"), ["gpn_scale.eval"]) == []
