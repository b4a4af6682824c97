#!/usr/bin/env bash
# The gpu-marked tests on the GPU machine (`pytest -m gpu` with KGEN_TEST_ON_GPU=1): parity
# against the float32 reference at real sizes with the shipped table rows, CUDA-graph
# replay, the tuner's GPU backend, the experiments' kernels.
#
# Usage, from the repository root:
#   bash benchmarks/device/gpu_tests.sh                      # every gpu-marked test under tests/
#   bash benchmarks/device/gpu_tests.sh tests/test_gpu.py -k "parity_real_sizes or graph"
# Arguments replace `tests/` and go to pytest as given (add -s to see what the tests print).
# On a fresh H100 the whole suite with -n 16 outgrew one 10-minute device call (stopped by a 570 s
# limit at about 1250 tests, 2026-12-06; the sweep alone passed 400 s at about 860 of its 975 on
# 2026-12-07): run it in parts, one call each, and quote every part's closing line, e.g. three
# calls of `bash benchmarks/device/gpu_tests.sh tests/ -n 16 --dist loadgroup --splits 3 --group I`
# (I = 1, 2, 3: pytest-split's fixed parts, about 410 tests each; its wheel travels in .whl/).
#
# Environment:
#   OUT                 where the logs go (default gpu-tests-out): gpu_tests.log (pytest's whole
#                       output) and env.log (benchmarks/device/env.sh)
#   GPU_TESTS_TIMEOUT   seconds before pytest is stopped (default 400), so the log comes back
#                       inside a 10-minute device call
#   KGEN_GIT_COMMIT     the commit under test, recorded in env.log
# Exit status: pytest's; 124 when the time limit stopped it; 2 when the set-up failed.
set -uo pipefail
source "$(dirname "$0")/env.sh"
kgen_device_setup gpu-tests-out

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tests/)
KGEN_TEST_ON_GPU=1 timeout "${GPU_TESTS_TIMEOUT:-400}" python3 -m pytest -q -m gpu "${targets[@]}" 2>&1 \
    | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
echo "== gpu_tests.sh: exit $status" | tee -a "$OUT/gpu_tests.log"
exit "$status"
