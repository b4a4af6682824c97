#!/usr/bin/env bash
# Session 5's closing device call: the GPU tests, `kgen tune` of the group-8 rows with the
# min_rows candidates, a rebuild, then the benchmarks of record: the 48-case matrix
# (grouped and per-head) and the headline with its peers (groups 16, 8, 4; BF16 and FP8).
# $OUT: gpu_tests.log tune.log sm_90.json matrix/bench.{json,md} headline/bench.{json,md}.
# Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session5.sh
set -uo pipefail
OUT="${OUT:-s5-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR=/tmp/kgen-cache
KGEN_TEST_ON_GPU=1 timeout 140 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -n 40 > "$OUT/gpu_tests.log"
tail -n 1 "$OUT/gpu_tests.log"
KGEN_TABLE=benchmarks/candidates/sm_90_group8_min_rows.json timeout -s INT 100 python3 -m kgen.tuner.cli tune \
    --no-progress --timeout "${STUDY_S:-14}" --out kgen/tables/sm_90.json --layout qwen3_5_gqa256 --kv-dtype bf16 \
    --group 8 --bucket b33-96 --bucket b9-32 2>&1 | tee "$OUT/tune.log" | tail -n 8
cp kgen/tables/sm_90.json "$OUT/sm_90.json"
python3 -m kgen.cli build | tail -n 1
OUT="$OUT/matrix" KGEN_BENCH_TIME_LIMIT=80 bash benchmarks/run_h200.sh --no-plots \
    --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4,mla_absorbed_512_64:16 --kv-dtype bf16,fp8 \
    --batch 16,64 --prefix 1K,4K,16K --draft 4 --kernels grouped,per_head 2>&1 | tail -n 4
OUT="$OUT/headline" KGEN_BENCH_TIME_LIMIT=120 bash benchmarks/run_h200.sh --no-plots \
    --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4 --batch 64 --prefix 4K,16K --draft 4 \
    --kv-dtype bf16,fp8 2>&1 | tail -n 12
rm -f "$OUT"/*/bench.log "$OUT"/*/compare.md
