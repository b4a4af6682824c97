"""What a bench run leaves behind: bench.json, bench.md, two PNG plots, and --compare.

The JSON is the one source: the Markdown and the plots are rendered from it (``kgen bench
--from-json`` re-renders them), and a baseline such as ``benchmarks/baselines/h200.json``
is simply a committed bench.json. Cases are matched by ``key``
(``layout/gGROUP/kvtag/bsB/pP/LL``), so a ``--quick`` run compares against a full baseline
on the cases they share, and only where both measured the same kv_indices dtype (a case
written before the dtype was recorded counts as int32, what the bench used then).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kgen.bench import SCHEMA
from kgen.bench.cases import (
    ALL_KERNELS,
    ENGINE_KERNELS,
    FLASHINFER_KERNELS,
    HEADLINE_KERNEL,
    KGEN_KERNELS,
    LEGACY_INDEX_DTYPE,
    Case,
)
from kgen.bench.measure import CaseResult, KernelResult, SweepEntry
from kgen.errors import KgenError, read_validated
from kgen.spec import KV_DTYPES

JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
BANDWIDTH_PNG = "bandwidth.png"
SPEEDUP_PNG = "speedup.png"
COMPARE_NAME = "compare.md"
DEFAULT_THRESHOLD = 0.10
KERNEL_COLORS = {"grouped": "tab:blue", "per_head": "tab:orange", "flex": "tab:green", "sdpa": "tab:red",
                 "flashinfer_fa2": "tab:purple", "flashinfer_fa3": "tab:brown", "flashinfer_fa2_page16": "tab:pink",
                 "flashinfer_fa3_page16": "tab:olive", "sglang_triton": "tab:gray",
                 "vllm_triton": "tab:cyan"}  # fmt: skip
KERNEL_TITLES = {
    "grouped": "kgen grouped",
    "per_head": "kgen per-head",
    "flex": "FlexAttention",
    "sdpa": "SDPA",
    "flashinfer_fa2": "FlashInfer FA2",
    "flashinfer_fa3": "FlashInfer FA3",
    "flashinfer_fa2_page16": "FlashInfer FA2 page 16",
    "flashinfer_fa3_page16": "FlashInfer FA3 page 16",
    "sglang_triton": "SGLang Triton",
    "vllm_triton": "vLLM Triton",
}


class BenchReportError(KgenError, ValueError):
    """A result or baseline file cannot be read."""


class BenchMeta(BaseModel):
    """Where and how a run was made. Unknown fields are kept (newer writers)."""

    model_config = ConfigDict(extra="allow")

    created: str = ""
    gpu_name: str = "unknown"
    arch: str = ""
    num_sms: int | None = None
    l2_bytes: int | None = None
    total_memory: int | None = None
    torch_version: str | None = None
    triton_version: str | None = None
    cuda_version: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None
    # sha256 of what ran (kgen/ sources, templates, tables, generated/): names the code even
    # where the tree was copied without its .git or with a stale one.
    source_digest: str | None = None
    copy_ceiling_gbps: float | None = None
    copy_bytes: int | None = None
    quick: bool = False
    argv: list[str] = Field(default_factory=list)
    timer: dict[str, Any] = Field(default_factory=dict)
    flex_sweep: str = "none"
    # --baseline-modules: the earlier build whose grouped modules were timed against these.
    baseline_modules: str | None = None
    # --baseline-tables: the tables the baseline modules were built with (into baseline_modules).
    baseline_tables: str | None = None
    # --batch-invariant: the grouped figures are the batch-invariant modules', each timed in
    # alternation with the default module (the kernels' mode_ab).
    batch_invariant: bool = False
    duration_s: float | None = None
    notes: list[str] = Field(default_factory=list)


class BenchRun(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["kgen.bench/1"] = Field(default=SCHEMA, alias="schema")
    meta: BenchMeta = Field(default_factory=BenchMeta)
    cases: list[CaseResult] = Field(default_factory=list)
    sweeps: list[SweepEntry] = Field(default_factory=list)

    def by_key(self) -> dict[str, CaseResult]:
        return {c.key: c for c in self.cases}


def merge_runs(prior: BenchRun, new: BenchRun, order: Sequence[Case], source: str) -> BenchRun:
    """A resumed run: for each case of ``order``, its result in ``prior`` unless that was
    skipped, else its result in ``new``. New sweep entries replace old ones of the same key
    and options. The new run's meta, with a note naming ``source``."""
    done = {c.key: c for c in prior.cases if c.status != "skipped"}
    fresh = new.by_key()
    cases = [r for r in (done.get(c.key) or fresh.get(c.key) for c in order) if r is not None]
    seen = {(s.key, s.options) for s in new.sweeps}
    sweeps = [*new.sweeps, *(s for s in prior.sweeps if (s.key, s.options) not in seen)]
    kept = sum(1 for r in cases if r.key in done)
    ceiling = f"{prior.meta.copy_ceiling_gbps:.0f} GB/s" if prior.meta.copy_ceiling_gbps else "unknown"
    note = (f"resumed from {source}: {kept} case(s) measured there (commit {prior.meta.git_commit}, "
            f"copy ceiling {ceiling}), {len(cases) - kept} here")
    meta = new.meta.model_copy(update={"notes": [*new.meta.notes, note]})
    return BenchRun(meta=meta, cases=cases, sweeps=sweeps)


