"""``kgen tune``: search block configs on the GPU and write them to the arch's table.

The main CLI (kgen/cli.py) calls ``add_tune_parser(subparsers)`` and dispatches the
``tune`` command to ``run_tune(args)`` (also set as ``args.func``). ``python -m
kgen.tuner.cli tune ...`` runs the same command on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kgen.blockconfig import TABLE_DIR, BlockConfig, TableFile, resolve_tables
from kgen.errors import KgenError
from kgen.locations import TABLES_DIR_ENV, source_root
from kgen.passes.legalize import MAX_DRAFT_TOKENS
from kgen.spec import KV_DTYPES, Q_DTYPES, LayoutSpec, canonical_dtype, load_layouts
from kgen.tuner.errors import TuneError
from kgen.tuner.job import TuneJob
from kgen.tuner.space import SPACES_FILE, SearchSpace, SpacesFile, arch_profile, load_spaces
from kgen.tuner.study import (
    STORAGE_ENV,
    BackendSpec,
    Interrupted,
    StopRequest,
    WorkerSpec,
    build_space,
    make_backend,
    redact_url,
    resolve_storage,
    restore_sigint,
    run_inprocess,
    run_workers,
    stop_on_sigint,
    study_name,
)
from kgen.tuner.workloads import WORKLOADS_FILE, Bucket, WorkloadsFile, load_workloads

if TYPE_CHECKING:
    from collections.abc import Callable

    from kgen.tuner.results import JobResult

EPILOG = """\
examples:
  kgen tune --dry-run --arch sm_90                      # the space and workloads, no GPU
  kgen tune --layout qwen3_5_gqa256 --kv-dtype bf16 --group 8 --trials 150
  KGEN_TUNE_STORAGE=postgresql+psycopg2://user:pw@db/kgen kgen tune --workers 8
  kgen tune --report --workers 2                        # who ran which trials, from the storage
The study resumes where it stopped when the same command runs again (Ctrl-C is safe).
The storage URL comes from --storage, else $KGEN_TUNE_STORAGE (keeps a password out of
the process list and the shell history), else an SQLite file in the cache dir; a
password is printed as ***. See docs/tuning.md.
"""


def add_tune_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``tune`` on the main CLI's subparsers; dispatch to ``run_tune``."""
    p = subparsers.add_parser(
        "tune",
        help="autotune block configs on this GPU and write kgen/tables/<arch>.json",
        description="Search block configs per (layout, KV dtype, group size, batch bucket) with "
        "Optuna (TPE), check each against the reference, and write the winners to the table.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sel = p.add_argument_group("what to tune (default: everything the arch supports)")
    sel.add_argument("--arch", help="target arch (sm_90, gfx942, ...); default: the GPU's. Required with --dry-run")
    sel.add_argument("--layout", action="append", metavar="NAME", help="layout name (repeatable)")
    sel.add_argument("--kv-dtype", action="append", metavar="DTYPE", help="KV dtype: bf16, fp8, ... (repeatable)")
    sel.add_argument("--q-dtype", default="bfloat16", metavar="DTYPE", help="query dtype (default bfloat16)")
    sel.add_argument("--group", action="append", type=int, metavar="G", help="group size (repeatable)")
    sel.add_argument(
        "--bucket", action="append", metavar="NAME", help="batch bucket name from the workloads file (repeatable)"
    )

    bud = p.add_argument_group("budget and workers")
    bud.add_argument(
        "--trials", type=int, default=100, help="finished trials per study, in all runs together (default 100)"
    )
    bud.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="stop each study's search after this long"
    )
    bud.add_argument(
        "--workers", type=int, default=1, help="worker processes on one study, one per local GPU (default 1)"
    )
    bud.add_argument("--seed", type=int, default=0, help="TPE seed (default 0)")

    io = p.add_argument_group("storage and output")
    io.add_argument(
        "--storage",
        metavar="URL",
        help=f"Optuna RDB URL; default ${STORAGE_ENV}, else an sqlite file in the kgen cache dir "
        "($KGEN_CACHE_DIR overrides the dir). The flag wins over the environment",
    )
    io.add_argument(
        "--report",
        action="store_true",
        help="no tuning: for every kgen study in the storage, the trials per worker and GPU, lost or "
        "twice-measured trials and the table writes; exit 1 when a check fails (--workers N: "
        "expect N workers on N GPUs)",
    )
    io.add_argument("--out", type=Path, metavar="DIR",
                    help="folder the table is merged into, as DIR/<arch>.json; kgen.load reads it with "
                    "KGEN_TABLES_DIR=DIR, no rebuild (default: $KGEN_TABLES_DIR, else kgen/tables/ of a source "
                    "checkout)")
    io.add_argument("--dry-run", action="store_true", help="print the space and workloads; touch no GPU, write nothing")
    io.add_argument("--no-progress", action="store_true", help="no progress bar")
    io.add_argument("--spaces", type=Path, default=SPACES_FILE, metavar="TOML", help="search-space file")
    io.add_argument("--workloads", type=Path, default=WORKLOADS_FILE, metavar="TOML", help="buckets/workloads file")
    io.add_argument("--draft-tokens", metavar="L[,L...]",
                    help="time every bucket at these draft lengths instead of the workloads file's (e.g. 4,16: "
                    "a row then answers for the MMA-bound drafts too); new studies, as any change of workloads")

    obj = p.add_argument_group("objective")
    obj.add_argument(
        "--objective",
        choices=("gpu", "synthetic"),
        default="gpu",
        help="gpu: time the generated kernels (default); synthetic: a CPU stand-in with a "
        "known optimum, to test the tuner itself (writes a table only with --out DIR)",
    )
    obj.add_argument(
        "--fit-check",
        choices=("auto", "on", "off"),
        default="auto",
        help="judge each winner's row over its whole domain (every draft length, entry and mask) with kgen "
        "check's rule before writing it, and fall back to the next finalist where it fails (compiled offline; "
        "docs/tuning.md, 'Choosing the winner'); auto: on with the gpu objective, off with synthetic",
    )
    obj.add_argument(
        "--synthetic-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="seconds each synthetic measurement sleeps (to test interruption)",
    )
    p.set_defaults(func=run_tune)
    return p


