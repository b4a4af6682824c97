#!/usr/bin/env bash
# `kgen tune` jobs on the GPU machine, one after another, each under its own time limit; then
# `kgen build`, so that a script run after this one in the same call uses the new rows. The
# tables it wrote come back in $OUT: commit them with `kgen build`'s output (docs/tuning.md).
#
# Usage, from the repository root:
#   bash benchmarks/device/tune.sh JOB [JOB...]
#   JOB = LAYOUT:KV:GROUP:BUCKET[,BUCKET...]   (names as `kgen tune` takes them), e.g.
#   STUDY_S=45 bash benchmarks/device/tune.sh qwen3_5_gqa256:bf16:8:b33-96 mla_absorbed_512_64:bf16:16:b9-32,b33-96
#   KGEN_TABLE=/tmp/candidates.json bash benchmarks/device/tune.sh qwen3_5_gqa256:fp8:8:b33-96
#   TUNE_DRY_RUN=1 bash benchmarks/device/tune.sh qwen3_5_gqa256:bf16:8:b33-96   # the plan only, no GPU
#
# Environment:
#   STUDY_S        each study's search time in seconds (`kgen tune --timeout`, default 45). A job
#                  is stopped with SIGINT after STUDY_S + 45 + FIT_S s per bucket (twice that for
#                  MLA, whose kernels take seconds each to compile); the tuner then finishes the
#                  running trial and writes what it has
#   FIT_S          seconds a bucket's fit check may add (default 120: the winner's programs over
#                  the whole domain, compiled offline; docs/tuning.md, "Choosing the winner")
#   TUNE_DRAFTS    draft lengths every bucket is timed at (`kgen tune --draft-tokens`, e.g. 4,16);
#                  default: the workloads file's
#   KGEN_TABLE     a table whose rows are offered as the current configs: kgen tune times them
#                  next to the default and its own best and keeps whichever wins beyond noise
#                  (docs/tuning.md, "Offering candidate configs")
#   TUNE_ARCH      the arch of a dry run (default sm_90); a real run tunes the GPU it finds
#   TUNE_DRY_RUN=1 print the space, workloads and study names of each job; no GPU, no writes
#   OUT            default tune-out: tune.log (every job's output), <arch>.json (each table
#                  the jobs wrote), env.log
#   KGEN_GIT_COMMIT  the commit tuned, recorded in env.log
# Exit status: 0 when every job and the build ran; otherwise the last failing step's status;
# 2 for a malformed JOB or a failed set-up.
set -uo pipefail

usage="usage: bash benchmarks/device/tune.sh LAYOUT:KV:GROUP:BUCKET[,BUCKET...] [...]"
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
for job in "$@"; do
    if ! [[ "$job" =~ ^[A-Za-z0-9_]+:[A-Za-z0-9_]+:[0-9]+:[A-Za-z0-9+-]+(,[A-Za-z0-9+-]+)*$ ]]; then
        echo "tune.sh: '$job' is not LAYOUT:KV:GROUP:BUCKET[,BUCKET...] (e.g. qwen3_5_gqa256:bf16:8:b33-96)" >&2
        echo "$usage" >&2
        exit 2
    fi
done

source "$(dirname "$0")/env.sh"
kgen_device_setup tune-out
STUDY_S="${STUDY_S:-45}"
FIT_S="${FIT_S:-120}"
log="$OUT/tune.log"
status=0

for job in "$@"; do
    IFS=: read -r layout kv group buckets <<<"$job"
    bucket_args=()
    limit=0
    for bucket in ${buckets//,/ }; do
        bucket_args+=(--bucket "$bucket")
        limit=$((limit + STUDY_S + 45 + FIT_S))
    done
    case "$layout" in mla*) limit=$((limit * 2)) ;; esac
    args=(--no-progress --timeout "$STUDY_S" --layout "$layout" --kv-dtype "$kv" --group "$group" "${bucket_args[@]}")
    [ -z "${TUNE_DRAFTS:-}" ] || args+=(--draft-tokens "$TUNE_DRAFTS")
    echo "== tune.sh: $job${KGEN_TABLE:+ (candidates: $KGEN_TABLE)}" | tee -a "$log"
    if [ "${TUNE_DRY_RUN:-0}" = 1 ]; then
        python3 -m kgen.cli tune --dry-run --arch "${TUNE_ARCH:-sm_90}" "${args[@]}" 2>&1 | tee -a "$log"
    else
        timeout -s INT "$limit" python3 -m kgen.cli tune "${args[@]}" 2>&1 | tee -a "$log"
    fi
    job_status=${PIPESTATUS[0]}
    [ "$job_status" = 0 ] || { echo "== tune.sh: $job exited $job_status" | tee -a "$log"; status=$job_status; }
done

if [ "${TUNE_DRY_RUN:-0}" != 1 ]; then
    python3 -m kgen.cli build 2>&1 | tail -n 3 | tee -a "$log"
    build_status=${PIPESTATUS[0]}
    [ "$build_status" = 0 ] || status=$build_status
    # The tables the jobs wrote: newer than env.log, which the set-up wrote before them.
    find kgen/tables -name '*.json' ! -name defaults.json -newer "$OUT/env.log" -exec cp {} "$OUT/" \;
fi
echo "== tune.sh: exit $status" | tee -a "$log"
exit "$status"
