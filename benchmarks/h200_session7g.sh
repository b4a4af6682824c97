#!/usr/bin/env bash
# Session 7: `kgen tune` for the batch buckets the sm_90 table had no rows for (GQA 256 BF16,
# groups 16/8/4 at batch 97+, group 16 at batch 1-8), offered the neighbouring buckets' rows
# as candidates (benchmarks/candidates/sm_90_b97_b1.json). Writes kgen/tables/sm_90.json.
# Usage: KGEN_GIT_COMMIT=<sha> [STUDY_S=45] bash benchmarks/h200_session7g.sh
set -uo pipefail
OUT="${OUT:-s7g-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR="/tmp/kgen-cache"
STUDY_S="${STUDY_S:-45}"
for job in 16:b97+ 8:b97+ 4:b97+ 16:b1-8; do
    IFS=: read -r group bucket <<<"$job"
    KGEN_TABLE=benchmarks/candidates/sm_90_b97_b1.json timeout -s INT $((STUDY_S + 50)) python3 -m kgen.tuner.cli tune \
        --no-progress --timeout "$STUDY_S" --out kgen/tables/sm_90.json --layout qwen3_5_gqa256 --kv-dtype bf16 \
        --group "$group" --bucket "$bucket" 2>&1 | tee -a "$OUT/tune.log" | tail -n 4
done
cp kgen/tables/sm_90.json "$OUT/sm_90.json"
