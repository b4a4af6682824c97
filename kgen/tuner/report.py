"""``kgen tune --report``: what a study's storage says about how it was run.

Read from the storage alone, after the fact: which workers and GPUs ran trials (each
trial records its host, pid, worker index, CUDA_VISIBLE_DEVICES and, on a GPU, the
device's name and UUID), whether a trial was lost (left RUNNING, or FAILED with no retry)
or a config measured twice, whether each enqueued config (the default, the current
table's) ran once, and how often the parent wrote a table from the study (it records
each write in the study's ``table_writes`` attribute).

The checks are what a multi-GPU run must show; ``problems`` names each one that fails.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kgen.tuner.study import STUDY_PREFIX

if TYPE_CHECKING:
    import optuna

TABLE_WRITES_ATTR = "table_writes"
STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")


@dataclass
class WorkerRow:
    """The trials of one worker process slot (host, worker index, device)."""

    host: str
    worker: int | None
    gpu: str | None
    visible_devices: str | None
    gpu_uuid: str | None
    gpu_name: str | None
    pids: set[int] = field(default_factory=set)
    states: Counter[str] = field(default_factory=Counter)

    @property
    def device_key(self) -> tuple[str, str] | None:
        """The physical device: its UUID where known, else the host and the device index the
        process saw; None when the trials ran on no GPU (the synthetic objective)."""
        if self.gpu_uuid:
            return ("uuid", self.gpu_uuid)
        device = self.visible_devices or self.gpu
        return (self.host, device) if device is not None else None


@dataclass
class StudyReport:
    name: str
    states: Counter[str]
    workers: list[WorkerRow]
    lost: list[int]  # trials that did not finish and were not retried
    measured_twice: dict[str, list[int]]  # params -> numbers of the COMPLETE trials that measured them
    repeats_answered: int  # proposals of an already measured config, answered without measuring
    enqueued: dict[str, list[int]]  # enqueued config -> the trials that ran it
    table_writes: list[dict[str, Any]]
    expect_workers: int = 1

    @property
    def finished(self) -> int:
        return self.states["COMPLETE"] + self.states["PRUNED"]

    @property
    def devices(self) -> set[tuple[str, str]]:
        return {row.device_key for row in self.workers if row.device_key is not None and self._finished(row)}

    @property
    def active_workers(self) -> set[tuple[str, int | None]]:
        return {(row.host, row.worker) for row in self.workers if self._finished(row)}

    @staticmethod
    def _finished(row: WorkerRow) -> bool:
        return row.states["COMPLETE"] + row.states["PRUNED"] > 0

    @property
    def problems(self) -> list[str]:
        out = []
        if len(self.active_workers) < self.expect_workers:
            out.append(f"{len(self.active_workers)} worker(s) finished trials, {self.expect_workers} expected")
        gpu_rows = [row for row in self.workers if row.device_key is not None]
        if gpu_rows and len(self.devices) < self.expect_workers:
            out.append(f"trials ran on {len(self.devices)} distinct GPU(s), {self.expect_workers} expected")
        if self.states["RUNNING"]:
            out.append(f"{self.states['RUNNING']} trial(s) still RUNNING (a run in progress, or a worker that died)")
        if self.lost:
            out.append(f"trial(s) {self.lost} FAILED and were not retried")
        if self.measured_twice:
            out.append(f"{len(self.measured_twice)} config(s) measured more than once: "
                       + "; ".join(str(n) for n in self.measured_twice.values()))  # fmt: skip
        twice = {cfg: nums for cfg, nums in self.enqueued.items() if len(nums) > 1}
        if twice:
            out.append(f"enqueued config(s) ran more than once: {sorted(twice.values())}")
        runs = Counter((w.get("host"), w.get("pid")) for w in self.table_writes)
        again = [run for run, n in runs.items() if n > 1]
        if again:
            out.append(f"one run wrote the table more than once: {again}")
        return out


def _params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def study_report(study: optuna.Study, expect_workers: int = 1) -> StudyReport:
    """The report of one study, from its trials and attributes."""
    trials = study.get_trials(deepcopy=False)
    states: Counter[str] = Counter(t.state.name for t in trials)
    rows: dict[tuple, WorkerRow] = {}
    for t in trials:
        if t.state.name == "WAITING":
            continue
        a = t.user_attrs
        key = (a.get("host", "?"), a.get("worker"), a.get("gpu"), a.get("visible_devices"), a.get("gpu_uuid"))
        row = rows.setdefault(key, WorkerRow(*key, gpu_name=a.get("gpu_name")))
        if a.get("pid") is not None:
            row.pids.add(int(a["pid"]))
        row.states[t.state.name] += 1
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    lost = [t.number for t in trials if t.state.name == "FAIL" and t.number not in retried]
    measured: dict[str, list[int]] = {}
    repeats = 0
    for t in trials:
        if t.state.name != "COMPLETE":
            continue
        if t.user_attrs.get("repeat_of_earlier_trial"):
            repeats += 1
            continue
        measured.setdefault(_params_key(t.params), []).append(t.number)
    enqueued: dict[str, list[int]] = {}
    for t in trials:
        cfg = t.user_attrs.get("enqueued")
        if cfg is not None and t.system_attrs.get("failed_trial") is None and t.state.name != "WAITING":
            enqueued.setdefault(_params_key(cfg), []).append(t.number)
    return StudyReport(
        name=study.study_name,
        states=states,
        workers=sorted(rows.values(), key=lambda r: (r.host, r.worker if r.worker is not None else -1)),
        lost=lost,
        measured_twice={k: v for k, v in measured.items() if len(v) > 1},
        repeats_answered=repeats,
        enqueued=enqueued,
        table_writes=list(study.user_attrs.get(TABLE_WRITES_ATTR, [])),
        expect_workers=expect_workers,
    )


def storage_reports(storage: Any, expect_workers: int = 1) -> list[StudyReport]:
    """Reports of every ``kgen tune`` study in ``storage`` (an Optuna storage object)."""
    import optuna

    names = sorted(s.study_name for s in storage.get_all_studies() if s.study_name.startswith(STUDY_PREFIX + ":"))
    return [study_report(optuna.load_study(study_name=n, storage=storage), expect_workers) for n in names]


def format_report(report: StudyReport) -> str:
    states = ", ".join(f"{report.states[s]} {s.lower()}" for s in STATES if report.states[s])
    lines = [f"study {report.name}", f"  trials: {sum(report.states.values())} ({states or 'none'})"]
    for row in report.workers:
        where = f"GPU {row.visible_devices or row.gpu}" if (row.visible_devices or row.gpu) is not None else "no GPU"
        if row.gpu_uuid:
            where += f" {row.gpu_uuid}"
        if row.gpu_name:
            where += f" ({row.gpu_name})"
        done = ", ".join(f"{row.states[s]} {s.lower()}" for s in STATES if row.states[s])
        pids = ",".join(str(p) for p in sorted(row.pids))
        lines.append(f"  worker {row.worker} on {row.host} {where}, pid {pids}: {done}")
    lines.append(f"  distinct GPUs with finished trials: {len(report.devices)}; "
                 f"workers with finished trials: {len(report.active_workers)}")  # fmt: skip
    lines.append(f"  configs measured more than once: {len(report.measured_twice)}; "
                 f"repeats answered from an earlier trial: {report.repeats_answered}; "
                 f"lost trials: {len(report.lost)}")  # fmt: skip
    enq = ", ".join(f"trial(s) {nums}" for nums in report.enqueued.values())
    lines.append(f"  enqueued configs: {len(report.enqueued)} ({enq or 'none'})")
    lines.append(f"  table writes: {len(report.table_writes)}")
    for w in report.table_writes:
        lines.append(f"    {w.get('at')} {w.get('path')} by {w.get('host')} pid {w.get('pid')}: "
                     f"{w.get('finished')} finished trials, {w.get('workers')} worker(s)")  # fmt: skip
    problems = report.problems
    lines += [f"  PROBLEM: {p}" for p in problems] if problems else ["  checks: all passed"]
    return "\n".join(lines)


def record_table_write(study: optuna.Study, path: Path, finished: int, workers: int) -> None:
    """Append this write of ``path`` to the study's ``table_writes`` attribute."""
    writes = list(study.user_attrs.get(TABLE_WRITES_ATTR, []))
    writes.append(
        {
            "path": str(path),
            "at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "finished": finished,
            "workers": workers,
        }
    )
    study.set_user_attr(TABLE_WRITES_ATTR, writes)
