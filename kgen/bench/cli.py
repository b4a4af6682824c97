"""``kgen bench``: argument parsing and the run, for the main CLI and ``python -m kgen.bench``.

The main ``kgen`` CLI calls ``add_bench_parser(subparsers)`` and then ``run_bench(args)``
(also set as ``func`` on the sub-parser). Exit codes: 0 all cases right and no regression,
1 a case FAILED or ``--compare`` found a regression, 2 a usage or environment problem.

Without a GPU, ``--list`` prints the cases and ``--from-json RESULT`` re-renders a result
(and ``--compare``s it), so the report side runs anywhere.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kgen.bench.cases import (
    ALL_KERNELS,
    ENGINE_ALIAS,
    ENGINE_KERNELS,
    FLASHINFER_ALIAS,
    FLASHINFER_KERNELS,
    INDEX_DTYPES,
    KERNELS,
    MASKS,
    BenchUsageError,
    Case,
    build_matrix,
    format_case_list,
    parse_index_dtypes,
    parse_kv_dtypes,
    parse_layout_groups,
    parse_masks,
    parse_sizes,
    split_list,
)
from kgen.bench.measure import CaseResult, Provider, SweepEntry
from kgen.bench.report import (
    COMPARE_NAME,
    DEFAULT_THRESHOLD,
    BenchMeta,
    BenchReportError,
    BenchRun,
    build_ab_line,
    build_ab_summary,
    compare_runs,
    format_comparison,
    index_ab_summary,
    mask_ab_summary,
    merge_runs,
    mode_ab_line,
    mode_ab_summary,
    read_run,
    speedup_summary,
    write_json,
    write_report,
)
from kgen.bench.timing import Timer
from kgen.errors import KgenError

DEFAULT_OUT = "bench-out"
DESCRIPTION = (
    "Time the generated grouped-head verify kernel against the per-head split-KV kernel, "
    "FlexAttention, SDPA and (where it is installed) FlashInfer on the same inputs, with the "
    "device-copy bandwidth as the ceiling. Writes bench.json, bench.md and PNG plots into --out."
)
EPILOG = """examples:
  kgen bench --quick                                  32 cases, a few minutes on an H200
  kgen bench --layout qwen3_5_gqa256:16 --kv-dtype bf16 --batch 64 --prefix 16K --draft 4
  kgen bench --compare benchmarks/baselines/h200.json exit 1 on a >10% kgen slowdown
  kgen bench --from-json bench-out/bench.json --compare benchmarks/baselines/h200.json
  kgen bench --index-dtype int64,int32 --layout qwen3_5_gqa256:16 --batch 64 --prefix 4K,16K --draft 4
                                                      int64 vs int32 kv_indices, alternated graph replays
  kgen bench --mask tree,none --kernels grouped --layout qwen3_5_gqa256:16 --batch 64 --prefix 16K --draft 8,16
                                                      EAGLE trees vs the causal chain, alternated graph replays
  kgen bench --mask chain,none --kernels grouped --quick
                                                      the chain handed as a mask vs no mask
  cp -r generated /tmp/before; (change kgen, kgen build)
  kgen bench --quick --kernels grouped --baseline-modules /tmp/before
                                                      this build vs the earlier one, alternated graph replays
  kgen bench --kernels grouped --layout gqa128:16 --kv-dtype bf16 --draft 8,16 --baseline-tables /tmp/rows
                                                      the tables in use vs the rows in /tmp/rows/sm_90.json
  kgen bench --batch-invariant --kernels grouped --layout qwen3_5_gqa256:16 --kv-dtype bf16 --batch 64 --prefix 16K
                                                      the batch-invariant modules vs the default ones, alternated
  kgen bench --kernels grouped,flashinfer --layout qwen3_5_gqa256:16 --batch 64 --prefix 16K --draft 4
                                                      FlashInfer FA2/FA3, pages of 1 and 16 (flashinfer_fa2,
                                                      flashinfer_fa3, flashinfer_fa2_page16, flashinfer_fa3_page16)
  kgen bench --kernels grouped,engines --layout qwen3_5_gqa256:16 --batch 64 --prefix 16K --draft 4
                                                      SGLang's and vLLM's own Triton verify kernels
                                                      (sglang_triton, vllm_triton; each needs its engine)
  kgen bench --list                                   the cases, no GPU needed
  kgen bench --time-limit 500 --out a; kgen bench --resume a/bench.json --out a
                                                      a matrix longer than one sitting"""
FLEX_SWEEP_MODES = ("headline", "all", "none")
CHECKPOINT_S = 15.0


class BenchEnvironmentError(KgenError, RuntimeError):
    """No GPU, or a missing package the measurement needs."""


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every ``kgen bench`` option (shared by the sub-command and ``python -m kgen.bench``)."""
    sel = parser.add_argument_group("cases (repeat an option or separate values by commas)")
    sel.add_argument(
        "--layout",
        action="append",
        metavar="NAME[:GROUP]",
        help="layouts (default: qwen3_5_gqa256:16, :4, mla_absorbed_512_64:16, gqa128:8)",
    )
    sel.add_argument(
        "--kv-dtype",
        action="append",
        metavar="DTYPE",
        help="KV dtypes: bf16, fp8 ... (default: bfloat16, float8_e4m3fn)",
    )
    sel.add_argument("--batch", action="append", metavar="N", help="batches (default 1,16,64,128)")
    sel.add_argument(
        "--prefix", action="append", metavar="TOKENS", help="prefix lengths, K suffix allowed (default 1K,4K,16K,32K)"
    )
    sel.add_argument("--draft", action="append", metavar="L", help="draft lengths (default 1,2,4)")
    sel.add_argument("--kv-heads", type=int, default=1, help="KV heads per rank (default 1)")
    sel.add_argument(
        "--index-dtype",
        action="append",
        metavar="|".join(INDEX_DTYPES),
        help="kv_indices dtype of the kgen kernels (default int64, what SGLang sends); two, e.g. int64,int32: "
        "the first's figures, and both timed in alternation in one process (CUDA-graph replays, the median "
        "of at least 5 alternations) with their ratio per case",
    )
    sel.add_argument(
        "--mask",
        action="append",
        metavar="|".join(MASKS),
        help="how draft tokens see each other: none (the causal chain, default), chain (the same chain handed "
        "to the kernels as SGLang's custom mask), tree (a random EAGLE-like tree, topk 4, per request); two, "
        "e.g. tree,none: the first's figures, and both timed in alternation in one process with their ratio "
        "per case (the peers run the causal chain only)",
    )
    sel.add_argument(
        "--baseline-modules",
        metavar="DIR",
        help="a copy of an earlier build's generated/: for every case, its same-named grouped module and the "
        "current one are timed in alternation in one process (CUDA-graph replays, the median of at least 5 "
        "alternations); the JSON holds both times and their ratio, the summary their geometric mean and the worst",
    )
    sel.add_argument(
        "--baseline-tables",
        metavar="DIR",
        help="a directory of block-config tables (<arch>.json, as $KGEN_TABLES_DIR takes): every case's grouped "
        "module is built again with them (into OUT/baseline-tables/) and timed in alternation with the current "
        "one, as --baseline-modules times an earlier build (ratio: time now / time with DIR's tables)",
    )
    sel.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the grouped kernel's figures are its batch-invariant module's (kgen.load(..., batch_invariant=True)), "
        "timed in alternation with the default module in one process (CUDA-graph replays, the median of at least 5 "
        "alternations); the JSON holds both times and their ratio, the summary their geometric mean and the worst",
    )
    sel.add_argument(
        "--quick", action="store_true", help="the fast subset: batch 16,64 x prefix 1K,16K x L 4 (32 cases)"
    )
    sel.add_argument(
        "--kernels",
        action="append",
        metavar="NAME",
        help=f"kernels to run (default all but the engines': {', '.join(DEFAULT_KERNELS)}; the FlashInfer ones "
        f"only where flashinfer is installed); {FLASHINFER_ALIAS}: all four FlashInfer kernels, "
        "flashinfer_<fa2|fa3>[_page16]: its backend on pages of 1 token (the token-slot pool) or 16 (a shuffled "
        f"copy); {ENGINE_ALIAS}: {' and '.join(ENGINE_KERNELS)}, SGLang's and vLLM's own Triton verify kernels "
        "(each needs its engine installed)",
    )
    sel.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")

    out = parser.add_argument_group("output and verdict")
    out.add_argument("--out", metavar="DIR", help=f"output directory (default {DEFAULT_OUT})")
    out.add_argument(
        "--compare", metavar="BASELINE.json", help="exit 1 when a kgen kernel is more than --threshold slower than here"
    )
    out.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD * 100, metavar="PCT",
                     help="regression threshold in percent (default 10)")
    out.add_argument(
        "--from-json", metavar="RESULT.json", help="no measurement: re-render (with --out) and --compare a saved result"
    )
    out.add_argument("--resume", metavar="RESULT.json",
                     help="keep the cases this earlier run measured (same GPU) and measure only the rest "
                     "(its skipped ones, or cases it did not have); writes the merged run")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true",
                     help="no progress bar: one line a case with its figures instead (the default when stderr "
                     "is not a terminal, as in a log or a device call)")

    run = parser.add_argument_group("measurement")
    run.add_argument(
        "--flex-sweep",
        choices=FLEX_SWEEP_MODES,
        help="FlexAttention kernel-option sweep: on the headline cases (default), "
        "on all cases, or none (default with --quick)",
    )
    run.add_argument("--replays", type=int, default=15, help="graph replays per timing (default 15)")
    run.add_argument("--min-graph-us", type=float, default=1000.0,
                     help="launches per graph are chosen to last at least this long (default 1000)")
    run.add_argument("--time-limit", type=float, default=0.0, metavar="SECONDS",
                     help="skip the cases left after this long and write what was measured (0: none)")
    run.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy-ceiling copy")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--precompile-workers", type=int, default=-1, metavar="N",
                     help="processes that compile every kernel before timing (default: cores - 4, at most 12; 0: none)")
    run.add_argument("--precompile-timeout", type=float, default=240.0, metavar="SECONDS",
                     help="longest wait for the precompile processes (default 240)")
    run.add_argument(
        "--flex-eager", action="store_true", help="run FlexAttention without torch.compile (debugging only: unfused)"
    )
    run.add_argument(
        "--flashinfer-jit",
        action="store_true",
        help="let FlashInfer compile kernels it has no prebuilt module for (minutes each; default: such a kernel "
        "is skipped with its name; KGEN_FLASHINFER_JIT=1 does the same)",
    )
    return parser


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the main CLI's sub-parsers; ``func`` is ``run_bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark the generated kernels against per-head, FlexAttention and SDPA",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_arguments(parser)
    parser.set_defaults(func=run_bench)
    return parser


