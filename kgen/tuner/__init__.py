"""``kgen tune``: the Optuna autotuner of block configs (see docs/tuning.md).

Modules, from data to decisions:

- ``space``: the search space per arch family, read from ``spaces.toml``; before anything
  is compiled, prunes every config the launch rules (``kgen/launcher/rules.py``, against the arch's
  row of ``kgen/tables/targets.json``) would change or cannot fit;
- ``workloads``: batch buckets and their timed workloads, read from ``workloads.toml``;
- ``objective``: the Optuna objective around an injectable backend (``check`` + ``measure``)
  and ``SyntheticBowl``, a deterministic backend with a known optimum for tests;
- ``gpu``: the real backend: the generated module's kernels, checked against the reference,
  timed by ``kgen.bench.timing.CudaGraphTimer`` over inputs rotated beyond L2;
- ``job``: ``TuneJob``, what one study tunes (its table key and workloads);
- ``study``: study names, storage (SQLite in the cache dir or any RDB URL), resuming,
  budgets and worker processes;
- ``results``: re-measurement, the tuned-vs-default decision, and merging into the table;
- ``report``: ``kgen tune --report``: per study, the trials of each worker and GPU, lost
  or twice-measured trials and the table writes, read back from the storage;
- ``cli``: ``add_tune_parser`` / ``run_tune`` for the main CLI.

Nothing here imports torch at import time: dry runs and the synthetic objective run
without it.
"""
