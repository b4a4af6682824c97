"""The measurement loop: cases in, results out, with kernels as callables and an injected timer.

Nothing here touches torch. A *provider* turns a case into ``KernelRun`` objects (the GPU
one builds tensors and compiles kernels; tests pass fakes), the *timer* turns a launch
callable into a ``Timing``. This split is what lets CI check every figure the report
derives (GB/s, % of the copy ceiling, speed-ups, FAILED verdicts, peer reuse, the time
limit) without a GPU and without a clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kgen.bench.cases import HEADLINE_KERNEL, KERNELS, KGEN_KERNELS, PEER_KERNELS, Case, min_bytes
from kgen.bench.timing import Launch, PairedTiming, Timer, Timing, percentile

# Max |out - ref| / max |ref| allowed: bf16 outputs round at ~4e-3, the P.V product runs in
# bf16; FP8 adds the dequantized-operand path of the kernel under test.
TOLERANCE_BF16 = 2e-2
TOLERANCE_FP8 = 5e-2

KernelStatus = Literal["ok", "failed", "error", "unsupported", "skipped"]
# A variant of a kernel in a sweep is named "<kernel>@<label>", e.g. "flex@BLOCK_N=32,...".
VARIANT_SEP = "@"


def tolerance_for(case: Case) -> float:
    return TOLERANCE_FP8 if case.is_fp8 else TOLERANCE_BF16


@dataclass
class KernelRun:
    """One kernel made ready for one case by a provider.

    ``fn(i)`` launches on input set ``i`` of ``n_sets``; ``check()`` runs it once and
    returns its max relative error against the reference. A provider that cannot build the
    kernel sets ``unsupported`` (the shape is refused: a fact about the peer) or ``error``
    (something broke: a fact about this run).
    """

    fn: Launch | None = None
    n_sets: int = 1
    check: Callable[[], float] | None = None
    tolerance: float | None = None
    choice: str = ""
    scratch_bytes: int | None = None
    note: str = ""
    unsupported: str | None = None
    error: str | None = None
    index_dtype: str | None = None  # the kv_indices dtype fn launches with (kgen kernels)
    alt: KernelRun | None = None  # the same kernel on the other kv_indices dtype, timed in alternation
    mask: str | None = None  # the draft mask fn launches with (a mask A/B's other side)
    mask_alt: KernelRun | None = None  # the same kernel with the case's other mask, timed in alternation
    baseline: KernelRun | None = None  # the same kernel of an earlier build, timed in alternation
    baseline_modules: str = ""  # where ``baseline``'s module came from
    module: str = ""  # the generated module fn launches (its URI; kgen kernels)
    # The default grouped module, timed in alternation with this batch-invariant one (--batch-invariant).
    default_mode: KernelRun | None = None


class Measured(BaseModel):
    """What every timed figure of one kernel holds."""

    model_config = ConfigDict(extra="forbid")

    status: KernelStatus
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    max_rel_err: float | None = None
    note: str = ""


class Alternated(Measured):
    """The other side of an A/B timed in alternation with a kernel (``CudaGraphTimer.pair``):
    its time, and the median, 10th and 90th percentiles over the alternations of
    (the kernel's time / this side's time)."""

    ratio: float | None = None
    ratio_p10: float | None = None
    ratio_p90: float | None = None
    alternations: int | None = None


class IndexAB(Alternated):
    """A kgen kernel on the case's other kv_indices dtype (``--index-dtype a,b``)."""

    dtype: str


class MaskAB(Alternated):
    """A kgen kernel with the case's other draft mask (``--mask a,b``, e.g. tree against the
    unmasked chain): ratio > 1 means the case's own mask is slower."""

    mask: str


class BuildAB(Alternated):
    """The same-named grouped module of an earlier build (``--baseline-modules DIR``): ratio
    > 1 means the current build is slower there."""

    modules: str


class ModeAB(Alternated):
    """The default grouped module, timed in alternation with the batch-invariant one whose
    figures the kernel's are (``--batch-invariant``): ratio > 1 means the batch-invariant
    module is slower."""

    module: str


