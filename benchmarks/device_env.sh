# Sourced by the benchmarks/h200_*.sh device scripts, from the repository root: the wheels
# carried in .whl/ (the GPU image has no optuna or pydantic) go to /tmp/kgen-site, and the
# checkout and that folder go on PYTHONPATH. Exits the calling script if pip fails.
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/kgen-site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kgen-site \
    .whl/*.whl || exit 2
