#!/usr/bin/env bash
# A device session's first call: the GPU tests, then the variants queued in
# benchmarks/exp_variants.py --only ${KGEN_EXP_SECTIONS:-session6}. What comes back
# in $OUT: gpu_tests.log, exp.log, exp.json. Usage: bash benchmarks/h200_next.sh
set -uo pipefail
OUT="${OUT:-next-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
KGEN_TEST_ON_GPU=1 timeout 200 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 1 "$OUT/gpu_tests.log"
timeout 360 python3 benchmarks/exp_variants.py --out "$OUT" --only "${KGEN_EXP_SECTIONS:-session6}" 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
