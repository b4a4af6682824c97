"""Optuna studies for ``kgen tune``: naming, storage, resuming, budgets and workers.

One study per (arch, layout, KV dtype, Q dtype, group size, bucket), named so that the
same command finds it again: an interrupted run (Ctrl-C, a crash, a killed job) resumes
with every finished trial kept, because each trial is committed to the RDB storage as it
ends. The default storage is an SQLite file in the user's cache directory; ``--storage``
takes any Optuna RDB URL (PostgreSQL lets workers on many hosts share one study).

Budgets count finished trials (complete + pruned) of the whole study, so ``--trials 200``
means 200 in all, however many runs or workers it takes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from unittest import mock

from kgen.blockconfig import BlockConfig
from kgen.tuner.errors import TuneError
from kgen.tuner.job import TuneJob
from kgen.tuner.space import ProblemShape, SearchSpace, SpacesFile, arch_profile
from kgen.tuner.workloads import WorkloadsFile

if TYPE_CHECKING:
    import optuna

    from kgen.tuner.objective import Backend

STUDY_PREFIX = "kgen-tune"
HEARTBEAT_S = 30
GRACE_S = 120
SQLITE_TIMEOUT_S = 120


def build_space(job: TuneJob, spaces: SpacesFile, triton_version: str | None = None) -> SearchSpace:
    """The job's search space; ``triton_version`` (default: the installed one) decides, with
    the arch, whether a Gluon prefix stage is searched (SearchSpace.build)."""
    drafts = tuple(sorted({w.draft for w in job.workloads}))
    shape = ProblemShape.of(job.layout, job.kv_dtype, job.q_dtype, job.group_size, drafts)
    return SearchSpace.build(arch_profile(job.arch, spaces), shape, triton_version)


def study_name(job: TuneJob, space: SearchSpace) -> str:
    """arch + layout + dtypes + group + bucket, and a hash of the space and workloads so
    a changed space file starts a new study instead of resuming a mismatched one."""
    digest = space.digest([w.model_dump() for w in job.workloads])
    return (
        f"{STUDY_PREFIX}:{job.arch}:{job.layout.name}:{job.kv_dtype}:{job.q_dtype}:"
        f"g{job.group_size}:{job.bucket.name}:{digest}"
    )


# --------------------------------------------------------------------------- storage


def cache_dir(env: dict[str, str] | None = None) -> Path:
    """``$KGEN_CACHE_DIR``, else platformdirs' user cache dir for kgen, else ~/.cache/kgen."""
    env = os.environ if env is None else env
    if env.get("KGEN_CACHE_DIR"):
        return Path(env["KGEN_CACHE_DIR"]).expanduser()
    try:
        import platformdirs
    except ImportError:
        return Path.home() / ".cache" / "kgen"
    return Path(platformdirs.user_cache_dir("kgen"))


def default_storage_url(env: dict[str, str] | None = None) -> str:
    return f"sqlite:///{cache_dir(env) / 'tune.db'}"


STORAGE_ENV = "KGEN_TUNE_STORAGE"


def resolve_storage(flag: str | None, env: dict[str, str] | None = None) -> tuple[str, str]:
    """The storage URL and where it came from: ``--storage``, else ``$KGEN_TUNE_STORAGE``
    (a password there stays out of the process list and the shell history), else the
    SQLite file in the cache dir."""
    env = os.environ if env is None else env
    if flag:
        return flag, "--storage"
    if env.get(STORAGE_ENV):
        return env[STORAGE_ENV], f"${STORAGE_ENV}"
    return default_storage_url(env), "default"


