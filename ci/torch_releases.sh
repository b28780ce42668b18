#!/usr/bin/env bash
# The FSDP2 seam on every other torch minor release: for each, a fresh venv with that torch installed
# first, TIDE installed beside it (which must keep that torch), then tests/fsdp (parity included),
# tests/opcheck and, from torch 2.14 (torchtitan 0.3 needs it), tests/integrations with torchtitan 0.3.0 and
# tests/compile (tide.compile's rewrite; torch 2.13 runs it in the main suite); before 2.14 the order tests of
# tests/compile (Inductor's scheduler keeping TIDE's issue order differs between releases).
# Usage: bash ci/torch_releases.sh [VERSION ...]   (default: 2.11.0 2.12.1 2.14.1 2.15.0)
# The 2.11-2.15 wheels on the package index are CUDA builds (about 3 GB with their nvidia-* packages) that
# run on the CPU. PIP_CONSTRAINT=/dev/null lifts a machine-wide pip cap on torch, if one is set.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ "${#versions[@]}" -gt 0 ] || versions=(2.11.0 2.12.1 2.14.1 2.15.0)
root=${TIDE_RELEASE_VENVS:-.venvs}
for v in "${versions[@]}"; do
  start=$SECONDS
  venv="$root/torch-$v"
  rm -rf "$venv"
  python3 -m venv "$venv"
  py="$venv/bin/python"
  "$py" -m pip install -q --upgrade pip
  PIP_CONSTRAINT=/dev/null "$py" -m pip install -q "torch==$v"
  PIP_CONSTRAINT=/dev/null "$py" -m pip install -q -e ".[test]"
  got=$("$py" -c "import torch; print(torch.__version__.split('+')[0])")
  if [ "$got" != "$v" ]; then
    echo "torch_releases: installing TIDE replaced torch $v with $got" >&2
    exit 1
  fi
  tests=(tests/fsdp tests/opcheck)
  if [ "$(printf '%s\n' 2.14 "$v" | sort -V | head -n 1)" != 2.14 ]; then
    tests+=(tests/compile/test_order.py)
  fi
  if [ "$(printf '%s\n' 2.14 "$v" | sort -V | head -n 1)" = 2.14 ]; then
    echo "torch==$v" > "$venv/torch.txt"
    PIP_CONSTRAINT="$venv/torch.txt" "$py" -m pip install -q torchtitan==0.3.0
    tests+=(tests/integrations tests/compile)
  fi
  echo "== torch $v: ${tests[*]}"
  "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
  rm -rf "$venv"
  echo "== torch $v: $((SECONDS - start)) s"
done