def select_cases(args: argparse.Namespace) -> list[Case]:
    from kgen.spec import load_layouts

    specs = load_layouts()
    drafts = parse_sizes(args.draft)
    return build_matrix(
        specs,
        layout_groups=parse_layout_groups(args.layout, specs),
        kv_dtypes=parse_kv_dtypes(args.kv_dtype),
        batches=parse_sizes(args.batch),
        prefixes=parse_sizes(args.prefix),
        drafts=drafts,
        quick=args.quick,
        kv_heads=args.kv_heads,
        index_dtypes=parse_index_dtypes(args.index_dtype),
        masks=parse_masks(args.mask),
    )


def _baseline_option_checks(args: argparse.Namespace, option: str) -> None:
    """What --baseline-modules and --baseline-tables share: they time the grouped kernel, in a
    measuring run with no other A/B."""
    if "grouped" not in select_kernels(args):
        raise BenchUsageError(f"{option} times the grouped kernel: keep it in --kernels")
    if parse_index_dtypes(args.index_dtype)[1] is not None or parse_masks(args.mask)[1] is not None:
        raise BenchUsageError(f"{option} and two --index-dtype or --mask values are two A/Bs: run one at a time")
    if args.from_json:
        raise BenchUsageError(f"{option} measures: it does not go with --from-json")


