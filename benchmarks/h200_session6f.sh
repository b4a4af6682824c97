#!/usr/bin/env bash
# Session 6's last device call: the GPU tests (GQA's draft tile now moves before the loop in
# programs under 64 rows), then that placement against draft_after (exp_variants.py --only
# session6f). Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session6f.sh
set -uo pipefail
OUT="${OUT:-s6f-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
KGEN_TEST_ON_GPU=1 timeout 170 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 1 "$OUT/gpu_tests.log"
timeout 230 python3 benchmarks/exp_variants.py --out "$OUT" --only session6f 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
