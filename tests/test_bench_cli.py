"""kgen bench: the CLI hooks, --list, --from-json re-rendering and --compare exit codes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_bench_report import make_run

from kgen.bench import cli
from kgen.bench.cli import add_bench_parser, run_bench, sweep_cases
from kgen.bench.report import COMPARE_NAME, JSON_NAME, MARKDOWN_NAME, write_json


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kgen")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_subparser_hooks_run_bench() -> None:
    args = _parse("--quick", "--layout", "gqa128:8", "--kv-dtype", "bf16,fp8", "--prefix", "1K")
    assert args.func is run_bench and args.quick and args.layout == ["gqa128:8"]
    assert args.kv_dtype == ["bf16,fp8"] and args.replays == 15


def test_list_full_and_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_parse("--list")) == 0
    assert capsys.readouterr().out.splitlines()[0] == "384 cases"
    assert run_bench(_parse("--list", "--quick")) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "32 cases" and "(headline)" in out


def test_list_with_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_bench(_parse("--list", "--layout", "mla_absorbed_512_64", "--kv-dtype", "fp8",
                            "--batch", "2", "--prefix", "4K,1K", "--draft", "3"))  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 cases"
    assert "mla_absorbed_512_64/g16/fp8_e4m3fn/bs2/p1024/L3" in lines[1]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_parse("--list", "--layout", "nope")) == 2
    assert "unknown layout" in capsys.readouterr().err
    assert run_bench(_parse("--list", "--prefix", "12G")) == 2
    assert run_bench(_parse("--kernels", "triton")) == 2
    assert run_bench(_parse("--from-json", "/nonexistent/bench.json")) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_measuring_without_gpu_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(_parse("--quick", "--out", str(tmp_path))) == 2
    assert "no CUDA/ROCm GPU" in capsys.readouterr().err


def test_from_json_rerenders_and_compares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = write_json(make_run(), tmp_path / "result.json")
    baseline = write_json(make_run(), tmp_path / "baseline.json")
    out = tmp_path / "out"
    code = run_bench(_parse("--from-json", str(result), "--compare", str(baseline), "--out", str(out),
                            "--no-plots"))  # fmt: skip
    assert code == 0
    assert (out / JSON_NAME).exists() and (out / MARKDOWN_NAME).exists()
    assert (out / COMPARE_NAME).read_text().strip().endswith("verdict: PASS")
    assert "verdict: PASS" in capsys.readouterr().out


def test_compare_regression_exits_1_naming_cases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = write_json(make_run(scale=1.25), tmp_path / "result.json")
    baseline = write_json(make_run(), tmp_path / "baseline.json")
    assert run_bench(_parse("--from-json", str(result), "--compare", str(baseline))) == 1
    out = capsys.readouterr().out
    assert "REGRESSIONS (32)" in out and "qwen3_5_gqa256/g16/bf16/bs16/p1024/L4 [grouped]" in out
    # a threshold above the slowdown passes
    assert run_bench(_parse("--from-json", str(result), "--compare", str(baseline), "--threshold", "30")) == 0


def test_failed_case_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = "mla_absorbed_512_64/g16/bf16/bs16/p1024/L4"
    result = write_json(make_run(failed_key=key), tmp_path / "result.json")
    assert run_bench(_parse("--from-json", str(result))) == 1
    assert f"FAILED: {key}" in capsys.readouterr().out


def test_sweep_cases_one_per_peer_shape() -> None:
    cases = cli.select_cases(_parse("--quick"))
    targets = sweep_cases(cases, "headline")
    # 2 headline shapes x 4 layout/group pairs; the FP8 twins share the BF16 peers
    assert len(targets) == 8 and all(c.kv_dtype == "bfloat16" and c.is_headline for c in targets)
    assert len(sweep_cases(cases, "all")) == 16
    assert sweep_cases(cases, "none") == []
    assert cli.flex_sweep_mode(_parse("--quick")) == "none"
    assert cli.flex_sweep_mode(_parse()) == "headline"
    assert cli.flex_sweep_mode(_parse("--quick", "--flex-sweep", "all")) == "all"


def test_python_m_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "kgen.bench", "--list", "--quick"], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("32 cases")


def test_gpu_script_is_wired(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "benchmarks" / "device" / "bench_of_record.sh"
    text = script.read_text()
    assert "kgen.bench" in text and "$OUT" in text and "--time-limit" in text
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_execute_on_cpu_writes_everything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The orchestration of a real run (matrix, peer sharing, sweep, report) on CPU tensors,
    with a reference-backed stand-in for the generated modules and a fake timer."""
    from test_bench_peers import ReferenceModule, fake_timer

    from kgen.bench.peers import DeviceProvider
    from kgen.bench.report import BenchMeta, write_report

    args = _parse("--layout", "gqa128:8", "--kv-dtype", "bf16,fp8", "--batch", "2", "--prefix", "64", "--draft", "2",
                  "--flex-sweep", "all", "--no-progress", "--flex-eager")  # fmt: skip
    cases = cli.select_cases(args)
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: ReferenceModule())  # fmt: skip
    meta = BenchMeta(gpu_name="cpu", copy_ceiling_gbps=100.0)
    run = cli.execute(args, cases, provider, fake_timer, meta, tmp_path)
    assert [c.status for c in run.cases] == ["ok", "ok"]
    assert len(run.sweeps) == 9  # default + the 8-point grid, once for the shared shape
    assert {e.peer_key for e in run.sweeps} == {cases[0].peer_key}
    assert run.meta.duration_s is not None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gqa128/g8/bf16/bs2/p64/L2") and "grouped" in lines[0]
    paths = write_report(run, tmp_path, plots=False)
    assert "## FlexAttention kernel-option sweep" in paths[1].read_text()


