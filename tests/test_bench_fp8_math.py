"""kgen bench --fp8-math: the grouped kernel's launches with fp8_math=True, timed in alternation
with the same module's fp8_math=False ones (the --batch-invariant A/B's twin; tests there:
test_bench_cli.py, test_bench_measure.py, test_bench_warm.py).

The modules here are stand-ins (``ReferenceModule`` with a ``launch`` that takes fp8_math), so
nothing depends on the generated modules' signature, except the one test that runs a real
module in Triton's interpreter, skipped where its ``launch`` has no fp8_math yet.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from test_bench_cli import _parse, _sm90_table
from test_bench_measure import COPY_GBPS, FakeLaunch, FakePairTimer, FakeTimer
from test_bench_peers import ReferenceModule, fake_timer
from test_bench_report import make_run

from kgen.bench import cli
from kgen.bench.cases import build_matrix, case_for
from kgen.bench.inputs import build_inputs
from kgen.bench.measure import (
    FP8_MATH_SAME_NOTE,
    TOLERANCE_FP8,
    Fp8MathAB,
    KernelResult,
    KernelRun,
    make_case_result,
    measure_kernel,
)
from kgen.bench.peers import DeviceProvider, kgen_run
from kgen.bench.report import (
    JSON_NAME,
    BenchMeta,
    BenchReportError,
    compare_runs,
    read_run,
    render_markdown,
    write_json,
)
from kgen.bench.timing import PairedTiming
from kgen.bench.warm import warm_jobs
from kgen.spec import load_layouts

SPECS = load_layouts()
FP8 = "float8_e4m3fn"
# A small e4m3 FP8 case of one layout: what --fp8-math times.
SMALL = ("--layout", "gqa128:8", "--kv-dtype", "fp8", "--batch", "2", "--prefix", "32", "--draft", "2")
ABSENT = "absent"


class Fp8MathModule(ReferenceModule):
    """A stand-in module whose ``launch`` takes fp8_math and records what each call passed
    (``ABSENT`` where the keyword was not given). ``wrong``: the mode (True or False) whose
    launches write a wrong o. ``same``: whether launch_params lists the same kernels for both."""

    URI = "verify_gqa128__kv_fp8_e4m3fn__q_bf16"

    def __init__(self, wrong: bool | None = None, same: bool = False) -> None:
        super().__init__()
        self.seen: list[object] = []
        self.wrong, self.same = wrong, same

    def launch(self, *args, fp8_math: object = ABSENT, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.seen.append(fp8_math)
        super().launch(*args, **kwargs)
        if fp8_math is self.wrong:
            args[3].mul_(1.5)  # o

    def launch_params(self, arch, num_sms, group, batch, max_len, page_size=None, config=None, num_kv_heads=1,  # noqa: ANN001, ANN201
                      has_mask=False, fp8_math=False):  # fmt: skip
        program = "_prefix_fp8_math" if fp8_math and not self.same else "_prefix"
        return [(program, {}, {}), ("_merge", {}, {})]


def _fp8_case(draft: int = 2):  # noqa: ANN202
    return case_for(SPECS["gqa128"], 8, FP8, 2, 32, draft)


class PairingFakeTimer:
    """fake_timer for single kernels; pair() launches both sides and claims a = 0.9 x b."""

    def __init__(self) -> None:
        self.pairs = 0

    def __call__(self, fn, n_sets):  # noqa: ANN001, ANN204
        return fake_timer(fn, n_sets)

    def pair(self, fn_a, fn_b, n_sets):  # noqa: ANN001, ANN202
        self.pairs += 1
        fn_a(n_sets - 1)
        fn_b(n_sets - 1)
        return PairedTiming.from_samples([10.0 * r for r in (0.91, 0.9, 0.89, 0.9, 0.9)], [10.0] * 5, n_sets, "fake")


# ----------------------------------------------------------------- the option


def test_fp8_math_option_is_checked_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused with every other A/B, without the grouped kernel, on a pool other than e4m3fn
    (the default --kv-dtype asks for bf16 too), with --from-json, and against a baseline of the
    exact mode; accepted on e4m3 FP8 alone."""
    built = tmp_path / "built"
    built.mkdir()
    (built / "verify_gqa128__kv_fp8_e4m3fn__q_bf16.py").write_text("")
    tables = _sm90_table(tmp_path / "rows", {"block_n": 64, "num_stages": 2})
    for extra, why in ((("--kernels", "per_head"), "keep it in --kernels"),
                       (("--index-dtype", "int64,int32"), "run one at a time"),
                       (("--mask", "tree,none"), "run one at a time"),
                       (("--baseline-modules", str(built)), "run one at a time"),
                       (("--baseline-tables", str(tables)), "run one at a time"),
                       (("--batch-invariant",), "run one at a time")):  # fmt: skip
        assert cli.run_bench(_parse("--quick", "--fp8-math", "--kv-dtype", "fp8", *extra)) == 2
        assert why in capsys.readouterr().err, extra
    for kv, asked in ((None, "bfloat16 (the default --kv-dtype asks for it)"), ("bf16,fp8", "bfloat16"),
                      ("fp8_e5m2", "float8_e5m2")):  # fmt: skip
        assert cli.run_bench(_parse("--list", "--fp8-math", *(("--kv-dtype", kv) if kv else ()))) == 2
        err = capsys.readouterr().err
        assert "exists only for e4m3 FP8 pools (float8_e4m3fn) with bf16 queries" in err
        assert f"this run asks for {asked}: pass --kv-dtype fp8" in err
    result = write_json(make_run(), tmp_path / "result.json")
    assert cli.run_bench(_parse("--fp8-math", "--kv-dtype", "fp8", "--from-json", str(result))) == 2
    assert "--fp8-math measures: it does not go with --from-json" in capsys.readouterr().err
    assert cli.run_bench(_parse("--quick", "--fp8-math", "--kv-dtype", "fp8", "--compare", str(result))) == 2
    assert "holds the exact mode's figures" in capsys.readouterr().err
    assert cli.run_bench(_parse("--list", "--fp8-math", "--kv-dtype", "fp8,float8_e4m3fn", "--quick")) == 0
    assert capsys.readouterr().out.splitlines()[0] == "16 cases"
    assert cli.fp8_math_run(_parse("--fp8-math", "--kv-dtype", "fp8")) and not cli.fp8_math_run(_parse())


