#!/bin/bash
# One device call of the paper protocol: the sweep's grid points for at most STOP seconds
# (paused ones keep their checkpoints in /tmp/paper, which the next call on the same, still warm,
# machine continues from), then the results (run JSONs, a paused run's <id>.progress with its loss
# curve, report, log; no checkpoints) tarred into $OUT/paper.tgz. Unpack here with
# `tar xzf paper.tgz -C /tmp` and copy the new paper/runs/*.json
# into results/experiments/paper/runs/ (the sweep skips finished grid points, the committed ones
# included: a fresh machine's /tmp/paper starts from them).
#
#   bash benchmarks/paper_protocol.sh STOP [--mqar-only] SWEEP-OPTIONS...
#   bash benchmarks/paper_protocol.sh 500 --tasks majority --jobs 18 \
#        --models "xlstm[0:1],xlstm[1:0],xlstm[1:1],transformer,lstm,lstm-plain"
#
# The sweep runs under CUDA MPS, so that the kernels of the parallel runs (small models, a few
# SMs each) share the GPU at once instead of taking turns: 18 xLSTM runs of 10k steps took
# 192-228 s each with it and 350-370 s without (H200, 2026-12-02); the daemon is stopped
# at the end, and without nvidia-cuda-mps-control it runs without. The sweep runs with
# --protocol paper and --no-mqar (formal tasks); with --mqar-only after STOP it runs the MQAR
# grid alone instead (--tasks none: give --setting, --widths, --seq-len/--pairs as wanted).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
STOP=$1; shift
MPS=0
FORMAL=(--no-mqar)
if [ "${1:-}" = "--mqar-only" ]; then FORMAL=(--tasks none); shift; fi
R=/tmp/paper; mkdir -p "$R"
# a fresh machine starts from the committed results, so that finished grid points are skipped
[ -d "$R/runs" ] || { mkdir -p "$R/runs"; cp results/experiments/paper/runs/*.json "$R/runs/"; }
N=$(ls "$R"/log*.txt 2>/dev/null | wc -l)
LOG=$R/log$N.txt
fin() {
  [ $MPS = 1 ] && echo quit | nvidia-cuda-mps-control 2>/dev/null
  kill %1 2>/dev/null
  tar czf "$OUT/paper.tgz" -C /tmp --exclude='*.ckpt' --exclude='*.tmp' paper
  cp "$R/report.md" "$LOG" "$OUT/" 2>/dev/null
}
trap fin EXIT
if command -v nvidia-cuda-mps-control >/dev/null; then
    MPS=1
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && echo "MPS on" | tee -a "$LOG"
else
    echo "no nvidia-cuda-mps-control: running without MPS" | tee -a "$LOG"
fi
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 20 > "$R/smi$N.txt" 2>&1 &
python3 -m xlstm_kit experiment sweep --protocol paper "${FORMAL[@]}" --device cuda --out "$R" \
  --stop-after "$STOP" "$@" >> "$LOG" 2>&1
echo "rc $?"
grep -E "^\[|protocol|paused|report|MPS" "$LOG" | tail -45
tail -3 "$R/smi$N.txt"
echo "checkpoints left: $(ls "$R"/runs 2>/dev/null | grep -c ckpt)"