def test_warm_up_hands_the_run_kernels_to_precompile(monkeypatch: pytest.MonkeyPatch) -> None:
    from kgen.bench import warm
    from kgen.bench.report import BenchMeta

    seen: dict = {}

    def fake_precompile(jobs, workers, timeout_s=0.0, device="cuda"):  # noqa: ANN001, ANN202
        seen.update(jobs=jobs, workers=workers, timeout=timeout_s)
        done = [warm.JobOutcome(j.kind, j.where(), warm.OK) for j in jobs]
        return warm.WarmReport(jobs=len(jobs), workers=workers, seconds=1.0, outcomes=done)

    monkeypatch.setattr(warm, "precompile", fake_precompile)
    args = _parse("--quick", "--precompile-workers", "3", "--time-limit", "300", "--kernels", "grouped,flex")
    meta = BenchMeta()
    cli.warm_up(args, cli.select_cases(args), meta, started=__import__("time").monotonic())
    assert seen["workers"] == 3 and 140 < seen["timeout"] <= 150
    assert {j.kind for j in seen["jobs"]} == {"grouped", "flex"}
    assert all(not j.options for j in seen["jobs"])  # --quick: no sweep
    assert meta.notes and meta.notes[0].startswith("precompiled")
    seen.clear()
    cli.warm_up(_parse("--quick", "--precompile-workers", "0"), cli.select_cases(args), meta, 0.0)
    assert not seen
    # FlexAttention run eagerly compiles nothing to warm, its headline sweep included.
    eager = _parse("--precompile-workers", "3", "--flex-eager", "--layout", "gqa128:8", "--kv-dtype", "bf16")
    cli.warm_up(eager, cli.select_cases(eager), meta, __import__("time").monotonic())
    assert {j.kind for j in seen["jobs"]} == {"grouped", "per_head"}


RESUME_CASES = ("--layout", "qwen3_5_gqa256:16,mla_absorbed_512_64:16", "--kv-dtype", "bf16,fp8",
                "--batch", "16,64", "--prefix", "1K,16K", "--draft", "4")


