"""Studies: storage, names, resuming after a SIGKILL, and worker processes sharing a study."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
import sqlalchemy.exc

from kgen.spec import load_layouts
from kgen.tuner.job import TuneJob
from kgen.tuner.report import format_report, record_table_write, study_report
from kgen.tuner.space import default_config, load_spaces
from kgen.tuner.study import (
    BackendSpec,
    WorkerSpec,
    build_space,
    cache_dir,
    default_storage_url,
    run_workers,
    study_name,
)
from kgen.tuner.workloads import Bucket, load_workloads

optuna.logging.set_verbosity(optuna.logging.WARNING)
ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = load_layouts()
SPACES = load_spaces()
WORKLOADS = load_workloads()
DONE = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)


def job_for(bucket: Bucket | None = None, arch: str = "sm_90") -> TuneJob:
    bucket = bucket or WORKLOADS.bucket_named("b2-8")
    return TuneJob(arch, LAYOUTS["gqa64"], "bfloat16", "bfloat16", 8, bucket, tuple(WORKLOADS.workloads(bucket)))


def fresh_bucket() -> Bucket:
    """A bucket with a unique name: a unique study in a shared database."""
    return WORKLOADS.bucket_named("b2-8").model_copy(update={"name": f"t{uuid.uuid4().hex[:12]}"})


def test_cache_dir_and_default_storage(tmp_path: Path) -> None:
    assert cache_dir({"KGEN_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_storage_url({"KGEN_CACHE_DIR": str(tmp_path)}) == f"sqlite:///{tmp_path}/tune.db"
    assert cache_dir({}).name == "kgen"


def test_study_name_is_stable_and_names_the_key() -> None:
    job = job_for()
    space = build_space(job, SPACES)
    name = study_name(job, space)
    assert name == study_name(job_for(), build_space(job_for(), SPACES))
    for part in ("sm_90", "gqa64", "bfloat16", "g8", "b2-8"):
        assert part in name
    other = job_for(WORKLOADS.bucket_named("b9-32"))
    assert study_name(other, build_space(other, SPACES)) != name


# ----------------------------------------------------------------- resume after SIGKILL


def tune_cmd(storage: str, trials: int, delay: float, bucket: str = "b2-8") -> list[str]:
    return [
        sys.executable,
        "-m",
        "kgen.tuner.cli",
        "tune",
        "--objective",
        "synthetic",
        "--arch",
        "sm_90",
        "--layout",
        "gqa64",
        "--kv-dtype",
        "bf16",
        "--group",
        "8",
        "--bucket",
        bucket,
        "--trials",
        str(trials),
        "--storage",
        storage,
        "--synthetic-delay",
        str(delay),
        "--no-progress",
    ]


def finished(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    """The study's finished trials; none while the tuner has not created it. Opening an
    SQLite file the tuner is creating races its schema setup (both stamp the schema's
    version), so the file is opened only once it exists, and that race reads as not yet."""
    path = storage.removeprefix("sqlite:///")
    if path != storage and not Path(path).exists():
        return []
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except (KeyError, sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
        return []
    return study.get_trials(deepcopy=False, states=DONE)


def default_sigint() -> None:
    """In the child, before Python starts: SIGINT as a terminal's foreground job has it.
    A pytest started as a background job (`pytest &` in a script) ignores SIGINT, its
    children inherit SIG_IGN, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ignored_sigint() -> None:
    """In the child: SIGINT ignored, as `kgen tune ... &` in a script (or under a parent
    that ignores it) starts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_until(
    cmd: list[str], env: dict[str, str], storage: str, name: str, count: int, sig: int,
    preexec: Callable[[], None] = default_sigint,
) -> tuple[int, str]:  # fmt: skip
    """Start the tuner, wait for ``count`` finished trials in the storage, send ``sig``."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=preexec)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(finished(storage, name)) < count:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the tuner made no progress"
            time.sleep(0.1)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, out


def snapshot(storage: str, name: str) -> dict[int, tuple]:
    return {t.number: (t.state, t.value, t.params) for t in finished(storage, name)}


