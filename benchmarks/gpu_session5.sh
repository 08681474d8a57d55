#!/usr/bin/env bash
# The final 2-GPU call (nvidia-h200-x2) of issue 5's table, ~300 s:
#   GPU 0: our mLSTM variants timed at the four shapes + profile, correctness cases A (long T),
#          then the mLSTM GPU tests
#   GPU 1: the peers (limit_chunk, SDPA) in the same call, correctness cases B (T = 1, extreme
#          gates, head dims), then the model and DPLR GPU tests
#   then: the 2-GPU test (kernels on a GPU that is not the current one) and one summary table.
# Carry .whl and .peers; results in $OUT/session.tgz.
set -u
export PYTHONUNBUFFERED=1
START=$(date +%s)
OUT=${OUT:-/tmp/out}; T="$OUT/mlstm_t"; P="$OUT/mlstm_p"; CA="$OUT/mlstm_ca"; CB="$OUT/mlstm_cb"
mkdir -p "$T" "$P" "$CA" "$CB"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
mark() { echo "[t=$(( $(date +%s) - START ))s] $*" >> "$OUT/timeline.txt"; }
(
  export CUDA_VISIBLE_DEVICES=0
  mark "gpu0 time"
  OUT="$T" BUDGET_S=100 VARIANTS="${VARIANTS:-default,seq_loop,sweep2_default,fbs2,scan_G8}" \
    timeout -k 5 115 python3 benchmarks/gpu_mlstm.py time profile > "$T/log.txt" 2>&1
  mark "gpu0 check A"
  OUT="$CA" BUDGET_S=130 CHECK_CASE_S=20 CHECK_VARIANTS=default \
    CHECK_CASES='[[8192,"normal",64,128],[2048,"extreme",64,128],[2048,"normal",64,128]]' \
    timeout -k 5 140 python3 benchmarks/gpu_mlstm.py check > "$CA/log.txt" 2>&1
  mark "gpu0 tests"
  timeout -k 5 150 python3 -m pytest -m gpu -p no:cacheprovider --durations=5 tests/ops/test_mlstm_triton.py \
    > "$OUT/gpu_tests_mlstm.txt" 2>&1
  mark "gpu0 done"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  mark "gpu1 peers"
  OUT="$P" BUDGET_S=140 timeout -k 5 150 python3 benchmarks/gpu_mlstm.py peers > "$P/log.txt" 2>&1
  mark "gpu1 check B"
  OUT="$CB" BUDGET_S=100 CHECK_CASE_S=15 CHECK_VARIANTS=default \
    CHECK_CASES='[[1,"normal",64,128],[100,"extreme",64,128],[100,"normal",64,128],[300,"normal",256,512],[300,"normal",512,64],[300,"normal",128,128]]' \
    timeout -k 5 110 python3 benchmarks/gpu_mlstm.py check > "$CB/log.txt" 2>&1
  mark "gpu1 tests"
  timeout -k 5 150 python3 -m pytest -m gpu -p no:cacheprovider --durations=5 tests/test_model.py \
    tests/ops/test_dplr_triton.py tests/nn/test_dplr_block.py > "$OUT/gpu_tests_other.txt" 2>&1
  mark "gpu1 done"
) &
wait
mark "2-GPU test"
timeout -k 5 60 python3 -m pytest -m gpu -p no:cacheprovider tests/ops/test_multi_gpu.py > "$OUT/gpu_tests_multi.txt" 2>&1
cat "$P/anchors.jsonl" >> "$T/anchors.jsonl" 2>/dev/null
CUDA_VISIBLE_DEVICES=0 OUT="$T" timeout 60 python3 benchmarks/gpu_mlstm.py summary > "$T/summary.txt" 2>&1
mark "all done"
cat "$OUT/timeline.txt"; tail -n 1 "$OUT"/gpu_tests_*.txt
grep -A9 "^## Summary" "$T/summary.txt"; grep -hE "^- T=|ours bf16|ours fp32 FAIL|overall|skipped" "$CA/mlstm.md" "$CB/mlstm.md"
cd "$OUT" && tar czf session.tgz mlstm_t mlstm_p mlstm_ca mlstm_cb gpu_tests_*.txt gpu.txt timeline.txt \
  && rm -rf mlstm_t mlstm_p mlstm_ca mlstm_cb
