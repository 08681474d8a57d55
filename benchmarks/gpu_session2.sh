#!/usr/bin/env bash
# One device call on 2 GPUs (nvidia-h200-x2) that re-checks and times the Triton kernels:
#   GPU 0: mLSTM (issue 5): correctness check, peers (limit_chunk, SDPA), timing, decode; then
#          generation speed (benchmarks/gpu_decode.py) and the mLSTM, sLSTM and model GPU tests
#   GPU 1: DPLR/KDA (issue 7): fla timed in the same process tree (it compiles for minutes on the
#          CPU first), cold compile, correctness, timing; then the DPLR GPU tests
#   then both: the 2-GPU test (kernels on a GPU that is not the current one)
# Run from the repo root with `.whl` (peer wheels) and `.peers` (peers_gpu.py) carried; results
# under $OUT/{mlstm,dplr} (tar them if more than 8 files come back).
# Knobs: MLSTM_PARTS, VARIANTS, CHECK_VARIANTS, MLSTM_S (budget of gpu_mlstm.py), DPLR_ENV.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/mlstm" "$OUT/dplr"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
git rev-parse HEAD >> "$OUT/gpu.txt" 2>/dev/null

(
  export CUDA_VISIBLE_DEVICES=0
  OUT="$OUT/mlstm" BUDGET_S=${MLSTM_S:-300} CHECK_QUICK=1 \
    timeout $(( ${MLSTM_S:-300} + 30 )) python3 benchmarks/gpu_mlstm.py ${MLSTM_PARTS:-check peers time decode summary} \
    > "$OUT/mlstm/log.txt" 2>&1
  OUT="$OUT/mlstm" timeout ${DECODE_S:-90} python3 benchmarks/gpu_decode.py 125m > "$OUT/mlstm/decode.txt" 2>&1
  timeout ${TESTS_S:-180} python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/ops/test_mlstm_triton.py tests/ops/test_slstm_triton.py tests/test_model.py > "$OUT/mlstm/gpu_tests.txt" 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  env ${DPLR_ENV:-} OUT="$OUT/dplr" timeout ${DPLR_S:-360} python3 benchmarks/gpu_dplr.py > "$OUT/dplr/log.txt" 2>&1
  timeout ${TESTS_S:-180} python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_dplr_triton.py \
    tests/nn/test_dplr_block.py > "$OUT/dplr/gpu_tests.txt" 2>&1
) &
wait
# both GPUs at once, briefly: kernels on a GPU that is not the current device
CUDA_VISIBLE_DEVICES=0,1 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_multi_gpu.py \
  > "$OUT/multi_gpu_tests.txt" 2>&1
tail -3 "$OUT/mlstm/gpu_tests.txt" "$OUT/dplr/gpu_tests.txt" "$OUT/multi_gpu_tests.txt"; cat "$OUT/mlstm/decode.txt"