def _userinfo_secret(url: str) -> tuple[int, int] | None:
    """Where the password of ``scheme://user:password@host...`` sits, reading the password
    up to the *last* ``@`` of the URL: a password with an unescaped ``@`` is hidden whole
    (SQLAlchemy would take its tail for the host). None when there is no password."""
    at = url.rfind("@")
    scheme = url.find("://")
    if scheme >= 0:
        start = scheme + 3
        colon = url.find(":", start, at) if at > start else -1
        if colon < 0 or "/" in url[start:colon]:
            return None
    else:  # not a URL: the password runs from the first ':' to the last '@'
        colon = url.find(":", 0, at) if at > 0 else -1
        if colon < 0:
            return None
    return colon + 1, at


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***``, for printing and error messages.
    SQLAlchemy renders it where it parses the URL the same way (one ``@``); anything else
    (an unparsable URL, a password with a raw ``@``, no SQLAlchemy) is cut by position."""
    if url.count("@") == 1:
        try:
            from sqlalchemy.engine import make_url

            return make_url(url).render_as_string(hide_password=True)
        except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: cut it by position
            pass
    span = _userinfo_secret(url)
    return url if span is None else f"{url[: span[0]]}***{url[span[1] :]}"


def scrub_secret(text: str, url: str) -> str:
    """``text`` (an exception message) with ``url`` redacted and its password, raw or
    URL-decoded, replaced by ``***`` wherever it appears alone."""
    from urllib.parse import unquote

    out = text.replace(url, redact_url(url))
    span = _userinfo_secret(url)
    if span is not None:
        secret = url[span[0] : span[1]]
        # A raw '@' splits the password where a driver reads the URL: its pieces show up alone.
        pieces = [p for p in secret.split("@") if len(p) >= 3] if "@" in secret else []
        for form in sorted({secret, unquote(secret), *pieces}, key=len, reverse=True):
            if form:
                out = out.replace(form, "***")
    return out


def make_storage(url: str) -> optuna.storages.RDBStorage:
    """An RDB storage with heartbeats: a trial whose process died is marked failed after
    the grace period and re-enqueued once, so a crash loses at most the trial it killed."""
    import optuna
    from optuna.storages import RDBStorage

    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine_kwargs["connect_args"] = {"timeout": SQLITE_TIMEOUT_S}
    else:
        engine_kwargs["pool_pre_ping"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            return _open_rdb(lambda: RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=HEARTBEAT_S,
                grace_period=GRACE_S,
                **_retry_stale_trials(),
            ))  # fmt: skip
        except ImportError as exc:
            raise TuneError(
                f"storage {redact_url(url)!r} needs a database driver that is not installed "
                f"({scrub_secret(str(exc), url)}); for PostgreSQL: pip install 'kgen[postgres]'"
            ) from None
        except Exception as exc:
            raise TuneError(
                f"cannot open the study storage {redact_url(url)!r}: {type(exc).__name__}: "
                f"{scrub_secret(str(exc), url)}"
            ) from None


# Opening a new database: attempts while another process creates its schema at the same time.
SCHEMA_RACE_ATTEMPTS = 5
SCHEMA_RACE_PAUSE_S = 0.2


def _open_rdb(open_storage: Callable[[], optuna.storages.RDBStorage]) -> optuna.storages.RDBStorage:
    """``open_storage()``, again when it lost the race to create a new database's schema.

    Two processes opening one new database (the workers of ``kgen tune --workers``, tuners
    started on several machines, a script reading the study) each create Optuna's tables
    and stamp their version; the loser's table creation or stamp fails (a table that already
    exists, a broken unique key). The schema is whole by then, so opening again succeeds."""
    import sqlalchemy.exc

    for attempt in range(1, SCHEMA_RACE_ATTEMPTS):
        try:
            return open_storage()
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError, sqlalchemy.exc.ProgrammingError):
            # a duplicate version stamp, or a table the other creator made first ("already
            # exists"); any other database error comes back from the last attempt unchanged
            time.sleep(SCHEMA_RACE_PAUSE_S * attempt)
    return open_storage()


def _retry_stale_trials() -> dict[str, Any]:
    """Re-enqueue a trial whose worker died, once: Optuna >= 4.9 names the callback
    ``heartbeat_stale_trial_callback``, older releases ``failed_trial_callback``."""
    from optuna import storages

    if hasattr(storages, "RetryHeartbeatStaleTrialCallback"):
        return {"heartbeat_stale_trial_callback": storages.RetryHeartbeatStaleTrialCallback(max_retry=1)}
    return {"failed_trial_callback": storages.RetryFailedTrialCallback(max_retry=1)}


def _as_storage(storage: str | optuna.storages.BaseStorage) -> Any:
    return make_storage(storage) if isinstance(storage, str) else storage


# --------------------------------------------------------------------------- the study


def make_sampler(seed: int, worker: int = 0, conditional: bool = False) -> optuna.samplers.TPESampler:
    """Seeded TPE; each worker gets its own seed, and ``constant_liar`` keeps parallel
    workers from proposing the config another is still timing. A conditional space (a
    ``lowering`` axis whose branches have their own axes) is sampled by groups of axes that
    occur together (``group``), so each branch is modelled jointly from its own trials."""
    import optuna

    extra = {"group": True} if conditional else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed + 1000 * worker, multivariate=True, constant_liar=True, n_startup_trials=10, **extra
        )


def open_study(
    job: TuneJob,
    space: SearchSpace,
    storage: str | optuna.storages.BaseStorage,
    seed: int = 0,
    worker: int = 0,
    enqueue: tuple[BlockConfig, ...] = (),
) -> optuna.Study:
    """Create or load the job's study; enqueue ``enqueue`` (the default first) unless a
    trial with the same parameters already exists."""
    import optuna

    study = optuna.create_study(
        study_name=study_name(job, space),
        storage=_as_storage(storage),
        sampler=make_sampler(seed, worker, space.conditional),
        direction="minimize",
        load_if_exists=True,
    )
    for cfg in enqueue:
        params, notes = space.params_of(cfg)
        attrs = {"enqueued": cfg.model_dump(exclude_none=True), "enqueue_notes": notes}
        study.enqueue_trial(params, user_attrs=attrs, skip_if_exists=True)
    if "arch" not in study.user_attrs:
        study.set_user_attr("arch", job.arch)
        study.set_user_attr("job", job.label())
        study.set_user_attr("workloads", [w.model_dump() for w in job.workloads])
    return study


def waiting_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Enqueued trials no worker has taken yet."""
    import optuna

    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return study.get_trials(deepcopy=False, states=states)


