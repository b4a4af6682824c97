"""kgen bench: the measurement loop with fake kernels and a fake timer (no GPU, no clock)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import pytest

from kgen.bench.cases import KERNELS, build_matrix, case_for, min_bytes
from kgen.bench.measure import (
    TOLERANCE_BF16,
    KernelResult,
    KernelRun,
    apply_sweep,
    make_case_result,
    measure_kernel,
    run_matrix,
    run_sweep,
)
from kgen.bench.timing import (
    MIN_ALTERNATIONS,
    CudaGraphTimer,
    PairedTiming,
    Timing,
    alternation_order,
    launches_per_graph,
    percentile,
)
from kgen.spec import load_layouts

SPECS = load_layouts()
COPY_GBPS = 4000.0


class FakeLaunch:
    """A launch callable that only remembers which kernel it is and how fast to claim."""

    def __init__(self, name: str, us: float) -> None:
        self.name, self.us, self.calls = name, us, 0

    def __call__(self, i: int) -> None:
        self.calls += 1


class FakeTimer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def __call__(self, fn: FakeLaunch, n_sets: int) -> Timing:
        self.seen.append((fn.name, n_sets))
        if fn.us < 0:
            raise RuntimeError("capture failed")
        return Timing(fn.us, fn.us * 0.9, fn.us * 1.2, launches=n_sets, replays=5, mode="fake")


US = {"grouped": 100.0, "per_head": 300.0, "flex": 200.0, "sdpa": 150.0}


class FakeProvider:
    """Builds fake runs; records which kernels each case asked for."""

    def __init__(self, us: Mapping[str, float] = US, errors: Mapping[str, float] | None = None,
                 fail_inputs: set[str] | None = None) -> None:  # fmt: skip
        self.us, self.errors = dict(us), dict(errors or {})
        self.fail_inputs = fail_inputs or set()
        self.asked: list[tuple[str, frozenset[str]]] = []

    @contextlib.contextmanager
    def __call__(self, case, names: frozenset[str]) -> Iterator[dict[str, KernelRun]]:  # noqa: ANN001
        self.asked.append((case.key, names))
        if case.key in self.fail_inputs:
            raise MemoryError("CUDA out of memory")
        runs = {}
        for name in names:
            base = name.partition("@")[0]
            us = self.us.get(name, self.us.get(base, 50.0))
            err = self.errors.get(name, 1e-3)
            runs[name] = KernelRun(fn=FakeLaunch(name, us), n_sets=3, check=lambda e=err: e,
                                   choice=f"cfg-{name}", scratch_bytes=1024)  # fmt: skip
        yield runs


def _cases(**kw):  # noqa: ANN202
    return build_matrix(SPECS, [("gqa128", 8)], ["bfloat16", "float8_e4m3fn"], batches=[4],
                        prefixes=[1024], drafts=[2], **kw)  # fmt: skip


def test_measure_kernel_bandwidth_and_copy_share() -> None:
    case = case_for(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 2, 1024, 4)
    nbytes = min_bytes(case).total  # 2,236,416 B
    run = KernelRun(fn=FakeLaunch("grouped", 2.0), n_sets=2, check=lambda: 0.001, scratch_bytes=7)
    res = measure_kernel(run, FakeTimer(), nbytes, COPY_GBPS, TOLERANCE_BF16)
    assert res.status == "ok" and res.median_us == 2.0 and res.p10_us == 1.8 and res.p90_us == 2.4
    assert res.gbps == pytest.approx(2_236_416 / 2e-6 / 1e9)  # 1118.208 GB/s
    assert res.pct_copy == pytest.approx(100 * 1118.208 / COPY_GBPS)
    assert res.max_rel_err == 0.001 and res.scratch_bytes == 7 and res.launches == 2


def test_measure_kernel_verdicts() -> None:
    timer = FakeTimer()
    wrong = measure_kernel(KernelRun(fn=FakeLaunch("g", 1.0), check=lambda: 0.5), timer, 10, None, 0.02)
    assert wrong.status == "failed" and wrong.median_us == 1.0 and wrong.pct_copy is None
    nan = measure_kernel(KernelRun(fn=FakeLaunch("g", 1.0), check=lambda: float("inf")), timer, 10, None, 0.02)
    assert nan.status == "failed"

    def boom() -> float:
        raise ValueError("illegal memory access")

    broke = measure_kernel(KernelRun(fn=FakeLaunch("g", 1.0), check=boom), timer, 10, None, 0.02)
    assert broke.status == "error" and "illegal memory access" in broke.note and broke.median_us is None
    untimed = measure_kernel(KernelRun(fn=FakeLaunch("g", -1.0)), timer, 10, None, 0.02)
    assert untimed.status == "error" and "capture failed" in untimed.note
    refused = measure_kernel(KernelRun(unsupported="head dim 576"), timer, 10, None, 0.02)
    assert refused.status == "unsupported" and refused.note == "head dim 576"
    load = measure_kernel(KernelRun(error="load grouped: ImportError"), timer, 10, None, 0.02)
    assert load.status == "error"


def test_run_matrix_speedups_and_peer_reuse() -> None:
    cases = _cases()
    provider, timer = FakeProvider(), FakeTimer()
    results = run_matrix(cases, provider, timer, COPY_GBPS)
    bf16, fp8 = results
    assert [r.status for r in results] == ["ok", "ok"]
    assert list(bf16.kernels) == list(KERNELS)
    assert bf16.speedup == {"per_head": 3.0, "flex": 2.0, "sdpa": 1.5}
    # The FP8 twin did not build peers again, and reuses the BF16 case's figures...
    assert provider.asked[0][1] == frozenset(KERNELS)
    assert provider.asked[1][1] == frozenset({"grouped", "per_head"})
    flex = fp8.kernels["flex"]
    assert flex.shared_from == bf16.key and flex.median_us == 200.0
    # ...re-expressed against the FP8 case's (smaller) minimum bytes.
    assert flex.gbps == pytest.approx(fp8.min_bytes / 200e-6 / 1e9)
    assert flex.gbps < bf16.kernels["flex"].gbps
    assert fp8.speedup["flex"] == 2.0
    assert bf16.input_sets == 3 and bf16.min_bytes == min_bytes(cases[0]).total


def test_wrong_kgen_output_fails_the_case_but_not_a_peer() -> None:
    results = run_matrix(_cases()[:1], FakeProvider(errors={"grouped": 0.3}), FakeTimer(), COPY_GBPS)
    assert results[0].status == "FAILED"
    assert results[0].kernels["grouped"].status == "failed"
    assert results[0].speedup == {}  # no speed-up of a wrong kernel
    peer_wrong = run_matrix(_cases()[:1], FakeProvider(errors={"flex": 0.3}), FakeTimer(), COPY_GBPS)
    assert peer_wrong[0].status == "ok" and peer_wrong[0].kernels["flex"].status == "failed"
    assert "flex" not in peer_wrong[0].speedup


def test_input_failure_is_reported_per_kernel() -> None:
    cases = _cases()
    results = run_matrix(cases, FakeProvider(fail_inputs={cases[0].key}), FakeTimer(), COPY_GBPS)
    first = results[0]
    assert first.status == "FAILED"
    assert {r.status for r in first.kernels.values()} == {"error"}
    assert "out of memory" in first.kernels["grouped"].note
    # the peers errored, so the twin measures them itself
    assert results[1].kernels["flex"].shared_from is None and results[1].status == "ok"


def test_time_limit_skips_the_rest_and_checkpoints() -> None:
    cases = _cases()
    ticks = iter([0.0, 100.0])
    saved: list[int] = []
    results = run_matrix(cases, FakeProvider(), FakeTimer(), COPY_GBPS, deadline=50.0,
                         clock=lambda: next(ticks), on_case=lambda r: saved.append(len(r)))  # fmt: skip
    assert [r.status for r in results] == ["ok", "skipped"]
    assert results[1].kernels["grouped"].status == "skipped"
    assert saved == [1, 2]


def test_kernel_subset() -> None:
    results = run_matrix(_cases()[:1], FakeProvider(), FakeTimer(), COPY_GBPS, kernels=["grouped", "sdpa"])
    assert list(results[0].kernels) == ["grouped", "sdpa"] and results[0].speedup == {"sdpa": 1.5}


def test_sweep_winner_replaces_the_peer_everywhere() -> None:
    cases = _cases()
    timer = FakeTimer()
    results = run_matrix(cases, FakeProvider(), timer, COPY_GBPS)
    us = dict(US, **{"flex@BLOCK_N=32": 120.0, "flex@BLOCK_N=64": 400.0})
    entries = run_sweep(cases[:1], FakeProvider(us), "flex", ["BLOCK_N=32", "BLOCK_N=64"], timer, COPY_GBPS)
    assert [(e.options, e.result.median_us) for e in entries] == [
        ("default", 200.0), ("BLOCK_N=32", 120.0), ("BLOCK_N=64", 400.0)
    ]  # fmt: skip
    swept = apply_sweep(results, entries, COPY_GBPS)
    for res in swept:
        assert res.kernels["flex"].median_us == 120.0
        assert res.kernels["flex"].choice == "BLOCK_N=32"
        assert res.speedup["flex"] == pytest.approx(1.2)
    assert swept[0].kernels["flex"].shared_from is None
    assert swept[1].kernels["flex"].shared_from == cases[0].key


def test_sweep_never_makes_a_peer_slower() -> None:
    cases = _cases()[:1]
    results = run_matrix(cases, FakeProvider(), FakeTimer(), COPY_GBPS)
    slow = dict(US, flex=500.0, **{"flex@X=1": 450.0})
    entries = run_sweep(cases, FakeProvider(slow), "flex", ["X=1"], FakeTimer(), COPY_GBPS)
    assert apply_sweep(results, entries, COPY_GBPS)[0].kernels["flex"].median_us == 200.0


def test_sweep_stops_at_deadline() -> None:
    entries = run_sweep(_cases(), FakeProvider(), "flex", ["A=1"], FakeTimer(), COPY_GBPS,
                        deadline=1.0, clock=iter([0.0, 2.0]).__next__)  # fmt: skip
    assert {e.key for e in entries} == {_cases()[0].key}


def test_kernel_result_json_round_trip() -> None:
    res = KernelResult(status="ok", median_us=1.5, gbps=2.0, choice="x")
    assert KernelResult.model_validate_json(res.model_dump_json()) == res


@pytest.mark.parametrize(
    ("n_sets", "est_us", "expected"),
    [
        (1, 2000.0, 1),  # one long launch is enough
        (1, 10.0, 100),  # 100 x 10 us = 1 ms per replay
        (3, 10.0, 102),  # whole passes over the 3 sets
        (256, 5.0, 256),  # one pass over many sets already lasts > 1 ms
        (4, 0.01, 512),  # capped at max_launches
        (600, 1.0, 600),  # never less than one pass
    ],
)
def test_launches_per_graph(n_sets: int, est_us: float, expected: int) -> None:
    assert launches_per_graph(n_sets, est_us, 1000.0, 512) == expected


def test_timing_percentiles() -> None:
    t = Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0], launches=10)
    assert (t.median_us, t.p10_us, t.p90_us, t.replays) == (3.0, 1.4, 4.6, 5)
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        Timing.from_samples([])


# ----------------------------------------------------------------- kv_indices A/B in alternation


def test_alternation_order_flips_every_other_alternation() -> None:
    assert alternation_order(2, 5) == [0, 1, 1, 0, 0, 1, 1, 0, 0, 1]
    assert alternation_order(1, 3) == [0, 0, 0]


class FakeClock:
    """Milliseconds, advanced only by fake graph replays; events read it when recorded."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.log: list[str] = []
        self.syncs = 0


