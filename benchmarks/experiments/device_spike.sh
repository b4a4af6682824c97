#!/usr/bin/env bash
# One device call for the spike (benchmarks/experiments/gluon_mla_ws.py): its parity under the
# Gluon stage's gpu tests (tests/test_gpu_gluon.py with spike_plugin), then its A/B against the
# shipped Gluon stage (ab_gluon_mla_ws.sh). Logs under $OUT.
# Usage: bash benchmarks/experiments/device_spike.sh "QK_AHEAD..." VARIANT...
set -uo pipefail
source benchmarks/device/env.sh
kgen_device_setup bench-out
export PYTHONPATH="$PWD/benchmarks/experiments:$PYTHONPATH"
aheads="$1"; shift
for ahead in $aheads; do
    echo "== parity, QK_AHEAD=$ahead" | tee -a "$OUT/parity.log"
    KGEN_SPIKE_QK_AHEAD=$ahead KGEN_TEST_ON_GPU=1 timeout "${KGEN_PARITY_TIMEOUT:-170}" python3 -m pytest -q -m gpu \
        -p spike_plugin tests/test_gpu_gluon.py -n 8 --dist loadgroup -x 2>&1 | tail -n 30 | tee -a "$OUT/parity.log"
done
[ $# -gt 0 ] && bash benchmarks/experiments/ab_gluon_mla_ws.sh "$@"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee -a "$OUT/parity.log"