def test_merge_runs_keeps_measured_cases_and_takes_the_rest() -> None:
    from kgen.bench.report import merge_runs

    prior, new = make_run(), make_run(scale=2.0)
    skipped = prior.cases[3].key
    prior.cases[3] = prior.cases[3].model_copy(update={"status": "skipped", "kernels": {}})
    del prior.cases[5]  # a case the earlier run did not have at all
    order = [r.case for r in new.cases]
    merged = merge_runs(prior, new, order, "a/bench.json")
    got = merged.by_key()
    assert [r.key for r in merged.cases] == [r.key for r in new.cases]  # the order asked for
    assert got[skipped] == new.by_key()[skipped] and got[new.cases[5].key] == new.by_key()[new.cases[5].key]
    assert got[new.cases[0].key] == prior.cases[0]  # measured before: kept as it was
    assert len(merged.sweeps) == 2  # same keys and options: the new entries replace the old
    assert merged.meta.notes[-1].startswith("resumed from a/bench.json: 14 case(s) measured there (commit abc123")


def test_resume_with_nothing_left_needs_no_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prior = write_json(make_run(), tmp_path / "a" / JSON_NAME)
    code = run_bench(_parse(*RESUME_CASES, "--resume", str(prior), "--out", str(tmp_path / "b"), "--no-plots"))
    assert code == 0
    assert "resuming" in capsys.readouterr().out
    merged = cli.read_run(tmp_path / "b" / JSON_NAME)
    assert [c.key for c in merged.cases] == [c.key for c in make_run().cases]
    assert merged.meta.notes[-1].startswith("resumed from")


def test_resume_refuses_another_gpu() -> None:
    prior, new = make_run(), make_run()
    new.meta.gpu_name = "NVIDIA B200"
    with pytest.raises(cli.BenchUsageError, match="measured on NVIDIA H200, this GPU is NVIDIA B200"):
        cli._same_gpu(prior, new, "a/bench.json")


def test_execute_hands_its_result_to_finish(tmp_path: Path) -> None:
    """With --resume, what execute returns (and checkpoints) is the merged run."""
    from test_bench_peers import ReferenceModule, fake_timer

    from kgen.bench.peers import DeviceProvider
    from kgen.bench.report import BenchMeta, merge_runs

    args = _parse("--layout", "gqa128:8", "--kv-dtype", "bf16,fp8", "--batch", "2", "--prefix", "64", "--draft", "2",
                  "--flex-sweep", "none", "--no-progress", "--flex-eager", "--kernels", "grouped")  # fmt: skip
    cases = cli.select_cases(args)
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: ReferenceModule())  # fmt: skip
    meta = BenchMeta(gpu_name="cpu", copy_ceiling_gbps=100.0)
    first = cli.execute(args, cases[:1], provider, fake_timer, meta, tmp_path)
    run = cli.execute(args, cases[1:], provider, fake_timer, meta.model_copy(), tmp_path,
                      finish=lambda new: merge_runs(first, new, cases, "first"))  # fmt: skip
    assert [c.key for c in run.cases] == [c.key for c in cases] and run.cases[0] == first.cases[0]


@pytest.mark.parametrize(("flag", "tty", "bar"), [((), True, True), (("--no-progress",), True, False),
                                                 ((), False, False)])
def test_a_log_gets_a_line_a_case_not_a_bar(tmp_path: Path, monkeypatch, capsys, flag, tty, bar) -> None:
    """The bar only on a terminal: where stderr is a file (a log, a device call) or --no-progress
    is given, each case prints its figures on a line of its own."""
    from test_bench_peers import ReferenceModule, fake_timer

    from kgen.bench.peers import DeviceProvider
    from kgen.bench.report import BenchMeta

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    args = _parse("--layout", "gqa128:8", "--kv-dtype", "bf16", "--batch", "2", "--prefix", "64", "--draft", "2",
                  "--flex-sweep", "none", "--flex-eager", "--kernels", "grouped", *flag)  # fmt: skip
    assert cli.show_progress_bar(args) is bar
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: ReferenceModule())  # fmt: skip
    run = cli.execute(args, cli.select_cases(args), provider, fake_timer, BenchMeta(gpu_name="cpu",
                      copy_ceiling_gbps=100.0), tmp_path)  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(run.cases[0].key)]
    assert len(lines) == (0 if bar else 1) and (bar or " us" in lines[0]), lines


