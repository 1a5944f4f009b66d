#!/usr/bin/env bash
# The main job on the embedded corpus: prepare, train a tiny GPN+M, evaluate, analyse, report.
# Extra arguments go to `gpn-scale demo` (e.g. `--out runs/mydemo`).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec gpn-scale demo "$@"
