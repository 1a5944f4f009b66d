# Sourced by the README's commands: make (once) and activate the project's virtual environment.
# Reinstalls only when pyproject.toml changes. Python 3.11 recommended; no GPU needed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${GPN_SCALE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.gpn-scale-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[env] creating $venv"
  "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[env] installing gpn-scale and its dependencies into $venv (first run: several minutes)"
  "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  "$venv/bin/python" -m pip install -q -e "$root[dev]" 2>&1 | grep -vE "is ignored|^WARNING: Location" || true
  "$venv/bin/python" -c "import gpn_scale, torch, deepspeed, streaming, triton, wandb" 2>/dev/null \
    || { echo "[env] install failed: see pip's output above" >&2; exit 1; }
  echo "$want" > "$stamp"
  # The C++ ops a CPU run loads, compiled now (a minute on 2 cores) instead of by the first run or
  # test that needs them: gpn-scale's CPU kernels, and DeepSpeed's shared-memory comm op, which its
  # CPU accelerator builds at every process group's start. A failed build is said, not fatal: the
  # first use builds again and reports why.
  if "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.cuda.is_available())' 2>/dev/null; then
    echo "[env] building the C++ CPU ops (cached in torch's extensions directory)"
    DS_ACCELERATOR=cpu "$venv/bin/python" -c 'import logging
logging.disable(logging.WARNING)
from kernels import cpu_build
from deepspeed.accelerator import get_accelerator
cpu_build.load()
get_accelerator().get_op_builder("ShareMemCommBuilder")().load(verbose=False)' >/dev/null 2>&1 \
      || echo "[env] could not build the C++ CPU ops now; the first run that needs them builds them" >&2
  fi
fi
export PATH="$venv/bin:$PATH"
export DS_ACCELERATOR="${DS_ACCELERATOR:-$("$venv/bin/python" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
export WANDB_MODE="${WANDB_MODE:-offline}"
cd "$root"
