#!/usr/bin/env bash
# After the MLA kernel change (unmasked whole tiles) and its new FP8 default: the 64-token
# tile probe for GQA group 16 (exp_variants.py --only bn64), then re-tune the MLA rows of
# sm_90.json. $OUT: exp.json, tune.log, sm_90.json. Usage: bash benchmarks/h200_retune_mla.sh
set -uo pipefail
OUT="${OUT:-retune-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR=/tmp/kgen-cache
timeout 120 python3 benchmarks/exp_variants.py --out "$OUT" --only bn64 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p' | cut -c1-150
rm -f "$OUT/exp.log"
# MLA kernels take seconds each to compile: a 14 s study ran 2 trials (2026-11-29), so 60 s.
tune() { timeout -s INT "$1" python3 -m kgen.tuner.cli tune --no-progress --timeout "${STUDY_S:-60}" \
    --out kgen/tables/sm_90.json "${@:2}" 2>&1 | tee -a "$OUT/tune.log" | tail -n 8; }
tune 190 --layout mla_absorbed_512_64 --kv-dtype fp8 --group 16 --bucket b33-96
tune 190 --layout mla_absorbed_512_64 --kv-dtype bf16 --group 16 --bucket b33-96
cp kgen/tables/sm_90.json "$OUT/sm_90.json"
