#!/usr/bin/env bash
# One device call that re-checks and times what changed (H200, torch 2.11, triton 3.6):
#   1. GPU correctness tests of the Triton kernels (pytest -m gpu)
#   2. 125M-preset training throughput and MFU (issue 4)
#   3. mLSTM Triton variants vs limit_chunk / SDPA (issue 5)
# Run from the repo root with `.whl` (peer wheels) and `.peers` (peers_gpu.py) carried.
# Each stage has its own time limit so one slow stage cannot eat the others' budget.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"

echo "== 1. GPU tests"
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -q -x -p no:cacheprovider \
  tests/ops/test_slstm_triton.py tests/ops/test_mlstm_triton.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"

echo "== 2. training throughput (125M preset)"
timeout ${TRAIN_S:-120} python3 benchmarks/train_speed.py --preset 125m --batch-size 16 --seq-len 2048 \
  --steps 12 --warmup 4 --json "$OUT/train_125m.json" 2>&1 | tail -15 | tee "$OUT/train_125m.txt"

echo "== 3. mLSTM variants"
BUDGET_S=${MLSTM_S:-285} CHECK_QUICK=1 CHECK_VARIANTS=${CHECK_VARIANTS:-fused32_all,fused64_all,old_all} \
  VARIANTS=${VARIANTS:-fused64_all,fused32_all,fused64_all_seq,default,old_all} \
  timeout $(( ${MLSTM_S:-285} + 30 )) python3 benchmarks/gpu_mlstm.py check peers time summary 2>&1 | tail -60
