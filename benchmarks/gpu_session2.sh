#!/usr/bin/env bash
# One device call on 2 GPUs (nvidia-h200-x2) that re-checks and times the Triton kernels:
#   first, both GPUs briefly: kernels on a GPU that is not the current one (tests/ops/test_multi_gpu.py)
#   GPU 0: mLSTM (issue 5): peers (limit_chunk, SDPA) + our variants timed + profile + summary,
#          then the correctness check, generation speed (gpu_decode.py), mLSTM and model GPU tests
#   GPU 1: DPLR/KDA (issue 7): fla timed in the same call (it compiles for minutes on the CPU
#          first), cold compile, correctness, variants, timing, decode; then the DPLR GPU tests
# Run from the repo root with `.whl` (peer wheels) and `.peers` (peers_gpu.py) carried; results
# under $OUT/{mlstm_t,mlstm_c,dplr} (tar them: only 8 files come back).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/mlstm_t" "$OUT/mlstm_c" "$OUT/dplr"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null

timeout 45 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_multi_gpu.py > "$OUT/multi_gpu_tests.txt" 2>&1

(
  export CUDA_VISIBLE_DEVICES=0
  OUT="$OUT/mlstm_t" BUDGET_S=170 VARIANTS=${VARIANTS:-default,fused64_prev,fused64_all_seq} \
    timeout 190 python3 benchmarks/gpu_mlstm.py peers time profile summary > "$OUT/mlstm_t/log.txt" 2>&1
  OUT="$OUT/mlstm_c" BUDGET_S=95 CHECK_CASE_S=25 \
    CHECK_CASES='[[2048,"extreme",64,128],[1,"normal",64,128],[100,"extreme",64,128],[2048,"normal",64,128],[2048,"normal",256,512]]' \
    CHECK_VARIANTS=default,fused64_prev timeout 110 python3 benchmarks/gpu_mlstm.py check > "$OUT/mlstm_c/log.txt" 2>&1
  OUT="$OUT/mlstm_t" timeout 60 python3 benchmarks/gpu_decode.py 125m > "$OUT/mlstm_t/decode.txt" 2>&1
  timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_mlstm_triton.py tests/test_model.py \
    > "$OUT/mlstm_t/gpu_tests.txt" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT="$OUT/dplr" timeout 330 python3 benchmarks/gpu_dplr.py > "$OUT/dplr/log.txt" 2>&1
  timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_dplr_triton.py \
    tests/nn/test_dplr_block.py > "$OUT/dplr/gpu_tests.txt" 2>&1
) &
wait
tail -2 "$OUT/multi_gpu_tests.txt" "$OUT/mlstm_t/gpu_tests.txt" "$OUT/dplr/gpu_tests.txt"; cat "$OUT/mlstm_t/decode.txt"
cd "$OUT" && tar czf session.tgz mlstm_t mlstm_c dplr multi_gpu_tests.txt gpu.txt && rm -rf mlstm_t mlstm_c dplr
