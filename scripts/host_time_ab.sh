#!/usr/bin/env bash
# Host time of two trees side by side on one GPU machine, run alternately RUNS times each (the tree BEFORE: a
# checkout of the earlier commit, its extension built apart), then merged by bench/host_time_ab.py. BENCH:
#   ops   bench/bench_host_time.py of each tree: one op call of a 60-parameter group (default);
#   seam  this tree's bench/fsdp_host_overhead.py --device cuda on each tree's package: one steady unshard and
#         reduce of the FSDP2 seam (ranks sharing a GPU time TIDE alone; stock runs with a GPU per rank).
# Usage (the device tool's $OUT receives the runs and the merge):
#   bash scripts/host_time_ab.sh BEFORE_DIR BEFORE_COMMIT AFTER_COMMIT RUNS [ITERS] [BENCH]
# Writes host_time_ab.csv and .png (seam: seam_host_time_ab.*), and the runs' output in ab_runs.tgz (seam_ab_runs.tgz).
set -uo pipefail
cd "$(dirname "$0")/.."
before=$1 before_commit=$2 after_commit=$3 runs=$4 iters=${5:-300} bench=${6:-ops}
OUT=${OUT:-$PWD/out}
AB=$OUT/ab_$bench
mkdir -p "$AB"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
here=$PWD
case $bench in
  ops) mode="bench_host_time --world-size 2 --iters $iters" name=host_time_ab runs_tgz=ab_runs.tgz ;;
  seam) mode="fsdp_host_overhead --device cuda --reps $iters" name=seam_host_time_ab runs_tgz=seam_ab_runs.tgz ;;
  *) echo "host_time_ab: BENCH is ops or seam, got $bench" >&2; exit 2 ;;
esac
one() {  # one TREE EXT_DIR NAME: a run's printed output in NAME.log (and the seam's CSV in NAME/)
  if [ "$bench" = ops ]; then
    (cd "$1" && TORCH_EXTENSIONS_DIR=$2 PYTHONPATH=$1 timeout 120 $PY bench/bench_host_time.py --world-size 2 \
      --iters "$iters" --out "$AB/tmp") >"$AB/$3.log" 2>&1
  else
    TORCH_EXTENSIONS_DIR=$2 PYTHONPATH=$1 timeout 150 $PY "$here/bench/fsdp_host_overhead.py" --device cuda \
      --reps "$iters" --out "$AB/$3" >"$AB/$3.log" 2>&1
  fi || echo "host_time_ab: run $3 failed (its output: $AB/$3.log)" >&2
}
for i in $(seq 1 "$runs"); do
  one "$before" /tmp/tide_ext_before "before_$i"
  one "$here" /tmp/tide_torch_extensions "after_$i"
done
if [ "$bench" = ops ]; then
  before_runs=("$AB"/before_*.log) after_runs=("$AB"/after_*.log)
else
  before_runs=("$AB"/before_*/fsdp_host_overhead.csv) after_runs=("$AB"/after_*/fsdp_host_overhead.csv)
fi
$PY bench/host_time_ab.py --before "$before_commit" "${before_runs[@]}" --after "$after_commit" "${after_runs[@]}" \
  --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" --mode "$mode" \
  --name "$name" --out "$OUT"
tar czf "$OUT/$runs_tgz" -C "$OUT" "ab_$bench" && rm -rf "$AB"