class KernelResult(Measured):
    """One kernel on one case, as written to JSON."""

    launches: int | None = None
    replays: int | None = None
    timing_mode: str | None = None
    gbps: float | None = None
    pct_copy: float | None = None
    tolerance: float | None = None
    choice: str = ""
    scratch_bytes: int | None = None
    shared_from: str | None = None
    index_ab: IndexAB | None = None
    mask_ab: MaskAB | None = None
    build_ab: BuildAB | None = None
    mode_ab: ModeAB | None = None

    @property
    def timed(self) -> bool:
        return self.median_us is not None and self.median_us > 0


class CaseResult(BaseModel):
    """Every kernel on one case, the derived figures and the case verdict."""

    model_config = ConfigDict(extra="forbid")

    key: str
    case: Case
    min_bytes: int
    min_bytes_parts: dict[str, int]
    input_sets: int = 0
    status: Literal["ok", "FAILED", "skipped"]
    kernels: dict[str, KernelResult] = Field(default_factory=dict)
    speedup: dict[str, float] = Field(default_factory=dict)
    note: str = ""


class SweepEntry(BaseModel):
    """One kernel-option variant timed on one case (the FlexAttention sweep)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    peer_key: str
    kernel: str
    options: str
    result: KernelResult


def _short(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bandwidth(nbytes: int, median_us: float, copy_gbps: float | None) -> tuple[float, float | None]:
    gbps = nbytes / (median_us * 1e-6) / 1e9
    return gbps, (100.0 * gbps / copy_gbps if copy_gbps else None)


def _timed_result(base: dict[str, Any], timing: Timing, nbytes: int, copy_gbps: float | None) -> KernelResult:
    gbps, pct = _bandwidth(nbytes, timing.median_us, copy_gbps)
    figures = dataclasses.asdict(timing)  # median_us, p10_us, p90_us, launches, replays, mode
    figures["timing_mode"] = figures.pop("mode")
    return KernelResult(**base, **figures, gbps=gbps, pct_copy=pct)


def _checked(run: KernelRun, tolerance: float) -> tuple[KernelStatus, float | None, str]:
    """(status, max rel error, note) of ``run.check``: ok, failed (beyond tolerance or not
    finite) or error (it raised)."""
    if run.check is None:
        return "ok", None, ""
    try:
        err = float(run.check())
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        return "error", None, f"check: {_short(exc)}"
    return ("failed" if not math.isfinite(err) or err > tolerance else "ok"), err, ""


def measure_kernel(
    run: KernelRun, timer: Timer, nbytes: int, copy_gbps: float | None, tolerance: float
) -> KernelResult:
    """Check once, then time. A wrong result is still timed (status ``failed``), so the
    report shows how fast the wrong kernel was; an exception ends the kernel (``error``).
    With ``run.alt`` both index dtypes are checked and timed in alternation (``timer.pair``),
    with ``run.mask_alt`` both draft masks."""
    base: dict[str, Any] = {
        "choice": run.choice,
        "scratch_bytes": run.scratch_bytes,
        "note": run.note,
        "tolerance": run.tolerance if run.tolerance is not None else tolerance,
    }
    if run.error is not None:
        return KernelResult(status="error", **{**base, "note": run.error})
    if run.unsupported is not None or run.fn is None:
        return KernelResult(status="unsupported", **{**base, "note": run.unsupported or "no kernel"})
    status, err, note = _checked(run, base["tolerance"])
    if status == "error":
        return KernelResult(status="error", **{**base, "note": note})
    if run.check is not None:
        base["max_rel_err"] = err
    if run.alt is not None and run.alt.fn is not None:
        label = {"dtype": run.alt.index_dtype or "?"}
        return _measure_pair(run, run.alt, timer, {**base, "status": status}, nbytes, copy_gbps, "index_ab", label)
    if run.mask_alt is not None:
        label = {"mask": run.mask_alt.mask or "?"}
        return _measure_pair(run, run.mask_alt, timer, {**base, "status": status}, nbytes, copy_gbps, "mask_ab", label)
    if run.baseline is not None:
        label = {"modules": run.baseline_modules}
        return _measure_pair(run, run.baseline, timer, {**base, "status": status}, nbytes, copy_gbps, "build_ab", label)
    if run.default_mode is not None:
        label = {"module": run.default_mode.module}
        return _measure_pair(run, run.default_mode, timer, {**base, "status": status}, nbytes, copy_gbps, "mode_ab",
                             label)
    try:
        timing = timer(run.fn, run.n_sets)
    except Exception as exc:  # noqa: BLE001
        return KernelResult(status="error", **{**base, "note": f"timing: {_short(exc)}"})
    return _timed_result({**base, "status": status}, timing, nbytes, copy_gbps)


AB_MODELS: dict[str, type[Alternated]] = {"index_ab": IndexAB, "mask_ab": MaskAB, "build_ab": BuildAB,
                                          "mode_ab": ModeAB}
AB_WHAT = {"index_ab": "two index dtypes", "mask_ab": "two draft masks", "build_ab": "two builds",
           "mode_ab": "two modes"}


def _measure_pair(
    run: KernelRun, other: KernelRun, timer: Timer, base: dict[str, Any], nbytes: int, copy_gbps: float | None,
    field: str, label: dict[str, str],
) -> KernelResult:  # fmt: skip
    """``run`` and ``other`` timed in alternation (``timer.pair``): ``run``'s figures, plus
    ``other``'s as ``field`` (an ``AB_MODELS`` entry labelled by ``label``). When ``other``
    does not run, ``run`` is timed alone and ``field`` says why."""
    model = AB_MODELS[field]
    pair = getattr(timer, "pair", None)
    if pair is None:
        note = f"timing: {type(timer).__name__} cannot time {AB_WHAT[field]} in alternation"
        return KernelResult(**{**base, "status": "error", "note": note})
    if other.fn is None:
        ab_status, ab_err, ab_note = "error", None, other.error or other.unsupported or "no kernel"
    else:
        ab_status, ab_err, ab_note = _checked(other, base["tolerance"])
    if ab_status == "error":
        ab = model(**label, status="error", note=ab_note)
        try:
            timing = timer(run.fn, run.n_sets)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            return KernelResult(**{**base, "status": "error", "note": f"timing: {_short(exc)}", field: ab})
        return _timed_result(base, timing, nbytes, copy_gbps).model_copy(update={field: ab})
    try:
        paired: PairedTiming = pair(run.fn, other.fn, run.n_sets)
    except Exception as exc:  # noqa: BLE001
        return KernelResult(**{**base, "status": "error", "note": f"timing: {_short(exc)}"})
    ordered = sorted(paired.ratios)
    ab = model(
        **label,
        status=ab_status,
        median_us=paired.b.median_us,
        p10_us=paired.b.p10_us,
        p90_us=paired.b.p90_us,
        ratio=paired.ratio,
        ratio_p10=percentile(ordered, 10),
        ratio_p90=percentile(ordered, 90),
        alternations=len(paired.ratios),
        max_rel_err=ab_err,
    )
    return _timed_result(base, paired.a, nbytes, copy_gbps).model_copy(update={field: ab})


def speedups(kernels: Mapping[str, KernelResult]) -> dict[str, float]:
    """Time of each other kernel / time of the grouped kernel (> 1: grouped is faster).
    Only between two correct timed results."""
    head = kernels.get(HEADLINE_KERNEL)
    if head is None or head.status != "ok" or not head.timed:
        return {}
    out: dict[str, float] = {}
    for name, res in kernels.items():
        if name != HEADLINE_KERNEL and res.status == "ok" and res.timed:
            out[name] = res.median_us / head.median_us  # type: ignore[operator]
    return out


def case_status(kernels: Mapping[str, KernelResult]) -> Literal["ok", "FAILED"]:
    """FAILED when a kgen kernel is wrong or broke (with either kv_indices dtype of an A/B, or
    either module of a --batch-invariant A/B); a peer's trouble is its own row."""
    bad = any(
        kernels[k].status in ("failed", "error")
        or any(ab is not None and ab.status in ("failed", "error") for ab in (kernels[k].index_ab, kernels[k].mode_ab))
        for k in KGEN_KERNELS
        if k in kernels
    )
    return "FAILED" if bad else "ok"


