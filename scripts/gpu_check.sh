#!/usr/bin/env bash
# One call on a bare GPU machine: build the CUDA extension, run tests/cuda and every GPU benchmark,
# print a summary table last. Usage:
#   bash scripts/gpu_check.sh [--quick] [--only STAGE,STAGE...]
#     --quick: build and tests only; --only: just these stages (build always runs first). Stages:
#     tests_transport tests_compiled tests_capture tests_fsdp_cuda tests_multinode tests_memory_model tests_faults
#     fault_campaign kernels
#     collectives
#     collectives_multinode multinode_host timeline ce_patterns lease_probe (2+ GPUs) overlap sm_room rs_ctas (2+ GPUs)
#     host_time seam_host train_step_8b train_step_multinode (2+ GPUs) train_step_moe train_step_compiled compiled_overlap
#     train_step_8b_graphs
#     train_step_moe_graphs train_step_8b_float8 (needs torchao) memory layout_conversion
# Wheels in .whl/ (carried to a machine without a registry: torchao for the float8 test and benchmark) are
# installed into a folder of their own first and put on PYTHONPATH.
# The device tool stops a command at 600 s: a full run on a 2-GPU machine takes two calls (--only).
# Results: bench CSV/PNG files in $OUT/results.tgz (unpack into bench/results/), logs in $OUT/logs.tgz,
# the environment in $OUT/env.txt and the summary in $OUT/summary.txt ($OUT: the device tool's output
# folder, or ./out). A stage is ok, SKIPPED (every test skipped), TIMEOUT or FAIL (scripts/stage_status.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
WORK=$(mktemp -d /tmp/gpu_check.XXXX)
mkdir -p "$OUT" "$WORK/results" "$WORK/logs"
# Multicast stays off; several ranks may share one GPU through symmetric memory over gloo.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tide_torch_extensions}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:$WORK/site
fi
quick=0 only=""
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --only) only=",$2,"; shift ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
# Whole-run time limit (GPU_CHECK_LIMIT_S; machines that stop a command at 600 s keep the default): a stage
# gets at most what is left, and is skipped (and reported) when under 20 s remain, so the archives and the
# summary are always written.
time_limit=${GPU_CHECK_LIMIT_S:-560}
declare -a summary
failed=0
stage() {  # stage NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  if [ -n "$only" ] && [ "$name" != build ] && [[ "$only" != *",$name,"* ]]; then return 0; fi
  if [ $quick = 1 ] && [[ "$name" != build && "$name" != tests_* ]]; then return 0; fi
  local t0=$SECONDS left=$((time_limit - SECONDS - 10))
  if [ $left -lt 20 ]; then summary+=("$(printf '%-18s %-7s' "$name" SKIPPED) (time limit reached)"); failed=1; return 1; fi
  [ $limit -gt $left ] && limit=$left
  timeout "$limit" "$@" >"$WORK/logs/$name.log" 2>&1
  local rc=$?
  # ok only when something ran and nothing failed: a pytest stage whose every test skipped is SKIPPED
  local status
  status=$($PY scripts/stage_status.py $rc "$WORK/logs/$name.log") || status="FAIL($rc)"
  case $status in ok|SKIPPED) ;; *) failed=1 ;; esac
  summary+=("$(printf '%-18s %-7s %4ss' "$name" "$status" $((SECONDS - t0)))")
  [ "$status" = ok ]
}

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4
  $PY - <<'PY'
import json
from tide.transport import probe
print(json.dumps(probe.summary(), default=str))
PY
  nvcc --version | tail -1
} >"$OUT/env.txt" 2>&1