# ---------------------------------------------------------------------------- JSON


def run_to_json(run: BenchRun) -> str:
    return json.dumps(run.model_dump(mode="json", by_alias=True), indent=1) + "\n"


def write_json(run: BenchRun, path: Path) -> Path:
    """Write through a temporary file: the checkpoint after each case is never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_to_json(run), encoding="utf-8")
    tmp.replace(path)
    return path


def read_run(path: Path | str) -> BenchRun:
    """Read a bench.json (a result or a baseline); errors name the file and the field."""
    return read_validated(path, BenchRun, BenchReportError, invalid=f"not a kgen bench result ({SCHEMA})")


# ---------------------------------------------------------------------------- summary figures


def geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def speedup_summary(cases: Sequence[CaseResult]) -> dict[str, tuple[float, int]]:
    """Per other kernel: the geometric-mean speed-up of the grouped kernel and over how many
    cases it was measured."""
    out: dict[str, tuple[float, int]] = {}
    for name in ALL_KERNELS:
        if name == HEADLINE_KERNEL:
            continue
        vals = [c.speedup[name] for c in cases if name in c.speedup]
        g = geomean(vals)
        if g is not None:
            out[name] = (g, len(vals))
    return out


def choice_counts(cases: Sequence[CaseResult], kernel: str) -> dict[str, int]:
    """How often each configuration won for a peer (shared results counted once)."""
    counts: dict[str, int] = {}
    for c in cases:
        res = c.kernels.get(kernel)
        if res is None or res.shared_from or res.status != "ok":
            continue
        counts[res.choice or "default"] = counts.get(res.choice or "default", 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------- Markdown


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _cell_us(res: KernelResult | None) -> str:
    if res is None:
        return "-"
    if not res.timed:
        return res.status
    text = _fmt(res.median_us)
    return f"FAILED {text}" if res.status == "failed" else text


def _cell_choice(res: KernelResult | None) -> str:
    if res is None or not res.timed:
        return _cell_us(res)
    return f"{_cell_us(res)} ({res.choice})" if res.choice else _cell_us(res)


def _header(run: BenchRun) -> list[str]:
    m = run.meta
    counts = {s: sum(1 for c in run.cases if c.status == s) for s in ("ok", "FAILED", "skipped")}
    commit = (m.git_commit or "unknown")[:12] + (" (dirty)" if m.git_dirty else "")
    where = [
        m.created,
        m.arch,
        f"torch {m.torch_version}" if m.torch_version else "",
        f"triton {m.triton_version}" if m.triton_version else "",
        f"CUDA {m.cuda_version}" if m.cuda_version else "",
        f"commit {commit}",
        f"source {m.source_digest[:12]}" if m.source_digest else "",
        "--quick" if m.quick else "",
    ]
    lines = [
        f"# kgen bench: {m.gpu_name}",
        "",
        "- " + " · ".join(w for w in where if w),
        f"- copy ceiling: **{_fmt(m.copy_ceiling_gbps, 0)} GB/s** "
        f"({(m.copy_bytes or 0) / (1 << 30):.0f} GiB device-to-device copy, bytes read + written)",
        f"- {len(run.cases)} cases: {counts['ok']} ok, {counts['FAILED']} FAILED, "
        f"{counts['skipped']} skipped" + (f" · {m.duration_s:.0f} s" if m.duration_s else ""),
    ]
    summary = speedup_summary(run.cases)
    if summary:
        parts = [f"{KERNEL_TITLES.get(k, k)} **{g:.2f}x** ({n} cases)" for k, (g, n) in summary.items()]
        lines.append("- grouped kernel speed-up (geometric mean) over: " + ", ".join(parts))
    for kernel, (title, mid, worst, key, n) in index_ab_summary(run.cases).items():
        lines.append(f"- {KERNEL_TITLES[kernel]} kv_indices {title}: median **{mid:.3f}** over {n} cases "
                     f"(largest {worst:.3f} at {key}), each the median of alternated graph replays")  # fmt: skip
    for kernel, (title, mid, worst, key, n) in mask_ab_summary(run.cases).items():
        lines.append(f"- {KERNEL_TITLES[kernel]} draft mask {title} (time with the first / the second): median "
                     f"**{mid:.3f}** over {n} cases (largest {worst:.3f} at {key}), each the median of alternated "
                     "graph replays")  # fmt: skip
    build = build_ab_summary(run.cases)
    if build is not None:
        lines.append(f"- {build_ab_line(build, m.baseline_modules, m.baseline_tables)}, each the median of "
                     "alternated graph replays")
    if m.batch_invariant:
        lines.append("- grouped: the batch-invariant modules (`kgen.load(..., batch_invariant=True)`), each timed in "
                     "alternation with the default module")
    mode = mode_ab_summary(run.cases)
    if mode is not None:
        lines.append(f"- {mode_ab_line(mode)}, each the median of alternated graph replays")
    for note in m.notes:
        lines.append(f"- {note}")
    return lines


def _failures(run: BenchRun) -> list[str]:
    rows = []
    for c in run.cases:
        for name, res in c.kernels.items():
            if res.status in ("failed", "error") or (name in KGEN_KERNELS and res.status == "unsupported"):
                err = _fmt(res.max_rel_err, 4) if res.max_rel_err is not None else "-"
                rows.append(f"| {c.key} | {name} | {res.status} | {err} | {res.note or '-'} |")
    if not rows:
        return []
    return ["", "## Failures and errors", "", "| case | kernel | status | max rel err | note |",
            "| --- | --- | --- | --- | --- |", *rows]  # fmt: skip


def _group_title(c: CaseResult) -> str:
    tag = KV_DTYPES.get(c.case.kv_dtype, c.case.kv_dtype)
    extra = f", {c.case.kv_heads} KV heads" if c.case.kv_heads != 1 else ""
    return f"{c.case.layout}, group {c.case.group}, KV {tag}{extra}"


def _index_cell(case: Case) -> str:
    """The kv_indices dtype of a case's kgen figures; "int32?" where the file did not record it."""
    return case.index_dtype or f"{LEGACY_INDEX_DTYPE}?"


