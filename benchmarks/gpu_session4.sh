#!/usr/bin/env bash
# A 2-GPU sweep call (nvidia-h200-x2) for the mLSTM kernels, ~420 s:
#   GPU 0: our variants timed at the four shapes + profile (gpu_mlstm.py time profile), then the
#          correctness cases not yet run on this code (CHECK_CASES), then the mLSTM GPU tests
#   GPU 1: the peers (limit_chunk, SDPA) in the same call, then the model and DPLR GPU tests
#   then (both idle) one summary table from both parts' records.
# Carry .whl and .peers; results in $OUT/session.tgz.
set -u
export PYTHONUNBUFFERED=1
START=$(date +%s)
OUT=${OUT:-/tmp/out}; T="$OUT/mlstm_t"; P="$OUT/mlstm_p"; C="$OUT/mlstm_c"; mkdir -p "$T" "$P" "$C"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
mark() { echo "[t=$(( $(date +%s) - START ))s] $*" >> "$OUT/timeline.txt"; }
(
  export CUDA_VISIBLE_DEVICES=0
  mark "gpu0 time"
  OUT="$T" BUDGET_S=${TIME_S:-190} VARIANTS="${VARIANTS:-default,scan,seq_loop,scan_w1,ds4,fbw4,out128}" \
    timeout -k 5 205 python3 benchmarks/gpu_mlstm.py time profile > "$T/log.txt" 2>&1
  mark "gpu0 check"
  OUT="$C" BUDGET_S=100 CHECK_CASE_S=20 CHECK_VARIANTS=default CHECK_CASES="${CHECK_CASES:-[[1,\"normal\",64,128],[8192,\"normal\",64,128],[2048,\"extreme\",64,128]]}" \
    timeout -k 5 110 python3 benchmarks/gpu_mlstm.py check > "$C/log.txt" 2>&1
  mark "gpu0 tests"
  timeout -k 5 150 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests/ops/test_mlstm_triton.py \
    > "$OUT/gpu_tests_mlstm.txt" 2>&1
  mark "gpu0 done"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  mark "gpu1 peers"
  OUT="$P" BUDGET_S=140 timeout -k 5 150 python3 benchmarks/gpu_mlstm.py peers > "$P/log.txt" 2>&1
  mark "gpu1 tests"
  timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests/test_model.py \
    tests/ops/test_dplr_triton.py tests/nn/test_dplr_block.py > "$OUT/gpu_tests_other.txt" 2>&1
  mark "gpu1 done"
) &
wait
cat "$P/anchors.jsonl" >> "$T/anchors.jsonl" 2>/dev/null
CUDA_VISIBLE_DEVICES=0 OUT="$T" timeout 60 python3 benchmarks/gpu_mlstm.py summary > "$T/summary.txt" 2>&1
mark "all done"
cat "$OUT/timeline.txt"; tail -n 4 "$OUT/gpu_tests_mlstm.txt" "$OUT/gpu_tests_other.txt"
grep -A14 "^## Summary" "$T/summary.txt"; grep -E "^- T=|ours bf16|overall|skipped" "$C/mlstm.md"
cd "$OUT" && tar czf session.tgz mlstm_t mlstm_p mlstm_c gpu_tests_mlstm.txt gpu_tests_other.txt gpu.txt timeline.txt \
  && rm -rf mlstm_t mlstm_p mlstm_c
