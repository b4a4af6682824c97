#!/usr/bin/env bash
# Set up a development environment for kgen in the active Python (a fresh virtual environment,
# say): what the README's Quick start runs and what .ci/run runs in each of its venvs, so the
# two cannot drift apart. It installs
#   1. torch 2.13.0, the CPU build (skipped with --keep-torch, e.g. on a GPU machine);
#   2. Triton: --triton VERSION pinned exactly, else the newest release inside pyproject's range;
#   3. kgen itself, editable, with the extras the test suite and the tools use;
#   4. the engines the integration tests drive: SGLang's and vLLM's pinned releases and the CPU
#      packages their imported modules need, all with --no-deps (.ci/engines/*.txt), so no CUDA
#      build of anything is pulled in (skipped with --no-engines; those tests then skip).
# Generating the kernels is a separate step: `kgen build`.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'EOF'
usage: scripts/setup-dev.sh [--triton VERSION] [--keep-torch] [--no-engines]

Installs kgen for development into the active Python (`python -m pip`).
  --triton VERSION  pin Triton exactly (CI runs 3.6.0 and 3.9.0); default: the newest in range
  --keep-torch      keep the installed torch (a GPU machine's CUDA build); default: torch==2.13.0 (CPU)
  --no-engines      leave out SGLang and vLLM (their integration tests then skip)
EOF
}

triton_pin=""
keep_torch=0
engines=1
while [ $# -gt 0 ]; do
    case "$1" in
        --triton) [ $# -ge 2 ] || { usage >&2; exit 2; }; triton_pin="$2"; shift 2 ;;
        --keep-torch) keep_torch=1; shift ;;
        --no-engines) engines=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup-dev.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

pip_install() { python -m pip install -q "$@"; }

t0=$(date +%s)
# torch first: 2.13.0 is the CPU build on the package index's disk; an open range would pull a
# multi-GB CUDA build, and the CPU build of torch does not pull Triton.
if [ "$keep_torch" = 0 ]; then pip_install torch==2.13.0; fi
if [ -n "$triton_pin" ]; then pip_install "triton==$triton_pin"; fi
# numpy comes from the test extra (its bound keeps Triton 3.6's interpreter working).
pip_install -e ".[test,tune,bench,postgres]"
if [ "$engines" = 1 ]; then
    for pins in .ci/engines/*.txt; do pip_install --no-deps -r "$pins"; done
fi
echo "setup-dev: torch $(python -c 'import torch; print(torch.__version__)')," \
     "triton $(python -c 'import triton; print(triton.__version__)')," \
     "numpy $(python -c 'import numpy; print(numpy.__version__)')," \
     "engines $([ "$engines" = 1 ] && echo installed || echo 'left out') in $(( $(date +%s) - t0 ))s"
