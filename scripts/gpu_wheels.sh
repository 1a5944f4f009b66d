#!/usr/bin/env bash
# Wheels for the engine stage of scripts/gpu_check.sh, made on a machine that reaches PyPI for a
# GPU machine that does not: DeepSpeed and MosaicML Streaming (the versions pyproject.toml pins)
# and what they import at run time that a machine with only torch, triton, numpy, pyyaml and
# pytest lacks. DeepSpeed has only an sdist on PyPI: it is built here as a pure-Python wheel with
# DS_BUILD_OPS=0 (no compiled ops; the engine uses torch's AdamW). Streaming also imports
# transformers and torchvision at import time for classes its MDS reader never uses; they are not
# fetched (tens of MB, and torchvision's binary must match the GPU machine's torch build exactly):
# gpu_check.py puts import stand-ins in their place where the machine lacks them.
#
#   bash scripts/gpu_wheels.sh [--python-version 3.12] [--dest scripts/.gpu_wheels] [--max-mb 64]
#
# Then copy the tree (with scripts/.gpu_wheels/, which git ignores) to the GPU machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pyver=3.12 dest="$root/scripts/.gpu_wheels" max_mb=64
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver="${2:?--python-version needs a value}"; shift 2 ;;
    --dest) dest="${2:?--dest needs a value}"; shift 2 ;;
    --max-mb) max_mb="${2:?--max-mb needs a value}"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) echo "gpu_wheels: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$pyver" =~ ^3\.[0-9]+$ ]] || { echo "gpu_wheels: error: --python-version: expected 3.N, got $pyver" >&2; exit 2; }
[[ "$max_mb" =~ ^[0-9]+$ ]] || { echo "gpu_wheels: error: --max-mb: expected an integer, got $max_mb" >&2; exit 2; }

source "$root/scripts/env.sh"   # the project's .venv: torch (DeepSpeed's setup.py imports it) and pip
pin() { grep -oE "\"$1==[^\"]+\"" "$root/pyproject.toml" | tr -d '"'; }
deepspeed="$(pin deepspeed)" streaming="$(pin mosaicml-streaming)"
[ -n "$deepspeed" ] && [ -n "$streaming" ] || { echo "gpu_wheels: error: no deepspeed/mosaicml-streaming pin in pyproject.toml" >&2; exit 1; }

# What deepspeed (its requirements) and streaming (its modules' imports) need at run time; the
# bounds are theirs. Not here: torch, triton, numpy, pyyaml and packaging (the GPU machine has
# them), ninja (only for building DeepSpeed ops), pynvml and nvtx (optional imports).
runtime=(einops hjson msgpack psutil py-cpuinfo "pydantic>=2" "tqdm>=4.64,<5"
         "catalogue>=2,<3" "brotli>=1.0.9" "python-snappy>=0.6.1,<1" "zstd>=1.5.2.5,<2" "xxhash>=3,<4" pillow)
# already on the GPU machine (torch's and pytest's own requirements): dropped if pulled in
# (typing_extensions stays: pydantic may need a newer one than torch's, and newer ones are compatible)
present='^(torch|triton|numpy|pyyaml|pytest|pluggy|iniconfig|pygments|packaging|filelock|sympy|mpmath|networkx|jinja2|markupsafe|fsspec|setuptools)$'

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
quiet() { grep -vE "is ignored|^WARNING: Location|^\s*$" || true; }
target=(--only-binary=:all: --implementation cp --python-version "$pyver"
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

echo "[wheels] building $deepspeed (DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed "$deepspeed" -w "$work" 2>&1 | quiet
ls "$work"/deepspeed-*-py3-none-any.whl >/dev/null || { echo "gpu_wheels: error: no pure-Python deepspeed wheel was built" >&2; exit 1; }
echo "[wheels] downloading $streaming and ${#runtime[@]} runtime requirements for CPython $pyver"
python -m pip download -q --no-deps "${target[@]}" "$streaming" -d "$work" 2>&1 | quiet
python -m pip download -q "${target[@]}" "${runtime[@]}" -d "$work" 2>&1 | quiet

mkdir -p "$dest"
rm -f "$dest"/*.whl "$dest"/MANIFEST.txt
for f in "$work"/*.whl; do
  name="$(basename "$f")"
  if [[ "$(echo "${name%%-*}" | tr 'A-Z' 'a-z')" =~ $present ]]; then echo "[wheels] skip $name (the GPU machine has it)"; continue; fi
  mv "$f" "$dest/"
done
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
{
  echo "# wheels for scripts/gpu_check.sh's engine stage: CPython $pyver, manylinux x86_64; made $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# install: python3 -m pip install --no-index --no-deps --target DIR $dest/*.whl (gpu_check.py does this)"
  for f in "$dest"/*.whl; do printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "$(basename "$f")"; done
  printf '%10d  total\n' "$total"
} > "$dest/MANIFEST.txt"
cat "$dest/MANIFEST.txt"
echo "[wheels] $(ls "$dest"/*.whl | wc -l) wheels, $(( (total + 524287) / 1048576 )) MB in $dest"
if [ "$total" -gt $(( max_mb * 1048576 )) ]; then
  echo "gpu_wheels: error: $(( total / 1048576 )) MB is over --max-mb $max_mb" >&2
  exit 1
fi