def _ratio_cell(res: KernelResult | None, field: str = "index_ab") -> str:
    """The median ratio (p10–p90) of an A/B: ``field`` is index_ab or mode_ab."""
    ab = getattr(res, field) if res is not None else None
    if ab is None:
        return "-"
    if ab.ratio is None:
        return ab.status
    spread = ""
    if ab.ratio_p10 is not None and ab.ratio_p90 is not None:
        spread = f" ({ab.ratio_p10:.3f}–{ab.ratio_p90:.3f})"
    return ("FAILED " if ab.status != "ok" else "") + f"{ab.ratio:.3f}{spread}"


def _ab_title(run: BenchRun) -> str | None:
    """"int64/int32" when the run timed two index dtypes in alternation."""
    for c in run.cases:
        if c.case.index_dtype_ab:
            return f"{c.case.indices}/{c.case.index_dtype_ab}"
    return None


def flashinfer_best(c: CaseResult) -> tuple[str, KernelResult] | None:
    """The fastest correct FlashInfer kernel of a case (name, result), or None."""
    timed = [(n, r) for n in FLASHINFER_KERNELS if (r := c.kernels.get(n)) is not None and r.status == "ok" and r.timed]
    return min(timed, key=lambda nr: nr[1].median_us) if timed else None  # type: ignore[arg-type, return-value]


def _flashinfer_cells(c: CaseResult) -> list[str]:
    """The case table's FlashInfer columns: the fastest correct variant and grouped's speed-up over it."""
    best = flashinfer_best(c)
    if best is None:
        return ["-", "-"]
    name, res = best
    return [f"{_fmt(res.median_us)} ({name.removeprefix('flashinfer_')})", _fmt(c.speedup.get(name), 2)]


