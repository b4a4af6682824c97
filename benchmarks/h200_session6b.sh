#!/usr/bin/env bash
# Session 6's second device call: the e4m3 tensor-core dot experiments for FP8 KV
# (exp_variants.py --only session6b) and the latency case's partial traffic (session6c).
# Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session6b.sh
set -uo pipefail
OUT="${OUT:-s6b-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 540 python3 benchmarks/exp_variants.py --out "$OUT" --only session6b session6c 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