def test_help_explains_the_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="kgen")
    sub = cli.add_bench_parser(parser.add_subparsers(dest="command"))
    text = " ".join(sub.format_help().split())
    assert "--fp8-math the grouped kernel's figures are its launches in the opt-in FP8-math mode" in text
    assert "exact mode (fp8_math=False)" in text and "--kv-dtype fp8" in text
    assert "kgen bench --fp8-math --kernels grouped" in text  # the epilog's example


# ----------------------------------------------------------------- kgen_run


def test_kgen_run_launches_fp8_math_and_the_exact_mode_alternately() -> None:
    """--fp8-math: the grouped run passes fp8_math=True, its exact_mode the same module and
    inputs with fp8_math=False; both are checked. The per-head kernel, and any run without
    --fp8-math, pass no fp8_math at all."""
    case = _fp8_case()
    inp = build_inputs(case, "cpu", n_sets=2)
    module = Fp8MathModule()
    loads: list[tuple[str, str, str]] = []

    def loader(*key: str) -> Fp8MathModule:
        loads.append(key)
        return module

    run = kgen_run(case, inp, "grouped", loader=loader, fp8_math=True)
    assert loads == [("gqa128", FP8, "grouped")]  # one module for both modes
    exact = run.exact_mode
    assert exact is not None and exact.module == run.module == module.URI and exact.index_dtype == "int64"
    assert run.default_mode is None and run.alt is None and run.note == ""
    assert run.check() < TOLERANCE_FP8 and exact.check() < TOLERANCE_FP8
    run.fn(1)
    exact.fn(1)
    assert module.seen == [True, False, True, False]
    module.seen.clear()
    per_head = kgen_run(case, inp, "per_head", loader=loader, fp8_math=True)
    assert per_head.exact_mode is None
    per_head.fn(0)
    plain = kgen_run(case, inp, "grouped", loader=loader)
    assert plain.exact_mode is None
    plain.fn(0)
    assert module.seen == [ABSENT, ABSENT]


