#!/usr/bin/env bash
# One device call: the grid-vs-TPE measurement, then `kgen tune` on the headline layouts.
# Every step has its own time limit (SIGINT: the tuner writes what it finished), and the
# table, the grid and the logs land in $OUT. Usage: bash benchmarks/h200_tune.sh
set -uo pipefail
OUT="${OUT:-tune-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/kgen-site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kgen-site .whl/*.whl || exit 2
export KGEN_CACHE_DIR="$OUT/cache"
log="$OUT/tune.log"
GRID_S="${GRID_S:-120}"; STUDY_S="${STUDY_S:-15}"
timeout -s INT $((GRID_S + 60)) python3 benchmarks/grid_vs_tpe.py --measure "$OUT/grid.json" --budget "$GRID_S" 2>&1 | tail -n 80 >> "$log"
tune() { timeout -s INT "$1" python3 -m kgen.tuner.cli tune --no-progress --timeout "$STUDY_S" "${@:2}" 2>&1 | tee -a "$log" | tail -n 30; }
tune 170 --layout qwen3_5_gqa256 --kv-dtype bf16 --kv-dtype fp8 --group 16 --group 4 --bucket b33-96 --bucket b9-32
tune 110 --layout mla_absorbed_512_64 --kv-dtype bf16 --kv-dtype fp8 --group 16 --bucket b33-96 --bucket b9-32
tune 50 --layout qwen3_5_gqa256 --kv-dtype bf16 --group 8 --bucket b33-96 --bucket b9-32
tune 50 --layout gqa128 --kv-dtype bf16 --group 8 --bucket b33-96 --bucket b9-32
cp kgen/tables/sm_90.json "$OUT/sm_90.json" 2>/dev/null
rm -rf "$OUT/cache"
ls -la "$OUT"
