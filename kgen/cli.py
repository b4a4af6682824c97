"""The ``kgen`` command: list, build, explain, check, tune, bench."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kgen.errors import KgenError

if TYPE_CHECKING:
    from kgen import check

COMMANDS = """\
  kgen list                           the layout specs and what each generates
  kgen build [--check]                write generated/ (or check it is up to date)
  kgen explain LAYOUT [--kv-dtype D]  the plan after each compiler pass, and the gate's decision
  kgen tune [--layout LAYOUT] ...     search block configs on this GPU (needs the 'tune' extra)
  kgen bench [--quick] ...            measure kernels against peers and the copy ceiling
  kgen check [--arch A,B] ...         compile every kernel variant for real GPUs offline, check resources
"""

DESCRIPTION = f"""\
kgen generates grouped-head shared-KV target-verify attention kernels (speculative
decoding: EAGLE chains, topk = 1, and trees, topk > 1) from layout specs, and tunes their
block configs per GPU.

{COMMANDS}
`kgen COMMAND --help` shows a command's options.
"""


class _DeprecatedAlias(argparse.Action):
    """An old option name that still works and says which name replaced it."""

    def __init__(self, *args, replacement: str, **kwargs) -> None:
        self.replacement = replacement
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"warning: {option_string} is deprecated, use {self.replacement}", file=sys.stderr)
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _add_layout_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout-dir", metavar="DIR",
                   help="directory of layout specs (default: the shipped kgen/layouts)")
    p.add_argument("--layouts", dest="layout_dir", action=_DeprecatedAlias, replacement="--layout-dir",
                   help=argparse.SUPPRESS)


def _cmd_list(args: argparse.Namespace) -> int:
    from kgen.spec import load_layouts

    specs = load_layouts(Path(args.layout_dir) if args.layout_dir else None)
    header = (f"{'layout':24s} {'kind':4s} {'qk':>4s} {'nope':>4s} {'pe':>3s} {'v':>4s}  "
              f"{'groups':14s} {'kv dtypes':40s} q")
    print(header)
    print("-" * len(header))
    for name, spec in sorted(specs.items()):
        a = spec.attention
        print(f"{name:24s} {a.kind:4s} {a.qk_dim:4d} {a.nope_dim:4d} {a.pe_dim:3d} {a.v_head_dim:4d}  "
              f"{','.join(map(str, a.group_sizes)):14s} {','.join(spec.dtypes.kv):40s} {','.join(spec.dtypes.q)}")
        if spec.architectures:
            print(f"{'':24s} architectures: {', '.join(spec.architectures)}")
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kgen.build import build_all

    bar = tqdm(desc="kgen build", unit="module", disable=not sys.stderr.isatty() or args.quiet)
    result = build_all(Path(args.out) if args.out else None, check_only=args.check,
                       layout_dir=Path(args.layout_dir) if args.layout_dir else None,
                       progress=lambda plan: bar.update(1))
    bar.close()
    for warning in sorted({d.why for p in result.plans for d in p.warnings}):
        print(f"warning: {warning}", file=sys.stderr)
    stale = [p.output_path for p in result.changed]
    if args.check:
        if stale or result.orphans:
            for path in stale:
                print(f"stale: {path}")
            for path in result.orphans:
                print(f"orphan (no spec generates it): {path}")
            print(f"generated/ is out of date ({len(stale)} stale, {len(result.orphans)} orphans): run `kgen build`",
                  file=sys.stderr)
            return 1
        print(f"generated/ is up to date ({len(result.plans)} modules)")
        return 0
    for path in result.orphans:
        path.unlink()
        print(f"removed orphan {path}")
    print(f"{len(result.plans)} modules, {len(stale)} written, {len(result.plans) - len(stale)} unchanged")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from kgen.explain import explain

    print(explain(args.layout, args.kv_dtype, args.q_dtype, args.variant, arch=args.arch,
                  model=args.model, topk=args.topk, group=args.group, show_source=args.source,
                  batch_invariant=args.batch_invariant, verbose=args.verbose, only_pass=args.only_pass))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from kgen import check

    def split(values: list[str] | None) -> list[str]:
        return [v for item in values or () for v in item.split(",") if v]

    archs = split(args.arch) or list(check.ARCHS)
    selection = dict(layouts=split(args.layout), kv_dtypes=split(args.kv_dtype), q_dtypes=split(args.q_dtype),
                     variants=split(args.variant), entries=split(args.entry) or check.ENTRIES,
                     index_dtypes=split(args.index_dtype) or check.INDEX_DTYPES)
    if args.count:
        print(check.format_counts(check.select_scope(archs, args.largest_rows, **selection), archs))
        return 0
    ci_only = [flag for flag, value in (("--budget-s", args.budget_s), ("--sample", args.sample),
                                         ("--sample-min", args.sample_min), ("--seed", args.seed)) if value is not None]
    if (ci_only and not args.ci) or (args.recompile and not args.update_ledger) or (args.ledger and not (
            args.ci or args.update_ledger)):
        raise check.CheckError("--budget-s, --sample, --sample-min and --seed go with --ci, --recompile with "
                               "--update-ledger, --ledger with either")
    if args.ci or args.update_ledger:
        return _check_ledger(args, archs, selection, split(args.recompile))
    report = check.run_check(archs, jobs=args.jobs, use_cache=not args.no_cache, progress=not args.quiet,
                             worst_case_only=args.largest_rows, **selection)
    failed = _print_check(args, report)
    if not failed:
        scope = "largest-rows programs" if args.largest_rows else "programs"
        print(f"kgen check: all {len(report.enumeration.variants)} distinct {scope} fit their targets "
              f"({check.module_variant_count(report.enumeration)} module variants)")
    return 1 if failed else 0


def _print_check(args: argparse.Namespace, report: check.CheckReport) -> bool:
    """The table, where the time went, refusals, --json / --report and the failures (stderr);
    whether anything fails."""
    import json

    from kgen import check

    print(check.format_table(report, verbose=args.verbose))
    print(check.format_timing(report))
    for refusal in report.enumeration.refused:
        print(f"refused: {refusal.module} on {refusal.arch}: {refusal.reason}")
    if args.json:
        Path(args.json).write_text(json.dumps(check.to_json(report), indent=1, default=sorted))
    if args.report:
        Path(args.report).write_text(check.format_markdown(report))
    failures = check.format_failures(report)
    if failures:
        print(failures, file=sys.stderr)
        print(f"kgen check: {len(report.failures())} variant(s) do not fit their target", file=sys.stderr)
    return bool(failures)


def _check_ledger(args: argparse.Namespace, archs: list[str], selection: dict, recompile: list[str]) -> int:
    """--ci and --update-ledger (docs/check.md, "The ledger")."""
    import os

    from kgen import check
    from kgen import check_ledger as ledger

    scope = ledger.Scope(tuple(archs), selection, args.largest_rows)
    path = Path(args.ledger) if args.ledger else ledger.default_path()
    book = ledger.Ledger.read(path)  # a malformed ledger stops the run before anything is enumerated
    jobs = args.jobs or os.cpu_count() or 1
    if args.update_ledger:
        run = ledger.update(scope, book, jobs, set(recompile), use_cache=not args.no_cache, progress=not args.quiet)
    else:
        print(check.format_counts(scope.programs, archs))
        run = ledger.run_ci(scope, book, jobs, ledger.BUDGET_S if args.budget_s is None else args.budget_s,
                            ledger.SAMPLE_FRACTION if args.sample is None else args.sample,
                            ledger.SAMPLE_MIN if args.sample_min is None else args.sample_min, args.seed,
                            progress=not args.quiet, use_cache=not args.no_cache)
    failed = _print_check(args, run.report)
    mend = ledger.mend_command(scope, run.ledger)
    if args.update_ledger:
        print(f"ledger: wrote {path}: {len(run.ledger.lines)} lines; {len(run.missing)} programs new (compiled, "
              f"or read from the check cache), {len(run.sampled)} recompiled, {len(run.differ)} lines changed, "
              f"{len(run.stale)} stale lines removed")
        return 1 if failed else 0
    for key, found in run.differ.items():
        line = run.ledger.lines[key]
        print(f"DIFFER {line['target']} {line['kernel']} {line['modules']} [{key}]: {'; '.join(found)}\n"
              f"       {line['program']}", file=sys.stderr)
    if run.differ:
        keys = ",".join(run.differ) if len(run.differ) <= 10 else "all"
        print(f"kgen check: {len(run.differ)} ledger line(s) differ from what this run finds: a line edited by hand "
              f"(or merged wrong) is mended by `{mend} --recompile {keys}`; if the line is what the "
              "compile gave before, the key misses an input that changed the compile (docs/check.md, \"The ledger\")",
              file=sys.stderr)
    if run.stale:
        print(f"note: {len(run.stale)} ledger line(s) are no program of this scope (a kernel changed): `{mend}` "
              "drops them")
    if run.ledger.scope not in (None, scope.flags()):
        print(f"note: the ledger was written for `{run.ledger.scope}`, not this run's scope `{scope.flags()}`")
    print(run.closing())
    return 1 if failed or run.differ else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kgen", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # Not required: a bare `kgen` prints the command list instead of argparse's one-line error.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("list", help="list the layout specs")
    _add_layout_dir(p)
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("build", help="generate the kernels into generated/",
                       description="Run every layout spec through the compiler passes and write "
                       "generated/<uri>.py (atomically, only when the text changed). A bad spec "
                       "aborts the build before anything is written.")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming the files if generated/ is stale")
    p.add_argument("--out", help="output directory (default: generated/ of the source checkout; required "
                   "outside one, then set KGEN_GENERATED_DIR to it so kgen.load finds the modules)")
    _add_layout_dir(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("explain", help="print the plan after each pass and the dispatch decision",
                       description="Show every decision the compiler makes for one specialization, "
                       "pass by pass, one line each with its reason in short (--verbose: the whole reasons); "
                       "which block-config table applies and why; and what the runtime gate would choose for "
                       "a model on a GPU.")
    p.add_argument("layout", help="layout name (see `kgen list`)")
    p.add_argument("--kv-dtype", default="bfloat16", help="bf16 | fp8 | fp8_e4m3fnuz | fp8_e5m2 (default bf16)")
    p.add_argument("--q-dtype", default="bfloat16", help="bf16 | fp16 (default bf16)")
    p.add_argument("--variant", default="grouped", choices=["grouped", "per_head"])
    p.add_argument("--batch-invariant", action="store_true",
                   help="the grouped kernel's batch-invariant module: what it fixes, and why")
    p.add_argument("--arch", default=None, help="GPU arch for the gate and table lookup, one of "
                   "the targets in kgen/tables/targets.json (e.g. sm_90, gfx950); default: this GPU's")
    p.add_argument("--model", default=None, help="HuggingFace architecture name for the gate; one the layout "
                   "lists (see `kgen list`) or none lists (default: the layout's first)")
    p.add_argument("--topk", type=int, default=1, help="EAGLE topk for the gate: 1 a chain, > 1 a tree (default 1)")
    p.add_argument("--group", type=int, default=None, help="query heads per KV head (default: the largest)")
    p.add_argument("--source", action="store_true", help="also print the generated source")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="every decision with its whole reason, the fit pass's every cell, and the fields no "
                   "decision shows")
    p.add_argument("--pass", dest="only_pass", metavar="NAME", default=None,
                   help="only this pass, with its whole reasons (validate, specialize, legalize, ...)")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("check", help="compile every kernel variant for real GPUs (no GPU needed), check resources",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Prove without a GPU that every kernel a generated module can launch fits "
                       "its target.\n\nFor each module and arch it walks the accepted domain (every listed group "
                       "and one unlisted, draft lengths 1..MAX_DRAFT_TOKENS, batch sizes at every table row's "
                       "boundaries, the token-slot entry and the paged entry at every supported page size, chains "
                       "and trees (a custom mask), int32 and int64 index tensors), asks the module's launch_params "
                       "what it would launch, dedupes, compiles each distinct variant once with Triton's offline "
                       "compiler and reads shared memory / LDS, registers and spills (ptxas -v; amdgcn "
                       "metadata).\n\nExits 1 naming every variant that: uses more shared memory / LDS than the "
                       "target has; spills on gfx942/gfx950 while coming from a shipped table row; spills more "
                       "than 2048 B a thread on NVIDIA; or fails to compile. Results are cached in "
                       "$KGEN_CHECK_CACHE (default ~/.cache/kgen/check). See docs/check.md.")
    p.add_argument("--arch", action="append", help="comma-separated: sm_80,sm_89,sm_90,sm_100,gfx942,gfx950 "
                   "(default all)")
    p.add_argument("--layout", action="append", help="only these layouts (repeatable or comma-separated)")
    p.add_argument("--kv-dtype", action="append", help="only these KV dtypes (bf16, fp8, fp8_e4m3fnuz, fp8_e5m2)")
    p.add_argument("--q-dtype", action="append", help="only these query dtypes (bf16, fp16)")
    p.add_argument("--variant", action="append",
                   help="only grouped, per_head or batch_invariant (the grouped kernel's batch-invariant mode) modules")
    p.add_argument("--entry", action="append", help="narrow the domain to token-slot or paged calls (a narrowed "
                   "run proves only that part)")
    p.add_argument("--index-dtype", action="append", help="narrow the domain to int32 or int64 index tensors")
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: os.cpu_count())")
    p.add_argument("--json", help="write everything (every variant, its domain and numbers) to this file")
    p.add_argument("--report", help="write a Markdown report to this file")
    p.add_argument("--count", action="store_true", help="only count the distinct variants per arch and what "
                   "multiplies them; compile nothing")
    p.add_argument("--plan", dest="count", nargs=0, action=_DeprecatedAlias, replacement="--count",
                   help=argparse.SUPPRESS)
    p.add_argument("--largest-rows", action="store_true", help="compile only the variant with the most rows "
                   "(BLOCK_H x L_PAD) of each program shape: the worst case of shared memory and registers, "
                   "not every variant (CI's scope; docs/check.md)")
    p.add_argument("--no-cache", action="store_true", help="compile everything again (and store nothing)")
    ledger = p.add_argument_group("the ledger (docs/check.md, \"The ledger\")")
    mode = ledger.add_mutually_exclusive_group()
    mode.add_argument("--ci", action="store_true", help="what .ci/run runs: count the scope, compile the programs "
                      "the ledger lacks and a sample of those it holds (seeded by the commit), exit 1 on any line the "
                      "sample contradicts or any program over its target's limits; exit 2 within a minute of the "
                      "first compiles when the ledger lacks more programs than --budget-s allows")
    mode.add_argument("--update-ledger", action="store_true", help="compile the scope's programs the ledger lacks "
                      "and rewrite its lines (run it with CI's flags after a kernel change, then commit the ledger)")
    ledger.add_argument("--ledger", metavar="FILE", help="the ledger (default: ledger/check-triton<version>.jsonl "
                        "of the source checkout)")
    ledger.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="--ci: wall seconds its compiles may take (default 1200; 0: no budget)")
    ledger.add_argument("--sample", type=float, default=None, metavar="FRACTION",
                        help="--ci: the share of each target's programs compiled again (default 0.05; 1 compiles "
                        "every program and compares every line)")
    ledger.add_argument("--sample-min", type=int, default=None, metavar="N",
                        help="--ci: at least N programs a target compiled again (default 20)")
    ledger.add_argument("--seed", help="--ci: the sample's seed (default: `git rev-parse HEAD`, else the "
                        "ledger's hash)")
    ledger.add_argument("--recompile", action="append", metavar="KEY,...", help="--update-ledger: compile these "
                        "programs again though the ledger has them (keys as --ci names them, or all)")
    p.add_argument("-v", "--verbose", action="store_true", help="one row per distinct variant")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_check)

    try:
        from kgen.tuner.cli import add_tune_parser
    except ImportError as exc:  # the tune extra is optional
        p = sub.add_parser("tune", help="search block configs on this GPU (needs `pip install kgen[tune]`)")
        p.set_defaults(func=lambda a, exc=exc: _missing("tune", exc))
    else:
        add_tune_parser(sub)
    try:
        from kgen.bench.cli import add_bench_parser
    except ImportError as exc:
        p = sub.add_parser("bench", help="benchmark the kernels (needs `pip install kgen[bench]`)")
        p.set_defaults(func=lambda a, exc=exc: _missing("bench", exc))
    else:
        add_bench_parser(sub)
    return parser


def _missing(what: str, exc: Exception) -> int:
    print(f"kgen {what} is unavailable: {exc}. Install it with `pip install -e .[{what}]`.", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        print(f"usage: kgen COMMAND ...\n\n{COMMANDS}", file=sys.stderr)
        print("kgen: error: name a command (above); `kgen --help` says more", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KgenError as exc:
        print(f"kgen {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kgen {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