overlap_args=(--reps 10)
[ "$gpus" -ge 2 ] && overlap_args+=(--xgpu)
# Stages in priority order, each capped; what the time limit cannot fit is skipped and reported.
stage build 240 $PY -c "from tide import extension; extension.load(verbose=True); print('built')"
stage tests_transport 260 $PY -m pytest tests/cuda -q -rfEs -p no:cacheprovider --timeout=150 \
  --ignore=tests/cuda/test_fsdp_cuda.py --ignore=tests/cuda/test_memory_model.py --ignore=tests/cuda/test_faults.py \
  --ignore=tests/cuda/test_multinode_cuda.py --ignore=tests/cuda/test_capture.py \
  --ignore=tests/cuda/test_compiled_cuda.py --ignore=tests/cuda/test_compiled_order_cuda.py
# compiled graphs: bit for bit against the reference backend, plain and captured; one issue order on every rank
stage tests_compiled 420 $PY -m pytest tests/cuda/test_compiled_cuda.py tests/cuda/test_compiled_order_cuda.py -q -rfEs \
  -p no:cacheprovider --timeout=400
TIDE_TRACE=1 stage tests_capture 300 $PY -m pytest tests/cuda/test_capture.py -q -rfEs -p no:cacheprovider --timeout=200
stage tests_fsdp_cuda 240 $PY -m pytest tests/cuda/test_fsdp_cuda.py -q -rfEs -p no:cacheprovider --timeout=230
stage tests_multinode 300 $PY -m pytest tests/cuda/test_multinode_cuda.py -q -rfEs -p no:cacheprovider --timeout=290
stage tests_memory_model 90 $PY -m pytest tests/cuda/test_memory_model.py -q -rfEs -p no:cacheprovider --timeout=85
# The fault stages trace every TIDE decision (TIDE_TRACE=1): a hung rank's log shows what it last did.
TIDE_TRACE=1 stage tests_faults 330 $PY -m pytest tests/cuda/test_faults.py -v -rfEs -p no:cacheprovider --timeout=100 --maxfail=2
TIDE_TRACE=1 stage fault_campaign 420 $PY bench/fault_campaign.py --device cuda --runs 50 --parallel 6 --timeout 10 --out "$WORK/results"
stage kernels 40 $PY bench/bench_kernels.py --reps 10 --out "$WORK/results"
stage collectives 150 $PY bench/collectives.py --sizes 1,16,256,1024 --reps 5 --out "$WORK/results"
# Emulated nodes: G x 1 on any machine; with 4+ GPUs also 2 x G/2 and G/2 x 2 (results/multinode_L<L>/).
multinode_locals="1"; [ "$gpus" -ge 4 ] && multinode_locals="1 2 $((gpus / 2))"
[ "$gpus" -ge 2 ] && stage collectives_multinode 240 bash -c "for L in \$(echo $multinode_locals | tr ' ' '\n' | sort -un); do
  out='$WORK/results'; [ \$L = 1 ] || out='$WORK/results/multinode_L'\$L
  $PY bench/collectives.py --local-world-size \$L --sizes 1,16,256 --reps 5 --out \$out || exit 1; done"
# Where the multi-node ops' host time goes: every function of the path timed, 2 GPUs as 2 nodes x 1.
[ "$gpus" -ge 2 ] && stage multinode_host 90 $PY bench/multinode_host.py --device cuda --ranks 2 --out "$WORK/results"
[ "$gpus" -ge 2 ] && stage timeline 150 $PY bench/timeline.py --out "$WORK/results"
[ "$gpus" -ge 2 ] && stage ce_patterns 120 bash -c "nvcc -O2 -std=c++17 -arch=sm_90a -o '$WORK/ce_patterns' \
  bench/ce_patterns.cu -lcuda && '$WORK/ce_patterns' 10 > '$WORK/results/ce_patterns.csv'"
