"""Compile ahead, in parallel: fill Triton's and Inductor's on-disk caches before timing.

A full run needs a few hundred compilations: each generated kernel once per
specialization (layout, group, KV dtype, variant, L, and the split count that the batch
decides), FlexAttention once per (layout, batch, L) and per swept option set. One process
compiles them one after another, seconds each, which would take most of the run. Worker
processes launch every specialization once on a small prefix (the same batch and L, so
the same Triton specialization and the same FlexAttention graph) and the caches they fill
on disk are shared with the main process, whose compilations become cache loads.

Best effort by design: a job that fails, or is still running at the deadline, only means
the main process compiles that kernel itself; nothing measured depends on this module. A
job whose kernel refuses its case (``KernelRun.unsupported``: FlexAttention cannot build a
program for a head width, say) is no failure: the run reports the same refusal for that
case. The report counts the two apart, with their first reasons, and the job list leaves
out what the run never times (the FlexAttention sweep of a run without FlexAttention, the
peers on a masked case).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kgen.bench.cases import BATCH_INVARIANT, HEADLINE_KERNEL, KGEN_KERNELS, Case

# Longest a worker may take; what is not compiled by then is compiled by the main process.
DEFAULT_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class WarmJob:
    """One compilation: a kgen variant or a FlexAttention option set, on a small case."""

    kind: str  # "grouped", "per_head", "batch_invariant" (the grouped kernel's batch-invariant module) or "flex"
    case: dict
    options: str = ""  # FlexAttention options label ("" = default)

    def label(self) -> str:
        variant = f"{self.kind}@{self.options}" if self.options else self.kind
        return f"{variant} {Case(**self.case).key}"

    def where(self) -> str:
        """The layout and group it compiles for: what a refusal of a head width is about."""
        case = Case(**self.case)
        return f"{case.layout}/g{case.group}"


def warm_jobs(
    cases: Sequence[Case],
    kernels: Iterable[str],
    sweep: Sequence[Case] = (),
    sweep_labels: Sequence[str] = (),
    batch_invariant: bool = False,
) -> list[WarmJob]:
    """One job per distinct compilation the run will need (with ``batch_invariant``, the
    grouped kernel's batch-invariant module too). The prefix is the matrix's shortest: it
    does not change a kgen specialization, and FlexAttention's KV length is dynamic (but must
    stay past one 128-token block, or it would specialize). FlexAttention's jobs, its sweep's
    included, only where the run times it: ``flex`` in ``kernels``, a case the peers run
    (``Case.peers_refusal``)."""
    kernels = list(kernels)
    prefix = max(256, min((c.prefix for c in cases), default=1024))
    jobs: dict[tuple, WarmJob] = {}
    for case in cases:
        small = replace(case, prefix=prefix)
        for kind in KGEN_KERNELS:
            if kind in kernels:
                jobs.setdefault((kind, small.key), WarmJob(kind, asdict(small)))
        if batch_invariant and HEADLINE_KERNEL in kernels:
            jobs.setdefault((BATCH_INVARIANT, small.key), WarmJob(BATCH_INVARIANT, asdict(small)))
        if "flex" in kernels and not case.peers_refusal:  # the peers read bf16 whatever the pool holds
            peer = replace(small, kv_dtype="bfloat16")
            jobs.setdefault(("flex", peer.peer_key, ""), WarmJob("flex", asdict(peer)))
    # The run sweeps FlexAttention's options only where it times FlexAttention at all.
    for case in sweep if "flex" in kernels else ():
        if case.peers_refusal:
            continue
        peer = replace(case, prefix=prefix, kv_dtype="bfloat16")
        for label in sweep_labels:
            jobs.setdefault(("flex", peer.peer_key, label), WarmJob("flex", asdict(peer), label))
    # Interleave the slow FlexAttention jobs with the kgen ones across workers.
    flex = [j for j in jobs.values() if j.kind == "flex"]
    other = [j for j in jobs.values() if j.kind != "flex"]
    mixed: list[WarmJob] = []
    while flex or other:
        if flex:
            mixed.append(flex.pop(0))
        mixed.extend(other[:3])
        other = other[3:]
    return mixed


def split_jobs(jobs: Sequence[WarmJob], workers: int) -> list[list[WarmJob]]:
    """Round-robin: each worker gets a similar mix."""
    workers = max(1, min(workers, len(jobs)))
    return [list(jobs[i::workers]) for i in range(workers)]


class KernelRefused(RuntimeError):
    """The job's kernel does not run its case (``KernelRun.unsupported``): the run reports the
    same refusal, so it is not a failure to compile."""


def run_job(job: WarmJob, device: str) -> None:
    """Build the small case and launch the kernel once (that compiles it). Raises
    KernelRefused where the kernel refuses the case, another exception where it fails."""
    from kgen.bench.inputs import build_inputs, build_peer_inputs
    from kgen.bench.peers import flex_run, kgen_run, parse_flex_label

    case = Case(**job.case)
    inputs = build_inputs(case, device, 1)
    if job.kind == "flex":
        run = flex_run(case, build_peer_inputs(inputs), inputs, parse_flex_label(job.options))
    elif job.kind in (*KGEN_KERNELS, BATCH_INVARIANT):
        run = kgen_run(case, inputs, job.kind)
    else:
        raise ValueError(f"unknown kernel {job.kind!r}")
    if run.fn is None:
        if run.unsupported:
            raise KernelRefused(run.unsupported)
        raise RuntimeError(run.error or "no kernel")
    run.fn(0)
    if run.alt is not None and run.alt.fn is not None:  # the A/B's other kv_indices dtype
        run.alt.fn(0)
    if run.mask_alt is not None and run.mask_alt.fn is not None:  # the A/B's other draft mask
        run.mask_alt.fn(0)


# Job statuses: compiled, refused by its kernel (not a failure), failed.
OK, UNSUPPORTED, FAILED = "ok", "unsupported", "failed"
# A worker's outcome lines start with this, apart from whatever else it prints (warnings).
OUTCOME_TAG = "kgen-warm-outcome "
REASON_CHARS = 200  # of an exception's text, in a worker's outcome line


@dataclass(frozen=True)
class JobOutcome:
    """What became of one job: its status (OK, UNSUPPORTED or FAILED) and, unless OK, why."""

    kind: str
    where: str  # the layout and group (WarmJob.where)
    status: str
    reason: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        return OUTCOME_TAG + json.dumps(asdict(self))

    @classmethod
    def parse(cls, line: str) -> JobOutcome | None:
        """The outcome a worker's log line holds, or None for any other line."""
        if not line.startswith(OUTCOME_TAG):
            return None
        return cls(**json.loads(line[len(OUTCOME_TAG):]))


