#!/usr/bin/env bash
# Session 7's first device call: the merge that loads a chunk of splits as one block against
# the loop over single splits (exp_variants.py --only session7; the build before is carried
# as .prev/*__loopmerge.py). Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session7.sh
set -uo pipefail
OUT="${OUT:-s7-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 560 python3 benchmarks/exp_variants.py --out "$OUT" --only session7 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
