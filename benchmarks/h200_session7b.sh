#!/usr/bin/env bash
# Session 7's second device call: the GPU tests (the merge now loads a chunk of splits at
# once; block configs may set draft_tile), timing probes of the latency case
# (exp_variants.py --only session7b), and `kgen tune` of groups 8 and 4 at batch 33-96 with
# the new draft_tile axis, the shipped table as the current configs.
# Usage: KGEN_GIT_COMMIT=<sha> [STUDY_S=45] bash benchmarks/h200_session7b.sh
set -uo pipefail
OUT="${OUT:-s7b-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR="/tmp/kgen-cache"
STUDY_S="${STUDY_S:-45}"
KGEN_TEST_ON_GPU=1 timeout 170 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -n 60 > "$OUT/gpu_tests.log"
tail -n 1 "$OUT/gpu_tests.log"
timeout 100 python3 benchmarks/exp_variants.py --out "$OUT" --only session7b 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
cp kgen/tables/sm_90.json "$OUT/sm_90.before.json"
for group in 8 4; do
    KGEN_TABLE="$OUT/sm_90.before.json" timeout -s INT $((STUDY_S + 45)) python3 -m kgen.tuner.cli tune --no-progress \
        --timeout "$STUDY_S" --out kgen/tables/sm_90.json --layout qwen3_5_gqa256 --kv-dtype bf16 --group "$group" \
        --bucket b33-96 2>&1 | tee -a "$OUT/tune.log" | tail -n 6
done
cp kgen/tables/sm_90.json "$OUT/sm_90.json"
