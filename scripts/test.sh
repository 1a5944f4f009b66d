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
exec python -m pytest "$@"
