#!/usr/bin/env bash
# One node, N training processes:
#   launchers/torchrun.sh NPROC CONFIG [key=value ...]
# e.g. launchers/torchrun.sh 8 gpn_m_130m_1l run.dir=runs/gpn_m_130m
# Always resumes from the run's newest complete checkpoint (a fresh run.dir starts at step 0).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NPROC CONFIG [key=value ...]" >&2
  exit 2
fi
nproc="$1"; shift
# The config, the data and run.dir checked once, here, before torchrun starts the ranks: bad input
# ends as one line and exit status 2, as `gpn-scale train` ends it.
WORLD_SIZE="$nproc" python -m gpn_scale train "$@" --resume auto --check
exec python -m gpn_scale.train.torchrun --standalone --nnodes 1 --nproc-per-node "$nproc" \
  -m gpn_scale train "$@" --resume auto