def make_case_result(
    case: Case, kernels: Mapping[str, KernelResult], input_sets: int = 0, note: str = ""
) -> CaseResult:
    mb = min_bytes(case)
    return CaseResult(
        key=case.key,
        case=case,
        min_bytes=mb.total,
        min_bytes_parts={"prefix_kv": mb.prefix_kv, "q": mb.q, "draft_kv": mb.draft_kv, "o": mb.o},
        input_sets=input_sets,
        status=case_status(kernels),
        kernels=dict(kernels),
        speedup=speedups(kernels),
        note=note,
    )


def skipped_case(case: Case, kernels: Iterable[str], note: str) -> CaseResult:
    res = make_case_result(case, {k: KernelResult(status="skipped", note=note) for k in kernels})
    return res.model_copy(update={"status": "skipped", "note": note})


def reshare(result: KernelResult, source_key: str, case: Case, copy_gbps: float | None) -> KernelResult:
    """A peer's result measured on ``source_key``, re-expressed against ``case``'s minimum
    bytes (an FP8 case needs fewer bytes than its BF16 twin, so the same time is fewer GB/s)."""
    update: dict[str, Any] = {"shared_from": result.shared_from or source_key}
    if result.timed:
        gbps, pct = _bandwidth(min_bytes(case).total, result.median_us, copy_gbps)  # type: ignore[arg-type]
        update.update(gbps=gbps, pct_copy=pct)
    return result.model_copy(update=update)


