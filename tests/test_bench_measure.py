"""kgen bench: the measurement loop with fake kernels and a fake timer (no GPU, no clock)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import pytest

from kgen.bench.cases import KERNELS, build_matrix, make_case, min_bytes
from kgen.bench.measure import (
    TOLERANCE_BF16,
    KernelResult,
    KernelRun,
    apply_sweep,
    measure_kernel,
    run_matrix,
    run_sweep,
)
from kgen.bench.timing import Timing, launches_per_graph, percentile
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
    case = make_case(SPECS["qwen3_5_gqa256"], 16, "bfloat16", 2, 1024, 4)
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
