"""Where a small call's time goes: the grouped kernel's whole call, its prefix stage alone, its merge
stage alone, and empty launches, each timed as `kgen bench` times a call (CUDA-graph replays of
rotated input sets that read K/V from HBM, engine inputs: int64 kv_indices into a shuffled
token-slot pool).

- **call**: `module.launch`, as shipped.
- **prefix alone**: the same call with the merge launch skipped (its output is wrong on purpose).
- **merge alone**: the same call with the prefix launch skipped, the merge reading the partials
  an earlier call left (wrong output on purpose).
- **empty**: as many one-program kernels that do nothing as the call launches, plainly (no
  programmatic dependent launch, unlike the stages): the graph's cost of a launch that does no work.

call - prefix alone is what the merge launch adds to the call. `launches` is 1 where the call
has no merge launch: a grid without splits, or a row whose merge runs in a cluster inside the
prefix stage (`split.merge: "cluster"`); there "prefix alone" holds the merge too. `mode` is
`graph`, or `eager` where capture failed (launch overhead included). Not the benchmark of record
(`kgen bench`); a probe for issue 35's latency cases. On the GPU machine, from the repository root:

    python3 benchmarks/stage_times.py --layout qwen3_5_gqa256:16,mla_absorbed_512_64:16 --batch 1,16 \\
        --prefix 1K,4K --draft 4 --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

import kgen
from kgen.bench.cases import (
    HEADLINE_KERNEL,
    case_for,
    input_sets,
    parse_kv_dtypes,
    parse_layout_groups,
    parse_sizes,
    split_list,
)
from kgen.bench.inputs import build_inputs
from kgen.bench.peers import device_facts, kgen_run
from kgen.bench.timing import CudaGraphTimer
from kgen.spec import load_layouts


@triton.jit
def _empty_kernel(x_ptr):
    """Does nothing that can be seen (a never-true store keeps it a real launch)."""
    if tl.program_id(0) < 0:
        tl.store(x_ptr, 0)


@contextlib.contextmanager
def skipping(launcher: Any, stage: str) -> Iterator[None]:
    """``launcher`` (a generated module's VerifyLauncher) with one stage's launch made a no-op, for
    the ``with`` block: ``merge`` or ``prefix`` (the Triton prefix stage and every other lowering's)."""
    patched: list[Any] = []
    if stage == "merge":
        launcher.launch_merge = lambda *args, **kwargs: None
        patched.append(launcher)
    else:
        launcher.launch_triton_prefix = lambda *args, **kwargs: True
        patched.append(launcher)
        for lowering in launcher.prefix_lowerings.values():
            lowering.launch = lambda *args, **kwargs: None
            patched.append(lowering)
    try:
        yield
    finally:
        for owner in patched:  # the instance attributes go: the class's methods show again
            for name in ("launch_merge", "launch_triton_prefix", "launch"):
                owner.__dict__.pop(name, None)


def launch_count(module: Any, case: Any, device: torch.device) -> int:
    """Kernels one call launches (the prefix stage, and the merge where the grid has splits)."""
    arch, num_sms = device_facts(device)
    return max(1, len(module.launch_params(arch, num_sms, case.group, case.batch, case.draft,
                                           num_kv_heads=case.kv_heads)))


def time_case(layout: str, group: int, kv_dtype: str, batch: int, prefix: int, draft: int,
              timer: CudaGraphTimer, l2_bytes: int) -> dict[str, Any]:
    """One case's figures, µs (medians of graph replays); ``kv_dtype`` canonical (``bfloat16`` ...).
    As kgen bench, the input sets rotated pass twice ``l2_bytes`` (the device's L2), so every launch
    reads its K/V from HBM."""
    case = case_for(load_layouts()[layout], group, kv_dtype, batch, prefix, draft)
    inputs = build_inputs(case, "cuda", input_sets(case, l2_bytes))
    module = kgen.load(layout, kv_dtype=kv_dtype)  # the module kgen bench's launch calls (one a process)
    run = kgen_run(case, inputs, HEADLINE_KERNEL)
    if run.fn is None:
        raise SystemExit(f"stage_times.py: {case.key}: {run.error}")
    call, n_sets = run.fn, inputs.n_sets
    row: dict[str, Any] = {"case": case.key, "launches": launch_count(module, case, torch.device("cuda"))}
    timings = {"call_us": timer(call, n_sets)}
    with skipping(module.LAUNCHER, "merge"):
        timings["prefix_alone_us"] = timer(call, n_sets)
    if row["launches"] > 1:
        with skipping(module.LAUNCHER, "prefix"):
            timings["merge_alone_us"] = timer(call, n_sets)
    sink = torch.zeros(1, device="cuda", dtype=torch.int32)

    def empty(i: int) -> None:
        for _ in range(row["launches"]):
            _empty_kernel[(1,)](sink)

    timings["empty_us"] = timer(empty, n_sets)
    row.update({name: timing.median_us for name, timing in timings.items()})
    row["mode"] = "/".join(sorted({timing.mode for timing in timings.values()}))
    row["merge_adds_us"] = row["call_us"] - row["prefix_alone_us"]
    return row


def render(rows: list[dict[str, Any]], gpu: str) -> str:
    lines = [f"# Stage times: {gpu}", "",
             "| case | launches | call µs | prefix alone | merge alone | call - prefix alone | empty launches | mode |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        merge = f"{r['merge_alone_us']:.1f}" if "merge_alone_us" in r else "-"
        lines.append(f"| {r['case']} | {r['launches']} | {r['call_us']:.1f} | {r['prefix_alone_us']:.1f} | {merge} "
                     f"| {r['merge_adds_us']:.1f} | {r['empty_us']:.1f} | {r['mode']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: ``kv_dtype`` canonical (``bf16`` -> ``bfloat16``), ``layouts`` as
    (name, group), ``batches`` and ``prefixes`` as ints; a bad value exits with its name."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", action="append", metavar="NAME:GROUP", required=True,
                        help="layouts with their group, e.g. qwen3_5_gqa256:16 (repeat or separate by commas)")
    parser.add_argument("--kv-dtype", default="bf16", help="one KV dtype: bf16, fp8 ... (default bf16)")
    parser.add_argument("--batch", action="append", required=True, help="batches, e.g. 1,16")
    parser.add_argument("--prefix", action="append", required=True, help="prefix lengths, K suffix allowed")
    parser.add_argument("--draft", type=int, default=4, help="draft length L (default 4)")
    parser.add_argument("--replays", type=int, default=20, help="graph replays a figure (default 20)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for stage_times.md and .json")
    args = parser.parse_args(argv)
    try:
        kv_dtypes = parse_kv_dtypes([args.kv_dtype])
        args.layouts = parse_layout_groups(args.layout, load_layouts())
        args.batches, args.prefixes = parse_sizes(split_list(args.batch)), parse_sizes(split_list(args.prefix))
    except ValueError as exc:
        parser.error(str(exc))
    if len(kv_dtypes) != 1:
        parser.error(f"--kv-dtype {args.kv_dtype!r}: give one KV dtype")
    args.kv_dtype = kv_dtypes[0]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("stage_times.py: needs a CUDA GPU: run it on the GPU machine (it times graph replays)")
    timer = CudaGraphTimer(replays=args.replays)
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows = []
    for layout, group in args.layouts:
        for batch in args.batches:
            for prefix in args.prefixes:
                rows.append(time_case(layout, group, args.kv_dtype, batch, prefix, args.draft, timer, l2_bytes))
                print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    text = render(rows, torch.cuda.get_device_name())
    (args.out / "stage_times.md").write_text(text)
    (args.out / "stage_times.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