[ "$gpus" -ge 2 ] && stage lease_probe 90 $PY bench/lease_probe.py --out "$WORK/results"
stage overlap 150 $PY bench/overlap.py "${overlap_args[@]}" --out "$WORK/results"
stage sm_room 120 $PY bench/sm_room.py --out "$WORK/results"
[ "$gpus" -ge 2 ] && stage rs_ctas 280 $PY bench/rs_ctas.py --out "$WORK/results"
stage host_time 90 $PY bench/bench_host_time.py --iters 40 --out "$WORK/results"
stage seam_host 90 $PY bench/fsdp_host_overhead.py --device cuda --reps 150 --out "$WORK/results"
stage train_step_8b 280 $PY bench/train_step.py --preset llama8b --steps 10 --out "$WORK/results"
[ "$gpus" -ge 2 ] && stage train_step_multinode 200 $PY bench/train_step.py --preset llama8b --tokens 1024,4096 \
  --variants stock,tide_in_place --local-world-size 1 --steps 8 --out "$WORK/results"
stage train_step_moe 220 $PY bench/train_step.py --preset moe --steps 10 --out "$WORK/results"
# compiled SimpleFSDP (compiled_stock needs NCCL: left out, with a message, where ranks share one GPU)
stage train_step_compiled 280 $PY bench/train_step.py --preset llama8b --blocks 2 --tokens 1024 \
  --variants compiled_stock,compiled_tide,tide_in_place --steps 8 --warmup 3 --out "$WORK/results"
# compiled TIDE at all-gather prefetch depth 0 and 1: step time and the share of transfer time beside compute
stage compiled_overlap 240 $PY bench/compiled_overlap.py --steps 6 --warmup 2 --out "$WORK/results"
stage train_step_8b_graphs 280 $PY bench/train_step.py --preset llama8b --cuda-graphs --tokens 1024,4096 \
  --variants stock,tide_in_place,tide_slot_reuse --steps 10 --out "$WORK/results"
stage train_step_moe_graphs 220 $PY bench/train_step.py --preset moe --cuda-graphs --tokens 1024,4096 \
  --variants stock,tide_in_place,tide_slot_reuse --steps 10 --out "$WORK/results"
if $PY -c "import torchao.float8" 2>/dev/null; then
  stage train_step_8b_float8 280 $PY bench/train_step.py --preset llama8b --float8 --tokens 1024,4096 \
    --variants stock,tide_in_place,tide_slot_reuse --steps 10 --out "$WORK/results"
elif [ $quick = 0 ] && { [ -z "$only" ] || [[ "$only" == *",train_step_8b_float8,"* ]]; }; then
  summary+=("$(printf '%-18s %-7s' train_step_8b_float8 SKIPPED) (no torchao: carry its wheel in .whl/)")
fi
memory_ranks=8; [ "$gpus" -ge 2 ] && memory_ranks=$gpus
stage memory 180 $PY bench/bench_memory.py --ranks $memory_ranks --dims 2048,4096,6144 --out "$WORK/results"
stage layout_conversion 50 $PY bench/layout_conversion.py --reps 10 --out "$WORK/results"

# Driver errors (Xid) and the GPUs' state at the end: a rank stuck exiting, or a hang outside TIDE's ops,
# may leave a trace there (dmesg may need root; an empty file then).
{ dmesg 2>/dev/null | grep -i -E 'xid|nvrm' | tail -n 50
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv; } >"$WORK/logs/driver.log" 2>&1
tar -czf "$OUT/results.tgz" -C "$WORK/results" .
tar -czf "$OUT/logs.tgz" -C "$WORK/logs" .
{
  echo "==================== environment"
  cat "$OUT/env.txt"
  echo "==================== tests (last lines)"
  for t in tests_transport tests_compiled tests_capture tests_fsdp_cuda tests_multinode tests_memory_model tests_faults; do
    [ -f "$WORK/logs/$t.log" ] && tail -n 12 "$WORK/logs/$t.log"
  done
  echo "==================== benchmark summaries"
  grep -h '^SUMMARY' "$WORK"/logs/*.log 2>/dev/null
  echo "==================== gpu_check summary"
  printf '%s\n' "${summary[@]}"
} | tee "$OUT/summary.txt"
exit $failed
