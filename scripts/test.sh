#!/usr/bin/env bash
# The test suite, from nothing: makes the virtual environment if needed, then runs pytest.
# Extra arguments go to pytest (e.g. `-m "not slow"`, `-k convert`).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# The SLURM launcher tests start a real one-node cluster: Debian's slurm-wlm and munge.
if ! command -v slurmctld >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[test] installing slurm-wlm and munge for the SLURM launcher tests"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null 2>&1; } \
    || echo "[test] could not install slurm-wlm: the SLURM tests will be skipped"
fi
export WANDB_MODE=disabled
# Two workers, one per core of CI's machine (GPN_TEST_WORKERS=N to change, 0: one process); a file stays on one
# worker, and the files go out in the order tests/conftest.py gives them (longest first), not xdist's by test count.
exec python -m pytest -n "${GPN_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
