"""What a finished study decides, and how it lands in a table.

A study's best value was measured once, among many noisy trials: it is biased low. So
the best few distinct configs and the default are measured again ``repeats`` times; the
default's spread is the noise, and a tuned config replaces the default only when its
median beats the default's by more than max(noise, min_gain_pct) percent.

A row has two parts where the study searches the Gluon prefix stage. Its Triton fields are
decided as above among the Triton finalists, against the default's Triton fields. Its gluon
section is the Gluon finalist that beats the default's where the default has one (else the
default's), or the fastest where it has none; it is kept only when it also beats the Triton
part the same way, so a Gluon stage runs only where it measured faster. The row then holds
the Triton part as its fallback (wherever the Gluon kernel does not apply: another arch or
Triton, the paged entry, longer drafts) and its median as ``measured.triton_us``. The
fastest Triton config is always a finalist.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kgen.blockconfig import (
    TABLE_SCHEMA,
    BlockConfig,
    Measured,
    TableEntry,
    TableFile,
    TableMetadata,
    installed_triton_version,
    read_table,
    write_table,
)
from kgen.tuner.errors import TuneError

if TYPE_CHECKING:
    import optuna

    from kgen.tuner.job import TuneJob
    from kgen.tuner.objective import Backend
    from kgen.tuner.workloads import Timing


@dataclass
class JobResult:
    """The outcome of one study after re-measurement."""

    job: TuneJob
    study_name: str
    finished: int
    pruned: int
    default: BlockConfig
    default_us: float | None
    default_error: str | None
    noise_pct: float
    chosen: BlockConfig | None
    chosen_us: float | None
    replaced: bool
    candidates: list[tuple[BlockConfig, float]] = field(default_factory=list)
    # A Gluon winner's Triton fallback (its row's Triton fields): its median in the re-measurement.
    triton_us: float | None = None
    # Finalists the fit check refused (finalize), and what the row kept or dropped of the fields
    # no axis searches (SearchSpace.keep_unsearched).
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        if self.default_us and self.chosen_us:
            return self.default_us / self.chosen_us
        return None


def spread_pct(samples: list[float]) -> float:
    """(max - min) / median, in percent: the noise of repeated measurements."""
    med = statistics.median(samples)
    return 100.0 * (max(samples) - min(samples)) / med if med > 0 else 0.0


def top_configs(study: optuna.Study, k: int, triton_only: bool = False) -> list[BlockConfig]:
    """The ``k`` fastest distinct configs of the study's complete trials (only those without
    a gluon section with ``triton_only``)."""
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    out: list[BlockConfig] = []
    for trial in sorted(done, key=lambda t: t.value):
        raw = trial.user_attrs.get("config")
        if raw is None:
            continue
        cfg = BlockConfig.model_validate(raw)
        if cfg not in out and not (triton_only and cfg.gluon is not None):
            out.append(cfg)
        if len(out) == k:
            break
    return out


def finalists(study: optuna.Study, references: list[BlockConfig], k: int) -> list[BlockConfig]:
    """The configs re-measured beside the references (the default, and its Triton fields where
    it has a gluon section): the ``k`` fastest, and the fastest Triton one when a Gluon config
    is among them (a Gluon winner must beat it too)."""
    tops = [c for c in top_configs(study, k) if c not in references]
    if any(c.gluon is not None for c in tops):
        tops += [c for c in top_configs(study, 1, triton_only=True) if c not in references and c not in tops]
    return tops


def _check_reason(backend: Backend, cfg: BlockConfig) -> str | None:
    try:
        wrong = backend.parity_error(cfg)
    except Exception as exc:  # the default itself may not compile on this arch
        return f"{type(exc).__name__}: {exc}"
    return f"wrong output: {wrong}" if wrong else None


def measure_interleaved(
    backend: Backend, configs: list[BlockConfig], repeats: int
) -> tuple[list[list[float]], list[str | None]]:
    """``repeats`` rounds, each timing every config once (so a drift of clocks or
    temperature hits all of them alike). A config whose check fails or that raises gets
    no samples and a reason."""
    samples: list[list[float]] = [[] for _ in configs]
    errors = [_check_reason(backend, cfg) for cfg in configs]
    for _ in range(repeats):
        for i, cfg in enumerate(configs):
            if errors[i] is not None:
                continue
            try:
                samples[i].append(backend.measure(cfg))
            except Exception as exc:
                errors[i], samples[i] = f"{type(exc).__name__}: {exc}", []
    return samples, errors


def decide(
    default_samples: list[float],
    candidates: list[tuple[BlockConfig, list[float]]],
    min_gain_pct: float,
) -> tuple[int | None, float]:
    """Index of the candidate that replaces the default (None: keep it), and the noise.

    The fastest candidate (by median) must beat the default's median by more than
    max(noise, min_gain_pct) percent, where the noise is the spread of the default's
    repeated measurements, or the winner's when that is larger. With no default samples
    (the default failed) the fastest candidate wins outright.
    """
    measured = [(i, statistics.median(s)) for i, (_, s) in enumerate(candidates) if s]
    if not measured:
        return None, spread_pct(default_samples) if default_samples else 0.0
    best_i, best_us = min(measured, key=lambda x: x[1])
    if not default_samples:
        return best_i, 0.0
    noise = max(spread_pct(default_samples), spread_pct(candidates[best_i][1]))
    threshold = max(noise, min_gain_pct)
    default_us = statistics.median(default_samples)
    return (best_i if best_us < default_us * (1.0 - threshold / 100.0) else None), noise


Samples = tuple[BlockConfig, list[float]]  # a config and its re-measured times


def decide_lowerings(
    default: Samples, triton_default: Samples, candidates: list[Samples], min_gain_pct: float
) -> tuple[Samples | None, Samples | None, float]:
    """(Triton part, Gluon part, noise) of the row a study writes (the module docstring).

    ``triton_default`` is the default's Triton fields (the default itself when it has no
    gluon section). The Triton part is None when no Triton config ran; the Gluon part None
    where no Gluon config beats the Triton part."""
    triton = [c for c in candidates if c[0].gluon is None]
    gluon = [c for c in candidates if c[0].gluon is not None]
    won, noise = decide(triton_default[1], triton, min_gain_pct)
    triton_part = triton[won] if won is not None else (triton_default if triton_default[1] else None)
    if default[0].gluon is not None:
        won, _ = decide(default[1], gluon, min_gain_pct)
        gluon_part = gluon[won] if won is not None else default
    else:
        won, _ = decide([], gluon, min_gain_pct)  # no Gluon reference: the fastest
        gluon_part = gluon[won] if won is not None else None
    if gluon_part is None or not gluon_part[1]:
        return triton_part, None, noise
    won, gluon_noise = decide(triton_part[1] if triton_part is not None else [], [gluon_part], min_gain_pct)
    return (triton_part, gluon_part, gluon_noise) if won is not None else (triton_part, None, noise)


def _refused_part(triton: Samples | None, gluon: Samples | None, references: list[BlockConfig],
                  accept: Callable[[BlockConfig], str | None], chosen: BlockConfig) -> tuple[Samples, str] | None:
    """The finalist that keeps ``chosen`` from its row, and why (None: the row may be written).
    A part that is the default's is never refused (CI's kgen check proves the defaults); where
    both parts are finalists, the Triton part is judged alone first."""
    triton_own = triton is not None and triton[0] not in references
    gluon_own = gluon is not None and gluon[0] not in references
    if not (triton_own or gluon_own):
        return None
    if triton_own and gluon_own:
        reason = accept(triton[0])
        if reason is not None:
            return triton, reason
    reason = accept(chosen)
    if reason is None:
        return None
    return (gluon if gluon_own else triton), reason


def finalize(
    job: TuneJob,
    study: optuna.Study,
    default: BlockConfig,
    backend: Backend,
    timing: Timing,
    accept: Callable[[BlockConfig], str | None] | None = None,
) -> JobResult:
    """Re-measure the default (and its Triton fields alone where it has a gluon section) and
    the finalists; decide the row (``decide_lowerings``). A Gluon part takes the Triton part as
    its Triton fields (the default's when no Triton config ran). ``accept`` judges the row a
    decision would write over its whole domain (kgen/tuner/fit.py): a finalist it refuses is
    dropped and the row decided again, with the refusal among the result's notes."""
    import optuna

    triton_default = default.model_copy(update={"gluon": None})
    references = list(dict.fromkeys([default, triton_default]))
    tops = finalists(study, references, timing.top_k)
    samples, errors = measure_interleaved(backend, [*references, *tops], timing.repeats)
    measured = list(zip([*references, *tops], samples, strict=True))
    default_samples, default_error = samples[0], errors[0]
    candidates = measured[len(references):]
    notes: list[str] = []
    while True:
        triton, gluon, noise = decide_lowerings(measured[0], measured[len(references) - 1], candidates,
                                                timing.min_gain_pct)
        chosen, chosen_us, triton_us = None, None, None
        if gluon is not None:
            fallback = triton[0] if triton is not None else triton_default
            chosen, chosen_us = fallback.model_copy(update={"gluon": gluon[0].gluon}), statistics.median(gluon[1])
            triton_us = statistics.median(triton[1]) if triton is not None else None
        elif triton is not None:
            chosen, chosen_us = triton[0], statistics.median(triton[1])
        refused = None if accept is None or chosen is None else _refused_part(triton, gluon, references, accept,
                                                                             chosen)
        if refused is None:
            break
        (config, _), reason = refused
        notes.append(f"{config.short()} refused: {reason}")
        candidates = [c for c in candidates if c[0] != config]
    default_us = statistics.median(default_samples) if default_samples else None
    pruned = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.PRUNED,))
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return JobResult(
        job=job,
        study_name=study.study_name,
        finished=len(pruned) + len(complete),
        pruned=len(pruned),
        default=default,
        default_us=default_us,
        default_error=default_error,
        noise_pct=noise,
        chosen=chosen,
        chosen_us=chosen_us,
        replaced=chosen is not None and chosen != default,
        candidates=[(c, statistics.median(s)) for c, s in candidates if s],
        triton_us=triton_us,
        notes=notes,
    )


