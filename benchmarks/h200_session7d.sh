#!/usr/bin/env bash
# Session 7's closing device call: the headline with its peers (the benchmarks/baselines/h200.json
# of record) and the 48-case matrix (h200_matrix.json), both at the current commit (the merge
# with a chunk of splits in flight; group 8's draft tile first, which the old matrix lacked).
# Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session7d.sh
set -uo pipefail
OUT="${OUT:-s7d-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR=/tmp/kgen-cache
OUT="$OUT/headline" KGEN_BENCH_TIME_LIMIT=110 bash benchmarks/h200_headline.sh
OUT="$OUT/matrix" KGEN_BENCH_TIME_LIMIT=150 bash benchmarks/run_h200.sh --no-plots \
    --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4,mla_absorbed_512_64:16 --kv-dtype bf16,fp8 \
    --batch 16,64 --prefix 1K,4K,16K --draft 4 --kernels grouped,per_head 2>&1 | tail -n 4
rm -f "$OUT"/matrix/bench.log
