#!/usr/bin/env bash
# Session 7's third device call: the transposed prefix loop for groups 8 and 4
# (exp_variants.py --only session7c). Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session7c.sh
set -uo pipefail
OUT="${OUT:-s7c-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 400 python3 benchmarks/exp_variants.py --out "$OUT" --only session7c 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
