#!/usr/bin/env bash
# The cases of the Hopper lowering's targets, by `kgen bench`, on the GPU machine: absorbed MLA
# at group 16 (batch 64, prefix 16K) and group 128 (batch 16, prefix 4K), BF16 and FP8 KV; GQA
# 256 group 16 with FP8 KV (batch 64, prefix 16K) and the latency case (BF16, batch 16,
# prefix 1K). L 4, int64 kv_indices, shuffled token-slot pool, graph replay.
#
# Usage, from the repository root:
#   bash benchmarks/device/bench_hopper.sh [BASELINE_GENERATED_DIR]
# With BASELINE_GENERATED_DIR (a copy of an earlier build's generated/, e.g. one without the
# Gluon stage) the MLA cases also time that build's modules in alternation (--baseline-modules).
#
# Environment: OUT (default bench-out): one kgen bench folder per part, bench.log;
# KGEN_GIT_COMMIT, as in env.sh. Exit status: the worst part's.
set -uo pipefail
source "$(dirname "$0")/env.sh"
kgen_device_setup bench-out
baseline="${1:-}"
log="$OUT/bench.log"
: >"$log"
status=0

bench() {  # bench NAME ARGS...: one `kgen bench` run into $OUT/NAME
    local name="$1"
    shift
    echo "== bench_hopper.sh: $name" | tee -a "$log"
    python3 -m kgen.bench --out "$OUT/$name" --no-progress --no-plots --kernels grouped --flex-sweep none \
        --draft 4 --time-limit "${KGEN_BENCH_TIME_LIMIT:-120}" "$@" 2>&1 | tee -a "$log"
    local run_status=${PIPESTATUS[0]}
    echo "== bench_hopper.sh: $name exited $run_status" | tee -a "$log"
    [ "$run_status" = 0 ] || status=$run_status
}

ab=()
[ -n "$baseline" ] && ab=(--baseline-modules "$baseline")
bench mla_g16 --layout mla_absorbed_512_64:16 --kv-dtype bf16,fp8 --batch 64 --prefix 16K "${ab[@]}"
bench mla_g128 --layout mla_absorbed_512_64:128 --kv-dtype bf16,fp8 --batch 16 --prefix 4K "${ab[@]}"
bench gqa_fp8 --layout qwen3_5_gqa256:16 --kv-dtype bf16,fp8 --batch 64 --prefix 16K
bench latency --layout qwen3_5_gqa256:16 --kv-dtype bf16 --batch 16 --prefix 1K
echo "== bench_hopper.sh: exit $status" | tee -a "$log"
exit "$status"