def baseline_modules_dir(args: argparse.Namespace) -> Path | None:
    """``--baseline-modules DIR``: a directory holding generated modules (verify*.py), for
    a run that times the grouped kernel, with one kv_indices dtype (one A/B at a time)."""
    text = getattr(args, "baseline_modules", None)
    if not text:
        return None
    path = Path(text)
    if not path.is_dir() or not any(path.glob("verify*.py")):
        raise BenchUsageError(f"--baseline-modules {text}: not a directory of generated modules (verify*.py); "
                              "copy an earlier build's generated/ there")  # fmt: skip
    _baseline_option_checks(args, "--baseline-modules")
    if getattr(args, "baseline_tables", None):
        raise BenchUsageError("--baseline-modules and --baseline-tables are two baselines: run one at a time")
    return path


def baseline_tables_dir(args: argparse.Namespace) -> Path | None:
    """``--baseline-tables DIR``: a directory of block-config tables named for their arch
    (sm_90.json, ...), as $KGEN_TABLES_DIR takes, for a run that times the grouped kernel with
    no other A/B."""
    text = getattr(args, "baseline_tables", None)
    if not text:
        return None
    path = Path(text)
    if not path.is_dir() or not any(path.glob("*.json")):
        raise BenchUsageError(f"--baseline-tables {text}: not a directory of block-config tables (<arch>.json, as "
                              "kgen tune --out writes them)")
    _baseline_option_checks(args, "--baseline-tables")
    return path