def outcome_of(job: WarmJob, device: str) -> JobOutcome:
    """Run one job; its outcome, never an exception (the main process will see a failure again)."""
    t0 = time.monotonic()
    try:
        run_job(job, device)
        status, reason = OK, ""
    except KernelRefused as exc:
        status, reason = UNSUPPORTED, str(exc)[:REASON_CHARS]
    except Exception as exc:  # noqa: BLE001 - best effort: the main process compiles it itself
        status, reason = FAILED, f"{type(exc).__name__}: {str(exc)[:REASON_CHARS]}"
    return JobOutcome(job.kind, job.where(), status, reason, time.monotonic() - t0)


def worker_main(path: str, device: str) -> int:
    """``python -m kgen.bench.warm JOBS.json DEVICE``: run the jobs, one outcome line per job."""
    jobs = [WarmJob(**j) for j in json.loads(Path(path).read_text())]
    for job in jobs:
        print(outcome_of(job, device).line(), flush=True)
    return 0


def _first_line(reason: str) -> str:
    return reason.strip().splitlines()[0] if reason.strip() else "no reason given"


@dataclass
class WarmReport:
    """What the precompile did: one outcome per job a worker finished; the jobs without one
    were still queued when their worker stopped (at the deadline, or when it died)."""

    jobs: int = 0
    workers: int = 0
    seconds: float = 0.0
    timed_out: bool = False
    outcomes: list[JobOutcome] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def done(self) -> int:
        return self.count(OK)

    @property
    def failed(self) -> int:
        return self.count(FAILED)

    @property
    def unsupported(self) -> int:
        return self.count(UNSUPPORTED)

    @property
    def not_reached(self) -> int:
        return self.jobs - len(self.outcomes)

    def _groups(self, status: str, by_where: bool) -> str:
        """The outcomes of a status by kind (and layout/group), each with its count and first reason."""
        firsts: dict[str, str] = {}
        counts: Counter[str] = Counter()
        for o in self.outcomes:
            if o.status == status:
                key = f"{o.kind} on {o.where}" if by_where else o.kind
                counts[key] += 1
                firsts.setdefault(key, _first_line(o.reason))
        return "; ".join(f"{key} x{n}: {firsts[key]}" for key, n in counts.items())

    def note(self) -> str:
        """One line for the run's notes: the kernels compiled of those that could be, the failures
        by kind with their first reason, the jobs stopped at the deadline, and apart from all of
        them the jobs whose kernel refuses its case (the run reports those as unsupported)."""
        runnable = self.jobs - self.unsupported
        failed = f"{self.failed} failed" + (f": {self._groups(FAILED, by_where=False)}" if self.failed else "")
        if self.not_reached:
            failed += f", {self.not_reached} not reached " + (
                "by the deadline" if self.timed_out else "(a worker exited early)")
        note = (f"precompiled {self.done}/{runnable} kernels in {self.workers} worker processes in "
                f"{self.seconds:.0f} s ({failed})")
        if self.unsupported:
            note += f"; {self.unsupported} not run, unsupported here: {self._groups(UNSUPPORTED, by_where=True)}"
        return note