def test_source_digest_names_the_code_that_ran(tmp_path: Path) -> None:
    assert cli.source_digest(tmp_path) is None  # nothing to name
    (tmp_path / "kgen" / "templates").mkdir(parents=True)
    (tmp_path / "generated").mkdir()
    (tmp_path / "kgen" / "a.py").write_text("x = 1\n")
    (tmp_path / "kgen" / "templates" / "k.py.j2").write_text("{{ x }}\n")
    (tmp_path / "generated" / "m.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code\n")
    first = cli.source_digest(tmp_path)
    assert first is not None and len(first) == 64
    (tmp_path / "notes.txt").write_text("still not code\n")
    assert cli.source_digest(tmp_path) == first
    (tmp_path / "generated" / "m.py").write_text("y = 3\n")
    assert cli.source_digest(tmp_path) != first
    (tmp_path / "generated" / "m.py").write_text("y = 2\n")
    assert cli.source_digest(tmp_path) == first
    (tmp_path / "generated" / "m.py").rename(tmp_path / "generated" / "n.py")  # same bytes, other name
    assert cli.source_digest(tmp_path) != first


# ----------------------------------------------------------------- --index-dtype


def test_index_dtype_option() -> None:
    from kgen.bench.cases import parse_index_dtypes

    assert {c.index_dtype for c in cli.select_cases(_parse("--quick"))} == {"int64"}  # SGLang's, by default
    cases = cli.select_cases(_parse("--quick", "--index-dtype", "int64,int32"))
    assert {(c.index_dtype, c.index_dtype_ab) for c in cases} == {("int64", "int32")}
    assert parse_index_dtypes(["int32"]) == ("int32", None)
    assert parse_index_dtypes(["int32", "int64"]) == ("int32", "int64")
    for bad, pattern in ((["int16"], "choose from int64, int32"), (["int64,int32,int64", "int8"], "int8")):
        with pytest.raises(cli.BenchUsageError, match=pattern):
            parse_index_dtypes(bad)
    assert run_bench(_parse("--list", "--index-dtype", "uint8")) == 2


def test_mask_option() -> None:
    assert {c.mask for c in cli.select_cases(_parse("--quick"))} == {"none"}  # the causal chain, by default
    cases = cli.select_cases(_parse("--quick", "--mask", "tree,none"))
    assert {(c.mask, c.mask_ab) for c in cases} == {("tree", "none")}
    assert all(c.key.endswith("/mask-tree") for c in cases)
    assert run_bench(_parse("--list", "--mask", "forest")) == 2
    assert run_bench(_parse("--quick", "--mask", "tree,none", "--index-dtype", "int64,int32")) == 2


def test_resume_refuses_another_index_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prior = write_json(make_run(), tmp_path / "a" / JSON_NAME)  # int64
    code = run_bench(_parse(*RESUME_CASES, "--index-dtype", "int32", "--resume", str(prior), "--out",
                            str(tmp_path / "b"), "--no-plots"))  # fmt: skip
    assert code == 2
    assert "with --index-dtype int64, this run asks for int32" in capsys.readouterr().err


def test_execute_with_an_index_dtype_ab_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--index-dtype int64,int32 through the real provider (reference-backed module, CPU):
    each kgen kernel is checked on both page tables and timed with the timer's pair()."""
    from test_bench_peers import ReferenceModule, fake_timer

    from kgen.bench.peers import DeviceProvider
    from kgen.bench.report import BenchMeta, render_markdown
    from kgen.bench.timing import PairedTiming

    class PairingFakeTimer:
        def __init__(self) -> None:
            self.pairs = 0

        def __call__(self, fn, n_sets):  # noqa: ANN001, ANN204
            return fake_timer(fn, n_sets)

        def pair(self, fn_a, fn_b, n_sets):  # noqa: ANN001, ANN202
            self.pairs += 1
            fn_a(n_sets - 1)
            fn_b(n_sets - 1)
            return PairedTiming.from_samples([10.2, 10.1, 10.3, 10.0, 10.2], [10.0] * 5, n_sets, "fake")

    args = _parse("--layout", "gqa128:8", "--kv-dtype", "bf16", "--batch", "2", "--prefix", "64", "--draft", "2",
                  "--kernels", "grouped,per_head", "--index-dtype", "int64,int32", "--no-progress",
                  "--flex-sweep", "none")  # fmt: skip
    module = ReferenceModule()
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: module)  # fmt: skip
    timer = PairingFakeTimer()
    run = cli.execute(args, cli.select_cases(args), provider, timer, BenchMeta(gpu_name="cpu"), tmp_path)
    (case,) = run.cases
    assert case.status == "ok" and timer.pairs == 2  # grouped and per-head
    assert set(module.index_dtypes) == {torch.int64, torch.int32}
    ab = case.kernels["grouped"].index_ab
    assert ab.dtype == "int32" and ab.ratio == pytest.approx(1.02) and ab.max_rel_err < 2e-2
    assert case.kernels["grouped"].median_us == pytest.approx(10.2)
    out = capsys.readouterr().out
    assert "int64/int32=1.020" in out
    assert "grouped kv_indices int64/int32: median 1.020 over 1 cases" in cli.summary_text(run)
    assert "| grouped int64/int32 |" in render_markdown(run)