Provider = Callable[[Case, frozenset[str]], AbstractContextManager[Mapping[str, KernelRun]]]


def measure_case(
    case: Case,
    provider: Provider,
    names: Sequence[str],
    timer: Timer,
    copy_gbps: float | None,
) -> tuple[dict[str, KernelResult], int]:
    """Results for ``names`` on ``case`` and the number of input sets used. A provider that
    fails to build the case's inputs (out of memory, say) turns into one error per kernel."""
    nbytes = min_bytes(case).total
    tol = tolerance_for(case)
    out: dict[str, KernelResult] = {}
    sets = 0
    try:
        with provider(case, frozenset(names)) as runs:
            for name in names:
                run = runs.get(name)
                if run is None:
                    out[name] = KernelResult(status="skipped", note="not built by the provider")
                    continue
                sets = max(sets, run.n_sets)
                out[name] = measure_kernel(run, timer, nbytes, copy_gbps, tol)
    except Exception as exc:  # noqa: BLE001 - the next case may fit
        note = f"inputs: {_short(exc)}"
        for name in names:
            out.setdefault(name, KernelResult(status="error", note=note))
    return out, sets


@contextlib.contextmanager
def _progress(total: int, enabled: bool, desc: str) -> Iterator[Any]:
    """A tqdm bar on stderr when asked for and installed, else None."""
    bar = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit="case", dynamic_ncols=True)
        except ImportError:
            bar = None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


PeerCache = dict[tuple[str, str], tuple[str, KernelResult]]


def _measure_shared(
    case: Case,
    provider: Provider,
    kernels: Sequence[str],
    timer: Timer,
    copy_gbps: float | None,
    cache: PeerCache,
    share_peers: bool,
) -> CaseResult:
    """One case, peers taken from ``cache`` when a case of the same shape measured them."""
    reuse = {
        k: cache[(case.peer_key, k)]
        for k in kernels
        if share_peers and k in PEER_KERNELS and (case.peer_key, k) in cache
    }
    wanted = [k for k in kernels if k not in reuse]
    measured, sets = measure_case(case, provider, wanted, timer, copy_gbps)
    for name in PEER_KERNELS:
        res = measured.get(name)
        if res is not None and res.status != "error":
            cache[(case.peer_key, name)] = (case.key, res)
    for name, (source, res) in reuse.items():
        measured[name] = reshare(res, source, case, copy_gbps)
    return make_case_result(case, {k: measured[k] for k in kernels if k in measured}, sets)


