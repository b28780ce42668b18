#!/usr/bin/env bash
# One call on a bare H200 machine: build the CUDA extension, run tests/cuda and the GPU benchmarks,
# print a summary table last. Logs go to $OUT (the device tool) or ./out. Usage:
#   bash scripts/gpu_check.sh [--quick]      (--quick: tests only, no benchmarks)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# Multicast stays off; several ranks may share one GPU through symmetric memory over gloo.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tide_torch_extensions}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python3}
quick=0; [ "${1:-}" = "--quick" ] && quick=1
declare -a summary
stage() {  # stage NAME LOG CMD...
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-22s %-5s %4ss  %s' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" $((SECONDS - t0)) "$log")")
  return $rc
}

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY - <<'PY'
import torch, json
from tide.transport import probe
print(json.dumps(probe.summary(), default=str))
PY
  nvcc --version | tail -1
} >"$OUT/env.txt" 2>&1

stage build build.log $PY -c "from tide.transport import build; build.load(verbose=True); print('built')"
stage tests tests.log $PY -m pytest tests/cuda -q -rA -p no:cacheprovider --timeout=480 --junitxml="$OUT/tests.xml"
if [ $quick = 0 ]; then
  for b in bench/bench_sum_kernel.py bench/bench_host_time.py bench/bench_memory.py; do
    [ -f "$b" ] && stage "$(basename "$b" .py)" "$(basename "$b" .py).log" $PY "$b" --out "$OUT"
  done
fi

echo "==================== environment"
cat "$OUT/env.txt"
echo "==================== tests (last lines)"
tail -n 40 "$OUT/tests.log"
echo "==================== benchmark summaries"
grep -h '^SUMMARY' "$OUT"/*.log 2>/dev/null
echo "==================== gpu_check summary"
printf '%s\n' "${summary[@]}"