@pytest.mark.parametrize("wrong", [True, False])
def test_the_check_applies_to_both_modes(wrong: bool) -> None:
    """A wrong o in either mode is caught by that side's check, at the bench's tolerance, and
    fails the case once measured."""
    case = _fp8_case()
    inp = build_inputs(case, "cpu", n_sets=2)
    run = kgen_run(case, inp, "grouped", loader=lambda *a: Fp8MathModule(wrong=wrong), fp8_math=True)
    errors = {True: run.check(), False: run.exact_mode.check()}
    assert errors[wrong] > TOLERANCE_FP8 and errors[not wrong] < TOLERANCE_FP8
    res = measure_kernel(run, PairingFakeTimer(), 10**6, COPY_GBPS, TOLERANCE_FP8)
    assert (res.status, res.fp8_math_ab.status) == (("failed", "ok") if wrong else ("ok", "failed"))
    assert make_case_result(case, {"grouped": res}).status == "FAILED"


def test_a_case_with_one_program_for_both_modes_says_so() -> None:
    case = _fp8_case()
    inp = build_inputs(case, "cpu", n_sets=2)
    same = kgen_run(case, inp, "grouped", loader=lambda *a: Fp8MathModule(same=True), fp8_math=True)
    assert same.note == FP8_MATH_SAME_NOTE
    other = kgen_run(case, inp, "grouped", loader=lambda *a: Fp8MathModule(same=False), fp8_math=True)
    assert other.note == ""
    unknown = kgen_run(case, inp, "grouped", loader=lambda *a: ReferenceModule(), fp8_math=True)
    assert unknown.note == ""  # no launch_params: nothing to say (its launch still takes no fp8_math)


def test_device_provider_passes_fp8_math_to_the_grouped_kernel() -> None:
    module = Fp8MathModule()
    provider = DeviceProvider(device="cpu", compile_flex=False, loader=lambda *a: module, fp8_math=True)
    with provider(_fp8_case(), frozenset({"grouped", "per_head"})) as runs:
        assert runs["grouped"].exact_mode is not None and runs["per_head"].exact_mode is None
    plain = DeviceProvider(device="cpu", compile_flex=False, loader=lambda *a: module)
    with plain(_fp8_case(), frozenset({"grouped"})) as runs:
        assert runs["grouped"].exact_mode is None


# ----------------------------------------------------------------- measure_kernel


def _fp8_ab_run(exact: KernelRun) -> KernelRun:
    return KernelRun(fn=FakeLaunch("fp8 math", 90.0), n_sets=3, check=lambda: 3e-3, index_dtype="int64",
                     module="verify_x", exact_mode=exact)  # fmt: skip


def test_measure_kernel_times_the_exact_mode_in_alternation() -> None:
    """The grouped figures are the FP8-math launches'; the exact mode's time and the ratio
    fp8-math / exact are its fp8_math_ab."""
    timer = FakePairTimer(ratios=(0.9, 0.91, 0.89, 0.9, 0.92))
    exact = KernelRun(fn=FakeLaunch("exact", 100.0), n_sets=3, check=lambda: 2e-3, module="verify_x")
    res = measure_kernel(_fp8_ab_run(exact), timer, 10**6, COPY_GBPS, TOLERANCE_FP8)
    assert timer.pairs == [("fp8 math", "exact", 3)] and timer.seen == []
    assert res.mode_ab is None and res.build_ab is None and res.median_us == pytest.approx(90.0)
    ab = res.fp8_math_ab
    assert isinstance(ab, Fp8MathAB)
    assert (ab.module, ab.status, ab.median_us, ab.alternations) == ("verify_x", "ok", 100.0, 5)
    assert ab.ratio == pytest.approx(0.9) and ab.max_rel_err == 2e-3 and res.max_rel_err == 3e-3
    assert KernelResult.model_validate_json(res.model_dump_json()) == res
    no_pair = measure_kernel(_fp8_ab_run(KernelRun(fn=FakeLaunch("t", 1.0))), FakeTimer(), 10, None, TOLERANCE_FP8)
    assert no_pair.status == "error" and "cannot time the FP8-math and exact modes in alternation" in no_pair.note