class FakeEvent:
    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.t = clock, None

    def record(self) -> None:
        self.t = self.clock.now_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.t - self.t


class FakeGraph:
    """Each replay takes the next of ``durations_ms`` (warm replay first)."""

    def __init__(self, clock: FakeClock, name: str, durations_ms: list[float]) -> None:
        self.clock, self.name, self.durations = clock, name, list(durations_ms)

    def replay(self) -> None:
        self.clock.log.append(self.name)
        self.clock.now_ms += self.durations.pop(0)


class FakeGraphTimer(CudaGraphTimer):
    """The real ``CudaGraphTimer`` logic (launch count, capture, alternation, statistics)
    with its device operations on a fake clock."""

    def __init__(self, durations: dict[str, list[float]], capture_fails: bool = False, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.clock, self.durations, self.capture_fails = FakeClock(), durations, capture_fails
        self.captured: list[tuple[str, int]] = []

    def _warm(self, fn, n_sets: int) -> None:  # noqa: ANN001
        self.clock.log.append(f"warm {fn.name}")

    def _estimate_us(self, fn, n_sets: int) -> float:  # noqa: ANN001
        return fn.us

    def _capture(self, fn, n_sets: int, n: int) -> FakeGraph:  # noqa: ANN001
        if self.capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured.append((fn.name, n))
        return FakeGraph(self.clock, fn.name, self.durations[fn.name])

    def _event(self) -> FakeEvent:
        return FakeEvent(self.clock)

    def _sync(self) -> None:
        self.clock.syncs += 1


def test_pair_alternates_graph_replays_and_takes_the_median_of_the_alternations() -> None:
    # 4 sets; estimates 100 us (a) and 90 us (b): the faster one sets N = 12 launches for both
    # (3 passes x 4 sets >= 1000 us). Replays in ms: warm replay first, then 5 alternations.
    a_ms = [9.0, 1.2, 1.2, 1.8, 1.2, 1.2]  # a's 4th timed replay is slow (a hiccup)
    b_ms = [9.0, 1.0, 1.1, 1.0, 1.2, 1.0]
    timer = FakeGraphTimer({"a": a_ms, "b": b_ms}, replays=3, min_graph_us=1000.0)
    paired = timer.pair(FakeLaunch("a", 100.0), FakeLaunch("b", 90.0), 4)
    assert timer.captured == [("a", 12), ("b", 12)]
    assert timer.clock.log == ["warm a", "warm b", "a", "b",  # warm-ups, then one replay per graph
                               "a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]  # fmt: skip
    assert timer.clock.syncs == 2  # after the first replays, and once after all timed turns
    per_launch = [[ms * 1e3 / 12 for ms in times[1:]] for times in (a_ms, b_ms)]
    assert paired.a.median_us == pytest.approx(1.2e3 / 12) and paired.a.mode == "graph"
    assert paired.b.median_us == pytest.approx(1.0e3 / 12) and paired.b.launches == 12
    ratios = [x / y for x, y in zip(*per_launch, strict=True)]
    assert list(paired.ratios) == pytest.approx(ratios)  # alternation i pairs a's and b's i-th turns
    assert paired.ratio == pytest.approx(1.2)  # median of 1.2, 1.0909, 1.8, 1.0, 1.2: the hiccup is out
    assert len(paired.ratios) == MIN_ALTERNATIONS  # --replays 3 still alternates 5 times


class ClockLaunch(FakeLaunch):
    """An eager launch that takes ``us`` on the fake clock."""

    def __init__(self, name: str, us: float, clock: FakeClock) -> None:
        super().__init__(name, us)
        self.clock = clock

    def __call__(self, i: int) -> None:
        super().__call__(i)
        self.clock.now_ms += self.us / 1e3


def test_pair_alternates_eager_loops_when_capture_fails() -> None:
    timer = FakeGraphTimer({}, capture_fails=True, replays=6, min_graph_us=100.0)
    a, b = ClockLaunch("a", 60.0, timer.clock), ClockLaunch("b", 50.0, timer.clock)
    paired = timer.pair(a, b, 2)
    assert paired.a.mode == paired.b.mode == "eager" and len(paired.ratios) == 6
    assert a.calls == b.calls == 6 * 2  # 2 launches per turn (one pass of 2 sets >= 100 us), 6 turns each
    assert paired.ratio == pytest.approx(1.2)


def test_single_timing_uses_the_same_replay_loop() -> None:
    timer = FakeGraphTimer({"g": [5.0, 1.0, 2.0, 3.0]}, replays=3, min_graph_us=1000.0)
    t = timer(FakeLaunch("g", 1000.0), 1)
    assert timer.clock.log == ["warm g", "g", "g", "g", "g"]
    assert (t.median_us, t.replays, t.launches, t.mode) == (2000.0, 3, 1, "graph")


class FakePairTimer(FakeTimer):
    def __init__(self, ratios: tuple[float, ...] = (1.01, 0.99, 1.02, 1.0, 1.03)) -> None:
        super().__init__()
        self.ratios = ratios
        self.pairs: list[tuple[str, str, int]] = []

    def pair(self, fn_a: FakeLaunch, fn_b: FakeLaunch, n_sets: int) -> PairedTiming:
        self.pairs.append((fn_a.name, fn_b.name, n_sets))
        b = [fn_b.us] * len(self.ratios)
        return PairedTiming.from_samples([fn_b.us * r for r in self.ratios], b, n_sets, "fake")


def _ab_run(alt_err: float = 1e-3) -> KernelRun:
    alt = KernelRun(fn=FakeLaunch("grouped int32", 100.0), n_sets=3, check=lambda: alt_err, index_dtype="int32")
    return KernelRun(fn=FakeLaunch("grouped int64", 101.0), n_sets=3, check=lambda: 1e-3, index_dtype="int64",
                     alt=alt)  # fmt: skip


def test_measure_kernel_times_both_index_dtypes_in_alternation() -> None:
    timer = FakePairTimer()
    res = measure_kernel(_ab_run(), timer, 10**6, COPY_GBPS, TOLERANCE_BF16)
    assert timer.pairs == [("grouped int64", "grouped int32", 3)] and timer.seen == []
    assert res.status == "ok" and res.median_us == pytest.approx(101.0)  # the int64 figure: median of 1.01 x 100
    ab = res.index_ab
    assert ab is not None and (ab.dtype, ab.status, ab.median_us, ab.alternations) == ("int32", "ok", 100.0, 5)
    assert ab.ratio == pytest.approx(1.01) and ab.ratio_p10 == pytest.approx(0.994)
    assert KernelResult.model_validate_json(res.model_dump_json()) == res


def test_a_wrong_or_untimable_other_index_dtype() -> None:
    wrong = measure_kernel(_ab_run(alt_err=0.5), FakePairTimer(), 10, None, TOLERANCE_BF16)
    assert wrong.status == "ok" and wrong.index_ab.status == "failed"
    case = case_for(SPECS["gqa128"], 8, "bfloat16", 4, 1024, 2, index_dtype_ab="int32")
    assert make_case_result(case, {"grouped": wrong}).status == "FAILED"
    no_pair = measure_kernel(_ab_run(), FakeTimer(), 10, None, TOLERANCE_BF16)
    assert no_pair.status == "error" and "cannot time two index dtypes" in no_pair.note


def test_measure_kernel_times_both_masks_in_alternation() -> None:
    """--mask tree,none: the tree's figures, the unmasked chain alternated with it, their ratio."""
    timer = FakePairTimer(ratios=(1.04, 1.02, 1.06, 1.03, 1.05))
    chain = KernelRun(fn=FakeLaunch("grouped none", 100.0), n_sets=3, check=lambda: 1e-3, mask="none")
    tree = KernelRun(fn=FakeLaunch("grouped tree", 104.0), n_sets=3, check=lambda: 2e-3, mask_alt=chain)
    res = measure_kernel(tree, timer, 10**6, COPY_GBPS, TOLERANCE_BF16)
    assert timer.pairs == [("grouped tree", "grouped none", 3)]
    assert res.index_ab is None and res.median_us == pytest.approx(104.0)
    ab = res.mask_ab
    assert (ab.mask, ab.status, ab.median_us, ab.alternations) == ("none", "ok", 100.0, 5)
    assert ab.ratio == pytest.approx(1.04)
    assert KernelResult.model_validate_json(res.model_dump_json()) == res
    no_pair = measure_kernel(tree, FakeTimer(), 10, None, TOLERANCE_BF16)
    assert no_pair.status == "error" and "cannot time two draft masks" in no_pair.note


# ----------------------------------------------------------------- --baseline-modules


def _build_ab_run(baseline: KernelRun) -> KernelRun:
    return KernelRun(fn=FakeLaunch("grouped now", 103.0), n_sets=3, check=lambda: 1e-3, index_dtype="int64",
                     baseline=baseline, baseline_modules="/tmp/before")  # fmt: skip


def test_measure_kernel_times_the_earlier_build_in_alternation() -> None:
    timer = FakePairTimer(ratios=(1.03, 1.02, 1.05, 1.01, 1.03))
    then = KernelRun(fn=FakeLaunch("grouped then", 100.0), n_sets=3, check=lambda: 2e-3)
    res = measure_kernel(_build_ab_run(then), timer, 10**6, COPY_GBPS, TOLERANCE_BF16)
    assert timer.pairs == [("grouped now", "grouped then", 3)] and timer.seen == []
    assert res.index_ab is None and res.median_us == pytest.approx(103.0)
    ab = res.build_ab
    assert (ab.modules, ab.status, ab.median_us, ab.alternations) == ("/tmp/before", "ok", 100.0, 5)
    assert ab.ratio == pytest.approx(1.03) and ab.max_rel_err == 2e-3
    assert KernelResult.model_validate_json(res.model_dump_json()) == res


def test_an_earlier_build_that_does_not_load_leaves_the_current_figure_alone() -> None:
    missing = KernelRun(error="baseline: /tmp/before has no verify_x.py")
    timer = FakePairTimer()
    res = measure_kernel(_build_ab_run(missing), timer, 10**6, COPY_GBPS, TOLERANCE_BF16)
    assert res.status == "ok" and res.median_us == 103.0 and timer.pairs == []
    assert res.build_ab.status == "error" and "has no verify_x.py" in res.build_ab.note
    no_pair = measure_kernel(_build_ab_run(KernelRun(fn=FakeLaunch("t", 1.0))), FakeTimer(), 10, None, TOLERANCE_BF16)
    assert no_pair.status == "error" and "cannot time two builds" in no_pair.note


# ----------------------------------------------------------------- --batch-invariant


def _mode_ab_run(default: KernelRun) -> KernelRun:
    return KernelRun(fn=FakeLaunch("invariant", 104.0), n_sets=3, check=lambda: 1e-3, index_dtype="int64",
                     module="verify_batch_invariant_x", default_mode=default)  # fmt: skip


def test_measure_kernel_times_the_default_module_in_alternation() -> None:
    """--batch-invariant: the grouped figures are the batch-invariant module's; the default
    module's time and the ratio batch-invariant / default are its mode_ab."""
    timer = FakePairTimer(ratios=(1.04, 1.03, 1.05, 1.02, 1.04))
    default = KernelRun(fn=FakeLaunch("default", 100.0), n_sets=3, check=lambda: 2e-3, module="verify_x")
    res = measure_kernel(_mode_ab_run(default), timer, 10**6, COPY_GBPS, TOLERANCE_BF16)
    assert timer.pairs == [("invariant", "default", 3)] and timer.seen == []
    assert res.build_ab is None and res.index_ab is None and res.median_us == pytest.approx(104.0)
    ab = res.mode_ab
    assert (ab.module, ab.status, ab.median_us, ab.alternations) == ("verify_x", "ok", 100.0, 5)
    assert ab.ratio == pytest.approx(1.04) and ab.max_rel_err == 2e-3
    assert KernelResult.model_validate_json(res.model_dump_json()) == res
    no_pair = measure_kernel(_mode_ab_run(KernelRun(fn=FakeLaunch("t", 1.0))), FakeTimer(), 10, None, TOLERANCE_BF16)
    assert no_pair.status == "error" and "cannot time two modes" in no_pair.note


def test_a_wrong_default_module_fails_the_case() -> None:
    case = case_for(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 64, 16384, 4)
    wrong = KernelRun(fn=FakeLaunch("default", 100.0), n_sets=3, check=lambda: 0.5, module="verify_x")
    res = measure_kernel(_mode_ab_run(wrong), FakePairTimer(), 10**6, COPY_GBPS, TOLERANCE_BF16)
    assert res.status == "ok" and res.mode_ab.status == "failed"
    assert make_case_result(case, {"grouped": res}).status == "FAILED"
