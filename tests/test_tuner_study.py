"""Studies: storage, names, resuming after a SIGKILL, and worker processes sharing a study."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest

from kgen.spec import load_layouts
from kgen.tuner.space import default_config, load_spaces
from kgen.tuner.study import (
    BackendSpec,
    TuneJob,
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
    bucket = bucket or WORKLOADS.bucket[0]
    return TuneJob(arch, LAYOUTS["gqa64"], "bfloat16", "bfloat16", 8, bucket, tuple(WORKLOADS.workloads(bucket)))


def fresh_bucket() -> Bucket:
    """A bucket with a unique name: a unique study in a shared database."""
    return WORKLOADS.bucket[0].model_copy(update={"name": f"t{uuid.uuid4().hex[:12]}"})


def test_cache_dir_and_default_storage(tmp_path: Path) -> None:
    assert cache_dir({"KGEN_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_storage_url({"KGEN_CACHE_DIR": str(tmp_path)}) == f"sqlite:///{tmp_path}/tune.db"
    assert cache_dir({}).name == "kgen"


def test_study_name_is_stable_and_names_the_key() -> None:
    job = job_for()
    space = build_space(job, SPACES)
    name = study_name(job, space)
    assert name == study_name(job_for(), build_space(job_for(), SPACES))
    for part in ("sm_90", "gqa64", "bfloat16", "g8", "b1-8"):
        assert part in name
    other = job_for(WORKLOADS.bucket[1])
    assert study_name(other, build_space(other, SPACES)) != name


# ----------------------------------------------------------------- resume after SIGKILL


def tune_cmd(storage: str, trials: int, delay: float, bucket: str = "b1-8") -> list[str]:
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
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return []
    return study.get_trials(deepcopy=False, states=DONE)


def run_until(cmd: list[str], env: dict[str, str], storage: str, name: str, count: int, sig: int) -> tuple[int, str]:
    """Start the tuner, wait for ``count`` finished trials in the storage, send ``sig``."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


def run_two_workers(storage: str, trials: int) -> optuna.Study:
    job = job_for(fresh_bucket())
    space = build_space(job, SPACES)
    # Trials long enough that the second spawned worker (seconds to import torch on a busy
    # 2-core machine) starts before the first has finished the whole budget alone.
    backend = BackendSpec(kind="synthetic", synthetic_delay_s=0.25)
    specs = [WorkerSpec(job, SPACES, WORKLOADS, backend, storage, trials, None, 0, i, None) for i in range(2)]
    return run_workers(specs, space, enqueue=(default_config(job.layout, 8),), progress=False, poll_s=0.2)


def check_shared(study: optuna.Study, trials: int) -> None:
    done = study.get_trials(deepcopy=False, states=DONE)
    assert trials <= len(done) <= trials + 2  # each worker may finish the trial it had started
    assert len({t.number for t in study.trials}) == len(study.trials)
    workers = {t.user_attrs.get("worker") for t in done}
    assert workers == {0, 1}, "both worker processes ran trials of the one study"
    assert len({t.user_attrs.get("pid") for t in done}) == 2
    assert study.trials[0].user_attrs.get("enqueued") is not None  # the default came first


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
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
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