# --------------------------------------------------------------------------- tables


def entry_for(result: JobResult, gpu_name: str | None = None) -> TableEntry | None:
    """The table entry of one result, measured on ``gpu_name`` (None when neither the default
    nor a tuned config ran)."""
    if result.chosen is None or result.chosen_us is None:
        return None
    job = result.job
    measured = None
    if result.default_us is not None:
        measured = Measured(
            tuned_us=round(result.chosen_us, 3),
            default_us=round(result.default_us, 3),
            noise_pct=round(result.noise_pct, 2),
            workloads=[w.model_dump() for w in job.workloads],
            triton_us=round(result.triton_us, 3) if result.triton_us is not None else None,
            gpu_name=gpu_name,
        )
    return TableEntry(
        layout=job.layout.name,
        kv_dtype=job.kv_dtype,
        group_size=job.group_size,
        batch_min=job.bucket.batch_min,
        batch_max=job.bucket.batch_max,
        config=result.chosen.for_arch(job.arch),
        measured=measured,
    )


def _same_key(a: TableEntry, b: TableEntry) -> bool:
    return (a.layout, a.kv_dtype, a.group_size) == (b.layout, b.kv_dtype, b.group_size)


def _subtract(entry: TableEntry, lo: int, hi: int) -> list[TableEntry]:
    """``entry`` with the batch range lo..hi cut out (0, 1 or 2 pieces)."""
    if hi < entry.batch_min or lo > entry.batch_max:
        return [entry]
    pieces = []
    if entry.batch_min < lo:
        pieces.append(entry.model_copy(update={"batch_max": lo - 1}))
    if entry.batch_max > hi:
        pieces.append(entry.model_copy(update={"batch_min": hi + 1}))
    return pieces


