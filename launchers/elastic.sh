#!/usr/bin/env bash
# Elastic multi-node training: run this on every node (the same command everywhere).
#   RDZV_ENDPOINT=head-node:29400 launchers/elastic.sh CONFIG [key=value ...]
#
# Nodes may join and leave between MIN_NODES and MAX_NODES. When a member dies, torchrun stops the
# survivors' workers, the remaining agents re-rendezvous, and the workers restart from the run's
# newest complete checkpoint (`--resume auto`); the engine converts the checkpoint when the world
# size changed. Set `train.global_batch` in the config so the batch (and with it the global sample
# order) does not depend on how many nodes are left. The rendezvous lives on RDZV_ENDPOINT's host:
# losing that node ends the run (restart it there, or point the survivors at a new endpoint).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: RDZV_ENDPOINT=HOST:PORT $0 CONFIG [key=value ...]" >&2
  exit 2
fi
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the rendezvous (e.g. the first node)}"
# The config, the data and run.dir checked once, here, before torchrun starts the ranks: bad input
# ends as one line and exit status 2 (what depends on the world size is checked by the ranks).
python -m gpn_scale train "$@" --resume auto --check
exec python -m gpn_scale.train.torchrun \
  --nnodes "${MIN_NODES:-1}:${MAX_NODES:-2}" \
  --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  --rdzv-backend c10d \
  --rdzv-endpoint "$RDZV_ENDPOINT" \
  --rdzv-id "${RDZV_ID:-gpn-scale}" \
  ${RDZV_CONF:+--rdzv-conf "$RDZV_CONF"} \
  -m gpn_scale train "$@" --resume auto
