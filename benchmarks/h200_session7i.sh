#!/usr/bin/env bash
# Session 7's last device call: the real-size GPU parity tests, which now include the table
# rows tuned in this session. Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session7i.sh
set -uo pipefail
OUT="${OUT:-s7i-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
KGEN_TEST_ON_GPU=1 timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "parity_real_sizes or draft_tile or graph" 2>&1 | tail -n 40 > "$OUT/gpu_tests.log"
tail -n 3 "$OUT/gpu_tests.log"
