"""kgen bench: JSON, Markdown, PNG plots and the --compare verdicts (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kgen.bench.cases import build_matrix
from kgen.bench.measure import IndexAB, KernelResult, SweepEntry, make_case_result
from kgen.bench.report import (
    BANDWIDTH_PNG,
    JSON_NAME,
    MARKDOWN_NAME,
    SPEEDUP_PNG,
    BenchMeta,
    BenchReportError,
    BenchRun,
    compare_runs,
    format_comparison,
    read_run,
    render_markdown,
    run_to_json,
    speedup_summary,
    write_report,
)
from kgen.spec import load_layouts

SPECS = load_layouts()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ok(us: float, **kw) -> KernelResult:  # noqa: ANN003
    return KernelResult(status="ok", median_us=us, p10_us=us * 0.95, p90_us=us * 1.1, gbps=1000.0 / us,
                        pct_copy=25.0 / us, max_rel_err=1e-3, **kw)  # fmt: skip


def make_run(scale: float = 1.0, failed_key: str | None = None,
             index_dtypes: tuple[str, str | None] = ("int64", None), ab_scale: float = 1.0) -> BenchRun:
    """A small run: 2 layouts x 2 dtypes x 2 batches x 2 prefixes x L 4, grouped = 10 us x batch.
    With two index dtypes the kgen kernels' other-dtype figure is ``ab_scale`` x theirs."""
    cases = build_matrix(SPECS, [("qwen3_5_gqa256", 16), ("mla_absorbed_512_64", 16)],
                         ["bfloat16", "float8_e4m3fn"], batches=[16, 64], prefixes=[1024, 16384],
                         drafts=[4], index_dtypes=index_dtypes)  # fmt: skip
    results = []
    for case in cases:
        base = 10.0 * case.batch * case.prefix / 1024 * scale
        kernels = {
            "grouped": _ok(base, scratch_bytes=3 << 20, choice="BLOCK_H=16"),
            "per_head": _ok(base * 3),
            "flex": _ok(base * 2, choice="default"),
            "sdpa": _ok(base * 1.5, choice="gqa/flash"),
        }
        if case.index_dtype_ab:
            for name in ("grouped", "per_head"):
                us = kernels[name].median_us * ab_scale
                ab = IndexAB(dtype=case.index_dtype_ab, status="ok", median_us=us, ratio=1 / ab_scale,
                             ratio_p10=0.99 / ab_scale, ratio_p90=1.01 / ab_scale, alternations=15)  # fmt: skip
                kernels[name] = kernels[name].model_copy(update={"index_ab": ab})
        if case.key == failed_key:
            kernels["grouped"] = kernels["grouped"].model_copy(update={"status": "failed", "max_rel_err": 0.4})
        if case.layout.startswith("mla"):
            kernels["flex"] = KernelResult(status="unsupported", note="head dim 576")
        results.append(make_case_result(case, kernels, input_sets=2))
    meta = BenchMeta(gpu_name="NVIDIA H200", arch="sm_90", copy_ceiling_gbps=4300.0, copy_bytes=2 << 30,
                     torch_version="2.11.0", triton_version="3.6.0", git_commit="abc123")  # fmt: skip
    sweeps = [
        SweepEntry(
            key=results[0].key, peer_key=results[0].case.peer_key, kernel="flex", options=o, result=_ok(us, choice=o)
        )  # fmt: skip
        for o, us in (("default", 20.0), ("BLOCK_N=32,num_warps=4,num_stages=2", 18.0))
    ]
    return BenchRun(meta=meta, cases=results, sweeps=sweeps)


def test_json_round_trip(tmp_path: Path) -> None:
    run = make_run()
    paths = write_report(run, tmp_path, plots=False)
    assert [p.name for p in paths] == [JSON_NAME, MARKDOWN_NAME]
    raw = json.loads((tmp_path / JSON_NAME).read_text())
    assert raw["schema"] == "kgen.bench/1"
    assert raw["meta"]["gpu_name"] == "NVIDIA H200"
    first = raw["cases"][0]
    assert first["key"] == "qwen3_5_gqa256/g16/bf16/bs16/p1024/L4"
    assert first["case"]["layout"] == "qwen3_5_gqa256" and first["min_bytes"] > 0
    assert set(first["kernels"]) == {"grouped", "per_head", "flex", "sdpa"}
    assert first["speedup"] == {"per_head": 3.0, "flex": 2.0, "sdpa": 1.5}
    back = read_run(tmp_path / JSON_NAME)
    assert back == run