def build_table_baseline(tables: Path, cases: Sequence[Case], out_dir: Path) -> Path:
    """Every case's grouped module built again with the tables in ``tables`` (read as
    $KGEN_TABLES_DIR, the shipped tables behind them) into OUT/baseline-tables/, for
    --baseline-modules' alternated timing. A table a module cannot take fails here, before
    anything is measured."""
    from kgen.build import build_one
    from kgen.errors import TableError
    from kgen.locations import TABLES_DIR_ENV
    from kgen.passes.context import load_context

    target = out_dir / "baseline-tables"
    target.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "KGEN_TABLE"} | {TABLES_DIR_ENV: str(tables.resolve())}
    ctx = load_context(target, env=env)
    for layout, kv_dtype in sorted({(c.layout, c.kv_dtype) for c in cases}):
        try:
            build_one(layout, kv_dtype, "bfloat16", ctx=ctx)
        except TableError as exc:
            raise BenchUsageError(f"--baseline-tables {tables}: {exc}") from None
    return target


def batch_invariant_run(args: argparse.Namespace) -> bool:
    """``--batch-invariant``: a run that times the grouped kernel's batch-invariant modules
    against the default ones, with one kv_indices dtype, one draft mask and no other A/B."""
    if not getattr(args, "batch_invariant", False):
        return False
    if "grouped" not in select_kernels(args):
        raise BenchUsageError("--batch-invariant times the grouped kernel: keep it in --kernels")
    if (parse_index_dtypes(args.index_dtype)[1] is not None or parse_masks(args.mask)[1] is not None
            or getattr(args, "baseline_modules", None) or getattr(args, "baseline_tables", None)):
        raise BenchUsageError("--batch-invariant is an A/B, and so are two --index-dtype or --mask values, "
                              "--baseline-modules and --baseline-tables: run one at a time")  # fmt: skip
    if args.from_json:
        raise BenchUsageError("--batch-invariant measures: it does not go with --from-json")
    return True


ALIASES = {FLASHINFER_ALIAS: FLASHINFER_KERNELS, ENGINE_ALIAS: ENGINE_KERNELS}
# What runs without --kernels: every kernel but the engines' (FlashInfer's where installed).
DEFAULT_KERNELS = KERNELS + FLASHINFER_KERNELS


def select_kernels(args: argparse.Namespace) -> list[str]:
    """The kernels asked for (``flashinfer`` and ``engines`` standing for theirs), in report
    order; by default ``DEFAULT_KERNELS``, FlashInfer's only where it is installed."""
    names: list[str] = []
    for name in split_list(args.kernels):
        names += list(ALIASES.get(name, (name,)))
    unknown = [n for n in names if n not in ALL_KERNELS]
    if unknown:
        raise BenchUsageError(f"unknown kernel(s) {unknown}; choose from {', '.join(ALL_KERNELS)}, or "
                              f"{FLASHINFER_ALIAS} for the four FlashInfer ones, {ENGINE_ALIAS} for the engines' "
                              "two")  # fmt: skip
    if not names:
        names = list(DEFAULT_KERNELS) if flashinfer_missing() is None else list(KERNELS)
    return [k for k in ALL_KERNELS if k in names]


def flashinfer_missing() -> str | None:
    """Why FlashInfer cannot run here (not installed), or None."""
    from kgen.bench.flashinfer import flashinfer_missing as missing

    return missing()


def require_flashinfer(args: argparse.Namespace) -> str | None:
    """FlashInfer kernels asked for by name need FlashInfer: a usage error naming the install
    when it is missing. Without --kernels, the note that the FlashInfer peer is left out (None
    when it runs or was not asked for)."""
    wanted = [k for k in select_kernels(args) if k in FLASHINFER_KERNELS]
    if args.kernels:
        missing = flashinfer_missing() if wanted else None
        if missing:
            raise BenchEnvironmentError(f"--kernels {','.join(wanted)}: {missing}")
        return None
    missing = flashinfer_missing()
    return f"FlashInfer peer not run: {missing}" if missing else None


