#!/usr/bin/env bash
# One device call: `kgen tune` with a candidate table as the "current" configs (the tuner
# enqueues them next to the default and keeps whichever wins beyond noise), a rebuild, and
# the headline bench with its peers. Usage: bash benchmarks/h200_candidates.sh CANDIDATES.json
set -uo pipefail
OUT="${OUT:-cand-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/kgen-site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kgen-site .whl/*.whl || exit 2
export KGEN_CACHE_DIR="/tmp/kgen-cache"
STUDY_S="${STUDY_S:-12}"
tune() { KGEN_TABLE="$1" timeout -s INT "$2" python3 -m kgen.tuner.cli tune --no-progress --timeout "$STUDY_S" \
    --out kgen/tables/sm_90.json "${@:3}" 2>&1 | tee -a "$OUT/tune.log" | tail -n 6; }
tune "$1" 110 --layout qwen3_5_gqa256 --kv-dtype bf16 --group 16 --bucket b33-96 --bucket b9-32
tune "$1" 60 --layout qwen3_5_gqa256 --kv-dtype bf16 --group 8 --bucket b33-96
tune "$1" 100 --layout mla_absorbed_512_64 --kv-dtype bf16 --group 16 --bucket b33-96
cp kgen/tables/sm_90.json "$OUT/sm_90.json"
python3 -m kgen.cli build | tail -n 1
OUT="$OUT/headline" KGEN_BENCH_TIME_LIMIT=150 bash benchmarks/run_h200.sh --layout qwen3_5_gqa256:16 --batch 64 \
    --prefix 4K,16K --draft 4 --kv-dtype bf16,fp8 --no-plots 2>&1 | tail -n 12
rm -f "$OUT/headline/bench.log"
