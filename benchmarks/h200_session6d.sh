#!/usr/bin/env bash
# Session 6's last device call: the GPU tests, longer tuner studies for groups 8 and 4 at
# batch 33-96 (the cases where FlexAttention on contiguous KV is still faster), a rebuild
# and the headline bench with peers. Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session6d.sh
set -uo pipefail
OUT="${OUT:-s6d-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
KGEN_TEST_ON_GPU=1 timeout 200 python3 -m pytest -q -s -m gpu tests/ 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
grep -E "e4m3 against|passed|failed" "$OUT/gpu_tests.log" | tail -n 6
OUT="$OUT/cand" STUDY_S="${STUDY_S:-90}" bash benchmarks/h200_candidates.sh kgen/tables/sm_90.json \
    qwen3_5_gqa256:bf16:8:b33-96 qwen3_5_gqa256:bf16:4:b33-96