# --------------------------------------------------------------------------- planning


def _layouts(names: list[str] | None, specs: dict[str, LayoutSpec]) -> list[LayoutSpec]:
    if not names:
        return list(specs.values())
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise TuneError(f"unknown layout(s) {unknown}; known: {', '.join(specs)}")
    return [specs[n] for n in dict.fromkeys(names)]


def _kv_dtypes(names: list[str] | None, default: tuple[str, ...]) -> tuple[list[str], bool]:
    if not names:
        return list(default), False
    try:
        return [canonical_dtype(n, KV_DTYPES, "KV") for n in dict.fromkeys(names)], True
    except ValueError as exc:
        raise TuneError(f"--kv-dtype: {exc}") from None


def _buckets(names: list[str] | None, workloads: WorkloadsFile) -> list[Bucket]:
    return [workloads.bucket_named(n) for n in dict.fromkeys(names)] if names else list(workloads.bucket)


def plan_jobs(args: argparse.Namespace, arch: str, spaces: SpacesFile, workloads: WorkloadsFile) -> list[TuneJob]:
    """Every (layout, KV dtype, group, bucket) to tune; an explicit choice that matches no
    layout is an error, so a typo never tunes nothing quietly."""
    profile = arch_profile(arch, spaces)
    try:
        q_dtype = canonical_dtype(args.q_dtype, Q_DTYPES, "query")
    except ValueError as exc:
        raise TuneError(f"--q-dtype: {exc}") from None
    kvs, kv_explicit = _kv_dtypes(args.kv_dtype, profile.kv_dtypes)
    buckets = _buckets(args.bucket, workloads)
    jobs, used_kv, used_groups = [], set(), set()
    for layout in _layouts(args.layout, load_layouts()):
        groups = [g for g in layout.attention.group_sizes if not args.group or g in args.group]
        for kv in kvs:
            if kv not in layout.dtypes.kv or q_dtype not in layout.dtypes.q:
                continue
            used_kv.add(kv)
            for g in groups:
                used_groups.add(g)
                jobs += [TuneJob(arch, layout, kv, q_dtype, g, b, tuple(workloads.workloads(b))) for b in buckets]
    if kv_explicit and set(kvs) - used_kv:
        raise TuneError(f"KV dtype(s) {sorted(set(kvs) - used_kv)} are not offered by the selected layouts")
    if args.group and set(args.group) - used_groups:
        raise TuneError(f"group size(s) {sorted(set(args.group) - used_groups)} belong to no selected layout")
    if not jobs:
        raise TuneError("nothing to tune: the selection matches no layout, dtype and group")
    return jobs


