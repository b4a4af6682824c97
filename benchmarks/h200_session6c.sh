#!/usr/bin/env bash
# Session 6's third device call: the GPU tests (the e4m3 q.k is new), then the e4m3 q.k
# against fp16_qk and precise_qk (exp_variants.py --only session6b) and the latency case's
# fp16 partials (session6c). Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session6c.sh
set -uo pipefail
OUT="${OUT:-s6c-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
KGEN_TEST_ON_GPU=1 timeout 240 python3 -m pytest -q -s -m gpu tests/ 2>&1 | tail -n 80 > "$OUT/gpu_tests.log"
grep -E "e4m3 vs fp16|passed|failed" "$OUT/gpu_tests.log" | tail -n 6
timeout 300 python3 benchmarks/exp_variants.py --out "$OUT" --only session6b session6c 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
