#!/usr/bin/env bash
# The test suite, from nothing: makes the virtual environment if needed, then runs pytest.
# Extra arguments go to pytest (e.g. `-m "not slow"`, `-k convert`).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export WANDB_MODE=disabled
exec python -m pytest "$@"
