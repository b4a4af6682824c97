#!/usr/bin/env bash
# Session 7: two co-resident programs per SM for groups 8, 4 and 16 (exp_variants.py --only
# session7f). Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session7f.sh
set -uo pipefail
OUT="${OUT:-s7f-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 300 python3 benchmarks/exp_variants.py --out "$OUT" --only session7f 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