# ----------------------------------------------------------------- --baseline-modules


def test_baseline_modules_option_is_checked_before_measuring(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_bench(_parse("--quick", "--baseline-modules", str(empty), "--out", str(tmp_path))) == 2
    assert "not a directory of generated modules" in capsys.readouterr().err
    built = tmp_path / "before"
    built.mkdir()
    (built / "verify_gqa128__kv_bf16__q_bf16.py").write_text("")
    for extra, why in ((("--kernels", "per_head"), "keep it in --kernels"),
                       (("--index-dtype", "int64,int32"), "one at a time")):  # fmt: skip
        assert run_bench(_parse("--quick", "--baseline-modules", str(built), *extra)) == 2
        assert why in capsys.readouterr().err
    assert cli.baseline_modules_dir(_parse("--baseline-modules", str(built))) == built


def test_execute_with_a_baseline_build_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--baseline-modules through the real provider: the generated grouped module (Triton's
    interpreter) and its copy in DIR, each checked, timed with the timer's pair(); the JSON
    keeps both times and the ratio, the summary the geometric mean and the worst case."""
    import shutil

    from test_bench_peers import fake_timer

    import kgen
    from kgen.bench.peers import DeviceProvider
    from kgen.bench.report import BenchMeta, read_run, render_markdown, write_json
    from kgen.bench.timing import PairedTiming

    class PairingFakeTimer:
        def __init__(self) -> None:
            self.pairs: list[tuple[str, str]] = []

        def __call__(self, fn, n_sets):  # noqa: ANN001, ANN204
            return fake_timer(fn, n_sets)

        def pair(self, fn_a, fn_b, n_sets):  # noqa: ANN001, ANN202
            self.pairs.append((fn_a.__qualname__, fn_b.__qualname__))
            fn_a(n_sets - 1)
            fn_b(n_sets - 1)
            ratios = (1.04, 1.02, 1.05, 1.0, 1.04) if len(self.pairs) == 1 else (0.98, 0.99, 0.97, 1.0, 0.99)
            return PairedTiming.from_samples([10.0 * r for r in ratios], [10.0] * 5, n_sets, "fake")

    current = kgen.load("gqa128", "bfloat16")
    before = tmp_path / "before"
    before.mkdir()
    shutil.copy(current.__file__, before)
    args = _parse("--layout", "gqa128:8", "--kv-dtype", "bf16", "--batch", "2", "--prefix", "32", "--draft", "1,2",
                  "--kernels", "grouped", "--baseline-modules", str(before), "--no-progress", "--flex-sweep", "none")
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              baseline_modules=cli.baseline_modules_dir(args))  # fmt: skip
    timer = PairingFakeTimer()
    meta = BenchMeta(gpu_name="cpu", baseline_modules=str(before))
    run = cli.execute(args, cli.select_cases(args), provider, timer, meta, tmp_path)
    assert [c.status for c in run.cases] == ["ok", "ok"] and len(timer.pairs) == 2
    for case, ratio in zip(run.cases, (1.04, 0.99), strict=True):
        ab = case.kernels["grouped"].build_ab
        assert ab.status == "ok" and ab.modules == str(before) and ab.median_us == 10.0
        assert ab.ratio == pytest.approx(ratio) and ab.max_rel_err < 2e-2 and ab.alternations == 5
        assert case.kernels["grouped"].median_us == pytest.approx(10.0 * ratio)
    assert "now/then=1.040" in capsys.readouterr().out
    again = read_run(write_json(run, tmp_path / "bench.json"))
    assert again.cases[0].kernels["grouped"].build_ab.ratio == pytest.approx(1.04)
    summary = cli.summary_text(again)
    assert f"vs the build in {before}" in summary
    assert f"geometric mean {(1.04 * 0.99) ** 0.5:.3f} over 2 cases, worst 1.040 at {run.cases[0].key}" in summary
    assert f"grouped kernel vs the build in {before}" in render_markdown(again)


# ----------------------------------------------------------------- --baseline-tables


def _sm90_table(path: Path, gluon: dict) -> Path:
    """A tables directory whose sm_90.json has one GQA 128 group 8 row with this gluon section."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    row = {"layout": "gqa128", "kv_dtype": "bfloat16", "group_size": 8, "batch_min": 1, "batch_max": 8,
           "config": {"block_h": 8, "block_n": 64, "num_warps": 4, "num_stages": 3, "gluon": gluon}}
    (path / "sm_90.json").write_text(json.dumps({"schema": "kgen.block-config-table/1", "arch": "sm_90",
                                                 "metadata": {"arch": "sm_90"}, "entries": [row]}))
    return path