def current_config(job: TuneJob) -> BlockConfig | None:
    """The config the table in use picks today for the bucket (enqueued second)."""
    source = resolve_tables().get(job.arch)
    if source is None or source.table is None:
        return None
    entry = source.table.lookup(job.layout.name, job.kv_dtype, job.group_size, job.bucket.batch_min)
    return entry.config if entry else None


def _enqueue(job: TuneJob, space: SearchSpace) -> tuple[BlockConfig, ...]:
    """The first trials of a study: the default (what the winner must beat), then the table's
    current config; a config with a gluon section is followed by its Triton fields alone
    (the Triton reference of its Gluon stage, and its fallback)."""
    wanted: list[BlockConfig] = []
    for cfg in (space.default, current_config(job)):
        if cfg is not None:
            wanted += [cfg, cfg.model_copy(update={"gluon": None})] if cfg.gluon else [cfg]
    return tuple(dict.fromkeys(wanted))


# --------------------------------------------------------------------------- dry run


def dry_run(
    jobs: list[TuneJob], spaces: SpacesFile, storage: str, out: Path | None, budget: str = "", source: str = ""
) -> str:
    """The spaces, workloads, defaults and study names, as text; no GPU, no writes. The
    storage URL is shown with its password as ***."""
    shown = redact_url(storage) + (f"  (from {source})" if source else "")
    lines = [f"storage: {shown}", f"table:   {out or '(none: synthetic objective without --out)'}", ""]
    shown: set[tuple[str, str, int]] = set()
    for job in jobs:
        space = build_space(job, spaces)
        key = (job.layout.name, job.kv_dtype, job.group_size)
        if key not in shown:
            shown.add(key)
            default = space.default
            params, notes = space.params_of(default)
            lines += [
                f"== {job.layout.name}  kv={job.kv_dtype}  q={job.q_dtype}  group={job.group_size}",
                space.describe(),
                f"  default: {default.short()}"
                f"{'  [does not fit: ' + space.why_not(default) + ']' if space.why_not(default) else ''}",
            ]
            lines += [f"  enqueued as: {', '.join(notes)}"] if notes else []
        wl = ", ".join(w.label() for w in job.workloads)
        lines.append(f"  bucket {job.bucket.name} (batch {job.bucket.label()}): {wl}")
        lines.append(f"    study {study_name(job, space)}")
    lines.append(f"\n{len(jobs)} {'study' if len(jobs) == 1 else 'studies'}, {budget}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- run


def _device(args: argparse.Namespace) -> tuple[str, str]:
    """(arch, GPU name). The GPU is touched only for the gpu objective of a real run."""
    if args.dry_run or args.objective == "synthetic":
        if not args.arch:
            raise TuneError("--arch is required with --dry-run or --objective synthetic (no GPU is looked at)")
        return args.arch, "synthetic (no GPU)" if args.objective == "synthetic" else "-"
    from kgen.tuner.gpu import detect_device

    device = detect_device()
    if args.arch and args.arch != device.arch:
        raise TuneError(f"--arch {args.arch} but the GPU is {device.arch} ({device.name}): tune on a {args.arch} GPU")
    return device.arch, device.name


def _check_args(args: argparse.Namespace) -> None:
    if args.trials < 1:
        raise TuneError(f"--trials must be >= 1, got {args.trials}")
    if args.workers < 1:
        raise TuneError(f"--workers must be >= 1, got {args.workers}")
    if args.timeout is not None and args.timeout <= 0:
        raise TuneError(f"--timeout must be > 0 seconds, got {args.timeout}")


def _with_drafts(workloads: WorkloadsFile, text: str | None) -> WorkloadsFile:
    """The workloads with every bucket timed at the draft lengths of ``--draft-tokens``."""
    if not text:
        return workloads
    try:
        drafts = tuple(dict.fromkeys(int(x) for x in text.split(",")))
    except ValueError:
        raise TuneError(f"--draft-tokens {text!r}: give draft lengths as integers, e.g. 4,16") from None
    if not drafts or not all(1 <= d <= MAX_DRAFT_TOKENS for d in drafts):
        raise TuneError(f"--draft-tokens {text!r}: draft lengths are 1 to {MAX_DRAFT_TOKENS}")
    buckets = tuple(b.model_copy(update={"draft_tokens": None}) for b in workloads.bucket)
    return workloads.model_copy(update={"draft_tokens": drafts, "bucket": buckets})


def _gpus(args: argparse.Namespace) -> list[str | None]:
    if args.objective != "gpu":
        return [None] * args.workers
    import torch

    from kgen.tuner.gpu import select_gpu

    count = torch.cuda.device_count()
    if args.workers > count:
        raise TuneError(f"--workers {args.workers} but only {count} GPU(s) are visible: one worker per GPU")
    return [select_gpu(i) for i in range(args.workers)]


def _tune_job(
    job: TuneJob,
    args: argparse.Namespace,
    spaces: SpacesFile,
    workloads: WorkloadsFile,
    storage: str,
    gpus: list[str | None],
    stop: StopRequest,
) -> JobResult:
    """Search one study to its budget, then re-measure its finalists and decide."""
    from kgen.tuner.results import finalize

    space = build_space(job, spaces)
    spec = BackendSpec(kind=args.objective, seed=args.seed, synthetic_delay_s=args.synthetic_delay)
    enqueue = _enqueue(job, space)
    progress = not args.no_progress
    backend = None
    if args.workers == 1:
        backend = make_backend(spec, job, space, workloads)
        study = run_inprocess(
            job, space, backend, storage, args.trials, args.timeout, args.seed, enqueue, progress, stop
        )
    else:
        specs = [
            WorkerSpec(job, spaces, workloads, spec, storage, args.trials, args.timeout, args.seed, i, gpu)
            for i, gpu in enumerate(gpus)
        ]
        study = run_workers(specs, space, enqueue, progress, stop=stop)
        backend = make_backend(spec, job, space, workloads)
    source = current_config(job) or space.default
    result = finalize(job, study, enqueue[0], backend, workloads.timing, _fit_check(job, args, space, source))
    return _with_unsearched_kept(result, space, source)


def _fit_check(job: TuneJob, args: argparse.Namespace, space: SearchSpace,
               source: BlockConfig | None) -> Callable[[BlockConfig], str | None] | None:
    """The judge of a winner's row (kgen/tuner/fit.py), on the config it would be written with
    (the unsearched fields of ``source`` kept); None where --fit-check leaves it off."""
    if args.fit_check == "off" or (args.fit_check == "auto" and args.objective != "gpu"):
        return None
    from kgen.tuner.fit import fit_error

    return lambda config: fit_error(job, space.keep_unsearched(config, source)[0])


def _with_unsearched_kept(result: JobResult, space: SearchSpace, source: BlockConfig | None) -> JobResult:
    """The result whose row keeps the fields no axis searches (``SearchSpace.keep_unsearched``)
    of ``source``, the config the bucket runs today, with a note for each."""
    if result.chosen is None:
        return result
    chosen, notes = space.keep_unsearched(result.chosen, source)
    return dataclasses.replace(result, chosen=chosen, replaced=chosen != result.default, notes=[*result.notes, *notes])


def _default_out(args: argparse.Namespace, arch: str) -> Path | None:
    """The table file to write: DIR/<arch>.json of --out DIR, else of $KGEN_TABLES_DIR, else the
    checkout's kgen/tables/ (None: a synthetic run without --out writes nothing)."""
    if args.out is not None:
        directory = args.out
    elif args.objective == "synthetic":
        return None
    elif os.environ.get(TABLES_DIR_ENV):
        directory = Path(os.environ[TABLES_DIR_ENV])
    elif source_root() is not None:
        directory = TABLE_DIR
    else:
        raise TuneError("kgen is not running from a source checkout, so its kgen/tables/ is site-packages, "
                        f"which kgen tune never writes into: pass --out DIR and set {TABLES_DIR_ENV}=DIR "
                        "for kgen.load to read the table")
    if directory.suffix == ".json" or directory.is_file():
        raise TuneError(f"--out takes a folder (the table is written as DIR/{arch}.json), not the file "
                        f"{directory}: pass {directory.parent}")
    return directory / f"{arch}.json"


def _seed_table(arch: str) -> TableFile | None:
    """What a new table file starts from: the arch's table in use now (the shipped one, or
    $KGEN_TABLE's), so DIR/<arch>.json keeps the rows this run does not tune."""
    source = resolve_tables().get(arch)
    return source.table if source is not None else None


SYNTHETIC_NOTE = "SYNTHETIC: made by `kgen tune --objective synthetic` (no GPU); the times are not real"


def _require_optuna() -> None:
    """A clean error instead of an ImportError deep in a study (a dry run needs no Optuna)."""
    import importlib.util

    missing = [m for m in ("optuna", "sqlalchemy") if importlib.util.find_spec(m) is None]
    if missing:
        raise TuneError(f"kgen tune needs {', '.join(missing)}: pip install -e '.[tune]'")


def _quiet_optuna() -> None:
    """The progress bar and the closing table are the output; Optuna's per-trial log lines
    would bury them."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def run_report(storage: str, expect_workers: int) -> int:
    """``kgen tune --report``: the report of every kgen study in the storage; 1 when a
    check fails or there is no study."""
    from kgen.tuner.report import format_report, storage_reports
    from kgen.tuner.study import make_storage

    reports = storage_reports(make_storage(storage), expect_workers)
    if not reports:
        print(f"no kgen tune study in {redact_url(storage)}")
        return 1
    print("\n\n".join(format_report(r) for r in reports))
    return 1 if any(r.problems for r in reports) else 0


def _record_writes(storage: str, results: list[JobResult], out: Path, workers: int) -> None:
    """Note the table write in each study it came from (``--report`` shows it)."""
    import optuna

    from kgen.tuner.report import record_table_write
    from kgen.tuner.study import make_storage

    store = make_storage(storage)
    for r in results:
        record_table_write(optuna.load_study(study_name=r.study_name, storage=store), out, r.finished, workers)


def _print_reports(storage: str, results: list[JobResult], workers: int) -> None:
    """After a multi-worker run: who ran the trials of each study."""
    import optuna

    from kgen.tuner.report import format_report, study_report
    from kgen.tuner.study import make_storage

    store = make_storage(storage)
    for r in results:
        print(format_report(study_report(optuna.load_study(study_name=r.study_name, storage=store), workers)))


def run_tune(args: argparse.Namespace) -> int:
    """Run ``kgen tune``; returns the exit status (130 after Ctrl-C, with work kept)."""
    from kgen.tuner.results import format_results, write_results

    _check_args(args)
    storage, source = resolve_storage(args.storage, dict(os.environ))
    if args.report:
        _require_optuna()
        _quiet_optuna()
        return run_report(storage, args.workers)
    spaces, workloads = load_spaces(args.spaces), _with_drafts(load_workloads(args.workloads), args.draft_tokens)
    arch, gpu_name = _device(args)
    jobs = plan_jobs(args, arch, spaces, workloads)
    out = _default_out(args, arch)
    if args.dry_run:
        budget = f"{args.trials} finished trials each" + (f", at most {args.timeout:g} s each" if args.timeout else "")
        print(dry_run(jobs, spaces, storage, out, budget, source))
        return 0
    _require_optuna()
    restore_sigint()  # started with SIGINT ignored (`cmd &` in a script): Ctrl-C must still stop it cleanly
    gpus = _gpus(args)
    _quiet_optuna()
    results, status = [], 0
    try:
        with stop_on_sigint() as stop:
            for job in jobs:
                results.append(_tune_job(job, args, spaces, workloads, storage, gpus, stop))
    except (Interrupted, KeyboardInterrupt):
        status = 130
        print(
            f"\ninterrupted: finished trials are kept in {redact_url(storage)}; "
            "run the same command again to resume",
            file=sys.stderr,
        )
    if results:
        print(format_results(results))
        if out is not None:
            note = SYNTHETIC_NOTE if args.objective == "synthetic" else ""
            _table, changed = write_results(out, arch, gpu_name, results, note, workers=args.workers,
                                            seed=None if out.exists() else _seed_table(arch))
            _record_writes(storage, results, out, args.workers)
            print(f"{'wrote' if changed else 'unchanged:'} {out}")
        else:
            print("synthetic objective: no table written (pass --out DIR to write one)")
        if args.workers > 1:
            _print_reports(storage, results, args.workers)
    return status


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m kgen.tuner.cli tune ...``."""
    parser = argparse.ArgumentParser(prog="kgen")
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KgenError as exc:
        print(f"kgen tune: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
