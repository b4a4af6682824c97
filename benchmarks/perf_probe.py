"""Quick GPU probe for kernel work: parity at real sizes, then the time of the table's config
(and, for the cases given to --sweep, of a small grid of block configs) against the copy
ceiling and the per-head kernel, on nine fixed cases (CASES: GQA 256 groups 16/8/4, FP8, the
latency case, MLA, GQA 128).

Not the benchmark of record (`kgen bench`, benchmarks/device/bench_of_record.sh): one input
set per case, so small cases run from L2. Usage on a GPU machine, from the repository root:
  python3 benchmarks/perf_probe.py [--only 0 5] [--sweep 0] [--out DIR]
--only and --sweep take indices into CASES; DIR (default $OUT, else .) receives perf_probe.log.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton

import kgen
from kgen.bench.cases import Case
from kgen.bench.cases import min_bytes as bench_min_bytes
from kgen.bench.timing import bench_copy_ceiling_gbps
from kgen.problems import make_case
from kgen.reference import relative_error
from kgen.spec import load_layouts

SPECS = load_layouts()


def min_bytes(layout, kv, group, batch, prefix, draft) -> int:
    """The benchmark's byte count (kgen.bench.cases): prefix KV once, plus q, draft K/V and o."""
    a = SPECS[layout].attention
    return bench_min_bytes(Case(layout=layout, group=group, kv_dtype=kv, batch=batch, prefix=prefix, draft=draft,
                                qk_dim=a.qk_dim, v_dim=a.v_head_dim, separate_v=a.v_source != "k_latent")).total


def time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    try:
        ms = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    except Exception:  # noqa: BLE001 - fall back to plain events
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return ms * 1e3


CASES = [
    # layout, kv, group, batch, prefix, L
    ("qwen3_5_gqa256", "bfloat16", 16, 64, 16384, 4),
    ("qwen3_5_gqa256", "bfloat16", 8, 64, 16384, 4),
    ("qwen3_5_gqa256", "bfloat16", 4, 64, 16384, 4),
    ("qwen3_5_gqa256", "bfloat16", 16, 64, 4096, 4),
    ("qwen3_5_gqa256", "float8_e4m3fn", 16, 64, 16384, 4),
    ("qwen3_5_gqa256", "bfloat16", 16, 16, 1024, 4),
    ("mla_absorbed_512_64", "bfloat16", 16, 64, 16384, 4),
    ("mla_absorbed_512_64", "float8_e4m3fn", 16, 64, 16384, 4),
    ("gqa128", "bfloat16", 8, 64, 16384, 4),
]

SWEEP = {
    "block_n": [32, 64],
    "num_warps": [4, 8],
    "num_stages": [2, 3],
    "programs_per_sm": [1, 2, 4],
}


def run_case(layout, kv, group, batch, prefix, L, ceiling, sweep, log):
    spec = SPECS[layout]
    fp8 = "float8" in kv
    case = make_case(spec, [prefix] * batch, [L] * batch, group, kv_dtype=kv, device="cuda",
                     k_scale=0.7 if fp8 else 1.0, v_scale=1.3 if fp8 else 1.0, seed=batch + prefix)
    mod = kgen.load(layout, kv)
    per_head = kgen.load(layout, kv, variant="per_head")
    # Parity on the first two requests (reference is slow at full size).
    assert mod.verify_shared_kv_fwd(*case.sglang_args()), mod.why_not(*case.sglang_args())
    sub = make_case(spec, [prefix, prefix // 3 + 5], [L, max(1, L - 1)], group, kv_dtype=kv, device="cuda",
                    k_scale=case.k_scale, v_scale=case.v_scale, seed=7)
    assert mod.verify_shared_kv_fwd(*sub.sglang_args())
    ref = sub.reference()
    err = relative_error(sub.o.float(), ref)
    ref_err = relative_error(ref.to(sub.o.dtype).float(), sub.reference(torch.float64))
    nbytes = min_bytes(layout, kv, group, batch, prefix, L)
    floor_us = nbytes / (ceiling * 1e9) * 1e6
    rows = []
    configs = [None]
    if sweep:
        for bn, w, st, ppsm in itertools.product(*SWEEP.values()):
            configs.append({"block_h": 16, "block_n": bn, "num_warps": w, "num_stages": st,
                            "split": {"programs_per_sm": ppsm, "max_splits": 64, "min_tokens_per_split": 256}})
    for cfg in configs:
        try:
            us = time_us(lambda c=case, k=cfg: mod.launch(*c.launch_args(), config=k))
        except Exception as exc:  # noqa: BLE001
            log.write(f"{layout} {kv} g{group} b{batch} p{prefix} L{L} cfg={cfg} FAILED {exc!r}\n")
            continue
        rows.append((us, cfg))
    rows.sort(key=lambda r: r[0])
    best_us, best_cfg = rows[0]
    default_us = [us for us, c in rows if c is None][0]
    ph_us = time_us(lambda c=case: per_head.launch(*c.launch_args()))
    rec = dict(layout=layout, kv=kv, group=group, batch=batch, prefix=prefix, L=L, err=err, ref_err=ref_err,
               bytes=nbytes, floor_us=floor_us, default_us=default_us, best_us=best_us, best_cfg=best_cfg,
               per_head_us=ph_us, pct_ceiling=100 * floor_us / best_us)
    log.write(json.dumps(rec) + "\n")
    for us, cfg in rows[:5]:
        log.write(f"   {us:9.1f} us  {cfg}\n")
    log.flush()
    del case
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sweep", type=int, nargs="*", default=[], help="case indices to sweep configs on")
    ap.add_argument("--only", type=int, nargs="*")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    ceiling = bench_copy_ceiling_gbps()
    print(f"GPU {torch.cuda.get_device_name()} copy ceiling {ceiling:.0f} GB/s", flush=True)
    log = open(os.path.join(args.out, "perf_probe.log"), "w")
    recs = []
    for i, c in enumerate(CASES):
        if args.only and i not in args.only:
            continue
        t = time.time()
        recs.append(run_case(*c, ceiling, i in args.sweep, log))
        print(f"case {i} done in {time.time() - t:.0f}s", flush=True)
    print(f"{'case':48s} {'err':>7s} {'referr':>7s} {'floor':>7s} {'dflt':>7s} {'best':>7s} {'%ceil':>6s} "
          f"{'perhead':>8s} {'x':>5s}")
    for r in recs:
        name = f"{r['layout']} {r['kv'][:5]} g{r['group']} b{r['batch']} p{r['prefix']} L{r['L']}"
        print(f"{name:48s} {r['err']:7.4f} {r['ref_err']:7.4f} {r['floor_us']:7.1f} {r['default_us']:7.1f} "
              f"{r['best_us']:7.1f} {r['pct_ceiling']:6.1f} {r['per_head_us']:8.1f} "
              f"{r['per_head_us'] / r['best_us']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
