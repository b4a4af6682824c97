#!/usr/bin/env bash
# Session 7: `kgen tune` for FP8 GQA 256 groups 8 and 4 at batch 33-96 and MLA BF16 at batch
# 9-32 (no sm_90 rows before), offered neighbouring rows as candidates
# (benchmarks/candidates/sm_90_fp8_groups_mla_b9.json). Writes kgen/tables/sm_90.json.
# Usage: KGEN_GIT_COMMIT=<sha> [STUDY_S=45] bash benchmarks/h200_session7h.sh
set -uo pipefail
OUT="${OUT:-s7h-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR="/tmp/kgen-cache"
STUDY_S="${STUDY_S:-45}"
for job in qwen3_5_gqa256:fp8:8:b33-96 qwen3_5_gqa256:fp8:4:b33-96 mla_absorbed_512_64:bf16:16:b9-32; do
    IFS=: read -r layout kv group bucket <<<"$job"
    limit=$((STUDY_S + 50)); case "$layout" in mla*) limit=$((limit + 40));; esac
    KGEN_TABLE=benchmarks/candidates/sm_90_fp8_groups_mla_b9.json timeout -s INT "$limit" python3 -m kgen.tuner.cli tune \
        --no-progress --timeout "$STUDY_S" --out kgen/tables/sm_90.json --layout "$layout" --kv-dtype "$kv" \
        --group "$group" --bucket "$bucket" 2>&1 | tee -a "$OUT/tune.log" | tail -n 4
done
cp kgen/tables/sm_90.json "$OUT/sm_90.json"
