#!/usr/bin/env bash
# Multi-node data prep on SLURM: N array tasks prepare their shares, then one job merges them.
#   launchers/slurm/prep.sh N INPUT... --out DIR --tokenizer T --seq-len N [prep options]
# Extra sbatch options (partition, account, --cpus-per-task) go in SBATCH_ARGS.
# Prints the array job id and the merge job id.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NODES INPUT... --out DIR --tokenizer T --seq-len N [prep options]" >&2
  exit 2
fi
nodes="$1"; shift
out=""
args=("$@")
for i in "${!args[@]}"; do
  if [ "${args[$i]}" = "--out" ]; then out="${args[$((i + 1))]:-}"; fi
done
if [ -z "$out" ]; then
  echo "error: pass --out DIR (on a filesystem every node sees)" >&2
  exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck disable=SC2086
array=$(sbatch --parsable ${SBATCH_ARGS:-} --array="0-$((nodes - 1))" "$here/prep.sbatch" "$@")
# shellcheck disable=SC2086
merge=$(sbatch --parsable ${SBATCH_ARGS:-} --job-name=gpn-scale-prep-merge --dependency="afterok:${array%%;*}" \
  --output="slurm-%x-%j.out" --wrap "gpn-scale prep merge '$out'")
echo "array job ${array%%;*} (${nodes} tasks), merge job ${merge%%;*} after it"
