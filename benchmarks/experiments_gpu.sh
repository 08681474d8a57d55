#!/usr/bin/env bash
# The paper's synthetic experiments on one GPU: all formal-language tasks x all models, plus MQAR
# (T=256, 64 pairs, vocabulary 8192, width 128) for every model, as one sweep of parallel runs.
#
# On the GPU machine, from the repository root (torch + triton preinstalled, nothing to carry):
#     OUT=$OUT bash benchmarks/experiments_gpu.sh
# Writes $OUT/experiments/{table.md, heatmap.png, results.json, runs/*.json, sweep.log, env.txt}.
# Copy $OUT/experiments to results/experiments/ to commit it.
#
# Budget: about 8 minutes of wall time. JOBS runs share the GPU (2-block width-128 models leave
# it mostly idle); each formal run gets TIME_LIMIT_S seconds for training + evaluation and each
# MQAR run MQAR_TIME_LIMIT_S; every run times its first steps and fits its learning-rate schedule
# into its budget. The MQAR runs start first (longest). A hard timeout keeps the call under
# 10 minutes; whatever finished is reported anyway.
# Knobs (environment): JOBS (8), TIME_LIMIT_S (50), MQAR_TIME_LIMIT_S (120), HARD_TIMEOUT_S (510),
# EXTRA (more CLI options, e.g. "--backend torch" or "--tasks parity --models xlstm[0:1]").
# DRY=1: a CPU smoke run of the same pipeline in --quick mode (seconds).
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=".:${PYTHONPATH:-}"
OUT="${OUT:-results}"
DEST="$OUT/experiments"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-8}"
TL="${TIME_LIMIT_S:-50}"
MQTL="${MQAR_TIME_LIMIT_S:-120}"
HARD="${HARD_TIMEOUT_S:-510}"

{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
} > "$DEST/env.txt"

if [ "${DRY:-0}" = "1" ]; then
  ARGS=(--quick --device cpu --jobs 2 --time-limit 20)
else
  ARGS=(--device cuda --jobs "$JOBS" --time-limit "$TL" --mqar-time-limit "$MQTL")
fi
# shellcheck disable=SC2086
timeout --signal=TERM --kill-after=15 "$HARD" \
  "$PY" -m xlstm_kit experiment sweep "${ARGS[@]}" ${EXTRA:-} --out "$DEST" 2>&1 | tee "$DEST/sweep.log"
echo "sweep exit status: ${PIPESTATUS[0]}" | tee -a "$DEST/sweep.log"
# Rebuild the report from the per-run files: complete even if the sweep hit the hard timeout.
"$PY" -m xlstm_kit experiment sweep --report-only --out "$DEST" 2>&1 | tee -a "$DEST/sweep.log"
cat "$DEST/table.md"
