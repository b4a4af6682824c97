#!/usr/bin/env bash
# Session 6's closing device call: the draft-tile timing probe (exp_variants.py --only
# session6e), then the 48-case matrix of record (grouped and per-head) with the tables as
# they now stand. Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session6e.sh
set -uo pipefail
OUT="${OUT:-s6e-out}"; mkdir -p "$OUT/exp"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR=/tmp/kgen-cache
timeout 150 python3 benchmarks/exp_variants.py --out "$OUT/exp" --only session6e 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
OUT="$OUT/matrix" KGEN_BENCH_TIME_LIMIT=150 bash benchmarks/run_h200.sh --no-plots \
    --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4,mla_absorbed_512_64:16 --kv-dtype bf16,fp8 \
    --batch 16,64 --prefix 1K,4K,16K --draft 4 --kernels grouped,per_head 2>&1 | tail -n 4
rm -f "$OUT"/matrix/bench.log