def merge_entries(old: list[TableEntry], new: list[TableEntry]) -> list[TableEntry]:
    """Old entries with every newly tuned (layout, kv, group, batch range) cut out, plus the
    new ones: a partial tune replaces exactly what it measured and keeps the rest."""
    kept = list(old)
    for n in new:
        nxt: list[TableEntry] = []
        for e in kept:
            nxt.extend(_subtract(e, n.batch_min, n.batch_max) if _same_key(e, n) else [e])
        kept = nxt
    return sorted(kept + list(new), key=lambda e: (e.layout, e.kv_dtype, e.group_size, e.batch_min))


def attribute_to(entries: list[TableEntry], gpu_name: str) -> list[TableEntry]:
    """``entries`` with ``gpu_name`` written into every measured row that names no GPU. Such a
    row was measured on the GPU its table's metadata names (SCHEMA.md, ``measured.gpu_name``), so
    before a run on another GPU replaces that metadata, its rows must say where they came from."""
    return [e.model_copy(update={"measured": e.measured.model_copy(update={"gpu_name": gpu_name})})
            if e.measured is not None and e.measured.gpu_name is None else e for e in entries]


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def tune_metadata(arch: str, gpu_name: str, trials: int, previous: TableMetadata | None, note: str) -> TableMetadata:
    return TableMetadata(
        gpu_name=gpu_name,
        arch=arch,
        torch_version=_torch_version(),
        triton_version=installed_triton_version(),
        date=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        trials=(previous.trials if previous else 0) + trials,
        tuned=True,
        note=note,
    )


