# Shared set-up of the device scripts in benchmarks/device/: sourced, never run. Each script
# calls `kgen_device_setup DEFAULT_OUT` first; that function
#   - refuses to run outside the repository root (the scripts put $PWD on PYTHONPATH);
#   - installs the wheels carried in $KGEN_WHEEL_DIR (default .whl/; the GPU image has no pydantic, optuna or
#     SQLAlchemy; benchmarks/README.md lists them) into /tmp/kgen-site;
#   - when flashinfer is among them (the FlashInfer peer of kgen bench), copies the prebuilt sm_90a
#     kernels carried in $KGEN_FLASHINFER_AOT (default .fi-aot/) into its data/aot/, where FlashInfer
#     loads them instead of compiling (benchmarks/README.md, "FlashInfer");
#   - puts the checkout and /tmp/kgen-site on PYTHONPATH and sets PYTHONUNBUFFERED=1, so the
#     logs hold everything printed up to a time limit's kill;
#   - sets KGEN_CACHE_DIR (the tuner's study database) to /tmp/kgen-cache unless given, so
#     the database never counts against what $OUT may send back;
#   - makes $OUT (default DEFAULT_OUT) and writes $OUT/env.log: date, host, GPU, torch and
#     Triton versions, and the commit.
# The commit: the device tool copies the tree without its .git, so pass KGEN_GIT_COMMIT=<sha>
# (kgen bench records it in bench.json next to source_digest, a hash of the code that ran).
# Any failure here exits the calling script with status 2.

kgen_device_setup() {
    local default_out="$1"
    if [ ! -f kgen/__init__.py ] || [ ! -d benchmarks/device ]; then
        echo "benchmarks/device: run the script from the repository root (cd to it first), not from $PWD" >&2
        exit 2
    fi
    export OUT="${OUT:-$default_out}"
    mkdir -p "$OUT" || { echo "benchmarks/device: cannot create OUT=$OUT" >&2; exit 2; }
    export PYTHONUNBUFFERED=1
    export PYTHONPATH="$PWD:/tmp/kgen-site${PYTHONPATH:+:$PYTHONPATH}"
    export KGEN_CACHE_DIR="${KGEN_CACHE_DIR:-/tmp/kgen-cache}"
    local wheels="${KGEN_WHEEL_DIR:-.whl}"
    if compgen -G "$wheels/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/kgen-site "$wheels"/*.whl \
            || { echo "benchmarks/device: installing the wheels of $wheels/ failed (see pip's message above)" >&2; exit 2; }
    fi
    kgen_flashinfer_aot /tmp/kgen-site
    local commit="${KGEN_GIT_COMMIT:-}"
    if [ -z "$commit" ]; then
        commit="$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown: pass KGEN_GIT_COMMIT=<sha>')"
    fi
    {
        echo "== $(date -u +%FT%TZ) on $(hostname), commit $commit"
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader \
            2>/dev/null || echo "nvidia-smi: not available"
        python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
                    "cuda", torch.cuda.is_available())'
        if [ -d /tmp/kgen-site/flashinfer ]; then
            python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__, flashinfer.__file__)' 2>&1 | tail -n 1
            echo "flashinfer prebuilt modules: $(find /tmp/kgen-site/flashinfer/data/aot -name '*.so' 2>/dev/null | wc -l)"
        fi
    } 2>&1 | tee "$OUT/env.log"
}

# kgen_flashinfer_aot SITE: FlashInfer's prebuilt kernels (fetched by /work/shared/device/flashinfer/fetch.sh
# next to its wheel) copied into SITE/flashinfer/data/aot/, where the flashinfer installed in SITE looks for
# them. No $KGEN_FLASHINFER_AOT folder carried: nothing to do.
kgen_flashinfer_aot() {
    local site="$1" aot="${KGEN_FLASHINFER_AOT:-.fi-aot}"
    [ -d "$aot" ] || return 0
    if [ ! -d "$site/flashinfer" ]; then
        echo "benchmarks/device: $aot/ is here but no flashinfer wheel was installed from ${KGEN_WHEEL_DIR:-.whl}/:" \
            "the FlashInfer peer will not run" >&2
        return 0
    fi
    mkdir -p "$site/flashinfer/data/aot" && cp -r "$aot"/. "$site/flashinfer/data/aot/" \
        || { echo "benchmarks/device: copying $aot/ into flashinfer's data/aot/ failed" >&2; exit 2; }
}
