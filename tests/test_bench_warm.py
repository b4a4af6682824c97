"""kgen bench: the parallel precompile (job list, split, worker processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kgen.bench.cases import build_matrix, case_for, parse_sizes
from kgen.bench.cli import sweep_cases
from kgen.bench.peers import FLEX_SWEEP_GRID, flex_label
from kgen.bench.warm import WarmJob, precompile, split_jobs, warm_jobs
from kgen.spec import load_layouts

SPECS = load_layouts()
LABELS = [flex_label(o) for o in FLEX_SWEEP_GRID]


def test_full_run_jobs_are_one_per_compilation() -> None:
    cases = build_matrix(SPECS)
    jobs = warm_jobs(cases, ["grouped", "per_head", "flex", "sdpa"], sweep_cases(cases, "headline"), LABELS)
    kinds = [j.kind for j in jobs]
    # kgen: 4 layout/group x 2 dtypes x 4 batches x 3 L, per variant (the prefix does not matter)
    assert kinds.count("grouped") == kinds.count("per_head") == 96
    # flex: bf16 only, 4 x 4 batches x 3 L, plus 8 headline shapes x the 8-point grid
    assert kinds.count("flex") == 48 + 8 * 8
    assert len({(j.kind, j.options, tuple(sorted(j.case.items()))) for j in jobs}) == len(jobs)
    assert {j.case["prefix"] for j in jobs} == {1024}
    assert all(j.case["kv_dtype"] == "bfloat16" for j in jobs if j.kind == "flex")
    assert jobs[0].kind == "flex" and jobs[1].kind != "flex"  # slow jobs spread out


def test_jobs_follow_the_kernel_selection() -> None:
    cases = build_matrix(SPECS, quick=True)
    jobs = warm_jobs(cases, ["grouped", "sdpa"])
    assert {j.kind for j in jobs} == {"grouped"} and len(jobs) == 4 * 2 * 2 * 1
    short = build_matrix(SPECS, [("gqa128", 8)], ["bfloat16"], batches=[2], prefixes=[64], drafts=[2])
    assert warm_jobs(short, ["flex"])[0].case["prefix"] == 256  # past one 128-token block


def test_split_jobs_round_robin() -> None:
    jobs = [WarmJob("grouped", {"i": i}) for i in range(7)]
    chunks = split_jobs(jobs, 3)
    assert [len(c) for c in chunks] == [3, 2, 2] and chunks[0][1].case == {"i": 3}
    assert len(split_jobs(jobs[:2], 8)) == 2
    assert WarmJob("flex", _case_dict(), "BLOCK_N=32").label().startswith("flex@BLOCK_N=32 gqa128/g8/bf16")


def _case_dict() -> dict:
    from dataclasses import asdict

    return asdict(case_for(SPECS["gqa128"], 8, "bfloat16", 2, 96, 2))


def test_precompile_runs_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two worker processes on CPU (kgen kernels through Triton's interpreter): one job
    compiles, one fails; the report counts both."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    good = WarmJob("grouped", _case_dict())
    bad = WarmJob("no_such_variant", _case_dict())
    report = precompile([good, bad], workers=2, timeout_s=300, device="cpu")
    assert (report.jobs, report.workers, report.done, report.failed) == (2, 2, 1, 1)
    assert not report.timed_out and "precompiled 1/2 kernels in 2 worker processes" in report.note()
    assert precompile([], workers=4).jobs == 0


def test_run_job_compiles_both_index_dtypes_of_an_ab(monkeypatch: pytest.MonkeyPatch) -> None:
    """An int64/int32 A/B needs both Triton specializations (the pointer dtype is part of it)."""
    from dataclasses import asdict

    import torch
    from test_bench_peers import ReferenceModule

    from kgen.bench import peers, warm
    from kgen.bench.cases import case_for
    from kgen.spec import load_layouts

    module = ReferenceModule()
    real = peers.kgen_run
    monkeypatch.setattr(peers, "kgen_run", lambda case, inputs, variant: real(case, inputs, variant, lambda *a: module))
    case = case_for(load_layouts()["gqa128"], 8, "bfloat16", 1, 32, 2, index_dtype_ab="int32")
    warm.run_job(warm.WarmJob("grouped", asdict(case)), "cpu")
    assert module.index_dtypes == [torch.int64, torch.int32]


def test_batch_invariant_runs_warm_the_batch_invariant_modules_too() -> None:
    cases = build_matrix(SPECS, quick=True)
    jobs = warm_jobs(cases, ["grouped"], batch_invariant=True)
    kinds = [j.kind for j in jobs]
    assert kinds.count("batch_invariant") == kinds.count("grouped") == 4 * 2 * 2
    assert warm_jobs(cases, ["per_head"], batch_invariant=True)[0].kind == "per_head"


# ----------------------------------------------------------------- what is scheduled


def test_a_run_without_flexattention_schedules_none_of_its_sweep() -> None:
    """h200_fp8_scales/ab.json's run (--kv-dtype fp8 --kernels grouped --batch 1,16,64 --prefix
    1K,4K,16K --draft 1,4, the sweep left at headline) scheduled 88 jobs: its 24 grouped ones and
    64 FlexAttention sweep jobs it never timed, 16 of which FlexAttention refused."""
    cases = build_matrix(SPECS, kv_dtypes=["float8_e4m3fn"], batches=[1, 16, 64],
                         prefixes=parse_sizes(["1K,4K,16K"]), drafts=[1, 4])
    sweep = sweep_cases(cases, "headline")
    assert len(sweep) == 8  # the 4 layouts' two headline shapes
    jobs = warm_jobs(cases, ["grouped"], sweep, LABELS)
    assert len(jobs) == 24 and {j.kind for j in jobs} == {"grouped"}
    with_flex = warm_jobs(cases, ["grouped", "flex"], sweep, LABELS)
    assert sum(j.kind == "flex" and bool(j.options) for j in with_flex) == 8 * len(LABELS)


def test_the_peers_are_not_warmed_on_a_masked_case() -> None:
    """The run times FlexAttention on the causal chain only (Case.peers_refusal): a tree's jobs
    are the kgen kernels'."""
    cases = build_matrix(SPECS, [("gqa128", 8)], ["bfloat16"], batches=[64], prefixes=[16384], drafts=[4],
                         masks=("tree", None))
    assert cases[0].peers_refusal == "the peers are timed on the causal chain, not a tree mask"
    jobs = warm_jobs(cases, ["grouped", "flex"], sweep_cases(cases, "headline"), LABELS)
    assert [j.kind for j in jobs] == ["grouped"]
    chain = build_matrix(SPECS, [("gqa128", 8)], ["bfloat16"], batches=[64], prefixes=[16384], drafts=[4])
    assert chain[0].peers_refusal is None
    assert sum(j.kind == "flex" for j in warm_jobs(chain, ["flex"], sweep_cases(chain, "headline"), LABELS)) == 9