# ----------------------------------------------------------------- the run, the report, meta and resume


def test_execute_fp8_math_against_the_exact_mode_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--fp8-math through the provider (a stand-in module, CPU): each case's grouped kernel is
    checked in both modes and timed with the timer's pair(); the JSON keeps both times and the
    ratio, the log line, the summary and bench.md the ratio with its label."""
    args = _parse(*SMALL, "--kernels", "grouped", "--fp8-math", "--no-progress", "--flex-sweep", "none")
    module = Fp8MathModule()
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: module, fp8_math=cli.fp8_math_run(args))  # fmt: skip
    timer = PairingFakeTimer()
    run = cli.execute(args, cli.select_cases(args), provider, timer, BenchMeta(gpu_name="cpu", fp8_math=True), tmp_path)
    (case,) = run.cases
    grouped = case.kernels["grouped"]
    assert case.status == "ok" and timer.pairs == 1 and grouped.max_rel_err < TOLERANCE_FP8
    assert grouped.fp8_math_ab.module == module.URI and grouped.fp8_math_ab.max_rel_err < TOLERANCE_FP8
    assert grouped.fp8_math_ab.ratio == pytest.approx(0.9) and grouped.median_us == pytest.approx(9.0)
    assert {True, False} <= set(module.seen) and ABSENT not in module.seen
    assert "fp8-math/exact=0.900" in capsys.readouterr().out
    again = read_run(write_json(run, tmp_path / JSON_NAME))
    assert again.meta.fp8_math and again.cases[0].kernels["grouped"].fp8_math_ab == grouped.fp8_math_ab
    summary = cli.summary_text(again)
    assert f"FP8-math mode vs the exact mode (time fp8-math / time exact): geometric mean 0.900 over 1 cases, " \
           f"worst 0.900 at {case.key}" in summary
    text = render_markdown(again)
    assert "| fp8-math / exact |" in text and "| 0.900 (0.894–0.906) |" in text
    assert "the FP8-math mode (`launch(..., fp8_math=True)`" in text
    assert "batch-invariant / default" not in text and "launch the same kernels" not in text


def test_the_report_counts_the_cases_that_ran_one_program() -> None:
    run = make_run()
    run.meta.fp8_math = True
    first = run.cases[0]
    first.kernels["grouped"] = first.kernels["grouped"].model_copy(update={"note": FP8_MATH_SAME_NOTE})
    assert "- 1 case(s) launch the same kernels with fp8_math=True as with False" in render_markdown(run)
    assert "fp8-math / exact" not in render_markdown(make_run())  # no column without the A/B


def test_fp8_math_is_recorded_in_the_meta(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """collect_meta records fp8_math as it records batch_invariant; a result written before the
    field existed reads as an exact-mode run."""
    import kgen.runtime.device

    props = types.SimpleNamespace(name="NVIDIA H100", multi_processor_count=132, L2_cache_size=50 << 20,
                                  total_memory=80 << 30)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(kgen.runtime.device, "arch_of", lambda p: "sm_90")
    monkeypatch.setattr(cli, "source_digest", lambda: None)
    meta = cli.collect_meta(_parse(*SMALL, "--fp8-math"), 3000.0, 1 << 30)
    assert meta.fp8_math and not meta.batch_invariant and meta.arch == "sm_90"
    assert not cli.collect_meta(_parse(*SMALL), 3000.0, 1 << 30).fp8_math
    old = make_run().model_dump(mode="json", by_alias=True)
    del old["meta"]["fp8_math"]
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(old))
    assert read_run(path).meta.fp8_math is False


FP8_RESUME_CASES = ("--layout", "qwen3_5_gqa256:16,mla_absorbed_512_64:16", "--kv-dtype", "fp8",
                    "--batch", "16,64", "--prefix", "1K,16K", "--draft", "4")


def test_resume_refuses_to_mix_fp8_math_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exact = write_json(make_run(), tmp_path / "exact" / JSON_NAME)
    fp8_run = make_run()
    fp8_run.meta.fp8_math = True
    fp8 = write_json(fp8_run, tmp_path / "fp8" / JSON_NAME)
    out = ("--out", str(tmp_path / "b"), "--no-plots")
    assert cli.run_bench(_parse(*FP8_RESUME_CASES, "--fp8-math", "--resume", str(exact), *out)) == 2
    assert f"--resume {exact} was not a --fp8-math run: resume with the same mode" in capsys.readouterr().err
    assert cli.run_bench(_parse(*FP8_RESUME_CASES, "--resume", str(fp8), *out)) == 2
    assert f"--resume {fp8} was a --fp8-math run: resume with the same mode" in capsys.readouterr().err
    # the same mode resumes (every case measured there: no GPU needed) and stays an FP8-math run
    assert cli.run_bench(_parse(*FP8_RESUME_CASES, "--fp8-math", "--resume", str(fp8), *out)) == 0
    assert "resuming" in capsys.readouterr().out
    assert read_run(tmp_path / "b" / JSON_NAME).meta.fp8_math


def test_compare_refuses_runs_of_two_math_modes() -> None:
    fp8 = make_run()
    fp8.meta.fp8_math = True
    with pytest.raises(BenchReportError, match="FP8-math mode's .* the baseline's the exact mode's: compare runs of"):
        compare_runs(fp8, make_run())
    with pytest.raises(BenchReportError, match="compare runs of one mode"):
        compare_runs(make_run(), fp8)
    assert compare_runs(fp8, fp8).ok


# ----------------------------------------------------------------- precompile


def test_fp8_math_runs_warm_the_fp8_math_launches_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from kgen.bench import peers, warm

    cases = build_matrix(SPECS, kv_dtypes=[FP8], quick=True)
    jobs = warm_jobs(cases, ["grouped"], fp8_math=True)
    kinds = [j.kind for j in jobs]
    assert kinds.count("fp8_math") == kinds.count("grouped") == 4 * 2
    assert "fp8_math" not in [j.kind for j in warm_jobs(cases, ["per_head"], fp8_math=True)]
    assert "fp8_math" not in [j.kind for j in warm_jobs(cases, ["grouped"])]
    module = Fp8MathModule()
    real = peers.kgen_run
    monkeypatch.setattr(peers, "kgen_run", lambda case, inputs, variant, **kw: real(case, inputs, variant,
                                                                                    lambda *a: module, **kw))
    warm.run_job(warm.WarmJob("fp8_math", asdict(_fp8_case())), "cpu")
    assert module.seen == [True]


# ----------------------------------------------------------------- a real module


def _launch_takes_fp8_math() -> bool:
    import kgen

    try:
        return "fp8_math" in inspect.signature(kgen.load("gqa128", FP8, "bfloat16").launch).parameters
    except Exception:  # noqa: BLE001 - a module that does not load cannot take it either
        return False


@pytest.mark.skipif(not _launch_takes_fp8_math(), reason="the generated modules' launch takes no fp8_math yet")
def test_a_real_module_in_the_interpreter(tmp_path: Path) -> None:
    """A generated e4m3fn module in Triton's interpreter (no Gluon stage there): both modes
    right, and the case noted as launching one program for both."""
    args = _parse(*SMALL, "--kernels", "grouped", "--fp8-math", "--no-progress", "--flex-sweep", "none")
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              fp8_math=True)  # fmt: skip
    run = cli.execute(args, cli.select_cases(args), provider, PairingFakeTimer(),
                      BenchMeta(gpu_name="cpu", fp8_math=True), tmp_path)  # fmt: skip
    grouped = run.cases[0].kernels["grouped"]
    assert run.cases[0].status == "ok", grouped
    assert grouped.max_rel_err < TOLERANCE_FP8 and grouped.fp8_math_ab.max_rel_err < TOLERANCE_FP8
    assert grouped.note == FP8_MATH_SAME_NOTE
