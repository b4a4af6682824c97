"""kgen bench: the parallel precompile (job list, split, worker processes, the report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kgen.bench.cases import build_matrix, case_for, parse_sizes
from kgen.bench.cli import sweep_cases
from kgen.bench.measure import KernelRun
from kgen.bench.peers import FLEX_SWEEP_GRID, flex_label
from kgen.bench.warm import (
    FAILED,
    OK,
    UNSUPPORTED,
    JobOutcome,
    KernelRefused,
    WarmJob,
    WarmReport,
    outcome_of,
    precompile,
    run_job,
    split_jobs,
    warm_jobs,
    worker_outcomes,
)
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
    compiles, one fails; the report counts both and says what failed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    good = WarmJob("grouped", _case_dict())
    bad = WarmJob("no_such_variant", _case_dict())
    report = precompile([good, bad], workers=2, timeout_s=300, device="cpu")
    assert (report.jobs, report.workers, report.done, report.failed, report.unsupported) == (2, 2, 1, 1, 0)
    assert not report.timed_out and report.note().startswith("precompiled 1/2 kernels in 2 worker processes")
    assert report.note().endswith("(1 failed: no_such_variant x1: ValueError: unknown kernel 'no_such_variant')")
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


# ----------------------------------------------------------------- outcomes and the report


def _job(kind: str = "grouped", layout: str = "gqa128", group: int = 8, options: str = "") -> WarmJob:
    from dataclasses import asdict

    return WarmJob(kind, asdict(case_for(SPECS[layout], group, "bfloat16", 2, 96, 2)), options)


def test_a_refused_case_is_unsupported_and_a_broken_kernel_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kgen.bench import peers

    refused = "flex (default): OutOfResources: out of resource: shared memory, Required: 327680"
    monkeypatch.setattr(peers, "flex_run", lambda *a, **k: KernelRun(unsupported=refused))
    monkeypatch.setattr(peers, "kgen_run", lambda *a, **k: KernelRun(error="load grouped: no module"))
    flex = outcome_of(_job("flex", "mla_absorbed_512_64", 16), "cpu")
    assert (flex.kind, flex.where, flex.status) == ("flex", "mla_absorbed_512_64/g16", UNSUPPORTED)
    assert flex.reason == refused
    grouped = outcome_of(_job(), "cpu")
    assert (grouped.status, grouped.reason) == (FAILED, "RuntimeError: load grouped: no module")
    with pytest.raises(KernelRefused, match="OutOfResources"):
        run_job(_job("flex"), "cpu")


def test_outcome_lines_survive_the_workers_other_output() -> None:
    outcome = JobOutcome("flex", "mla_absorbed_512_64/g16", UNSUPPORTED, "flex (x): refused\nsecond line", 2.5)
    log = f"a warning printed by torch\n{outcome.line()}\n  ok\n"
    assert worker_outcomes([_job("flex")], log, 0, stopped=False) == [outcome]
    assert JobOutcome.parse("grouped gqa128/g8/bf16/bs2/p96/L2 1.0s ok") is None  # the old line format is noise


def test_a_worker_that_died_fails_the_job_it_was_running() -> None:
    """Its exit code and last output name the failure; the jobs after it were never started."""
    chunk = [_job(), _job("per_head"), _job("flex")]
    done = JobOutcome("grouped", "gqa128/g8", OK)
    log = f"{done.line()}\nSegmentation fault in ptxas\n"
    outcomes = worker_outcomes(chunk, log, -11, stopped=False)
    assert outcomes[0] == done and len(outcomes) == 2
    assert (outcomes[1].kind, outcomes[1].status) == ("per_head", FAILED)
    assert outcomes[1].reason == "the worker exited with code -11 (its last output: Segmentation fault in ptxas)"
    assert worker_outcomes(chunk, log, -9, stopped=True) == [done]  # killed at the deadline: not a failure


def test_the_note_counts_refusals_apart_from_failures() -> None:
    refused = "flex (BLOCK_N=64,num_warps=4,num_stages=2): OutOfResources: out of resource: shared memory"
    outcomes = ([JobOutcome("grouped", "gqa128/g8", OK)] * 24
                + [JobOutcome("flex", "mla_absorbed_512_64/g16", UNSUPPORTED, refused)] * 16)
    report = WarmReport(jobs=40, workers=12, seconds=56.2, outcomes=outcomes)
    assert (report.done, report.unsupported, report.failed, report.not_reached) == (24, 16, 0, 0)
    assert report.note() == ("precompiled 24/24 kernels in 12 worker processes in 56 s (0 failed); 16 not run, "
                             f"unsupported here: flex on mla_absorbed_512_64/g16 x16: {refused}")
    broken = [JobOutcome("grouped", "gqa128/g8", FAILED, "CompilationError: at 12:4:\nmore"),
              JobOutcome("grouped", "gqa64/g4", FAILED, "RuntimeError: other"),
              JobOutcome("per_head", "gqa64/g4", FAILED, "")]
    late = WarmReport(jobs=8, workers=2, seconds=240, timed_out=True, outcomes=outcomes[:3] + broken)
    assert late.note() == ("precompiled 3/8 kernels in 2 worker processes in 240 s (3 failed: grouped x2: "
                           "CompilationError: at 12:4:; per_head x1: no reason given, 2 not reached by the deadline)")
    assert WarmReport(jobs=2, workers=1, seconds=3, outcomes=outcomes[:1]).note().endswith(
        "(0 failed, 1 not reached (a worker exited early))")
    assert WarmReport(jobs=3, workers=3, seconds=9, outcomes=outcomes[:3]).note() == (
        "precompiled 3/3 kernels in 3 worker processes in 9 s (0 failed)")  # the note of every clean run