def test_baseline_tables_option_is_checked_before_measuring(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_bench(_parse("--quick", "--baseline-tables", str(empty))) == 2
    assert "not a directory of block-config tables" in capsys.readouterr().err
    tables = _sm90_table(tmp_path / "rows", {"block_n": 64, "num_stages": 2})
    built = tmp_path / "before"
    built.mkdir()
    (built / "verify_gqa128__kv_bf16__q_bf16.py").write_text("")
    for extra, why in ((("--kernels", "per_head"), "keep it in --kernels"),
                       (("--mask", "tree,none"), "one at a time"),
                       (("--baseline-modules", str(built)), "two baselines"),
                       (("--batch-invariant",), "run one at a time")):  # fmt: skip
        assert run_bench(_parse("--quick", "--baseline-tables", str(tables), *extra)) == 2
        assert why in capsys.readouterr().err
    assert cli.baseline_tables_dir(_parse("--baseline-tables", str(tables))) == tables


def test_baseline_tables_build_each_case_module_with_the_rows(tmp_path: Path) -> None:
    """--baseline-tables DIR builds the cases' grouped modules with DIR's rows (what
    --baseline-modules then times against the current ones); a row no module could take is a
    usage error before anything is measured."""
    import importlib.util

    tables = _sm90_table(tmp_path / "rows", {"block_n": 32, "num_stages": 4, "from_rows": 96})
    args = _parse("--layout", "gqa128:8", "--kv-dtype", "bf16", "--batch", "2", "--prefix", "32", "--draft", "1",
                  "--kernels", "grouped", "--baseline-tables", str(tables))
    built = cli.build_table_baseline(tables, cli.select_cases(args), tmp_path / "out")
    assert built == tmp_path / "out" / "baseline-tables"
    path = built / "verify_gqa128__kv_bf16__q_bf16.py"
    spec = importlib.util.spec_from_file_location("baseline_tables_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.LAUNCHER.block_configs["sm_90"]
    assert [(group, lo, hi, config["gluon"]["from_rows"]) for group, lo, hi, config in rows] == [(8, 1, 8, 96)]
    bad = _sm90_table(tmp_path / "bad", {"block_n": 64, "num_stages": 2, "converters": 2})
    with pytest.raises(cli.BenchUsageError, match=f"--baseline-tables {bad}: .*converters"):
        cli.build_table_baseline(bad, cli.select_cases(args), tmp_path / "out2")


# ----------------------------------------------------------------- --batch-invariant


def test_batch_invariant_option_is_checked_before_measuring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = tmp_path / "built"
    built.mkdir()
    (built / "verify_gqa128__kv_bf16__q_bf16.py").write_text("")
    for extra, why in ((("--kernels", "per_head"), "keep it in --kernels"),
                       (("--index-dtype", "int64,int32"), "run one at a time"),
                       (("--mask", "tree,none"), "run one at a time"),
                       (("--baseline-modules", str(built)), "run one at a time")):  # fmt: skip
        assert run_bench(_parse("--quick", "--batch-invariant", *extra)) == 2
        assert why in capsys.readouterr().err
    result = write_json(make_run(), tmp_path / "result.json")
    assert run_bench(_parse("--batch-invariant", "--from-json", str(result))) == 2
    assert "does not go with --from-json" in capsys.readouterr().err
    assert run_bench(_parse("--quick", "--batch-invariant", "--compare", str(result))) == 2
    assert "compare with a --batch-invariant run" in capsys.readouterr().err
    assert cli.batch_invariant_run(_parse("--batch-invariant")) and not cli.batch_invariant_run(_parse())


@pytest.mark.parametrize(("mask", "draft"), [("none", "2"), ("tree", "6")])
def test_execute_batch_invariant_against_the_default_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            mask: str, draft: str) -> None:
    """--batch-invariant through the real provider: the batch-invariant grouped module and the
    default one (Triton's interpreter), each checked and timed with the timer's pair(); the JSON
    keeps both times and the ratio, the summary and bench.md their geometric mean and worst.
    A tree (--mask tree, 6 draft tokens: two row blocks in the invariant module) goes to both."""
    from test_bench_peers import fake_timer

    from kgen.bench.peers import DeviceProvider
    from kgen.bench.report import BenchMeta, read_run, render_markdown
    from kgen.bench.timing import PairedTiming

    class PairingFakeTimer:
        def __init__(self) -> None:
            self.pairs = 0

        def __call__(self, fn, n_sets):  # noqa: ANN001, ANN204
            return fake_timer(fn, n_sets)

        def pair(self, fn_a, fn_b, n_sets):  # noqa: ANN001, ANN202
            self.pairs += 1
            fn_a(n_sets - 1)
            fn_b(n_sets - 1)
            return PairedTiming.from_samples([10.0 * r for r in (1.06, 1.05, 1.07, 1.05, 1.06)], [10.0] * 5, n_sets,
                                             "fake")

    args = _parse("--layout", "gqa128:8", "--kv-dtype", "bf16", "--batch", "2", "--prefix", "32", "--draft", draft,
                  "--mask", mask, "--kernels", "grouped", "--batch-invariant", "--no-progress", "--flex-sweep", "none")
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              batch_invariant=cli.batch_invariant_run(args))  # fmt: skip
    timer = PairingFakeTimer()
    run = cli.execute(args, cli.select_cases(args), provider, timer, BenchMeta(gpu_name="cpu", batch_invariant=True),
                      tmp_path)
    (case,) = run.cases
    grouped = case.kernels["grouped"]
    assert case.status == "ok" and timer.pairs == 1 and grouped.max_rel_err < 2e-2
    assert grouped.mode_ab.module == "verify_gqa128__kv_bf16__q_bf16" and grouped.mode_ab.max_rel_err < 2e-2
    assert grouped.mode_ab.ratio == pytest.approx(1.06) and grouped.median_us == pytest.approx(10.6)
    assert "invariant/default=1.060" in capsys.readouterr().out
    again = read_run(write_json(run, tmp_path / "bench.json"))
    assert f"geometric mean 1.060 over 1 cases, worst 1.060 at {case.key}" in cli.summary_text(again)
    text = render_markdown(again)
    assert "batch-invariant / default" in text and "the batch-invariant modules" in text


def test_a_tables_baseline_says_which_tables_built_it() -> None:
    from kgen.bench.report import BuildABSummary, build_ab_line

    summary = BuildABSummary(1.02, 1.05, "gqa128/g16/bf16/bs64/p16384/L16", 3)
    line = build_ab_line(summary, "out/baseline-tables", ".exp/rows")
    assert line.startswith("grouped kernel vs the build in out/baseline-tables (built with the tables in .exp/rows) "
                           "(time now / time then): geometric mean 1.020 over 3 cases, worst 1.050 at gqa128/")
    assert "built with" not in build_ab_line(summary, "/tmp/before")