def best_value(study: optuna.Study) -> float | None:
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return min((t.value for t in done), default=None)


@dataclass
class StopRequest:
    """Set by the first Ctrl-C: finish the running trial, then stop (see ``stop_on_sigint``).

    ``shared`` (a multiprocessing Event) carries the request between the parent and its
    worker processes, so a SIGINT sent to the parent alone (``kill -INT PID``) stops the
    workers too, after their running trial."""

    requested: bool = False
    shared: Any = None

    def request(self) -> None:
        self.requested = True
        if self.shared is not None:
            self.shared.set()

    def is_requested(self) -> bool:
        if not self.requested and self.shared is not None and self.shared.is_set():
            self.requested = True
        return self.requested

    def callback(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """An Optuna callback: end the optimize loop once a stop is requested."""
        if self.is_requested():
            study.stop()


class Interrupted(Exception):
    """The user asked to stop; finished trials are in the storage."""


def restore_sigint() -> bool:
    """Give SIGINT back its default meaning (KeyboardInterrupt) where the process started
    with it ignored: a ``cmd &`` in a script, or a parent that ignores it, hands its
    children SIG_IGN, and Python then installs no handler. ``kgen tune`` stops cleanly and
    resumes, so Ctrl-C and ``kill -INT PID`` must reach it. Returns whether it changed
    anything (only the main thread can)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True


@contextlib.contextmanager
def stop_on_sigint(
    notice: str | None = "stopping after the running trial; Ctrl-C again to stop now",
    stop: StopRequest | None = None,
) -> Iterator[StopRequest]:
    """The first Ctrl-C lets the running trial finish and commit, then stops the study
    cleanly; the second raises KeyboardInterrupt at once. A trial cut mid-way is lost
    anyway, and interrupting a database write can leave its lock held for the busy
    timeout, so the clean path is the default. Outside the main thread, or where SIGINT is
    ignored (``restore_sigint`` was not called), no handler is installed."""
    stop = stop if stop is not None else StopRequest()
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield stop
        return

    def handler(signum: int, frame: object) -> None:
        if stop.requested:
            raise KeyboardInterrupt
        stop.request()
        if notice:
            print(f"\n{notice}", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


class ProgressBar:
    """A tqdm bar over the study's finished trials with the best time so far."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="trial",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
            leave=True,
        )

    def show(self, finished: int, best: float | None) -> None:
        self.bar.n = min(finished, self.bar.total)
        self.bar.set_postfix_str(f"best {best:.2f} us" if best is not None else "best -", refresh=False)
        self.bar.refresh()

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.show(len(finished_trials(study)), best_value(study))

    def close(self) -> None:
        self.bar.close()