def test_markdown_table(tmp_path: Path) -> None:
    key = "qwen3_5_gqa256/g16/fp8_e4m3fn/bs64/p16384/L4"
    run = make_run(failed_key=key)
    md = render_markdown(run)
    assert md.startswith("# kgen bench: NVIDIA H200")
    assert "copy ceiling: **4300 GB/s**" in md
    assert "source " not in md  # no digest, no claim
    digested = render_markdown(run.model_copy(update={"meta": run.meta.model_copy(update={"source_digest": "f" * 64})}))
    assert "commit abc123 · source ffffffffffff" in digested
    assert "## qwen3_5_gqa256, group 16, KV bf16" in md
    assert "## mla_absorbed_512_64, group 16, KV fp8_e4m3fn" in md
    assert "## Failures and errors" in md and f"| {key} | grouped | failed | 0.4000 |" in md
    assert "FAILED" in md and "unsupported" in md
    assert "(gqa/flash)" in md and "## FlexAttention kernel-option sweep" in md
    assert "**18.0** (best)" in md
    # one table row per case: 16 cases
    rows = [line for line in md.splitlines() if line.startswith("| 16 |") or line.startswith("| 64 |")]
    assert len(rows) == 16
    row = next(line for line in rows if line.startswith("| 16 | 1024 | 4 |"))
    assert "| 160.0 (152.0–176.0) |" in row and "| 3.00 | 2.00 | 1.50 |" in row and "| 3.0 |" in row


def test_speedup_summary_is_a_geometric_mean() -> None:
    summary = speedup_summary(make_run().cases)
    assert summary["per_head"] == (pytest.approx(3.0), 16)
    assert summary["flex"] == (pytest.approx(2.0), 8)  # MLA flex unsupported


def test_plots_are_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    paths = write_report(make_run(), tmp_path)
    names = {p.name for p in paths}
    assert {BANDWIDTH_PNG, SPEEDUP_PNG} <= names
    for name in (BANDWIDTH_PNG, SPEEDUP_PNG):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_plots_without_copy_ceiling(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = make_run()
    run = run.model_copy(update={"meta": run.meta.model_copy(update={"copy_ceiling_gbps": None})})
    assert (tmp_path / BANDWIDTH_PNG) in write_report(run, tmp_path)


def test_compare_identical_passes() -> None:
    cmp = compare_runs(make_run(), make_run())
    assert cmp.ok and cmp.compared == 32 and not cmp.missing and not cmp.new
    assert format_comparison(cmp).endswith("verdict: PASS")


def test_compare_within_threshold_passes() -> None:
    assert compare_runs(make_run(scale=1.09), make_run()).ok


def test_compare_slower_fails_naming_cases() -> None:
    base = make_run()
    cur = make_run()
    slow_key = "mla_absorbed_512_64/g16/bf16/bs64/p16384/L4"
    slow = cur.by_key()[slow_key]
    slow.kernels["grouped"] = slow.kernels["grouped"].model_copy(
        update={"median_us": slow.kernels["grouped"].median_us * 1.15}
    )
    cmp = compare_runs(cur, base)
    assert not cmp.ok
    assert [(r.key, r.kernel) for r in cmp.regressions] == [(slow_key, "grouped")]
    assert cmp.regressions[0].slowdown_pct == pytest.approx(15.0)
    text = format_comparison(cmp, "h200.json")
    assert slow_key in text and "+15.0%" in text and text.endswith("verdict: FAIL")
    # a looser threshold lets it through
    assert compare_runs(cur, base, threshold=0.2).ok


def test_compare_everything_slower() -> None:
    cmp = compare_runs(make_run(scale=1.2), make_run())
    assert len(cmp.regressions) == 32  # grouped and per-head of 16 cases


def test_compare_missing_and_new_cases() -> None:
    base = make_run()
    cur = make_run()
    cur.cases = [c for c in cur.cases if c.case.layout == "qwen3_5_gqa256"]  # a partial run
    extra = base.cases[0].model_copy(update={"key": "gqa128/g8/bf16/bs1/p1024/L1"})
    cur.cases.append(extra)
    cmp = compare_runs(cur, base)
    assert cmp.ok and cmp.compared == 16
    assert len(cmp.missing) == 8 and all(k.startswith("mla") for k in cmp.missing)
    assert cmp.new == ["gqa128/g8/bf16/bs1/p1024/L1"]
    text = format_comparison(cmp)
    assert "not measured in this run (8 baseline cases)" in text and "not in the baseline (1" in text


def test_compare_skipped_case_counts_as_missing() -> None:
    cur = make_run()
    first = cur.cases[0]
    cur.cases[0] = first.model_copy(update={"status": "skipped"})
    cmp = compare_runs(cur, make_run())
    assert cmp.ok and cmp.missing == [first.key]


def test_compare_broken_kernel_is_a_regression() -> None:
    cur = make_run()
    case = cur.cases[3]
    case.kernels["per_head"] = KernelResult(status="error", note="illegal memory access")
    cmp = compare_runs(cur, make_run())
    assert [(r.key, r.kernel, r.current_us) for r in cmp.regressions] == [(case.key, "per_head", None)]
    assert "now error" in format_comparison(cmp)


def test_compare_ignores_peers_and_bad_baselines() -> None:
    base = make_run()
    base.cases[0].kernels["grouped"] = KernelResult(status="error")
    cur = make_run()
    cur.cases[1].kernels["sdpa"] = cur.cases[1].kernels["sdpa"].model_copy(update={"median_us": 1e6})
    cmp = compare_runs(cur, base)
    assert cmp.ok and cmp.compared == 31


def test_read_run_errors(tmp_path: Path) -> None:
    with pytest.raises(BenchReportError, match="no such file"):
        read_run(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BenchReportError, match="not valid JSON"):
        read_run(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "kgen.block-config-table/1", "entries": []}))
    with pytest.raises(BenchReportError, match="not a kgen bench result"):
        read_run(other)


