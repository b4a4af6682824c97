#!/usr/bin/env bash
# The kgen grouped kernel against FlashInfer 0.7.2.post1 (its four kgen bench kernels: FA2 and FA3, pages
# of 1 and 16) on the GPU machine, on the cases of record. Int64 kv_indices, shuffled token-slot pool,
# graph replay; BF16 and FP8 KV unless KGEN_BENCH_KV says otherwise.
#   gqa       Qwen3.5 GQA 256, group 16 (L 4, 8, 16) and group 4 (L 4, 16; L 8 comes along), batch 64, prefix 16K
#   mla       absorbed MLA 512+64, group 16, batch 64, prefix 16K, L 4, 8, 16
#   mla_g128  absorbed MLA 512+64, group 128, batch 16, prefix 4K, L 4
#   mla_small absorbed MLA 512+64, group 16, batch 16, prefix 1K, L 4 (a small batch)
#   small     issue 35's cases: GQA 256 group 16 and absorbed MLA group 16 at batches 1, 16 and 64, prefixes 1K
#             and 16K, L 4 (not in `all`; BF16 unless KGEN_BENCH_KV says otherwise)
#   trees     GQA 256 group 16, batch 64, prefix 16K, a random EAGLE tree (--mask tree) of 8, 16 and 64 tokens
#   gqa128    GQA 128 (Llama, Qwen3, MiniMax-M3), groups 8 and 16, batch 64, prefix 16K, L 4, 8, 16
#   gqa64     GQA 64, group 8, batch 64, prefix 16K, L 4, 8, 16
#
# Usage, from the repository root, with .whl/ (the flashinfer and apache-tvm-ffi wheels next to kgen's) and
# .fi-aot/ carried (both from /work/shared/device/flashinfer/fetch.sh; env.sh installs them):
#   KGEN_GIT_COMMIT=<sha> bash benchmarks/device/bench_flashinfer.sh [all|PART[,PART...]] [KGEN BENCH ARGS...]
#   e.g. bash benchmarks/device/bench_flashinfer.sh gqa,mla --replays 30
# The part defaults to all; further arguments go to every `kgen bench` call.
#
# Environment:
#   KGEN_BENCH_TIME_LIMIT  seconds of measurement per part (default 200): cases left when it runs out are
#                          written as "skipped", so two parts come back inside a 10-minute device call
#   KGEN_BENCH_KV          KV dtypes (default bf16,fp8; bf16 for the part small, the record of a BF16 issue)
#   KGEN_BENCH_KERNELS     the kernels of every part (default grouped,flashinfer; e.g. grouped,engines for
#                          SGLang's and vLLM's own Triton kernels, whose engines must be importable there)
#   KGEN_FLASHINFER_JIT    1: let FlashInfer compile kernels it has no prebuilt module for (minutes each);
#                          default: those kernels are reported unsupported with the module's name
#   KGEN_GIT_COMMIT        the commit measured (the device copy of the tree has no .git)
#   OUT                    default bench-out; it receives PART/bench.json and PART/bench.md for each part
#                          run (bench.json alone when more than three parts run in one call: the device tool
#                          returns 8 files; render the tables with `kgen bench --from-json OUT/PART/bench.json
#                          --out DIR`),
#                          bench.log (every part's output) and env.log (it names the flashinfer installed
#                          and how many prebuilt modules it found)
# Exit status: 0 when every part ran clean; 1 when a kgen case FAILED (a FlashInfer kernel's failure is its
# own row, not the case's); 2 for a usage or set-up problem, FlashInfer missing included.
set -uo pipefail

parts_arg="${1:-all}"
case "$parts_arg" in
    -*) parts_arg=all ;;
    *) [ $# -gt 0 ] && shift ;;
esac
[ "$parts_arg" = all ] && parts_arg=gqa,mla,mla_g128,mla_small,trees,gqa128,gqa64
IFS=, read -r -a parts <<<"$parts_arg"
for part in "${parts[@]}"; do
    case "$part" in
        gqa | mla | mla_g128 | mla_small | small | trees | gqa128 | gqa64) ;;
        *) echo "bench_flashinfer.sh: unknown part '$part': give all, or some of" \
               "gqa,mla,mla_g128,mla_small,small,trees,gqa128,gqa64" \
               "(then kgen bench options)" >&2
           exit 2 ;;
    esac
done

source "$(dirname "$0")/env.sh"
kgen_device_setup bench-out
log="$OUT/bench.log"
: >"$log"
status=0
kv="${KGEN_BENCH_KV:-bf16,fp8}"
keep_md=1  # the device tool returns 8 files: two per part and the two logs fit three parts
[ "${#parts[@]}" -le 3 ] || keep_md=0

bench() {  # bench NAME ARGS...: one `kgen bench` run into $OUT/NAME, of the KV dtypes in $kv
    local name="$1"
    shift
    echo "== bench_flashinfer.sh: $name" | tee -a "$log"
    python3 -m kgen.bench --out "$OUT/$name" --no-progress --no-plots --kernels "${KGEN_BENCH_KERNELS:-grouped,flashinfer}" \
        --flex-sweep none --kv-dtype "$kv" --time-limit "${KGEN_BENCH_TIME_LIMIT:-200}" "$@" 2>&1 | tee -a "$log"
    local run_status=${PIPESTATUS[0]}
    [ "$keep_md" = 1 ] || rm -f "$OUT/$name/bench.md"
    echo "== bench_flashinfer.sh: $name exited $run_status" | tee -a "$log"
    [ "$run_status" = 0 ] || [ "$status" = 2 ] || status=$run_status
}

for part in "${parts[@]}"; do
    case "$part" in
        gqa) bench gqa --layout qwen3_5_gqa256:16,qwen3_5_gqa256:4 --batch 64 --prefix 16K --draft 4,8,16 "$@" ;;
        mla) bench mla --layout mla_absorbed_512_64:16 --batch 64 --prefix 16K --draft 4,8,16 "$@" ;;
        mla_g128) bench mla_g128 --layout mla_absorbed_512_64:128 --batch 16 --prefix 4K --draft 4 "$@" ;;
        mla_small) bench mla_small --layout mla_absorbed_512_64:16 --batch 16 --prefix 1K --draft 4 "$@" ;;
        # Issue 35's record is BF16: the part's own default (a call's assignment lasts for that call).
        small) kv="${KGEN_BENCH_KV:-bf16}" bench small --layout qwen3_5_gqa256:16,mla_absorbed_512_64:16 \
                   --batch 1,16,64 --prefix 1K,16K --draft 4 "$@" ;;
        trees) bench trees --layout qwen3_5_gqa256:16 --batch 64 --prefix 16K --draft 8,16,64 --mask tree "$@" ;;
        gqa128) bench gqa128 --layout gqa128:8,gqa128:16 --batch 64 --prefix 16K --draft 4,8,16 "$@" ;;
        gqa64) bench gqa64 --layout gqa64:8 --batch 64 --prefix 16K --draft 4,8,16 "$@" ;;
    esac
done
echo "== bench_flashinfer.sh: exit $status" | tee -a "$log"
exit "$status"