def _case_row(c: CaseResult, ab: bool = False, mode: bool = False, fi: bool = False) -> str:
    k = c.kernels
    g = k.get("grouped")
    ratios = [_ratio_cell(g), _ratio_cell(k.get("per_head"))] if ab else []
    ratios += [_ratio_cell(g, "mode_ab")] if mode else []
    cells = [
        str(c.case.batch), str(c.case.prefix), str(c.case.draft), _index_cell(c.case),
        _cell_us(g) + (f" ({_fmt(g.p10_us)}–{_fmt(g.p90_us)})" if g and g.timed else ""),
        _fmt(g.gbps, 0) if g else "-",
        _fmt(g.pct_copy, 1) if g else "-",
        *ratios,
        _cell_us(k.get("per_head")),
        _cell_choice(k.get("flex")),
        _cell_choice(k.get("sdpa")),
        *(_fmt(c.speedup.get(name), 2) for name in ("per_head", "flex", "sdpa")),
        *(_flashinfer_cells(c) if fi else []),
        _fmt(g.scratch_bytes / (1 << 20), 1) if g and g.scratch_bytes is not None else "-",
        " / ".join(_fmt(k[n].max_rel_err, 4) for n in KGEN_KERNELS if n in k),
        c.status,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _table_head(ab: str | None, mode: bool = False, fi: bool = False) -> list[str]:
    """The case table's header; with an A/B of index dtypes, the two ratio columns (median
    over the alternations, p10–p90); with --batch-invariant, the batch-invariant / default one;
    with FlashInfer results, its fastest correct variant and the speed-up over it."""
    ratios = [f"grouped {ab}", f"per-head {ab}"] if ab else []
    ratios += ["batch-invariant / default"] if mode else []
    flashinfer = ["FlashInfer µs (best)", "× FlashInfer"] if fi else []
    names = ["batch", "prefix", "L", "kv_indices", "grouped µs (p10–p90)", "GB/s", "% copy", *ratios,
             "per-head µs", "FlexAttention µs", "SDPA µs", "× per-head", "× flex", "× SDPA", *flashinfer,
             "scratch MiB", "max rel err (grouped / per-head)", "status"]  # fmt: skip
    align = {"kv_indices": "---", "FlexAttention µs": "---", "SDPA µs": "---", "status": "---",
             "max rel err (grouped / per-head)": "---", "FlashInfer µs (best)": "---"}  # fmt: skip
    return ["| " + " | ".join(names) + " |", "| " + " | ".join(align.get(n, "---:") for n in names) + " |"]


def _case_tables(run: BenchRun) -> list[str]:
    lines: list[str] = []
    title = None
    ab = _ab_title(run)
    mode = any(g.mode_ab is not None for c in run.cases if (g := c.kernels.get(HEADLINE_KERNEL)) is not None)
    fi = _has_any(run, FLASHINFER_KERNELS)
    for c in run.cases:
        if _group_title(c) != title:
            title = _group_title(c)
            lines += ["", f"## {title}", "", *_table_head(ab, mode, fi)]
        lines.append(_case_row(c, ab is not None, mode, fi))
    return lines


def _has_any(run: BenchRun, names: Sequence[str]) -> bool:
    """Whether any case of the run holds a result of one of ``names``."""
    return any(n in c.kernels for c in run.cases for n in names)


FLASHINFER_INTRO = (
    "`flashinfer_<backend>` reads the case's token-slot pool as pages of one token, `..._page16` a copy in "
    "16-token pages (shuffled page order); GQA layouts run BatchPrefillWithPagedKVCacheWrapper, absorbed MLA "
    "BatchMLAPagedAttentionWrapper. µs per launch (max rel err)."
)
ENGINE_INTRO = (
    "What SGLang's and vLLM's Triton backends run for a verify step (kgen/bench/engine_kernels.py): "
    "`sglang_triton` is SGLang's extend_attention_fwd on the case's own call; `vllm_triton` is vLLM's "
    "unified_attention (GQA) or its Triton MLA decode kernel over a copy in 16-token pages. µs per launch "
    "(max rel err), and the grouped kernel's speed-up over it."
)


def _own_pool_table(run: BenchRun, title: str, intro: str, names: Sequence[str], speedups: bool) -> list[str]:
    """Every kernel of ``names`` in every case (µs, or its status; with ``speedups`` grouped's
    speed-up beside it), then each distinct reason a kernel did not run, with how many cases it
    held for. Empty when the run has none of them."""
    if not _has_any(run, names):
        return []
    heads = [n.removeprefix("flashinfer_") for n in names]
    if speedups:
        heads = [h for n in names for h in (n, f"× {KERNEL_TITLES.get(n, n)}")]
    lines = ["", f"## {title}", "", intro, "",
             "| case | " + " | ".join(heads) + " |", "| --- |" + " ---: |" * len(heads)]  # fmt: skip
    reasons: dict[tuple[str, str], int] = {}
    for c in run.cases:
        cells = []
        for name in names:
            res = c.kernels.get(name)
            cells.append(_cell_us(res) + (f" ({_fmt(res.max_rel_err, 4)})" if res and res.timed else ""))
            if speedups:
                cells.append(_fmt(c.speedup.get(name), 2))
            if res is not None and res.status in ("unsupported", "error", "skipped") and res.note:
                reasons[(name, res.note)] = reasons.get((name, res.note), 0) + 1
        lines.append(f"| {c.key} | " + " | ".join(cells) + " |")
    if reasons:
        lines += ["", "Not run:", ""]
        lines += [f"- {name} ({n} case{'s' if n > 1 else ''}): {note}" for (name, note), n in reasons.items()]
    return lines


def _sweep_table(run: BenchRun) -> list[str]:
    if not run.sweeps:
        return []
    from kgen.bench.measure import best_of_sweep

    best = {id(e) for e in best_of_sweep(run.sweeps).values()}
    lines = ["", "## FlexAttention kernel-option sweep", "",
             "| shape | options | µs | status |", "| --- | --- | ---: | --- |"]  # fmt: skip
    for e in run.sweeps:
        us = _cell_us(e.result)
        mark = f"**{us}** (best)" if id(e) in best else us
        lines.append(f"| {e.peer_key} | {e.options} | {mark} | {e.result.status} |")
    return lines


def _choices(run: BenchRun) -> list[str]:
    lines = ["", "## Peer configurations that won", ""]
    for kernel in ("flex", "sdpa"):
        counts = choice_counts(run.cases, kernel)
        if counts:
            text = ", ".join(f"{k}: {v}" for k, v in counts.items())
            lines.append(f"- {KERNEL_TITLES[kernel]}: {text}")
    return lines if len(lines) > 3 else []


_METHOD = [
    "",
    "## Method",
    "",
    "- Time: median (p10–p90) µs per launch over CUDA-graph replays; each graph holds a whole "
    "number of passes over input sets whose total size exceeds 2x the L2, so every launch reads "
    "its K/V from HBM.",
    "- GB/s counts the minimum bytes: prefix KV read once (V only where the layout stores it "
    "apart from K), plus q, draft K/V and o. `% copy` is that over the copy ceiling.",
    "- kgen kernels read a paged pool through a shuffled page table (SGLang token slots); "
    "FlexAttention and SDPA read the same values gathered into dense bf16 tensors (FP8 "
    "dequantized; the gather is not timed), so a peer's figure is shared by the BF16 and FP8 "
    "case of one shape.",
    "- `× peer` = peer time / grouped time. max rel err = max|out − ref| / max|ref| on the first "
    "two requests against `kgen.reference.reference_verify`; above the tolerance the case is FAILED.",
    "- `kv_indices`: the page table's dtype in the kgen kernels' figures (SGLang sends int64; `int32?`: "
    "a result that did not record it, int32 then). A column `a/b` is a's time over b's for the same kernel "
    "and inputs, the median of the per-alternation ratios of CUDA-graph replays alternated in one process "
    "(p10–p90 in brackets).",
]


_FLASHINFER_METHOD = [
    "- FlashInfer reads the case's own pool (FP8 too, with its scales) with the draft tokens' K/V written into it "
    "as an engine writes them (FP8: quantized, and checked against a reference of the values stored), int32 "
    "page tables converted once in set-up, `plan()` per input set in set-up and `run()` alone in the CUDA graph; "
    "`× FlashInfer` is against its fastest correct variant of the case. It is measured per case, not shared "
    "between KV dtypes.",
]
_ENGINE_METHOD = [
    "- The engines' Triton kernels: `sglang_triton` takes the call kgen's SGLang entry takes (the case's pool, "
    "its int64 kv_indices, the draft K/V apart, a masked case's custom mask); `vllm_triton` reads a copy of the "
    "pool in 16-token pages with the draft tokens written in (FP8: quantized, checked against the values "
    "stored), int32 block tables, and the split-K scratch vLLM's metadata builder reserves. Each is measured "
    "per case.",
]


def render_markdown(run: BenchRun) -> str:
    lines = [
        *_header(run), *_failures(run), *_case_tables(run),
        *_own_pool_table(run, "FlashInfer", FLASHINFER_INTRO, FLASHINFER_KERNELS, speedups=False),
        *_own_pool_table(run, "The engines' Triton kernels", ENGINE_INTRO, ENGINE_KERNELS, speedups=True),
        *_sweep_table(run),
    ]  # fmt: skip
    method = [*_METHOD, *(_FLASHINFER_METHOD if _has_any(run, FLASHINFER_KERNELS) else []),
              *(_ENGINE_METHOD if _has_any(run, ENGINE_KERNELS) else [])]  # fmt: skip
    return "\n".join(lines + _choices(run) + method) + "\n"


# ---------------------------------------------------------------------------- plots


def _panels(run: BenchRun) -> list[tuple[str, str, list[CaseResult]]]:
    """(layout-group label, kv tag, cases) per plot panel, in run order."""
    order: dict[tuple[str, str], list[CaseResult]] = {}
    for c in run.cases:
        row = f"{c.case.layout} g{c.case.group}"
        order.setdefault((row, KV_DTYPES.get(c.case.kv_dtype, c.case.kv_dtype)), []).append(c)
    return [(row, kv, cases) for (row, kv), cases in order.items()]


def _pick(values: Iterable[int], preferred: int) -> int:
    vals = sorted(set(values))
    return preferred if preferred in vals else vals[-1]


def _grid(panels: list[tuple[str, str, list[CaseResult]]]):  # noqa: ANN202 - matplotlib types
    from matplotlib.figure import Figure

    rows = list(dict.fromkeys(p[0] for p in panels))
    cols = list(dict.fromkeys(p[1] for p in panels))
    fig = Figure(figsize=(5.2 * len(cols), 3.6 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(cols), squeeze=False)
    return fig, {(r, c): axes[i][j] for i, r in enumerate(rows) for j, c in enumerate(cols)}


def _size_label(n: int) -> str:
    return f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _log2_axis(ax, values: Iterable[int], label: str) -> None:  # noqa: ANN001 - matplotlib Axes
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    if ticks:
        ax.set_xticks(ticks, [_size_label(t) for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel(label)
    ax.grid(True, alpha=0.3)


def _slices(cases: list[CaseResult], x: str, fixed: str, preferred: int) -> tuple[int, int, list[CaseResult]]:
    """One plot line's cases: ``fixed`` (batch or prefix) at ``preferred`` (else its largest)
    and the longest draft (4 when there), ordered by ``x``: (fixed value, draft, cases)."""
    value = _pick((getattr(c.case, fixed) for c in cases), preferred)
    draft = _pick((c.case.draft for c in cases), 4)
    chosen = [c for c in cases if getattr(c.case, fixed) == value and c.case.draft == draft]
    return value, draft, sorted(chosen, key=lambda c: getattr(c.case, x))


def _plot(ax, pts: list[tuple[int, float]], name: str, label: str) -> None:  # noqa: ANN001 - matplotlib Axes
    if pts:
        ax.plot(*zip(*pts, strict=True), marker="o", label=label, color=KERNEL_COLORS.get(name))


def plot_bandwidth(run: BenchRun, path: Path) -> Path:
    """% of the copy ceiling (GB/s when there is none) vs prefix length, one line per
    kernel, at batch 64 (else the largest) and the longest draft."""
    panels = _panels(run)
    fig, axes = _grid(panels)
    use_pct = run.meta.copy_ceiling_gbps is not None
    for row, kv, cases in panels:
        ax = axes[(row, kv)]
        batch, draft, sel = _slices(cases, "prefix", "batch", 64)
        for name in ALL_KERNELS:
            timed = [(c.case.prefix, c.kernels[name]) for c in sel if name in c.kernels and c.kernels[name].timed]
            _plot(ax, [(x, r.pct_copy if use_pct else r.gbps) for x, r in timed], name, KERNEL_TITLES.get(name, name))
        _log2_axis(ax, (c.case.prefix for c in sel), "prefix length (tokens)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{row} {kv}, batch {batch}, L {draft}", fontsize=9)
        ax.set_ylabel("% of copy ceiling" if use_pct else "GB/s (min bytes)")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    return path


def plot_speedup(run: BenchRun, path: Path) -> Path:
    """Grouped-kernel speed-up over each other kernel vs batch, at prefix 16K (else the
    longest) and the longest draft; the dashed line is parity."""
    panels = _panels(run)
    fig, axes = _grid(panels)
    for row, kv, cases in panels:
        ax = axes[(row, kv)]
        prefix, draft, sel = _slices(cases, "batch", "prefix", 16384)
        for name in ALL_KERNELS:
            pts = [(c.case.batch, c.speedup[name]) for c in sel if name in c.speedup]
            _plot(ax, pts, name, f"vs {KERNEL_TITLES.get(name, name)}")
        plotted = bool(ax.lines)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        _log2_axis(ax, (c.case.batch for c in sel), "batch")
        ax.set_title(f"{row} {kv}, prefix {_size_label(prefix)}, L {draft}", fontsize=9)
        ax.set_ylabel("speed-up of grouped (x)")
        if plotted:
            ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    return path


def write_plots(run: BenchRun, out_dir: Path) -> list[Path]:
    """Both PNGs; none (and no error) without matplotlib or without cases."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    if not run.cases:
        return []
    out_dir = Path(out_dir)
    return [plot_bandwidth(run, out_dir / BANDWIDTH_PNG), plot_speedup(run, out_dir / SPEEDUP_PNG)]


def write_report(run: BenchRun, out_dir: Path, plots: bool = True) -> list[Path]:
    """bench.json, bench.md and (``plots``) the PNGs into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [write_json(run, out_dir / JSON_NAME)]
    md = out_dir / MARKDOWN_NAME
    md.write_text(render_markdown(run), encoding="utf-8")
    paths.append(md)
    if plots:
        paths += write_plots(run, out_dir)
    return paths


# ---------------------------------------------------------------------------- --compare


@dataclass(frozen=True)
class Regression:
    key: str
    kernel: str
    baseline_us: float
    current_us: float | None
    status: str = "ok"

    @property
    def slowdown_pct(self) -> float | None:
        if self.current_us is None:
            return None
        return 100.0 * (self.current_us / self.baseline_us - 1.0)

    def describe(self) -> str:
        if self.current_us is None:
            return f"{self.key} [{self.kernel}]: {self.baseline_us:.1f} us in the baseline, now {self.status}"
        return (
            f"{self.key} [{self.kernel}]: {self.baseline_us:.1f} us -> {self.current_us:.1f} us "
            f"({self.slowdown_pct:+.1f}%)"
        )


@dataclass
class Comparison:
    """The verdict of a run against a baseline, case by case (matched by key)."""

    threshold: float
    compared: int = 0
    regressions: list[Regression] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the baseline, not measured now
    new: list[str] = field(default_factory=list)  # measured now, not in the baseline
    # kv_indices dtype differs: (key, this run's, the baseline's); not judged
    index_mismatch: list[tuple[str, str, str]] = field(default_factory=list)
    legacy_baseline: int = 0  # baseline cases that did not record their index dtype
    via_ab: int = 0  # cases judged on this run's alternated figure (the baseline's dtype)

    @property
    def ok(self) -> bool:
        return not self.regressions


def figure_for(res: KernelResult, case: Case, dtype: str) -> tuple[float | None, str] | None:
    """(median µs, status) of ``res`` measured with kv_indices ``dtype``: the main figure,
    or the alternated one of an A/B; None when the case did not time that dtype."""
    if case.indices == dtype:
        return (res.median_us if res.timed else None), res.status
    ab = res.index_ab
    if ab is not None and ab.dtype == dtype:
        timed = ab.median_us is not None and ab.median_us > 0
        return (ab.median_us if timed else None), ab.status
    return None


def compare_runs(
    current: BenchRun,
    baseline: BenchRun,
    threshold: float = DEFAULT_THRESHOLD,
    kernels: Sequence[str] = KGEN_KERNELS,
) -> Comparison:
    """A kgen kernel more than ``threshold`` slower than in the baseline, or no longer
    running correctly, is a regression. Peers are not judged (their speed is torch's).

    Like is compared with like: a case is judged only on a figure of the baseline's
    kv_indices dtype (this run's main figure, or its alternated one with ``--index-dtype
    a,b``); otherwise it is listed as not compared."""
    if current.meta.batch_invariant != baseline.meta.batch_invariant:
        which = {True: "the batch-invariant modules", False: "the default modules"}
        raise BenchReportError(f"the run's grouped figures are {which[current.meta.batch_invariant]}', the "
                               f"baseline's {which[baseline.meta.batch_invariant]}': compare runs of one mode")
    result = Comparison(threshold=threshold)
    now = current.by_key()
    for key, base in baseline.by_key().items():
        cur = now.get(key)
        if cur is None or cur.status == "skipped":
            result.missing.append(key)
            continue
        want = base.case.indices
        result.legacy_baseline += base.case.index_dtype is None
        judged = False
        for kernel in kernels:
            b = base.kernels.get(kernel)
            c = cur.kernels.get(kernel)
            if b is None or b.status != "ok" or not b.timed or c is None or c.status == "skipped":
                continue
            got = figure_for(c, cur.case, want)
            if got is None:
                if not any(m[0] == key for m in result.index_mismatch):
                    result.index_mismatch.append((key, cur.case.indices, want))
                continue
            us, status = got
            judged = True
            result.compared += 1
            if status != "ok" or us is None:
                result.regressions.append(Regression(key, kernel, b.median_us, None, status))  # type: ignore[arg-type]
            elif us > b.median_us * (1.0 + threshold):  # type: ignore[operator]
                result.regressions.append(Regression(key, kernel, b.median_us, us))  # type: ignore[arg-type]
        result.via_ab += judged and cur.case.indices != want
    base_keys = baseline.by_key()
    result.new = [c.key for c in current.cases if c.key not in base_keys and c.status != "skipped"]
    return result


def format_comparison(cmp: Comparison, baseline_name: str = "baseline") -> str:
    lines = [
        f"compare with {baseline_name}: {cmp.compared} kernel/case pairs compared, "
        f"threshold {cmp.threshold * 100:.0f}% slower"
    ]
    if cmp.legacy_baseline:
        lines.append(f"note: {cmp.legacy_baseline} baseline case(s) do not record their kv_indices dtype "
                     f"(written before kgen bench recorded it): taken as {LEGACY_INDEX_DTYPE}")  # fmt: skip
    if cmp.via_ab:
        lines.append(f"{cmp.via_ab} case(s) judged on this run's alternated figure of the baseline's kv_indices dtype")
    if cmp.regressions:
        lines.append(f"REGRESSIONS ({len(cmp.regressions)}):")
        lines += [f"  {r.describe()}" for r in cmp.regressions]
    if cmp.index_mismatch:
        pairs = sorted({(now, base) for _, now, base in cmp.index_mismatch})
        what = ", ".join(f"{now} here vs {base} in the baseline" for now, base in pairs)
        shown = ", ".join(k for k, _, _ in cmp.index_mismatch[:5]) + (" ..." if len(cmp.index_mismatch) > 5 else "")
        want = pairs[0][1]
        lines.append(
            f"warning: not compared, kv_indices dtype differs ({len(cmp.index_mismatch)} cases; {what}): {shown}; "
            f"measure with --index-dtype {want} (or --index-dtype {pairs[0][0]},{want}) to compare them"
        )
    if cmp.missing:
        shown = ", ".join(cmp.missing[:5]) + (" ..." if len(cmp.missing) > 5 else "")
        lines.append(f"not measured in this run ({len(cmp.missing)} baseline cases): {shown}")
    if cmp.new:
        shown = ", ".join(cmp.new[:5]) + (" ..." if len(cmp.new) > 5 else "")
        lines.append(f"not in the baseline ({len(cmp.new)} cases, no verdict): {shown}")
    if cmp.compared == 0:
        lines.append("warning: no case of this run has a baseline figure")
    lines.append("verdict: " + ("PASS" if cmp.ok else "FAIL"))
    return "\n".join(lines)


ABSummary = dict[str, tuple[str, float, float, str, int]]


def _pair_summary(cases: Sequence[CaseResult], pair: Callable[[CaseResult, str], tuple[float | None, str] | None]
                ) -> ABSummary:
    """Per kgen kernel: ("a/b", median of the cases' ratios, the largest ratio, its case key,
    number of cases), from ``pair(case, kernel)``: that case's (ratio, "a/b") or None."""
    out: ABSummary = {}
    for kernel in KGEN_KERNELS:
        pts: list[tuple[float, str, str]] = []
        for c in cases:
            got = pair(c, kernel) if kernel in c.kernels else None
            if got is not None and got[0] is not None:
                pts.append((got[0], c.key, got[1]))
        if pts:
            worst = max(pts)
            out[kernel] = (pts[0][2], statistics.median(p[0] for p in pts), worst[0], worst[1], len(pts))
    return out


def index_ab_summary(cases: Sequence[CaseResult]) -> ABSummary:
    """Per kgen kernel with an A/B of index dtypes (``--index-dtype a,b``), as ``_pair_summary``."""
    def pair(c: CaseResult, kernel: str) -> tuple[float | None, str] | None:
        ab = c.kernels[kernel].index_ab
        return None if ab is None else (ab.ratio, f"{c.case.indices}/{ab.dtype}")
    return _pair_summary(cases, pair)


def mask_ab_summary(cases: Sequence[CaseResult]) -> ABSummary:
    """Per kgen kernel with an A/B of draft masks (``--mask a,b``), as ``_pair_summary``."""
    def pair(c: CaseResult, kernel: str) -> tuple[float | None, str] | None:
        ab = c.kernels[kernel].mask_ab
        return None if ab is None else (ab.ratio, f"{c.case.mask}/{ab.mask}")
    return _pair_summary(cases, pair)


@dataclass(frozen=True)
class BuildABSummary:
    """The grouped kernel's ratios of one A/B over a run (now / then against an earlier build,
    or batch-invariant / default): their geometric mean, and the worst (largest) one."""

    geomean: float
    worst: float
    worst_key: str
    cases: int


def _ab_summary(cases: Sequence[CaseResult], field: str) -> BuildABSummary | None:
    """The grouped kernel's ratios of one A/B (``field``: build_ab or mode_ab) over a run:
    their geometric mean and the worst; None when no case has one."""
    pts = [
        (ab.ratio, c.key)
        for c in cases
        if HEADLINE_KERNEL in c.kernels
        and (ab := getattr(c.kernels[HEADLINE_KERNEL], field)) is not None
        and ab.ratio is not None
    ]
    if not pts:
        return None
    worst = max(pts)
    return BuildABSummary(geomean(p[0] for p in pts) or math.nan, worst[0], worst[1], len(pts))


def build_ab_summary(cases: Sequence[CaseResult]) -> BuildABSummary | None:
    """None when no case timed the grouped kernel against a baseline build."""
    return _ab_summary(cases, "build_ab")


def mode_ab_summary(cases: Sequence[CaseResult]) -> BuildABSummary | None:
    """None when no case timed the batch-invariant module against the default one."""
    return _ab_summary(cases, "mode_ab")


def mode_ab_line(summary: BuildABSummary) -> str:
    return (
        f"batch-invariant module vs the default one (time batch-invariant / time default): geometric mean "
        f"{summary.geomean:.3f} over {summary.cases} cases, worst {summary.worst:.3f} at {summary.worst_key}"
    )


def build_ab_line(summary: BuildABSummary, modules: str | None, tables: str | None = None) -> str:
    built = f"the build in {modules or 'the baseline modules'}"
    if tables:
        built += f" (built with the tables in {tables})"
    return (
        f"grouped kernel vs {built} (time now / time then): geometric mean {summary.geomean:.3f} over "
        f"{summary.cases} cases, worst {summary.worst:.3f} at {summary.worst_key}"
    )