def optimize(
    study: optuna.Study,
    objective: Callable[[optuna.Trial], float],
    n_trials: int,
    timeout: float | None = None,
    callbacks: list[Callable[..., None]] | None = None,
    stop: StopRequest | None = None,
) -> None:
    """Run trials until the study holds ``n_trials`` finished ones, ``timeout`` passes or
    ``stop`` is requested (checked after each trial).

    Only ``FatalDeviceError`` and ``KeyboardInterrupt`` escape (Optuna marks the running
    trial failed first); every finished trial is already in the storage.
    """
    import optuna
    from optuna.study import MaxTrialsCallback

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    remaining = n_trials - len(finished_trials(study))
    if remaining <= 0 or (stop is not None and stop.is_requested()):
        return
    budget = MaxTrialsCallback(n_trials, states=states)
    study.optimize(
        objective,
        n_trials=remaining,
        timeout=timeout,
        callbacks=[budget, *(callbacks or []), *([stop.callback] if stop else [])],
        catch=(),
        gc_after_trial=False,
    )


def run_inprocess(
    job: TuneJob,
    space: SearchSpace,
    backend: Backend,
    storage: str | optuna.storages.BaseStorage,
    n_trials: int,
    timeout: float | None = None,
    seed: int = 0,
    enqueue: tuple[BlockConfig, ...] = (),
    progress: bool = True,
    stop: StopRequest | None = None,
) -> optuna.Study:
    """One worker in this process: the study for ``job`` is run to its budget.
    Raises ``Interrupted`` when ``stop`` was requested (the study is then unfinished)."""
    from kgen.tuner.objective import make_objective

    study = open_study(job, space, storage, seed=seed, enqueue=enqueue)
    bar = ProgressBar(n_trials, len(finished_trials(study)), job.label(), enabled=progress)
    try:
        bar.show(len(finished_trials(study)), best_value(study))
        objective = make_objective(space, backend, worker_tags(0, None))
        optimize(study, objective, n_trials, timeout, callbacks=[bar], stop=stop)
    finally:
        bar.close()
    if stop is not None and stop.is_requested():
        raise Interrupted(study.study_name)
    return study


# --------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class BackendSpec:
    """How a worker process builds its backend (it cannot be pickled across processes)."""

    kind: Literal["gpu", "synthetic"] = "gpu"
    seed: int = 0
    synthetic_delay_s: float = 0.0
    synthetic_jitter_pct: float = 0.0


def make_backend(spec: BackendSpec, job: TuneJob, space: SearchSpace, workloads: WorkloadsFile) -> Backend:
    """The synthetic bowl, or the GPU backend on the current device for ``job``."""
    if spec.kind == "synthetic":
        from kgen.tuner.objective import SyntheticBowl, synthetic_optimum

        return SyntheticBowl(
            synthetic_optimum(space, spec.seed),
            delay_s=spec.synthetic_delay_s,
            jitter_pct=spec.synthetic_jitter_pct,
            seed=spec.seed,
        )
    from kgen.tuner.gpu import GpuBackend, detect_device, load_module

    module = load_module(job.layout.name, job.kv_dtype, job.q_dtype)
    return GpuBackend.for_job(module, job, workloads, detect_device().l2_bytes)


@dataclass(frozen=True)
class WorkerSpec:
    job: TuneJob
    spaces: SpacesFile
    workloads: WorkloadsFile
    backend: BackendSpec
    storage: str
    n_trials: int
    timeout: float | None
    seed: int
    worker: int
    gpu: str | None


