#!/usr/bin/env bash
# One device call: `kgen tune` with a candidate table as the "current" configs (the tuner
# enqueues them next to the default and keeps whichever wins beyond noise), a rebuild, and
# the headline bench with its peers.
# Usage: bash benchmarks/h200_candidates.sh CANDIDATES.json [LAYOUT:KV:GROUP:BUCKET[,BUCKET...] ...]
#   e.g. bash benchmarks/h200_candidates.sh benchmarks/candidates/sm_90_groups_4_8_bn64.json \
#            qwen3_5_gqa256:bf16:4:b33-96 qwen3_5_gqa256:bf16:8:b33-96
# Without jobs: group-16 GQA 256 (batch 9-32 and 33-96), group 8 (33-96) and MLA BF16 (33-96).
set -uo pipefail
OUT="${OUT:-cand-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR="/tmp/kgen-cache"
STUDY_S="${STUDY_S:-12}"
candidates="$1"; shift
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=(qwen3_5_gqa256:bf16:16:b33-96,b9-32 qwen3_5_gqa256:bf16:8:b33-96 mla_absorbed_512_64:bf16:16:b33-96)
for job in "${jobs[@]}"; do
    IFS=: read -r layout kv group buckets <<<"$job"
    bucket_args=(); limit=0
    for b in ${buckets//,/ }; do bucket_args+=(--bucket "$b"); limit=$((limit + STUDY_S + 43)); done
    case "$layout" in mla*) limit=$((limit * 2));; esac  # MLA kernels take seconds each to compile
    KGEN_TABLE="$candidates" timeout -s INT "$limit" python3 -m kgen.tuner.cli tune --no-progress \
        --timeout "$STUDY_S" --out kgen/tables/sm_90.json --layout "$layout" --kv-dtype "$kv" --group "$group" \
        "${bucket_args[@]}" 2>&1 | tee -a "$OUT/tune.log" | tail -n 6
done
cp kgen/tables/sm_90.json "$OUT/sm_90.json"
python3 -m kgen.cli build | tail -n 1
OUT="$OUT/headline" KGEN_BENCH_TIME_LIMIT=150 bash benchmarks/run_h200.sh --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4 \
    --batch 64 --prefix 4K,16K --draft 4 --kv-dtype bf16,fp8 --no-plots 2>&1 | tail -n 12
rm -f "$OUT/headline/bench.log"
