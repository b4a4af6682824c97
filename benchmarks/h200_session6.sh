#!/usr/bin/env bash
# Session 6's first device call: the latency case's min_tokens_per_split sweep
# (exp_variants.py --only session6), then the groups 4/8 candidate rows through the tuner
# and the headline bench with peers (benchmarks/h200_candidates.sh). No GPU tests: no kernel
# changed since session 5's run of them. Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session6.sh
set -uo pipefail
OUT="${OUT:-s6-out}"; mkdir -p "$OUT/exp"
source benchmarks/device_env.sh
timeout 200 python3 benchmarks/exp_variants.py --out "$OUT/exp" --only session6 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
OUT="$OUT/cand" bash benchmarks/h200_candidates.sh benchmarks/candidates/sm_90_groups_4_8_bn64.json \
    qwen3_5_gqa256:bf16:4:b33-96 qwen3_5_gqa256:bf16:8:b33-96