def worker_tags(worker: int, gpu: str | None) -> dict[str, object]:
    """What each trial records about the process that ran it (``kgen tune --report`` counts
    trials per worker and GPU from these): ``visible_devices`` is the process's own
    CUDA_VISIBLE_DEVICES, so a worker that was not pinned shows it."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "worker": worker,
        "gpu": gpu,
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def device_tags() -> dict[str, object]:
    """The GPU this process sees as device 0: its name and UUID (two workers on one
    physical GPU would show the same UUID)."""
    from kgen.tuner.gpu import detect_device

    device = detect_device()
    return {"gpu_name": device.name, "gpu_uuid": device.uuid}


def worker_main(spec: WorkerSpec, queue_drained: Any = None, stop_event: Any = None) -> None:
    """Entry point of one worker process: check its GPU pinning, then join the study.

    The parent starts the process with CUDA_VISIBLE_DEVICES set to the worker's GPU (so
    nothing imported before this function can open another device); a mismatch is an
    error, not a silent second worker on the first GPU.

    ``queue_drained`` (an Event) holds back every worker but the first until the enqueued
    trials are taken: Optuna pops a waiting trial without a row lock on SQLite
    (optuna/optuna#4621), so two workers could run the same one and the second fail to
    tell it ("Cannot tell a COMPLETE trial"). ``stop_event`` is the parent's stop request.
    """
    if spec.gpu is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != spec.gpu:
        raise TuneError(
            f"worker {spec.worker} was started with CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, not its GPU {spec.gpu!r}"
        )
    import optuna

    from kgen.tuner.objective import make_objective

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = build_space(spec.job, spec.spaces)
    backend = make_backend(spec.backend, spec.job, space, spec.workloads)
    study = open_study(spec.job, space, spec.storage, seed=spec.seed, worker=spec.worker)
    tags = worker_tags(spec.worker, spec.gpu)
    if spec.backend.kind == "gpu":
        tags.update(device_tags())
    objective = make_objective(space, backend, tags)
    with stop_on_sigint(notice=None, stop=StopRequest(shared=stop_event)) as stop:  # the parent tells the user
        while queue_drained is not None and not queue_drained.wait(0.05) and not stop.is_requested():
            pass
        optimize(study, objective, spec.n_trials, spec.timeout, stop=stop)


@contextlib.contextmanager
def _pinned_env(gpu: str | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES=gpu in this process's environment while a spawned child starts
    (it inherits the environment at start), restored afterwards."""
    if gpu is None:
        yield
        return
    with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": gpu}):
        yield


def run_workers(
    specs: list[WorkerSpec],
    space: SearchSpace,
    enqueue: tuple[BlockConfig, ...] = (),
    progress: bool = True,
    poll_s: float = 1.0,
    stop: StopRequest | None = None,
) -> optuna.Study:
    """Start one process per spec on one study (the parent enqueues the defaults first, so
    workers never race to enqueue them), each pinned to its GPU, show progress, and wait
    for all of them.

    Ctrl-C reaches the workers too (one process group): each finishes its running trial
    and exits; then this raises ``Interrupted``. A stop requested in the parent alone
    (``kill -INT`` of its pid) is passed on to the workers; a second Ctrl-C ends them at once.
    """
    first = specs[0]
    study = open_study(first.job, space, first.storage, seed=first.seed, enqueue=enqueue)
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot survive fork
    queue_drained = ctx.Event()  # the first worker has taken every enqueued trial
    stop_event = ctx.Event()  # a stop requested in the parent or in any worker
    procs = [
        ctx.Process(
            target=worker_main, args=(s, queue_drained if i else None, stop_event), name=f"kgen-tune-{s.worker}"
        )
        for i, s in enumerate(specs)
    ]
    bar = ProgressBar(first.n_trials, len(finished_trials(study)), first.job.label(), enabled=progress)
    try:
        for p, s in zip(procs, specs, strict=True):
            with _pinned_env(s.gpu):
                p.start()
        while any(p.is_alive() for p in procs):
            if stop is not None and stop.is_requested():
                stop_event.set()
            if not queue_drained.is_set() and (not procs[0].is_alive() or not waiting_trials(study)):
                queue_drained.set()
            bar.show(len(finished_trials(study)), best_value(study))
            time.sleep(poll_s)
        bar.show(len(finished_trials(study)), best_value(study))
    except BaseException:
        _stop(procs)
        raise
    finally:
        bar.close()
    if stop is not None and (stop.is_requested() or stop_event.is_set()):
        raise Interrupted(study.study_name)
    bad = [(p.name, p.exitcode) for p in procs if p.exitcode != 0]
    if bad:
        raise TuneError(
            f"worker(s) {bad} exited with an error (see above); finished trials are kept in "
            f"{redact_url(first.storage)}: run the same command again to resume"
        )
    return study


def _stop(procs: list[multiprocessing.process.BaseProcess], wait_s: float = 10.0) -> None:
    """Give our worker processes (they got the same Ctrl-C) time to stop, then end them."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
