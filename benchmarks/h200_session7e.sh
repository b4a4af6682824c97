#!/usr/bin/env bash
# Session 7: one split a request at batch 64 (exp_variants.py --only session7e), then Nsight
# Compute on group 8, batch 64, prefix 16K: the prefix and merge kernels' durations and
# DRAM throughput, as shipped and with one split. Usage: KGEN_GIT_COMMIT=<sha> bash benchmarks/h200_session7e.sh
set -uo pipefail
OUT="${OUT:-s7e-out}"; mkdir -p "$OUT"
source benchmarks/device_env.sh
timeout 200 python3 benchmarks/exp_variants.py --out "$OUT" --only session7e 2>&1 | grep -v Warning | sed -n '/SUMMARY/,$p'
NCU=(ncu --clock-control none --kernel-name regex:_verify --launch-skip 4 --launch-count 4
     --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,smsp__warps_active.avg.pct_of_peak_sustained_active)
for group in 8 4; do
    timeout 90 "${NCU[@]}" python3 benchmarks/ncu_probe.py --group $group > "$OUT/ncu_g$group.txt" 2>&1
    timeout 90 "${NCU[@]}" python3 benchmarks/ncu_probe.py --group $group --config '{"split": {"programs_per_sm": 1, "max_splits": 1, "min_tokens_per_split": 128}}' > "$OUT/ncu_g${group}_1split.txt" 2>&1
done
for f in "$OUT"/ncu_*.txt; do echo "== $f"; grep -E "_verify|gpu__time|dram__|sm__throughput|grid_size|warps_active" "$f" | head -30; done
