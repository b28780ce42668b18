#!/usr/bin/env bash
# Host time of two trees side by side on one GPU machine: bench/bench_host_time.py of the tree BEFORE (a
# checkout of the earlier commit, its extension built apart) and of this one, run alternately RUNS times
# each, then merged by bench/host_time_ab.py. Usage (the device tool's $OUT receives the runs and the merge):
#   bash scripts/host_time_ab.sh BEFORE_DIR BEFORE_COMMIT AFTER_COMMIT RUNS [ITERS]
# Writes host_time_ab.csv and .png, and the runs' printed output in ab_runs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
before=$1 before_commit=$2 after_commit=$3 runs=$4 iters=${5:-300}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/ab"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
one() {  # one TREE EXT_DIR LOG
  (cd "$1" && TORCH_EXTENSIONS_DIR=$2 PYTHONPATH=$PWD timeout 120 $PY bench/bench_host_time.py --world-size 2 \
    --iters "$iters" --out "$OUT/ab/tmp") >"$3" 2>&1 || echo "host_time_ab: $3 failed" >&2
}
for i in $(seq 1 "$runs"); do
  one "$before" /tmp/tide_ext_before "$OUT/ab/before_$i.log"
  one "$PWD" /tmp/tide_torch_extensions "$OUT/ab/after_$i.log"
done
$PY bench/host_time_ab.py --before "$before_commit" "$OUT"/ab/before_*.log --after "$after_commit" \
  "$OUT"/ab/after_*.log --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --mode "bench_host_time --world-size 2 --iters $iters" --out "$OUT"
tar czf "$OUT/ab_runs.tgz" -C "$OUT" ab && rm -rf "$OUT/ab"