def write_results(
    path: Path, arch: str, gpu_name: str, results: list[JobResult], note: str = "", workers: int = 1,
    seed: TableFile | None = None,
) -> tuple[TableFile, bool]:
    """Merge the results into the table at ``path`` (created, with its folder, if absent:
    then from ``seed``'s entries) and write it atomically. Returns the table and whether the
    file changed. The default note names how many studies, finished trials and workers the
    new entries come from."""
    path = Path(path)
    previous = read_table(path) if path.exists() else seed
    if previous is not None and previous.arch != arch:
        raise TuneError(f"{path} holds the table of {previous.arch}, not {arch}: a table file is named for "
                        f"its arch, so move it to {path.parent / (previous.arch + '.json')}")
    new = [e for e in (entry_for(r, gpu_name) for r in results) if e is not None]
    kept = list(previous.entries) if previous else []
    if previous is not None and previous.metadata.gpu_name != "unknown":
        kept = attribute_to(kept, previous.metadata.gpu_name)
    entries = merge_entries(kept, new)
    carried = sum(1 for e in entries if e.measured is None)
    trials = sum(r.finished for r in results)
    if not note:
        note = (
            f"kgen tune on {gpu_name}: {len(new)} {'entry' if len(new) == 1 else 'entries'} measured in this run "
            f"from {len(results)} {'study' if len(results) == 1 else 'studies'} ({trials} finished trials, "
            f"{workers} {'worker' if workers == 1 else 'workers'})"
        )
        if carried:
            note += f"; {carried} entries without 'measured' were carried over untuned"
    meta = tune_metadata(arch, gpu_name, trials, previous.metadata if previous else None, note)
    table = TableFile.model_validate(
        {
            "schema": TABLE_SCHEMA,
            "arch": arch,
            "metadata": meta.model_dump(),
            "entries": [e.model_dump() for e in entries],
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    return table, write_table(path, table)


def format_results(results: list[JobResult]) -> str:
    """The closing table: default vs tuned per bucket."""
    head = ("layout", "kv", "group", "batch", "trials", "default us", "tuned us", "speedup", "noise %", "decision")
    rows = [head]
    for r in results:
        j = r.job
        if r.chosen is None:
            decision = f"nothing ran: {r.default_error or 'every trial pruned'}"
        elif r.default_error:
            decision = f"tuned (default failed: {r.default_error[:60]})"
        elif not r.replaced:
            decision = "kept default (no win beyond noise)"
        elif r.chosen.gluon is not None:
            versus = f", its Triton fields {r.triton_us:.2f} us" if r.triton_us else ""
            decision = f"tuned: Gluon prefix stage{versus}"
        else:
            decision = "tuned"
        rows.append(
            (
                j.layout.name,
                j.kv_dtype,
                str(j.group_size),
                j.bucket.label(),
                f"{r.finished} ({r.pruned} pruned)",
                f"{r.default_us:.2f}" if r.default_us else "-",
                f"{r.chosen_us:.2f}" if r.chosen_us else "-",
                f"{r.speedup:.3f}x" if r.speedup else "-",
                f"{r.noise_pct:.2f}",
                decision,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    chosen = [f"  {r.job.label()}: {r.chosen.short()}" for r in results if r.replaced and r.chosen]
    if chosen:
        lines += ["", "tuned configs:", *chosen]
    notes = [f"  {r.job.label()}: {note}" for r in results for note in r.notes]
    if notes:
        lines += ["", "notes (refused finalists, fields no axis searches):", *notes]
    return "\n".join(lines)
