#!/bin/bash
# One device call for the DPLR/KDA kernels against fla, as run on 2026-12-02:
#   bash benchmarks/dplr_device.sh [VARIANTS] [SHAPES]   (carry .whl: fla's wheels, pip download --no-deps -d .whl)
# VARIANTS: a slice of dplr_tune.py's VARIANTS timed after the default (0:0, none, by default);
# SHAPES: "1,2" (default) or "1" (only (8, 2048, ...), leaving the variants the time of shape 2).
# fla's wheels installed from .whl; fla compiled in the background (200–240 s per case) while every
# DPLR/KDA test file runs on the GPU; then ours against fla at both issue shapes, profiles and the
# error table included. Results tarred into $OUT/dplr.tgz, the tables copied beside it.
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
V=${1:-0:0}; S=${2:-1,2}
R=/tmp/dplr; T0=$(date +%s); left() { echo $(( $1 - ($(date +%s) - T0) )); }
mkdir -p $R/t $R/a $R/b $R/w
fin() { tar czf $OUT/dplr.tgz -C /tmp dplr; cp $R/t/tests.txt $OUT/ 2>/dev/null
        cp $R/a/dplr_tune.md $OUT/shape1.md 2>/dev/null; cp $R/b/dplr_tune.md $OUT/shape2.md 2>/dev/null; }
trap fin EXIT
timeout 300 python3 benchmarks/dplr_tune.py --warm-fla --out $R/w > $R/w/log.txt 2>&1 &
# the float64 CPU references of 6 workers, threads capped (uncapped they oversubscribed 16 cores)
( OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 timeout 250 python3 -m pytest -v -rA -n 6 -p no:cacheprovider \
   tests/ops/test_dplr_triton.py tests/ops/test_dplr_triton_phases.py tests/ops/test_dplr_triton_varlen.py \
   tests/ops/test_reliability.py tests/layers/test_dplr_block.py > $R/t/tests.txt 2>&1; echo "rc $?" >> $R/t/tests.txt )
[ -n "$EXTRA_TESTS" ] && timeout 120 python3 -m pytest -q -rA -p no:cacheprovider $EXTRA_TESTS > $R/t/extra.txt 2>&1
[ -n "$EXTRA_TESTS" ] && tail -5 $R/t/extra.txt
echo "tests $(( $(date +%s) - T0 )) s: $(grep -c PASSED $R/t/tests.txt) passed, $(grep -c FAILED $R/t/tests.txt) failed"
grep -E "^FAILED" $R/t/tests.txt | head -8
wait; echo "fla compiled $(( $(date +%s) - T0 )) s"; grep "first" $R/w/log.txt
L=$(left $([ "$S" = 1 ] && echo 585 || echo 430)); timeout $L python3 benchmarks/dplr_tune.py --out $R/a --fla --variants $V --limit-s $((L - 30)) > $R/a/log.txt 2>&1
echo "shape 1 $(( $(date +%s) - T0 )) s"; grep -E "^## |^\| (default|fla) " $R/a/dplr_tune.md
[ "$S" = 1 ] && exit 0
L=$(left 585); timeout $L python3 benchmarks/dplr_tune.py --out $R/b --fla --variants $V --shape 2,8192,16,128,128 \
  --limit-s $((L - 40)) > $R/b/log.txt 2>&1
echo "shape 2 $(( $(date +%s) - T0 )) s"; grep -E "^## |^\| (default|fla) " $R/b/dplr_tune.md