def test_study_resumes_after_sigkill_and_ctrl_c_without_losing_finished_trials(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    job = job_for()
    name = study_name(job, build_space(job, SPACES))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    rc, _ = run_until(tune_cmd(storage, 60, 0.05), env, storage, name, 12, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    killed = snapshot(storage, name)
    assert 12 <= len(killed) < 60

    rc, out = run_until(tune_cmd(storage, 60, 0.05), env, storage, name, len(killed) + 8, signal.SIGINT)
    assert rc == 130 and "run the same command again to resume" in out
    interrupted = snapshot(storage, name)
    assert len(interrupted) >= len(killed) + 8
    assert all(interrupted[n] == killed[n] for n in killed)

    resumed = subprocess.run(tune_cmd(storage, 60, 0.0), cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    after = snapshot(storage, name)
    assert len(after) == 60  # the budget counts the trials of all runs together
    assert all(after[n] == interrupted[n] for n in interrupted)  # no finished trial lost or changed
    assert "gqa64" in resumed.stdout and "synthetic objective: no table written" in resumed.stdout


# ----------------------------------------------------------------- workers


def run_two_workers(storage: str, trials: int, gpus: tuple[str | None, ...] = ("3", "5")) -> optuna.Study:
    """Two worker processes on one study, each started pinned to a (fake) GPU: the
    synthetic backend opens no device, but each trial records the CUDA_VISIBLE_DEVICES
    its process saw."""
    job = job_for(fresh_bucket())
    space = build_space(job, SPACES)
    # Trials long enough that the second spawned worker (seconds to import torch on a busy
    # 2-core machine) starts before the first has finished the whole budget alone.
    backend = BackendSpec(kind="synthetic", synthetic_delay_s=0.25)
    specs = [WorkerSpec(job, SPACES, WORKLOADS, backend, storage, trials, None, 0, i, gpu)
             for i, gpu in enumerate(gpus)]
    return run_workers(specs, space, enqueue=(default_config(job.layout, 8),), progress=False, poll_s=0.2)


def check_shared(study: optuna.Study, trials: int) -> None:
    done = study.get_trials(deepcopy=False, states=DONE)
    assert trials <= len(done) <= trials + 2  # each worker may finish the trial it had started
    assert len({t.number for t in study.trials}) == len(study.trials)
    workers = {t.user_attrs.get("worker") for t in done}
    assert workers == {0, 1}, "both worker processes ran trials of the one study"
    assert len({t.user_attrs.get("pid") for t in done}) == 2
    assert study.trials[0].user_attrs.get("enqueued") is not None  # the default came first
    # each worker process ran pinned to its own device
    assert {(t.user_attrs["worker"], t.user_attrs["visible_devices"]) for t in done} == {(0, "3"), (1, "5")}
    report = study_report(study, expect_workers=2)
    assert report.problems == [], format_report(report)
    assert len(report.devices) == 2 and report.finished == len(done)
    assert [len(nums) for nums in report.enqueued.values()] == [1]


def test_two_worker_processes_share_one_sqlite_study(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    check_shared(run_two_workers(storage, 30), 30)


def test_ctrl_c_stops_worker_processes_cleanly(tmp_path: Path) -> None:
    """Ctrl-C in a terminal reaches the whole process group: the parent and both workers."""
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    job = job_for()
    name = study_name(job, build_space(job, SPACES))
    cmd = [*tune_cmd(storage, 500, 0.1), "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        # Six trials, from both workers: on a loaded machine the second worker can start
        # late, and the interrupt must find both running.
        while (len(done := finished(storage, name)) < 6
               or {t.user_attrs.get("worker") for t in done} != {0, 1}):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the workers made no progress"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130 and "run the same command again to resume" in out
    study = optuna.load_study(study_name=name, storage=storage)
    states = {t.state.name for t in study.trials}
    assert states == {"COMPLETE"}, "each worker finished its running trial before stopping"
    assert {t.user_attrs["worker"] for t in study.trials} == {0, 1}
    assert len(study.trials) < 500


@pytest.mark.postgres
@pytest.mark.skipif(
    not os.environ.get("KGEN_TEST_POSTGRES_URL"), reason="KGEN_TEST_POSTGRES_URL is not set (run .ci/postgres.sh)"
)
def test_two_worker_processes_share_one_postgres_study() -> None:
    check_shared(run_two_workers(os.environ["KGEN_TEST_POSTGRES_URL"], 40), 40)


# ----------------------------------------------------------------- SIGINT ignored at start


def test_tuner_started_with_sigint_ignored_still_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    """`kgen tune ... &` in a script starts with SIGINT ignored; `kill -INT PID` must still
    stop it after the running trial (kgen tune restores the default handler)."""
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    job = job_for()
    name = study_name(job, build_space(job, SPACES))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rc, out = run_until(tune_cmd(storage, 500, 0.05), env, storage, name, 4, signal.SIGINT, preexec=ignored_sigint)
    assert rc == 130 and "run the same command again to resume" in out
    study = optuna.load_study(study_name=name, storage=storage)
    assert {t.state.name for t in study.trials} == {"COMPLETE"} and len(study.trials) < 500


def test_sigint_to_the_parent_alone_stops_its_workers(tmp_path: Path) -> None:
    """Started with SIGINT ignored and signalled by pid (not the process group): the parent
    passes the stop on, each worker finishes its running trial, nothing is lost."""
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    job = job_for()
    name = study_name(job, build_space(job, SPACES))
    cmd = [*tune_cmd(storage, 500, 0.1), "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=ignored_sigint,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while (len(done := finished(storage, name)) < 6
               or {t.user_attrs.get("worker") for t in done} != {0, 1}):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the workers made no progress"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)  # the whole budget would take ~25 s more
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, out
    study = optuna.load_study(study_name=name, storage=storage)
    # Nothing left running or failed: every trial measured, or turned away before it ran by the
    # launch rules (a seeded sampler's proposal that does not fit), never by the stop.
    assert {t.state.name for t in study.trials} <= {"COMPLETE", "PRUNED"}
    pruned = [t.user_attrs.get("pruned_reason", "") for t in study.trials if t.state.name == "PRUNED"]
    assert all(reason.startswith("does not fit") for reason in pruned), pruned
    assert len(study.trials) < 100


# ----------------------------------------------------------------- the report


def report_study() -> tuple[optuna.Study, TuneJob]:
    job = job_for()
    space = build_space(job, SPACES)
    from kgen.tuner.study import open_study

    study = open_study(job, space, optuna.storages.InMemoryStorage(), enqueue=(default_config(job.layout, 8),))
    return study, job


def add(study: optuna.Study, state: str, params: dict, value: float | None = 10.0, **attrs: object) -> None:
    dist = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
    st = optuna.trial.TrialState[state]
    study.add_trial(optuna.trial.create_trial(state=st, params=params, distributions=dist,
                                              value=value if st.name == "COMPLETE" else None,
                                              user_attrs={"host": "h", "pid": 1, **attrs}))  # fmt: skip


def test_report_finds_lost_trials_double_measurements_and_double_writes(tmp_path: Path) -> None:
    study, _ = report_study()
    add(study, "COMPLETE", {"a": 1}, worker=0, gpu="0", visible_devices="0", gpu_uuid="GPU-aaa")
    add(study, "PRUNED", {"a": 2}, worker=1, gpu="1", visible_devices="1", gpu_uuid="GPU-bbb")
    clean = study_report(study, expect_workers=2)
    assert len(clean.devices) == 2 and clean.finished == 2 and clean.problems == []
    assert study_report(study, expect_workers=3).problems == ["2 worker(s) finished trials, 3 expected",
                                                              "trials ran on 2 distinct GPU(s), 3 expected"]
    add(study, "COMPLETE", {"a": 1}, worker=1, gpu="1", visible_devices="1")  # measured again
    add(study, "COMPLETE", {"a": 1}, worker=1, repeat_of_earlier_trial=True)  # answered, not measured
    add(study, "FAIL", {"a": 3}, worker=0)
    record_table_write(study, tmp_path / "t.json", 4, 2)
    record_table_write(study, tmp_path / "t.json", 4, 2)
    report = study_report(study, expect_workers=2)
    problems = report.problems
    assert report.repeats_answered == 1 and report.lost == [5]  # trial 0 is the enqueued default, still waiting
    assert any("measured more than once: [1, 3]" in p for p in problems)
    assert any("[5] FAILED and were not retried" in p for p in problems)
    assert any("wrote the table more than once" in p for p in problems)
    text = format_report(report)
    assert "table writes: 2" in text and "GPU-aaa" in text and "PROBLEM:" in text


def test_tune_with_two_workers_writes_the_table_once_and_reports(tmp_path: Path) -> None:
    from kgen.blockconfig import read_table
    from kgen.tuner.cli import main

    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    out = tmp_path / "sm_90.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [*tune_cmd(storage, 16, 0.25), "--workers", "2", "--out", str(out.parent)]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "table writes: 1" in run.stdout and "checks: all passed" in run.stdout
    assert read_table(out).metadata.trials >= 16
    job = job_for()
    name = study_name(job, build_space(job, SPACES))
    study = optuna.load_study(study_name=name, storage=storage)
    writes = study.user_attrs["table_writes"]
    assert len(writes) == 1 and writes[0]["path"] == str(out) and writes[0]["workers"] == 2
    assert main(["tune", "--report", "--workers", "2", "--storage", storage]) == 0
    assert main(["tune", "--report", "--workers", "3", "--storage", storage]) == 1


@pytest.mark.gpu
def test_two_gpu_workers_share_one_study_on_two_devices(tmp_path: Path) -> None:
    """`kgen tune --workers 2` on a machine with two GPUs: one study, both devices ran
    trials (two GPU UUIDs), nothing lost or measured twice, the table written once."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs")
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    out = tmp_path / "sm_90.json"
    cmd = [sys.executable, "-m", "kgen.tuner.cli", "tune", "--workers", "2", "--layout", "gqa64", "--kv-dtype",
           "bf16", "--group", "8", "--bucket", "b9-32", "--trials", "12", "--timeout", "240", "--storage", storage,
           "--out", str(out.parent), "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checks: all passed" in run.stdout, run.stdout[-3000:]
    (study_summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=study_summary.study_name, storage=storage)
    done = study.get_trials(deepcopy=False, states=DONE)
    assert len({t.user_attrs["gpu_uuid"] for t in done}) == 2, "both GPUs ran trials"
    report = study_report(study, expect_workers=2)
    assert report.problems == [] and len(report.table_writes) == 1, format_report(report)


def test_processes_opening_one_new_database_at_once_all_get_the_storage(tmp_path: Path) -> None:
    """Several processes open one new SQLite file at the same moment (workers, a second
    tuner, a script reading the study): each creates Optuna's schema, the losers' version
    stamps collide, and every one of them must still get the storage."""
    url = f"sqlite:///{tmp_path / 'new.db'}"
    code = ("import sys; from kgen.tuner.study import make_storage; "
            "make_storage(sys.argv[1]).get_all_studies(); print('opened')")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, url], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]  # fmt: skip
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 and "opened" in out for p, out in zip(procs, outs, strict=True)), outs
