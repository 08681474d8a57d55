#!/bin/bash
# Our DPLR / KDA fwd+bwd (dplr_tune.py --variants 0:0: the default config, four cases at
# (8, 2048, 16, 128, 128)) for this tree and another, interleaved twice in one device call, each
# run in its own process: an A/B of a code change without fla. Prepare the other tree here first
# (the device gets the working tree, not .git), in an untracked folder that git does not ignore:
#
#   mkdir -p ab && git archive REV xlstm_kit benchmarks/dplr_tune.py | tar x -C ab
#   bash benchmarks/dplr_ab.sh ab                       # on the device; ≈ 150 s
#
# Prints one line per case and run; the tables (with each run's kernel profile) are tarred into
# $OUT/dplr_ab.tgz. The glue removal was timed this way (results/2026-12-03-h200-dplr-glue.md).
set -u
cd "$(dirname "$0")/.."
OTHER=$(cd "$1" && pwd) || exit 2
R=/tmp/dplr_ab; mkdir -p $R
trap 'tar czf "${OUT:-.}/dplr_ab.tgz" -C /tmp dplr_ab' EXIT
for r in 1 2; do for v in this other; do
  P=$PWD; [ $v = other ] && P=$OTHER
  PYTHONPATH=$P PYTHONUNBUFFERED=1 timeout 100 python3 $P/benchmarks/dplr_tune.py --out $R/$v$r --variants 0:0 \
    --limit-s 80 > $R/$v$r.txt 2>&1
  echo "$v $r: $(grep -E '^## |^\| default ' $R/$v$r/dplr_tune.md | paste - - | sed 's/, {.*}//; s/## //; s/| default | //; s/ |  |//' | tr '\t' ' ' | paste -sd';')"
done; done
