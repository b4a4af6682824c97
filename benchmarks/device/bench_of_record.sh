#!/usr/bin/env bash
# The benchmarks of record on the GPU machine, each compared with its committed baseline:
#   headline  GQA 256 groups 16, 8 and 4; BF16 and FP8 KV; batch 64; prefix 4K and 16K; L 4;
#             every peer (per-head, FlexAttention with its kernel-option sweep, SDPA)
#             -> benchmarks/baselines/h200.json
#   matrix    48 cases of the kgen kernels (grouped and per-head): GQA 256 groups 16/8/4 and
#             absorbed MLA, BF16 and FP8, batch 16 and 64, prefix 1K/4K/16K, L 4
#             -> benchmarks/baselines/h200_matrix.json
#
# Usage, from the repository root:
#   KGEN_GIT_COMMIT=<sha> bash benchmarks/device/bench_of_record.sh [all|headline|matrix] [KGEN BENCH ARGS...]
#   e.g. KGEN_GIT_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/device/bench_of_record.sh headline --replays 30
# The part defaults to all; further arguments go to every `kgen bench` call.
#
# Environment:
#   KGEN_BENCH_TIME_LIMIT  seconds of measurement per part (default 150): cases left when it
#                          runs out are written as "skipped", so the files always come back
#                          inside a 10-minute device call (both parts take ~4-5 minutes)
#   KGEN_GIT_COMMIT        the commit measured: bench.json records it (the device copy of the
#                          tree has no .git)
#   OUT                    default bench-out; it receives (8 files, the device tool's limit):
#                          headline/bench.{json,md}, headline/compare.md, matrix/bench.{json,md},
#                          matrix/compare.md, bench.log (both parts' output), env.log
# To make a run the new record, copy PART/bench.json and PART/bench.md over the baseline's
# .json and .md (benchmarks/README.md, "Baselines").
# Exit status: 0 when every part ran clean; 1 when a case FAILED or a kgen kernel is more than
# 10% slower than its baseline; 2 for a usage or set-up problem.
set -uo pipefail

part="${1:-all}"
case "$part" in
    all | headline | matrix) [ $# -gt 0 ] && shift ;;
    -*) part=all ;;
    *) echo "bench_of_record.sh: unknown part '$part': give all, headline or matrix (then kgen bench options)" >&2
       exit 2 ;;
esac

source "$(dirname "$0")/env.sh"
kgen_device_setup bench-out
log="$OUT/bench.log"
: >"$log"
status=0

bench() {  # bench NAME BASELINE ARGS...: one `kgen bench` run into $OUT/NAME, compared with BASELINE
    local name="$1" baseline="$2"
    shift 2
    echo "== bench_of_record.sh: $name" | tee -a "$log"
    python3 -m kgen.bench --out "$OUT/$name" --no-progress --no-plots --time-limit "${KGEN_BENCH_TIME_LIMIT:-150}" \
        --compare "$baseline" "$@" 2>&1 | tee -a "$log"
    local run_status=${PIPESTATUS[0]}
    echo "== bench_of_record.sh: $name exited $run_status" | tee -a "$log"
    [ "$run_status" = 0 ] || [ "$status" = 2 ] || status=$run_status
}

if [ "$part" = all ] || [ "$part" = headline ]; then
    bench headline benchmarks/baselines/h200.json \
        --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4 --kv-dtype bf16,fp8 \
        --batch 64 --prefix 4K,16K --draft 4 "$@"
fi
if [ "$part" = all ] || [ "$part" = matrix ]; then
    bench matrix benchmarks/baselines/h200_matrix.json \
        --layout qwen3_5_gqa256:16,qwen3_5_gqa256:8,qwen3_5_gqa256:4,mla_absorbed_512_64:16 --kv-dtype bf16,fp8 \
        --batch 16,64 --prefix 1K,4K,16K --draft 4 --kernels grouped,per_head "$@"
fi
echo "== bench_of_record.sh: exit $status" | tee -a "$log"
exit "$status"