def require_engines(args: argparse.Namespace) -> None:
    """An engine kernel asked for needs its engine installed: one usage error naming every
    missing engine's install (another release is the kernel's own "unsupported" row)."""
    from kgen.bench.engine_kernels import ENGINE_OF

    missing = [f"--kernels {kernel}: {ENGINE_OF[kernel].package} is not installed; {ENGINE_OF[kernel].install}"
               for kernel in select_kernels(args) if kernel in ENGINE_KERNELS and ENGINE_OF[kernel].missing()]
    if missing:
        raise BenchEnvironmentError("; ".join(missing))


def run_bench(args: argparse.Namespace) -> int:
    """Run ``kgen bench`` with parsed arguments; returns the exit code."""
    try:
        return _run(args)
    except (BenchUsageError, BenchReportError, BenchEnvironmentError) as exc:
        print(f"kgen bench: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.replays < 1:
        raise BenchUsageError("--replays must be at least 1")
    if parse_index_dtypes(args.index_dtype)[1] is not None and parse_masks(args.mask)[1] is not None:
        raise BenchUsageError("two --index-dtype and two --mask values are two A/Bs: run one at a time")
    baseline = read_run(args.compare) if args.compare else None  # a bad path fails before measuring
    baseline_modules_dir(args)  # a bad --baseline-modules or --baseline-tables fails before measuring too
    baseline_tables_dir(args)
    if batch_invariant_run(args) and baseline is not None and not baseline.meta.batch_invariant:
        raise BenchUsageError(f"--compare {args.compare} holds the default modules' figures and --batch-invariant "
                              "times the batch-invariant ones: compare with a --batch-invariant run")
    if args.from_json:
        run = read_run(args.from_json)
        out_dir = Path(args.out) if args.out else None
    else:
        cases = select_cases(args)
        if args.list:
            print(format_case_list(cases))
            return 0
        out_dir = Path(args.out or DEFAULT_OUT)
        run = measure_or_resume(args, cases, out_dir)
    if out_dir is not None:
        for path in write_report(run, out_dir, plots=not args.no_plots):
            print(f"wrote {path}")
    print(summary_text(run))
    code = 1 if any(c.status == "FAILED" for c in run.cases) else 0
    if baseline is not None:
        cmp = compare_runs(run, baseline, args.threshold / 100.0)
        text = format_comparison(cmp, args.compare)
        print(text)
        if out_dir is not None:
            (out_dir / COMPARE_NAME).write_text(text + "\n", encoding="utf-8")
        code = code or (0 if cmp.ok else 1)
    return code


def case_line(res: CaseResult) -> str:
    """One log line per case (used instead of the progress bar in logs)."""
    g = res.kernels.get("grouped")
    head = f"{res.key:48s} {res.status:7s}"
    if g is None or not g.timed:
        return f"{head} grouped {g.status if g else '-'}"
    pct = f" {g.pct_copy:5.1f}% copy" if g.pct_copy is not None else ""
    if g.index_ab is not None and g.index_ab.ratio is not None:
        pct += f" {res.case.indices}/{g.index_ab.dtype}={g.index_ab.ratio:.3f}"
    if g.mask_ab is not None and g.mask_ab.ratio is not None:
        pct += f" mask {res.case.mask}/{g.mask_ab.mask}={g.mask_ab.ratio:.3f}"
    if g.build_ab is not None:
        pct += f" now/then={g.build_ab.ratio:.3f}" if g.build_ab.ratio is not None else f" then {g.build_ab.status}"
    if g.mode_ab is not None:
        pct += (f" invariant/default={g.mode_ab.ratio:.3f}" if g.mode_ab.ratio is not None
                else f" default {g.mode_ab.status}")
    ups = " ".join(f"x{k}={v:.2f}" for k, v in res.speedup.items())
    bad = " ".join(
        f"{k} {r.status} ({(r.note or str(r.max_rel_err))[:60]})" for k, r in res.kernels.items() if r.status != "ok"
    )
    return f"{head} grouped {g.median_us:9.1f} us{pct} {ups} {bad}".rstrip()


def summary_text(run: BenchRun) -> str:
    failed = [c.key for c in run.cases if c.status == "FAILED"]
    skipped = sum(1 for c in run.cases if c.status == "skipped")
    lines = [f"{len(run.cases)} cases, {len(failed)} FAILED, {skipped} skipped"]
    for name, (g, n) in speedup_summary(run.cases).items():
        lines.append(f"  grouped vs {name}: {g:.2f}x geometric mean over {n} cases")
    for kernel, (title, mid, worst, key, n) in index_ab_summary(run.cases).items():
        lines.append(f"  {kernel} kv_indices {title}: median {mid:.3f} over {n} cases, largest {worst:.3f} at {key}")
    for kernel, (title, mid, worst, key, n) in mask_ab_summary(run.cases).items():
        lines.append(f"  {kernel} mask {title}: median {mid:.3f} over {n} cases, largest {worst:.3f} at {key}")
    build = build_ab_summary(run.cases)
    if build is not None:
        lines.append(f"  {build_ab_line(build, run.meta.baseline_modules, run.meta.baseline_tables)}")
    mode = mode_ab_summary(run.cases)
    if mode is not None:
        lines.append(f"  {mode_ab_line(mode)}")
    lines += [f"  FAILED: {key}" for key in failed]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- measurement


def _git_state() -> tuple[str | None, bool | None]:
    """The commit measured: $KGEN_GIT_COMMIT (a copy of the tree without .git), else git."""
    env = os.environ.get("KGEN_GIT_COMMIT")
    if env:
        return env, None
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head or None, bool(dirty.strip())


SOURCE_GLOBS = ("kgen/**/*.py", "kgen/**/*.j2", "kgen/**/*.json", "kgen/**/*.toml", "generated/*.py")


def source_digest(root: Path | None = None) -> str | None:
    """sha256 over the paths and bytes of the code a benchmark runs (SOURCE_GLOBS under the
    repository root), in path order; None when no such file is found."""
    root = root if root is not None else Path(__file__).resolve().parents[2]
    files = sorted({p for pattern in SOURCE_GLOBS for p in root.glob(pattern) if p.is_file()})
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def collect_meta(args: argparse.Namespace, copy_gbps: float, copy_bytes: int,
                 baseline_dir: Path | None = None) -> BenchMeta:
    import torch
    import triton

    from kgen.bench.timing import CudaGraphTimer
    from kgen.runtime.device import arch_of

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = arch_of(props)
    commit, dirty = _git_state()
    return BenchMeta(
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        gpu_name=str(props.name),
        arch=arch,
        num_sms=int(props.multi_processor_count),
        l2_bytes=int(getattr(props, "L2_cache_size", 0) or 0) or None,
        total_memory=int(props.total_memory),
        torch_version=torch.__version__,
        triton_version=triton.__version__,
        cuda_version=torch.version.cuda or torch.version.hip,
        git_commit=commit,
        git_dirty=dirty,
        source_digest=source_digest(),
        copy_ceiling_gbps=copy_gbps,
        copy_bytes=copy_bytes,
        quick=bool(args.quick),
        argv=list(sys.argv),
        timer={
            "kind": "cuda-graph",
            "replays": args.replays,
            "min_graph_us": args.min_graph_us,
            "l2_rotate_factor": 2.0,
            "index_ab_alternations": CudaGraphTimer(replays=args.replays).alternations,
            "build_ab_alternations": CudaGraphTimer(replays=args.replays).alternations,
            "mode_ab_alternations": CudaGraphTimer(replays=args.replays).alternations,
        },  # fmt: skip
        flex_sweep=flex_sweep_mode(args),
        baseline_modules=str(baseline_dir or "") or None,
        baseline_tables=str(baseline_tables_dir(args) or "") or None,
        batch_invariant=batch_invariant_run(args),
    )


def flex_sweep_mode(args: argparse.Namespace) -> str:
    if args.flex_sweep:
        return args.flex_sweep
    return "none" if args.quick else "headline"


def sweep_cases(cases: Sequence[Case], mode: str) -> list[Case]:
    """One case per peer shape (the peers do not depend on the KV dtype)."""
    if mode == "none":
        return []
    first: dict[str, Case] = {}
    for case in cases:
        if mode == "all" or case.is_headline:
            first.setdefault(case.peer_key, case)
    return list(first.values())


def measure_or_resume(args: argparse.Namespace, cases: Sequence[Case], out_dir: Path) -> BenchRun:
    """``measure``, or with ``--resume`` only the cases the earlier run has not measured,
    every checkpoint holding the merged run (so a killed resume loses nothing)."""
    if not args.resume:
        return measure(args, cases, out_dir)
    prior = read_run(args.resume)
    _same_index_dtypes(prior, cases, args.resume)
    if prior.meta.batch_invariant != batch_invariant_run(args):
        raise BenchUsageError(f"--resume {args.resume} was {'' if prior.meta.batch_invariant else 'not '}a "
                              "--batch-invariant run: resume with the same mode")
    done = {c.key for c in prior.cases if c.status != "skipped"}
    todo = [c for c in cases if c.key not in done]
    print(f"resuming {args.resume}: {len(cases) - len(todo)} of {len(cases)} cases measured there", flush=True)
    if not todo:
        return merge_runs(prior, BenchRun(meta=prior.meta), cases, args.resume)
    return measure(args, todo, out_dir, finish=lambda new: merge_runs(_same_gpu(prior, new, args.resume), new,
                                                                       cases, args.resume))


def _same_index_dtypes(prior: BenchRun, cases: Sequence[Case], source: str) -> None:
    """A resume keeps the earlier run's cases: they must have timed the same kv_indices dtypes."""
    wanted = {c.key: (c.indices, c.index_dtype_ab) for c in cases}
    for r in prior.cases:
        want = wanted.get(r.key)
        if r.status != "skipped" and want is not None and (r.case.indices, r.case.index_dtype_ab) != want:
            have = ",".join(d for d in (r.case.indices, r.case.index_dtype_ab) if d)
            raise BenchUsageError(f"--resume {source} measured {r.key} with --index-dtype {have}, this run asks for "
                                  f"{','.join(d for d in want if d)}: resume with the same --index-dtype")  # fmt: skip


def _same_gpu(prior: BenchRun, new: BenchRun, source: str) -> BenchRun:
    if prior.meta.gpu_name != new.meta.gpu_name:
        raise BenchUsageError(f"--resume {source} was measured on {prior.meta.gpu_name}, this GPU is "
                              f"{new.meta.gpu_name}: resume on the same kind of GPU, or start a new run")
    return prior


def measure(args: argparse.Namespace, cases: Sequence[Case], out_dir: Path,
            finish: Callable[[BenchRun], BenchRun] | None = None) -> BenchRun:
    """The GPU run: the copy ceiling, then ``execute`` with the CUDA-graph timer and the
    device provider."""
    # A bad --kernels, or FlashInfer or an engine asked for and missing, fails before anything is measured.
    left_out = require_flashinfer(args)
    require_engines(args)
    try:
        import torch
    except ImportError as exc:
        raise BenchEnvironmentError(f"torch is needed to measure: {exc}") from None
    if not torch.cuda.is_available():
        raise BenchEnvironmentError(
            "no CUDA/ROCm GPU is visible: kgen bench times kernels on a GPU. "
            "Use --list to see the cases, or --from-json RESULT.json [--compare BASELINE.json]."
        )
    from kgen.bench.peers import DeviceProvider
    from kgen.bench.timing import CudaGraphTimer, bench_copy_ceiling_gbps

    started = time.monotonic()
    timer = CudaGraphTimer(replays=args.replays, min_graph_us=args.min_graph_us)
    copy_bytes = int(args.copy_gib * (1 << 30))
    copy_gbps = bench_copy_ceiling_gbps(copy_bytes)
    tables = baseline_tables_dir(args)
    baseline_dir = build_table_baseline(tables, cases, out_dir) if tables else baseline_modules_dir(args)
    meta = collect_meta(args, copy_gbps, copy_bytes, baseline_dir)
    print(f"{meta.gpu_name} ({meta.arch}): copy ceiling {copy_gbps:.0f} GB/s; {len(cases)} cases", flush=True)
    if left_out:
        meta.notes.append(left_out)
        print(left_out, flush=True)
    provider = DeviceProvider(l2_bytes=meta.l2_bytes or (50 << 20), seed=args.seed, compile_flex=not args.flex_eager,
                              baseline_modules=baseline_dir, batch_invariant=batch_invariant_run(args),
                              flashinfer_jit=args.flashinfer_jit)
    if finish is not None:
        finish(BenchRun(meta=meta))  # a resume from another GPU fails here, before any timing
    warm_up(args, cases, meta, started)
    return execute(args, cases, provider, timer, meta, out_dir, started, finish)


def precompile_workers(args: argparse.Namespace) -> int:
    if args.precompile_workers >= 0:
        return args.precompile_workers
    return max(1, min(12, (os.cpu_count() or 2) - 4))


def warm_up(args: argparse.Namespace, cases: Sequence[Case], meta: BenchMeta, started: float) -> None:
    """Compile every kernel the run needs in parallel processes first (``kgen.bench.warm``):
    the timed loop then loads them from the on-disk caches instead of compiling one by one."""
    from kgen.bench.peers import FLEX_SWEEP_GRID, flex_label
    from kgen.bench.warm import precompile, warm_jobs

    workers = precompile_workers(args)
    kernels = [k for k in select_kernels(args) if not (k == "flex" and args.flex_eager)]
    mode = flex_sweep_mode(args)
    labels = [flex_label(o) for o in FLEX_SWEEP_GRID] if mode != "none" else []
    jobs = warm_jobs(cases, kernels, sweep_cases(cases, mode), labels, batch_invariant_run(args))
    timeout = args.precompile_timeout
    if args.time_limit > 0:
        timeout = min(timeout, 0.5 * args.time_limit - (time.monotonic() - started))
    if workers == 0 or not jobs or timeout <= 0:
        return
    print(f"precompiling {len(jobs)} kernels in {workers} processes (at most {timeout:.0f} s)", flush=True)
    report = precompile(jobs, workers, timeout)
    meta.notes.append(report.note())
    print(report.note(), flush=True)


def show_progress_bar(args: argparse.Namespace) -> bool:
    """A bar on a terminal; where stderr goes to a file (a log, a device call's captured output)
    a bar's redraws say nothing once it ends, so each case prints its line instead."""
    return not args.no_progress and sys.stderr.isatty()


def execute(
    args: argparse.Namespace,
    cases: Sequence[Case],
    provider: Provider,
    timer: Timer,
    meta: BenchMeta,
    out_dir: Path,
    started: float | None = None,
    finish: Callable[[BenchRun], BenchRun] | None = None,
) -> BenchRun:
    """The matrix (checkpointed to bench.json as it goes), then the FlexAttention sweep
    while time is left. Device-free: the provider and timer carry the device. ``finish``
    turns what was measured into the run to write (``--resume`` merges it)."""
    finish = finish or (lambda run: run)
    from kgen.bench.measure import apply_sweep, run_matrix, run_sweep
    from kgen.bench.peers import FLEX_SWEEP_GRID, flex_label

    started = time.monotonic() if started is None else started
    deadline = started + args.time_limit if args.time_limit > 0 else None
    kernels = select_kernels(args)
    bar = show_progress_bar(args)
    copy_gbps = meta.copy_ceiling_gbps
    checkpoint = out_dir / "bench.json"
    last_write = [time.monotonic()]

    def on_case(results: list[CaseResult]) -> None:
        # A checkpoint every CHECKPOINT_S: a killed run still leaves most of its figures.
        if time.monotonic() - last_write[0] > CHECKPOINT_S:
            write_json(finish(BenchRun(meta=meta, cases=results)), checkpoint)
            last_write[0] = time.monotonic()
        if not bar:
            print(case_line(results[-1]), flush=True)

    results = run_matrix(cases, provider, timer, copy_gbps, kernels, deadline=deadline,
                         progress=bar, on_case=on_case)  # fmt: skip
    sweeps: list[SweepEntry] = []
    targets = sweep_targets(results, flex_sweep_mode(args)) if "flex" in kernels else []
    if targets:
        labels = [flex_label(o) for o in FLEX_SWEEP_GRID]
        sweeps = run_sweep(targets, provider, "flex", labels, timer, copy_gbps, deadline=deadline,
                           progress=bar)  # fmt: skip
        results = apply_sweep(results, sweeps, copy_gbps)
    meta.duration_s = time.monotonic() - started
    if deadline is not None and time.monotonic() > deadline:
        meta.notes.append(f"time limit of {args.time_limit:.0f} s reached: the rest was skipped")
    return finish(BenchRun(meta=meta, cases=results, sweeps=sweeps))


def sweep_targets(results: Sequence[CaseResult], mode: str) -> list[Case]:
    """The sweep's cases: one per peer shape, where FlexAttention ran at all."""
    refused = {r.case.peer_key for r in results if "flex" in r.kernels and r.kernels["flex"].status == "unsupported"}
    measured = [r.case for r in results if r.status != "skipped"]
    return [c for c in sweep_cases(measured, mode) if c.peer_key not in refused]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kgen.bench``: the same options as ``kgen bench``."""
    parser = argparse.ArgumentParser(
        prog="kgen bench", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))
