"""A wheel of the project, not a checkout: it carries the bundled configs and launch scripts, and a
process that imports gpn_scale from the wheel's files alone resolves configs by name and finds
the sweep's SLURM template."""

import os
import shutil
import subprocess
import sys
import zipfile

from support import ROOT

CHECK = r"""
import sys
from pathlib import Path
import gpn_scale
from gpn_scale.config import BUNDLE_ROOT, model_config
from gpn_scale.sweep.run import slurm_script
from gpn_scale.sweep.spec import load_spec
from gpn_scale.train.config import load_train_config

site = Path(sys.argv[1]).resolve()
assert Path(gpn_scale.__file__).resolve().is_relative_to(site), gpn_scale.__file__
assert BUNDLE_ROOT.is_relative_to(site), BUNDLE_ROOT
assert model_config("gpn_m_130m_1l").d_state == int(sys.argv[2])
assert load_train_config("gpn_m_tiny", ["run.dir=r", "data.train=d"]).model.family == "gpn_m"
script = slurm_script(load_spec("cpu_tiny")[0])  # the default template, launchers/slurm/train.sbatch
assert script.is_relative_to(site) and script.read_text().startswith("#!"), script
print("ok")
"""


def test_a_wheel_carries_the_configs_and_launchers(tmp_path):
    src = tmp_path / "src"  # a copy: building writes build/ and egg-info beside the sources
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "build", "__pycache__", "*.egg-info", ".pytest_cache", ".whl", ".gpu_wheels"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("gpn_scale-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for tree in ("configs", "launchers"):
        shipped = {p.relative_to(ROOT).as_posix() for p in (ROOT / tree).rglob("*") if p.is_file()}
        assert shipped and {f"gpn_scale/{n}" for n in shipped} <= names, tree

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    import yaml

    d_state = yaml.safe_load((ROOT / "configs" / "models" / "gpn_m_130m_1l.yaml").read_text())["d_state"]
    # Run away from the checkout, with the wheel's files first on the path (before the editable install)
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-c", CHECK, str(site), str(d_state)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
