#!/usr/bin/env bash
# Table rows A/B on the GPU machine: for each variant table folder (written beforehand by
# benchmarks/table_variant.py and carried), `kgen bench --kernels grouped` with that table
# (KGEN_TABLES_DIR) timed in alternation with the shipped rows (--baseline-tables kgen/tables),
# on the cases the further arguments select. Every variant's bench.md lands in one file, headed by
# the edits its table's metadata records, so any number of variants fits the device tool's 8 files.
#
# Usage, from the repository root:
#   bash benchmarks/device/ab_rows.sh DIR [DIR...] -- KGEN BENCH ARGS...
#   e.g. python benchmarks/table_variant.py --out .exp/s1 --row gqa64:bf16:8:33-96 split.max_splits=1
#        bash benchmarks/device/ab_rows.sh .exp/s1 -- --layout gqa64:8 --kv-dtype bf16 --batch 64 --prefix 16K --draft 4
#
# Environment:
#   AB_TIME_LIMIT    seconds of measurement a variant (kgen bench --time-limit, default 60): cases left
#                    when it runs out are written as "skipped"
#   AB_DRY_RUN=1     print each variant's kgen bench command (with --list: its cases); no GPU
#   KGEN_GIT_COMMIT  the commit measured (the device copy of the tree has no .git)
#   OUT              default ab-out; it receives ab.md (each variant's heading and bench.md, time with
#                    the variant over time with the shipped rows), ab.log (every run's output), env.log
# Exit status: 0 when every variant ran clean; otherwise the last failing run's status; 2 for a
# usage or set-up problem (a folder without a table, no bench arguments).
set -uo pipefail

usage="usage: bash benchmarks/device/ab_rows.sh DIR [DIR...] -- KGEN BENCH ARGS..."
dirs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    dirs+=("$1")
    shift
done
[ $# -gt 0 ] && shift
[ "${#dirs[@]}" -gt 0 ] && [ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
declare -A seen=()
for dir in "${dirs[@]}"; do
    compgen -G "$dir/*.json" >/dev/null || {
        echo "ab_rows.sh: $dir holds no table (ARCH.json); write one with benchmarks/table_variant.py --out $dir" >&2
        exit 2
    }
    name="$(basename "$dir")"
    [ -z "${seen[$name]:-}" ] || {
        echo "ab_rows.sh: $dir and ${seen[$name]} share the name $name, which heads its section of ab.md; rename one" >&2
        exit 2
    }
    seen[$name]="$dir"
done

source "$(dirname "$0")/env.sh"
kgen_device_setup ab-out
report="$OUT/ab.md"
log="$OUT/ab.log"
: >"$report"
: >"$log"
status=0

for dir in "${dirs[@]}"; do
    name="$(basename "$dir")"
    note="$(python3 -c 'import json, sys; [print(json.load(open(p))["metadata"].get("note", "")) for p in sys.argv[1:]]' "$dir"/*.json)"
    cmd=(python3 -m kgen.cli bench --kernels grouped --flex-sweep none --no-plots --no-progress
         --time-limit "${AB_TIME_LIMIT:-60}" --baseline-tables kgen/tables --out "/tmp/ab-rows/$name" "$@")
    echo "== ab_rows.sh: $name: $note" | tee -a "$log"
    if [ "${AB_DRY_RUN:-0}" = 1 ]; then
        echo "KGEN_TABLES_DIR=$dir ${cmd[*]}" | tee -a "$log"
        KGEN_TABLES_DIR="$dir" "${cmd[@]}" --list 2>&1 | grep -E '^  ' | tee -a "$log"
        continue
    fi
    rm -rf "/tmp/ab-rows/$name"  # a failed run must not report an earlier run's bench.md
    KGEN_TABLES_DIR="$dir" "${cmd[@]}" 2>&1 | tee -a "$log"
    run_status=${PIPESTATUS[0]}
    {
        echo "## $name (exit $run_status)"
        echo
        echo "$note"
        echo
        cat "/tmp/ab-rows/$name/bench.md" 2>/dev/null || echo "(no bench.md: see ab.log)"
        echo
    } >>"$report"
    [ "$run_status" = 0 ] || status=$run_status
done
echo "== ab_rows.sh: exit $status" | tee -a "$log"
exit "$status"
