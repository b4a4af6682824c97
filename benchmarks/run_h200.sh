#!/usr/bin/env bash
# The whole `kgen bench` on one H200 in one call; everything it leaves is in $OUT:
#   bench.json  bench.md  bandwidth.png  speedup.png  bench.log  [compare.md]   (<= 8 files)
#
# Run from the repository root on the GPU machine, with the wheels of .whl/ carried along
# (the GPU image has no pydantic), e.g. through the device tool:
#   KGEN_GIT_COMMIT=<sha> bash benchmarks/run_h200.sh            # full matrix (384 cases)
#   KGEN_GIT_COMMIT=<sha> bash benchmarks/run_h200.sh --quick    # 32 cases
# Extra arguments go to `kgen bench`. KGEN_BENCH_TIME_LIMIT (seconds, default 420) bounds the
# measurement: cases left after it are written as "skipped", so the files always come back
# inside the device's 10-minute command limit. When benchmarks/baselines/h200.json exists the
# run is compared with it (exit 1 on a >10% kgen slowdown or a FAILED case).
set -uo pipefail

OUT="${OUT:-bench-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kgen-site .whl/*.whl || exit 2
    export PYTHONPATH="$PYTHONPATH:/tmp/kgen-site"
fi

{
    echo "== $(date -u +%FT%TZ) kgen bench on $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
    python3 -c 'import torch, triton, pydantic; print("torch", torch.__version__, "triton", triton.__version__, "pydantic", pydantic.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$OUT/bench.log"

compare=()
if [ -f benchmarks/baselines/h200.json ]; then
    compare=(--compare benchmarks/baselines/h200.json)
fi

python3 -m kgen.bench --out "$OUT" --no-progress \
    --time-limit "${KGEN_BENCH_TIME_LIMIT:-420}" "${compare[@]}" "$@" 2>&1 | tee -a "$OUT/bench.log"
status=${PIPESTATUS[0]}
echo "== exit $status" | tee -a "$OUT/bench.log"
exit "$status"
