#!/usr/bin/env bash
# One device call: the GPU tests, the grid-vs-TPE measurement (GRID_S > 0), then `kgen tune`
# on the headline layouts.
# Every step has its own time limit (SIGINT: the tuner writes what it finished), and the
# table, the grid and the logs land in $OUT. Usage: bash benchmarks/h200_tune.sh
set -uo pipefail
OUT="${OUT:-tune-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
export KGEN_CACHE_DIR="$OUT/cache"
log="$OUT/tune.log"
GRID_S="${GRID_S:-0}"; STUDY_S="${STUDY_S:-20}"
KGEN_TEST_ON_GPU=1 timeout 150 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -n 15 > "$OUT/gpu_tests.log"
tail -n 1 "$OUT/gpu_tests.log"
if [ "$GRID_S" -gt 0 ]; then
    timeout -s INT $((GRID_S + 60)) python3 benchmarks/grid_vs_tpe.py --measure "$OUT/grid.json" --budget "$GRID_S" 2>&1 | tail -n 80 >> "$log"
fi
tune() { timeout -s INT "$1" python3 -m kgen.tuner.cli tune --no-progress --timeout "$STUDY_S" "${@:2}" 2>&1 | tee -a "$log" | tail -n 12; }
tune 200 --layout qwen3_5_gqa256 --kv-dtype bf16 --group 16 --group 8 --group 4 --bucket b33-96 --bucket b9-32
tune 60 --layout qwen3_5_gqa256 --kv-dtype fp8 --group 16 --bucket b33-96
tune 70 --layout mla_absorbed_512_64 --kv-dtype bf16 --group 16 --bucket b33-96
cp kgen/tables/sm_90.json "$OUT/sm_90.json" 2>/dev/null
rm -rf "$OUT/cache"
ls -la "$OUT"
