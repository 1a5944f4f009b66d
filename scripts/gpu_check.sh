#!/usr/bin/env bash
# Proves the GPU path in one command; the logic is scripts/gpu_check.py (see its --help, docs/gpu.md).
#   PYTHONPATH=. bash scripts/gpu_check.sh [--out DIR]     # on a CUDA machine, with its python3
#   bash scripts/gpu_check.sh --dry [--out DIR]            # on a CPU (the project's .venv if there is one)
# Results go to --out, else $OUT, else a new temporary directory. $PYTHON picks the interpreter.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  python=python3
  for arg in "$@"; do
    if [ "$arg" = "--dry" ] && [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; fi
  done
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" "$root/scripts/gpu_check.py" "$@"