# ----------------------------------------------------------------- kv_indices dtype


def legacy(run: BenchRun, tmp_path: Path) -> BenchRun:
    """``run`` as a file written before the index dtype was recorded (no such field)."""
    raw = json.loads(run_to_json(run))
    for c in raw["cases"]:
        del c["case"]["index_dtype"], c["case"]["index_dtype_ab"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    return read_run(path)


def test_json_and_markdown_record_the_index_dtype_per_case(tmp_path: Path) -> None:
    run = make_run(index_dtypes=("int64", "int32"), ab_scale=1 / 1.004)
    write_report(run, tmp_path, plots=False)
    raw = json.loads((tmp_path / JSON_NAME).read_text())
    first = raw["cases"][0]
    assert (first["case"]["index_dtype"], first["case"]["index_dtype_ab"]) == ("int64", "int32")
    ab = first["kernels"]["grouped"]["index_ab"]
    assert ab["dtype"] == "int32" and ab["ratio"] == pytest.approx(1.004) and ab["median_us"] > 0
    md = (tmp_path / MARKDOWN_NAME).read_text()
    assert "| kv_indices |" in md and "| grouped int64/int32 | per-head int64/int32 |" in md
    assert "| 16 | 1024 | 4 | int64 | 160.0 (152.0–176.0) |" in md and "| 1.004 (0.994–1.014) |" in md
    assert "kgen grouped kv_indices int64/int32: median **1.004** over 16 cases" in md
    plain = render_markdown(make_run())
    assert "| 4 | int64 |" in plain and "int64/int32" not in plain
    assert "| 4 | int32? |" in render_markdown(legacy(make_run(), tmp_path))


def test_compare_judges_only_like_index_dtypes(tmp_path: Path) -> None:
    old = legacy(make_run(), tmp_path)  # an int32 baseline that does not say so
    assert old.cases[0].case.index_dtype is None and old.cases[0].case.indices == "int32"
    int64 = compare_runs(make_run(scale=2.0), old)
    assert int64.compared == 0 and int64.ok and len(int64.index_mismatch) == 16
    text = format_comparison(int64)
    assert "taken as int32" in text and "not compared, kv_indices dtype differs (16 cases; int64 here vs int32" in text
    assert "--index-dtype int32 (or --index-dtype int64,int32)" in text
    int32 = compare_runs(make_run(scale=2.0, index_dtypes=("int32", None)), old)
    assert int32.compared == 32 and len(int32.regressions) == 32 and not int32.index_mismatch
    # an A/B run is judged on its alternated int32 figure: 25% slower there is a regression
    ab = compare_runs(make_run(index_dtypes=("int64", "int32"), ab_scale=1.25), old)
    assert ab.compared == 32 and len(ab.regressions) == 32 and ab.via_ab == 16
    assert "16 case(s) judged on this run's alternated figure" in format_comparison(ab)
    same = compare_runs(make_run(index_dtypes=("int64", "int32"), ab_scale=1.25), make_run())
    assert same.compared == 32 and same.ok and same.via_ab == 0  # int64 against int64


def test_committed_baselines_record_the_engines_index_dtype() -> None:
    root = Path(__file__).parents[1] / "benchmarks" / "baselines"
    for name in ("h200.json", "h200_matrix.json"):
        run = read_run(root / name)
        assert {c.case.indices for c in run.cases} == {"int64"}


def test_compare_refuses_runs_of_two_modes() -> None:
    """A --batch-invariant run's grouped figures are another module's than a default run's."""
    invariant = make_run()
    invariant.meta.batch_invariant = True
    with pytest.raises(BenchReportError, match="compare runs of one mode"):
        compare_runs(invariant, make_run())
    assert compare_runs(invariant, invariant).ok
