"""Exhaustive grid against TPE on one layout, for docs/tuning.md.

Step 1 (GPU): ``--measure OUT.json`` times every config of a small grid with the tuner's
own GPU backend (same check, same CUDA-graph timing, same workloads as ``kgen tune``).
Step 2 (CPU): ``--replay OUT.json`` runs kgen's TPE sampler (``kgen.tuner.study.make_sampler``,
default config enqueued first, as ``kgen tune`` does) against the *measured* times, for many
seeds, and reports how many trials it needed to come within 3% of the grid's best.
Replaying measured costs lets the comparison use many seeds without more GPU time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

GRID = {
    "block_n": [16, 32, 64],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
    "programs_per_sm": [1, 2, 4],
    "min_tokens_per_split": [128],
}
LAYOUT, KV, GROUP, BUCKET = "qwen3_5_gqa256", "bfloat16", 16, "b33-96"


def grid_configs() -> list[dict]:
    out = []
    for bn, w, st, ppsm, mt in itertools.product(*GRID.values()):
        out.append({"block_h": 16, "block_n": bn, "num_warps": w, "num_stages": st,
                    "split": {"programs_per_sm": ppsm, "max_splits": 64, "min_tokens_per_split": mt}})
    return out


def key(cfg: dict) -> str:
    s = cfg["split"]
    return f"{cfg['block_n']}/{cfg['num_warps']}/{cfg['num_stages']}/{s['programs_per_sm']}/{s['min_tokens_per_split']}"


def measure(out: Path, budget_s: float) -> int:
    from kgen.blockconfig import BlockConfig
    from kgen.spec import load_layouts
    from kgen.tuner.gpu import GpuBackend, detect_device, load_module
    from kgen.tuner.workloads import load_workloads

    wl = load_workloads()
    bucket = wl.bucket_named(BUCKET)
    spec = load_layouts()[LAYOUT]
    dev = detect_device()
    backend = GpuBackend(load_module(LAYOUT, KV, "bfloat16"), dev.arch, spec, KV, "bfloat16", GROUP, 1,
                         wl.workloads(bucket), wl.check, wl.timing, l2_bytes=dev.l2_bytes)
    results, start = {}, time.time()
    for i, cfg in enumerate(grid_configs()):
        if time.time() - start > budget_s:
            print(f"budget reached after {i} configs", flush=True)
            break
        bc = BlockConfig.model_validate(cfg)
        try:
            wrong = backend.check(bc)
            results[key(cfg)] = None if wrong else backend.measure(bc)
        except Exception as exc:  # noqa: BLE001 - a failing config is recorded as infeasible
            print(f"{key(cfg)}: {exc!r}"[:200], flush=True)
            results[key(cfg)] = None
        print(f"{i:3d} {key(cfg):18s} {results[key(cfg)]}", flush=True)
    out.write_text(json.dumps({"layout": LAYOUT, "kv": KV, "group": GROUP, "bucket": BUCKET, "gpu": dev.name,
                               "grid": GRID, "us": results}, indent=1))
    return 0


def replay(path: Path, seeds: int, within: float) -> int:
    import optuna

    from kgen.tuner.study import make_sampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    data = json.loads(path.read_text())
    costs = {k: v for k, v in data["us"].items() if v is not None}
    best = min(costs.values())
    n_grid = len(data["us"])
    target = best * (1 + within)
    default = "32/4/3/1/128"
    needed = []
    for seed in range(seeds):
        study = optuna.create_study(sampler=make_sampler(seed))
        bn, w, st, pp, mt = (int(x) for x in default.split("/"))
        study.enqueue_trial({"block_n": bn, "num_warps": w, "num_stages": st, "programs_per_sm": pp,
                             "min_tokens_per_split": mt})
        hit = None
        for n in range(1, n_grid + 1):
            trial = study.ask({name: optuna.distributions.CategoricalDistribution(vals)
                               for name, vals in data["grid"].items()})
            k = "/".join(str(trial.params[a]) for a in data["grid"])
            cost = data["us"].get(k)
            if cost is None:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, cost)
                if cost <= target and hit is None:
                    hit = n
            if hit:
                break
        needed.append(hit or n_grid)
    print(f"grid: {n_grid} configs, {len(costs)} valid, best {best:.1f} us "
          f"({min(costs, key=costs.get)}), default {data['us'].get(default)} us")
    print(f"TPE over {seeds} seeds: trials to within {within:.0%} of the grid's best: "
          f"median {statistics.median(needed)}, p90 {sorted(needed)[int(0.9 * (seeds - 1))]}, max {max(needed)} "
          f"(= {statistics.median(needed) / n_grid:.0%} / {max(needed) / n_grid:.0%} of the grid)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", type=Path, help="GPU: time the grid, write JSON here")
    ap.add_argument("--budget", type=float, default=240, help="seconds for --measure")
    ap.add_argument("--replay", type=Path, help="CPU: replay TPE against a measured grid")
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--within", type=float, default=0.03)
    args = ap.parse_args()
    if args.measure:
        return measure(args.measure, args.budget)
    if args.replay:
        return replay(args.replay, args.seeds, args.within)
    ap.error("give --measure or --replay")
    return 2


if __name__ == "__main__":
    sys.exit(main())
