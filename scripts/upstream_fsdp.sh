#!/usr/bin/env bash
# PyTorch's own FSDP2 tests (test/distributed/_composable/fsdp/test_fully_shard_{comm,extensions,frozen,
# mixed_precision,training}.py), stock and with TIDE enabled process-wide, on CPU (gloo).
# Usage: [PYTHON=.venvs/torch-2.15.0/bin/python] bash scripts/upstream_fsdp.sh FOLDER [stock] [tide]
# FOLDER holds the five files at the commits tests/upstream/sources.json records for the torch of PYTHON
# (default: python3); they are checked first and never copied into the repository. Each mode is one pytest
# process over the five files (tests/upstream/plugin.py); its log, results JSON and rank files go to
# bench/out/upstream/<torch>/, and bench/results/upstream_fsdp.csv gets that release's rows.
# DISTRIBUTED_TESTS_DEFAULT_TIMEOUT (PyTorch's per-test limit, 300 s) defaults to 1200 s here: a few of
# the multi-process tests need more than 300 s on two shared cores.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: bash scripts/upstream_fsdp.sh FOLDER [stock] [tide]" >&2; exit 2; }
folder=$(cd "$1" && pwd)
shift
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(stock tide)
py=${PYTHON:-python3}
# a relative interpreter path must survive the cd into FOLDER (keep its name: a venv's python is a link)
case "$py" in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac
export PYTHONPATH="$repo/tests/upstream/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=${DISTRIBUTED_TESTS_DEFAULT_TIMEOUT:-1200}
release=$("$py" -m tests.upstream.sources "$folder")
out="$repo/bench/out/upstream/$release"
files=(test_fully_shard_comm.py test_fully_shard_extensions.py test_fully_shard_frozen.py
       test_fully_shard_mixed_precision.py test_fully_shard_training.py)
results=()
for mode in "${modes[@]}"; do
  case "$mode" in stock|tide) ;; *) echo "upstream_fsdp: mode must be stock or tide, got '$mode'" >&2; exit 2 ;; esac
  rm -rf "$out/$mode-ranks" "$out/$mode.json"
  mkdir -p "$out"
  start=$SECONDS
  # pytest exits 1 when a test fails; the results JSON says which
  (cd "$folder" && TIDE_UPSTREAM_MODE=$mode TIDE_UPSTREAM_RESULTS="$out/$mode-ranks" \
     TIDE_UPSTREAM_OUT="$out/$mode.json" "$py" -m pytest -p tests.upstream.plugin -p no:cacheprovider \
     -q -rfE "${files[@]}" >"$out/$mode.log" 2>&1) || true
  [ -f "$out/$mode.json" ] || { echo "upstream_fsdp: $mode run wrote no results; see $out/$mode.log" >&2; exit 1; }
  echo "== torch $release $mode: $((SECONDS - start)) s, log $out/$mode.log"
  results+=("$out/$mode.json")
done
"$py" -m tests.upstream.report --csv "$repo/bench/results/upstream_fsdp.csv" "${results[@]}"
