#!/usr/bin/env bash
# The paper's synthetic experiments on the GPUs of one host: all formal-language tasks x all models,
# plus MQAR (T=256, 64 pairs, vocabulary 8192, width 128) for every model, as one sweep of parallel
# runs dealt out over every visible GPU.
#
# On the GPU machine, from the repository root (torch + triton preinstalled, nothing to carry):
#     OUT=$OUT bash benchmarks/experiments_gpu.sh
# Writes $OUT/experiments/{table.md, heatmap.png, results.json, runs/*.json, sweep.log, env.txt}.
# Copy $OUT/experiments to results/experiments/ to commit it.
#
# Budget: under 10 minutes of wall time on 2 H200s. JOBS runs share the GPUs (2-block width-128
# models leave a GPU mostly idle, but runs on one GPU are time-sliced, so throughput per GPU is
# roughly fixed). Step counts per task come from an H200 probe (xLSTM[0:1] learns parity by step
# ~2000 at lr 3e-3, xLSTM[1:1] MQAR by ~1300 at lr 1e-3): the hard tasks get more steps. The time
# limits are a safety net (a run that cannot finish its steps in time fits its schedule to what
# fits); a hard timeout keeps the call under 10 minutes and whatever finished is reported anyway.
# MQAR runs once per learning rate in MQAR_LR (the probe's best rate differed between models).
# Knobs (environment): JOBS (20), STEPS (1500), STEPS_FOR (parity=4000,...), MQAR_STEPS (1800), MQAR_LR,
# TIME_LIMIT_S (420), MQAR_TIME_LIMIT_S (480), HARD_TIMEOUT_S (545), EXTRA (more CLI options,
# e.g. "--backend torch" or "--tasks parity --models xlstm[0:1]").
# DRY=1: a CPU smoke run of the same pipeline in --quick mode (seconds).
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=".:${PYTHONPATH:-}"
OUT="${OUT:-results}"
DEST="$OUT/experiments"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-20}"
STEPS="${STEPS:-1500}"
STEPS_FOR="${STEPS_FOR:-parity=4000,modular_arithmetic=2000}"
MQSTEPS="${MQAR_STEPS:-1800}"
MQLR="${MQAR_LR:-1e-3,3e-3}"
TL="${TIME_LIMIT_S:-420}"
MQTL="${MQAR_TIME_LIMIT_S:-480}"
HARD="${HARD_TIMEOUT_S:-545}"

{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
} > "$DEST/env.txt"

if [ "${DRY:-0}" = "1" ]; then
  ARGS=(--quick --device cpu --jobs 2 --steps 4 --steps-for parity=6 --mqar-steps 3 --time-limit 20)
else
  ARGS=(--device cuda --jobs "$JOBS" --steps "$STEPS" --steps-for "$STEPS_FOR" --mqar-steps "$MQSTEPS" --mqar-lr "$MQLR"
        --time-limit "$TL" --mqar-time-limit "$MQTL")
fi
# shellcheck disable=SC2086
timeout --signal=TERM --kill-after=15 "$HARD" \
  "$PY" -m xlstm_kit experiment sweep "${ARGS[@]}" ${EXTRA:-} --out "$DEST" 2>&1 | tee "$DEST/sweep.log"
echo "sweep exit status: ${PIPESTATUS[0]}" | tee -a "$DEST/sweep.log"
# Rebuild the report from the per-run files: complete even if the sweep hit the hard timeout.
"$PY" -m xlstm_kit experiment sweep --report-only --out "$DEST" 2>&1 | tee -a "$DEST/sweep.log"
cat "$DEST/table.md"
