#!/usr/bin/env bash
# The headline bench with its peers alone (GQA 256 groups 16, 8, 4; BF16 and FP8; batch 64;
# prefix 4K and 16K; the FlexAttention sweep), in one short device call.
# Usage: KGEN_GIT_COMMIT=<sha> [KGEN_BENCH_TIME_LIMIT=s] bash benchmarks/h200_headline.sh
set -uo pipefail
OUT="${OUT:-headline-out}"; mkdir -p "$OUT"
OUT="$OUT" KGEN_BENCH_TIME_LIMIT="${KGEN_BENCH_TIME_LIMIT:-120}" bash benchmarks/run_h200.sh --no-plots \
    --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4 --batch 64 --prefix 4K,16K --draft 4 \
    --kv-dtype bf16,fp8 2>&1 | tail -n 12
rm -f "$OUT/bench.log"