def precompile(
    jobs: Sequence[WarmJob], workers: int, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cuda"
) -> WarmReport:
    """Run ``jobs`` in ``workers`` processes; wait at most ``timeout_s``, then stop the
    ones still running (only processes started here)."""
    report = WarmReport(jobs=len(jobs))
    if not jobs or workers < 1:
        return report
    start = time.monotonic()
    chunks = split_jobs(jobs, workers)
    report.workers = len(chunks)
    # One compile thread per worker: the workers are the parallelism.
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="kgen-warm-") as tmp:
        procs = []
        for i, chunk in enumerate(chunks):
            jobs_path = Path(tmp) / f"jobs{i}.json"
            jobs_path.write_text(json.dumps([asdict(j) for j in chunk]))
            log = open(Path(tmp) / f"log{i}.txt", "w")  # closed once the worker ends
            cmd = [sys.executable, "-m", "kgen.bench.warm", str(jobs_path), device]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        for i, (proc, log) in enumerate(procs):
            left = timeout_s - (time.monotonic() - start)
            stopped = False
            try:
                proc.wait(timeout=max(0.1, left))
            except subprocess.TimeoutExpired:
                report.timed_out = stopped = True
                proc.kill()
                proc.wait()
            log.close()
            text = (Path(tmp) / f"log{i}.txt").read_text(errors="replace")
            report.outcomes += worker_outcomes(chunks[i], text, proc.returncode, stopped)
    report.seconds = time.monotonic() - start
    return report


def worker_outcomes(chunk: Sequence[WarmJob], log: str, returncode: int | None, stopped: bool) -> list[JobOutcome]:
    """A worker's outcomes from its log (``stopped``: killed at the deadline). One that died by
    itself before its last job leaves the job it was running as a failure, with its exit code
    and its last words; the jobs after that one were never started."""
    outcomes = [o for o in map(JobOutcome.parse, log.splitlines()) if o is not None]
    if len(outcomes) < len(chunk) and not stopped:
        said = [line.strip() for line in log.splitlines() if line.strip() and JobOutcome.parse(line) is None]
        last = said[-1][:REASON_CHARS] if said else "nothing"
        job = chunk[len(outcomes)]
        why = f"the worker exited with code {returncode} (its last output: {last})"
        outcomes.append(JobOutcome(job.kind, job.where(), FAILED, why))
    return outcomes


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cuda"))