def run_matrix(
    cases: Sequence[Case],
    provider: Provider,
    timer: Timer,
    copy_gbps: float | None,
    kernels: Sequence[str] = KERNELS,
    deadline: float | None = None,
    progress: bool = False,
    on_case: Callable[[list[CaseResult]], None] | None = None,
    share_peers: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> list[CaseResult]:
    """Measure every case; past ``deadline`` (a ``clock()`` value) the rest are skipped.

    Peers (FlexAttention, SDPA) read bf16 KV whatever the pool's dtype, so with
    ``share_peers`` a peer measured on one case is reused for the case of the same shape
    and another KV dtype (``shared_from`` names the case it was measured on).
    """
    results: list[CaseResult] = []
    cache: PeerCache = {}
    with _progress(len(cases), progress, "kgen bench") as bar:
        for case in cases:
            if bar is not None:
                bar.set_postfix_str(case.key)
            if deadline is not None and clock() > deadline:
                results.append(skipped_case(case, kernels, "time limit reached"))
            else:
                results.append(_measure_shared(case, provider, kernels, timer, copy_gbps, cache, share_peers))
            if on_case is not None:
                on_case(results)
            if bar is not None:
                bar.update(1)
    return results


def run_sweep(
    cases: Sequence[Case],
    provider: Provider,
    kernel: str,
    labels: Sequence[str],
    timer: Timer,
    copy_gbps: float | None,
    deadline: float | None = None,
    progress: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> list[SweepEntry]:
    """Time ``kernel`` plus each ``kernel@label`` variant on each case (one input build per
    case). Stops at ``deadline``: the sweep is the optional last part of a run."""
    entries: list[SweepEntry] = []
    names = [kernel] + [f"{kernel}{VARIANT_SEP}{label}" for label in labels]
    with _progress(len(cases), progress, f"{kernel} sweep") as bar:
        for case in cases:
            if bar is not None:
                bar.set_postfix_str(case.key)
            if deadline is not None and clock() > deadline:
                break
            measured, _ = measure_case(case, provider, names, timer, copy_gbps)
            for name in names:
                label = name.partition(VARIANT_SEP)[2] or "default"
                res = measured[name].model_copy(update={"choice": label})
                entries.append(
                    SweepEntry(key=case.key, peer_key=case.peer_key, kernel=kernel, options=label, result=res)
                )
            if bar is not None:
                bar.update(1)
    return entries


def best_of_sweep(entries: Sequence[SweepEntry]) -> dict[tuple[str, str], SweepEntry]:
    """The fastest correct variant per (peer shape, kernel)."""
    best: dict[tuple[str, str], SweepEntry] = {}
    for entry in entries:
        res = entry.result
        if res.status != "ok" or not res.timed:
            continue
        slot = (entry.peer_key, entry.kernel)
        if slot not in best or res.median_us < best[slot].result.median_us:  # type: ignore[operator]
            best[slot] = entry
    return best


def apply_sweep(
    results: Sequence[CaseResult], entries: Sequence[SweepEntry], copy_gbps: float | None
) -> list[CaseResult]:
    """Replace a peer's figure with the sweep's winner where the winner is faster, in every
    case of the same shape (the sweep is what the peer can do at its best)."""
    best = best_of_sweep(entries)
    out: list[CaseResult] = []
    for res in results:
        kernels = dict(res.kernels)
        for (peer_key, kernel), entry in best.items():
            current = kernels.get(kernel)
            if peer_key != res.case.peer_key or current is None:
                continue
            if current.timed and current.status == "ok" and current.median_us <= entry.result.median_us:  # type: ignore[operator]
                continue
            winner = reshare(entry.result, entry.key, res.case, copy_gbps)
            if entry.key == res.key:
                winner = winner.model_copy(update={"shared_from": None})
            kernels[kernel] = winner.model_copy(update={"note": f"best of {kernel} sweep ({winner.choice})"})
        out.append(res.model_copy(update={"kernels": kernels, "speedup": speedups(kernels)}))
    return out
