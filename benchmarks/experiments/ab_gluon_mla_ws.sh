#!/usr/bin/env bash
# The spike of benchmarks/experiments/gluon_mla_ws.py against the shipped Gluon prefix stage, by
# `kgen bench --baseline-modules` (graph replay, int64 kv_indices, shuffled token-slot pool, both
# checked against the float32 reference): for each variant, a copy of the BF16 MLA module that
# installs the spike is the "baseline" side, so the ratio is shipped / spike.
# Usage, from the repository root on the GPU machine: bash benchmarks/experiments/ab_gluon_mla_ws.sh VARIANT...
# where VARIANT is name:block_n:num_stages:qk_ahead:producer_regs (e.g. ws64:64:2:0:40).
set -uo pipefail
source benchmarks/device/env.sh
kgen_device_setup bench-out
module=verify_mla_absorbed_512_64__kv_bf16__q_bf16
cases=(--layout mla_absorbed_512_64:16 --batch 64 --prefix 16K --draft 4,8 --kv-dtype bf16)
for variant in "$@"; do
    IFS=: read -r name block_n stages ahead regs <<<"$variant"
    dir=".ab/$name"
    mkdir -p "$dir"
    cp "generated/$module.py" "$dir/$module.py"
    cat >>"$dir/$module.py" <<PY

import sys as _sys
_sys.path.insert(0, "benchmarks/experiments")
import gluon_mla_ws as _spike
_spike.install(_sys.modules[__name__], block_n=$block_n, num_stages=$stages, qk_ahead=bool($ahead),
               producer_regs=$regs)
PY
    echo "== ab_gluon_mla_ws.sh: $variant" | tee -a "$OUT/ab.log"
    timeout "${KGEN_AB_TIMEOUT:-150}" python3 -m kgen.bench --out "$OUT/$name" --no-progress --no-plots --kernels grouped --flex-sweep none \
        --precompile-workers 0 --replays 10 --time-limit 100 --baseline-modules "$dir" "${cases[@]}" \
        2>&1 | tail -n 25 | tee -a "$OUT/ab.log"
    rm -f "$OUT/$name/bench.md"
done
