"""How a kernel is timed: the ``Timer`` protocol, the CUDA-graph timer and the copy ceiling.

A timer takes ``fn(i)`` (launch the kernel on input set ``i``) and the number of input
sets, and returns a ``Timing`` of microseconds per launch. The measurement loop only sees
the protocol, so CPU tests inject a fake and no test depends on a clock.

``CudaGraphTimer`` captures N launches, cycling over the input sets, in one CUDA graph and
replays it R times, each replay between two CUDA events: the launch overhead of Python and
of the driver is out of the figure (as in a serving engine that replays graphs), and the
rotation makes every launch read its K/V from HBM. N is chosen so that one replay lasts at
least ``min_graph_us``, which keeps the events' resolution out of the figure too.

``CudaGraphTimer.pair`` times two launches of the same kernel (the int64 and the int32
page table, say) in one process: one graph each, replayed in alternation, so clock and
temperature drift hit both alike; the ratio is the median of the per-alternation ratios.
``alternate`` is that loop, with the events and the synchronization injected (CPU tests
drive it with a fake clock).

torch is imported inside the functions: this module is imported by CPU-only code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

Launch = Callable[[int], object]


@dataclass(frozen=True)
class Timing:
    """Microseconds per launch: the median and the 10th/90th percentiles over replays."""

    median_us: float
    p10_us: float
    p90_us: float
    launches: int = 1
    replays: int = 1
    mode: Literal["graph", "eager", "fake"] = "graph"

    @classmethod
    def from_samples(cls, samples_us: Sequence[float], launches: int = 1, mode: str = "graph") -> Timing:
        if not samples_us:
            raise ValueError("no timing samples")
        ordered = sorted(samples_us)
        return cls(
            median_us=percentile(ordered, 50),
            p10_us=percentile(ordered, 10),
            p90_us=percentile(ordered, 90),
            launches=launches,
            replays=len(ordered),
            mode=mode,  # type: ignore[arg-type]
        )


class Timer(Protocol):
    """Times ``fn`` over ``n_sets`` rotated input sets; raises when it cannot run."""

    def __call__(self, fn: Launch, n_sets: int) -> Timing: ...


# The fewest alternations a paired timing uses, whatever --replays says.
MIN_ALTERNATIONS = 5


@dataclass(frozen=True)
class PairedTiming:
    """Two launches timed in alternation: ``a`` and ``b`` over the same alternations, and
    ``ratios[i]`` = a's time / b's time in alternation ``i``."""

    a: Timing
    b: Timing
    ratios: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """The median of the per-alternation ratios: each ratio compares two replays a
        millisecond apart, so drift over the run cancels."""
        return percentile(sorted(self.ratios), 50)

    @classmethod
    def from_samples(cls, a_us: Sequence[float], b_us: Sequence[float], launches: int, mode: str) -> PairedTiming:
        if len(a_us) != len(b_us) or not a_us:
            raise ValueError(f"paired samples must be non-empty and of one length, got {len(a_us)} and {len(b_us)}")
        return cls(
            a=Timing.from_samples(a_us, launches, mode),
            b=Timing.from_samples(b_us, launches, mode),
            ratios=tuple(x / y for x, y in zip(a_us, b_us, strict=True)),
        )


class Event(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: Event) -> float: ...


def alternation_order(runs: int, alternations: int) -> list[int]:
    """The order of the turns: every run once per alternation, forwards in even
    alternations and backwards in odd ones (a b, b a, a b, ...), so that neither run
    always goes first."""
    order: list[int] = []
    for i in range(alternations):
        turn = list(range(runs))
        order += turn if i % 2 == 0 else turn[::-1]
    return order


def alternate(
    runs: Sequence[Callable[[], object]],
    alternations: int,
    launches: int,
    new_event: Callable[[], Event],
    synchronize: Callable[[], None],
) -> list[list[float]]:
    """Each run once per alternation (``alternation_order``), each turn between two events
    (milliseconds, as CUDA events report); all turns are queued, then one synchronization.
    Returns, per run, microseconds per launch of each of its turns, in alternation order."""
    marks: list[tuple[int, Event, Event]] = []
    for r in alternation_order(len(runs), alternations):
        start, end = new_event(), new_event()
        start.record()
        runs[r]()
        end.record()
        marks.append((r, start, end))
    synchronize()
    samples: list[list[float]] = [[] for _ in runs]
    for r, start, end in marks:
        samples[r].append(start.elapsed_time(end) * 1e3 / launches)
    return samples


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile of an already sorted sequence."""
    if len(ordered) == 1:
        return float(ordered[0])
    pos = (len(ordered) - 1) * pct / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def launches_per_graph(n_sets: int, est_us: float, min_graph_us: float, max_launches: int) -> int:
    """Launches in one graph: a whole number of passes over the input sets (each set weighs
    the same), enough for ``min_graph_us`` per replay, at most ``max_launches`` (but never
    fewer than one pass)."""
    n_sets = max(1, n_sets)
    per_pass = max(est_us, 1e-3) * n_sets
    passes = max(1, math.ceil(min_graph_us / per_pass))
    passes = min(passes, max(1, max_launches // n_sets))
    return passes * n_sets


@dataclass
class EagerTimer:
    """Events around a plain loop of launches: for choosing among candidates (SDPA backends),
    where launch overhead biases all of them alike and a graph per candidate costs too much."""

    iters: int = 3
    warmup: int = 1

    def __call__(self, fn: Launch, n_sets: int) -> Timing:
        import torch

        for i in range(self.warmup):
            fn(i % n_sets)
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            for i in range(self.iters):
                fn(i % n_sets)
            return Timing.from_samples([(time.perf_counter() - t0) * 1e6 / self.iters], self.iters, "eager")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(self.iters):
            fn(i % n_sets)
        end.record()
        end.synchronize()
        return Timing.from_samples([start.elapsed_time(end) * 1e3 / self.iters], self.iters, "eager")


@dataclass
class CudaGraphTimer:
    """Median of ``replays`` replays of one graph of rotated launches (see the module doc).

    When capture fails (a kernel that is not graph safe) the same loop runs eagerly and the
    Timing says ``mode="eager"``, so the report shows which figures include launch overhead.
    The device operations (``_warm``, ``_estimate_us``, ``_capture``, ``_event``, ``_sync``)
    are methods, so a test can replace them with a fake clock.
    """

    replays: int = 20
    warmup: int = 2
    min_graph_us: float = 1000.0
    max_launches: int = 512

    def __call__(self, fn: Launch, n_sets: int) -> Timing:
        self._warm(fn, n_sets)
        est_us = self._estimate_us(fn, n_sets)
        n = launches_per_graph(n_sets, est_us, self.min_graph_us, self.max_launches)
        try:
            graph = self._capture(fn, n_sets, n)
        except Exception:  # noqa: BLE001 - capture refused: time the same loop eagerly
            self._sync()
            return self._replay(lambda: [fn(j % n_sets) for j in range(n)], n, "eager")
        try:
            graph.replay()
            self._sync()
            return self._replay(graph.replay, n, "graph")
        finally:
            del graph

    @property
    def alternations(self) -> int:
        return max(MIN_ALTERNATIONS, self.replays)

    def pair(self, fn_a: Launch, fn_b: Launch, n_sets: int) -> PairedTiming:
        """``fn_a`` and ``fn_b`` (the same kernel on two forms of the same inputs), one graph
        of N launches each (N from the faster estimate, so both replays last at least
        ``min_graph_us``), replayed in alternation ``alternations`` times: a b, b a, ...
        Eager, for both, when either graph cannot be captured."""
        self._warm(fn_a, n_sets)
        self._warm(fn_b, n_sets)
        est_us = min(self._estimate_us(fn_a, n_sets), self._estimate_us(fn_b, n_sets))
        n = launches_per_graph(n_sets, est_us, self.min_graph_us, self.max_launches)
        graphs = []
        try:
            graphs = [self._capture(fn, n_sets, n) for fn in (fn_a, fn_b)]
        except Exception:  # noqa: BLE001 - capture refused: alternate the eager loops
            graphs = []
            self._sync()
            runs = [lambda fn=fn: [fn(j % n_sets) for j in range(n)] for fn in (fn_a, fn_b)]
            a_us, b_us = alternate(runs, self.alternations, n, self._event, self._sync)
            return PairedTiming.from_samples(a_us, b_us, n, "eager")
        try:
            for graph in graphs:
                graph.replay()
            self._sync()
            a_us, b_us = alternate([g.replay for g in graphs], self.alternations, n, self._event, self._sync)
            return PairedTiming.from_samples(a_us, b_us, n, "graph")
        finally:
            del graphs

    def _warm(self, fn: Launch, n_sets: int) -> None:
        """Eager warm-up on a side stream (compiles, autotunes, allocates workspaces), as
        capture requires."""
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(max(1, self.warmup)):
                fn(i % n_sets)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    @staticmethod
    def _estimate_us(fn: Launch, n_sets: int) -> float:
        import torch

        k = min(n_sets, 8)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(k):
            fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / k

    @staticmethod
    def _capture(fn: Launch, n_sets: int, n: int):  # noqa: ANN205 - torch.cuda.CUDAGraph
        import torch

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(n):
                fn(j % n_sets)
        return graph

    @staticmethod
    def _event() -> Event:
        import torch

        return torch.cuda.Event(enable_timing=True)

    @staticmethod
    def _sync() -> None:
        import torch

        torch.cuda.synchronize()

    def _replay(self, run: Callable[[], object], n: int, mode: str) -> Timing:
        (samples,) = alternate([run], self.replays, n, self._event, self._sync)
        return Timing.from_samples(samples, n, mode)


def _copy_timing(timer: Timer, nbytes: int, device: str) -> Timing:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    return timer(lambda _i: dst.copy_(src), 1)


def copy_ceiling_gbps(timer: Timer, nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Bytes read + written per second of one large device-to-device copy: the bandwidth
    a memory-bound kernel can hope for on this device, measured in the same run."""
    import torch

    timing = _copy_timing(timer, nbytes, device)
    torch.cuda.empty_cache()
    return 2 * nbytes / (timing.median_us * 1e-6) / 1e9


def bench_copy_ceiling_gbps(nbytes: int = 2 << 30) -> float:
    """The copy ceiling as `kgen bench` reports it (its 100%): eager events around 20 copies, not
    a graph. A captured copy becomes a copy-engine memcpy node, which measured far below the
    same copy launched eagerly (docs/perf-notes.md, "The copy ceiling's timer")."""
    return copy_ceiling_gbps(EagerTimer(iters=20, warmup=3), nbytes)
