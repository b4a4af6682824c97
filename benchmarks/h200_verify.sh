#!/usr/bin/env bash
# One device call after a kernel change: the GPU tests, the PDL A/B and shipped-MLA timings
# (exp_variants.py --only pdl), then `kgen bench` on the headline cases (with the peers) and
# on the latency and MLA cases. What comes back in $OUT (<= 8 files): gpu_tests.log,
# exp.json, headline/bench.{json,md}, extra/bench.{json,md}. Usage: bash benchmarks/h200_verify.sh
set -uo pipefail
OUT="${OUT:-verify-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
KGEN_TEST_ON_GPU=1 timeout 150 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 1 "$OUT/gpu_tests.log"
timeout 150 python3 benchmarks/exp_variants.py --out "$OUT" --only pdl 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p' | cut -c1-80
rm -f "$OUT/exp.log"
OUT="$OUT/headline" KGEN_BENCH_TIME_LIMIT=150 bash benchmarks/run_h200.sh --layout qwen3_5_gqa256:16 --batch 64 \
    --prefix 4K,16K --draft 4 --kv-dtype bf16,fp8 --no-plots 2>&1 | tail -n 14
OUT="$OUT/extra" KGEN_BENCH_TIME_LIMIT=90 bash benchmarks/run_h200.sh --layout qwen3_5_gqa256:16,mla_absorbed_512_64:16 \
    --batch 16,64 --prefix 1K,16K --draft 4 --kv-dtype bf16,fp8 --kernels grouped --no-plots 2>&1 | tail -n 14
rm -f "$OUT/headline/bench.log" "$OUT/extra/bench.log" "$OUT/headline/compare.md" "$OUT/extra/compare.md"
