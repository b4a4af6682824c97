"""The Optuna objective of ``kgen tune``, around an injectable backend.

A backend answers two questions about a config: is its output right (``check``) and how
long does it take (``measure``, microseconds). The real one (``kgen.tuner.gpu``) runs the
generated module's kernels on a GPU; ``SyntheticBowl`` is a deterministic stand-in with a
known optimum, so the study machinery (pruning, resuming, workers, the final decision)
is tested on a CPU.

The objective never lets one config crash the study: a config that cannot fit is pruned
before compiling, a wrong output or any exception from compiling or launching prunes the
trial with the reason kept in the trial's user attributes. Only ``FatalDeviceError`` (the
device itself is gone: later trials would all fail) and ``KeyboardInterrupt`` stop it.
"""

from __future__ import annotations

import datetime
import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kgen.blockconfig import BlockConfig
from kgen.tuner.space import GLUON_PARAM, KERNEL_AXES, PLACEMENT_AXES, SPLIT_AXES, merge_choice

if TYPE_CHECKING:
    import optuna

    from kgen.tuner.space import SearchSpace

MAX_REASON_CHARS = 500


class FatalDeviceError(RuntimeError):
    """The device is unusable after a failure (e.g. an illegal memory access poisons a CUDA
    context): the worker must stop; a new process resumes the study."""


class Backend(Protocol):
    def parity_error(self, config: BlockConfig) -> str | None:
        """None when the config's output matches the reference, else why not."""

    def measure(self, config: BlockConfig) -> float:
        """The config's time in microseconds (lower is better)."""


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


def _prune(trial: optuna.Trial, reason: str) -> optuna.TrialPruned:
    import optuna

    trial.set_user_attr("pruned_reason", _short(reason))
    return optuna.TrialPruned(_short(reason))


def guarded(trial: optuna.Trial, stage: str, fn: Callable[[], object]) -> object:
    """Run one backend call; any ordinary exception becomes a pruned trial with a reason."""
    import optuna

    try:
        return fn()
    except (optuna.TrialPruned, FatalDeviceError):
        raise
    except Exception as exc:  # compile errors, OutOfResources, launch errors: all prune
        raise _prune(trial, f"{stage} failed: {type(exc).__name__}: {exc}") from None


# How long a trial waits for a lower-numbered trial that has not published its config yet
# (``config`` is set right after ``suggest``): one still RUNNING without it this long after it
# started is not choosing any more (its worker died, or hangs), so it is not waited for.
CHOOSING_S = 5.0
TWIN_POLL_S = 0.05
TWIN_ATTR = "twin_of"  # on a trial pruned because a lower-numbered one was measuring its config


def earlier_outcome(trial: optuna.Trial) -> tuple[str, object] | None:
    """An earlier finished trial with the same parameters: ("value", v) or ("pruned", why).

    TPE proposes repeats once it converges; re-timing them would cost a compile and a
    measurement for no new information.
    """
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    for old in trial.study.get_trials(deepcopy=False, states=states):
        if old.number == trial.number or old.params != trial.params:
            continue
        if old.state == optuna.trial.TrialState.COMPLETE:
            return "value", old.value
        reason = old.user_attrs.get("pruned_reason", "")
        # a prune that says nothing of the config: it does not fit, or a twin was measuring it
        if not reason.startswith("does not fit") and TWIN_ATTR not in old.user_attrs:
            return "pruned", f"same config as trial {old.number}: {reason}"
    return None


def _lower_twin(trial: optuna.Trial) -> tuple[str, int] | None:
    """A lower-numbered RUNNING trial that decides this one: ("choosing", n) when it started
    moments ago and has not published its config (it may be about to choose this one), or
    ("measuring", n) when it is measuring this config. None when there is none.

    Trial numbers are handed out atomically by the storage, so they order concurrent trials
    as a bakery's tickets do: of trials with one config, only the lowest-numbered measures.
    """
    import optuna

    now = datetime.datetime.now()  # Optuna stamps datetime_start with the local naive time
    for other in trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if other.number >= trial.number:
            continue
        if "config" not in other.user_attrs:
            started = other.datetime_start
            if started is not None and (now - started).total_seconds() < CHOOSING_S:
                return "choosing", other.number
        elif other.params == trial.params:
            return "measuring", other.number
    return None


def outcome_after_twins(
    trial: optuna.Trial, wait_s: float = CHOOSING_S, poll_s: float = TWIN_POLL_S
) -> tuple[str, object] | None:
    """``earlier_outcome``, or ("twin", n) while a lower-numbered trial n measures the same
    config: two workers that draw one config at once measure it once, and neither waits for
    the other's measurement (a twin whose worker died would hold it until the heartbeat's
    grace period). A trial still choosing its config is waited for, ``wait_s`` at most."""
    deadline = time.monotonic() + wait_s
    while True:
        seen = earlier_outcome(trial)
        if seen is not None:
            return seen
        twin = _lower_twin(trial)
        if twin is None:
            return None
        kind, number = twin
        if kind == "measuring":
            return "twin", number
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def make_objective(
    space: SearchSpace, backend: Backend, tags: dict[str, object] | None = None
) -> Callable[[optuna.Trial], float]:
    """The function Optuna calls once per trial: suggest, prune, check, then measure.

    ``tags`` (host, pid, GPU of the worker) are stored on every trial, so a shared study
    shows which worker ran what.
    """

    def objective(trial: optuna.Trial) -> float:
        for key, value in (tags or {}).items():
            trial.set_user_attr(key, value)
        config = space.suggest(trial)  # TrialPruned when it cannot fit: nothing compiled
        trial.set_user_attr("config", config.model_dump(exclude_none=True))
        seen = outcome_after_twins(trial)
        if seen is not None:
            kind, what = seen
            if kind == "twin":
                trial.set_user_attr(TWIN_ATTR, what)
                raise _prune(trial, f"same config as trial {what}, which is measuring it")
            if kind == "pruned":
                raise _prune(trial, str(what))
            trial.set_user_attr("repeat_of_earlier_trial", True)
            return float(what)
        wrong = guarded(trial, "parity", lambda: backend.parity_error(config))
        if wrong:
            raise _prune(trial, f"wrong output: {wrong}")
        us = guarded(trial, "measure", lambda: backend.measure(config))
        if not isinstance(us, int | float) or not math.isfinite(us) or us <= 0:
            raise _prune(trial, f"measure returned {us!r}, not a positive time")
        return float(us)

    return objective


# --------------------------------------------------------------------------- synthetic


_PLACEMENT_STEPS = {"after": 0, None: 1, "first": 2}
# Where the splits merge is a category: one step from the merge launch to the cluster, one more
# to the cluster's pipelined merge.
_MERGE_STEPS = {"launch": 0, "cluster": 1, "cluster_pipelined": 2}
# The lowering is two kernels, not a knob: a config of the other lowering is as far from the
# optimum as one several steps off on every axis (a log2 distance of 2, squared 4), as on the
# H200, where every Gluon config of MLA group 16 beat every Triton one.
_LOWERING_STEPS = {"triton": 0, "gluon": 3}


def _log_distance(value: int | None, target: int | None) -> float:
    if value is None or target is None:
        return 0.0
    return math.log2(value + 1) - math.log2(target + 1)


class SyntheticBowl:
    """A deterministic cost with one known optimum: ``base_us`` there, growing with the
    squared log2 distance of every field from it. For testing the tuner without a GPU;
    ``kgen tune --objective synthetic`` uses it to exercise a study end to end.

    ``wrong`` / ``broken`` mark configs whose check fails / whose measure raises, to test
    that such trials are pruned; ``delay_s`` makes each measurement take time (to kill a
    study mid-run); ``jitter_pct`` adds seeded noise to repeated measurements.
    """

    def __init__(
        self,
        optimum: BlockConfig,
        base_us: float = 100.0,
        delay_s: float = 0.0,
        jitter_pct: float = 0.0,
        seed: int = 0,
        wrong: Callable[[BlockConfig], bool] | None = None,
        broken: Callable[[BlockConfig], bool] | None = None,
    ) -> None:
        self.optimum = optimum
        self.base_us = base_us
        self.delay_s = delay_s
        self.jitter_pct = jitter_pct
        self._rng = random.Random(seed)
        self._wrong = wrong
        self._broken = broken
        self.calls = 0

    @staticmethod
    def _fields(cfg: BlockConfig) -> dict[str, int | None]:
        # A switch that is off is None in the config but a distance of one from on.
        # A placement is a category: one step from unset (the row rule) to either side.
        # A Gluon config is its lowering and its gluon section: its Triton fields never run
        # where the Gluon kernel does.
        if cfg.gluon is not None:
            own = {**cfg.gluon.model_dump(exclude={"split"}, exclude_none=True),
                   **cfg.gluon.split.model_dump(exclude={"merge", "merge_pipelined"})}
            return {"lowering": _LOWERING_STEPS["gluon"], **{"gluon." + k: int(v) for k, v in own.items()}}
        return {"lowering": _LOWERING_STEPS["triton"], **cfg.model_dump(exclude={"split", "gluon"}),
                **cfg.split.model_dump(exclude={"merge", "merge_pipelined"}),
                "merge": _MERGE_STEPS[merge_choice(cfg.split)],
                **{n: int(bool(getattr(cfg, n))) for n in KERNEL_AXES},
                **{n: _PLACEMENT_STEPS[getattr(cfg, n)] for n in PLACEMENT_AXES}}

    def exact(self, config: BlockConfig) -> float:
        """The noiseless cost."""
        want = self._fields(self.optimum)
        got = self._fields(config)
        keys = [*want, *(k for k in got if k not in want)]  # a Gluon and a Triton config share only "lowering"
        bowl = sum(_log_distance(got.get(k), want.get(k)) ** 2 for k in keys)
        return self.base_us * (1.0 + 0.1 * bowl)

    def parity_error(self, config: BlockConfig) -> str | None:
        if self._wrong is not None and self._wrong(config):
            return "synthetic: this config is marked wrong"
        return None

    def measure(self, config: BlockConfig) -> float:
        self.calls += 1
        if self._broken is not None and self._broken(config):
            raise RuntimeError("synthetic: this config is marked broken (stands for a launch failure)")
        if self.delay_s:
            time.sleep(self.delay_s)
        jitter = 1.0 + self.jitter_pct / 100.0 * (2.0 * self._rng.random() - 1.0)
        return self.exact(config) * jitter


def synthetic_optimum(space: SearchSpace, seed: int = 0) -> BlockConfig:
    """A feasible config picked from the space by ``seed``: the known optimum of a
    synthetic run. The split policy takes its middle choices."""
    feasible = space.feasible_configs()
    if not feasible:
        from kgen.tuner.errors import TuneError

        raise TuneError(f"no config of the space fits:\n{space.describe()}")
    core = random.Random(seed).choice(feasible)
    if core.gluon is not None:
        split = {n: space.gluon_axes[GLUON_PARAM + n][len(space.gluon_axes[GLUON_PARAM + n]) // 2] for n in SPLIT_AXES}
        gluon = core.gluon.model_copy(update={"split": core.gluon.split.model_copy(update=split)})
        return core.model_copy(update={"gluon": gluon})
    split = {n: c[len(c) // 2] for n, c in space.axes.items() if n in SPLIT_AXES}
    return core.model_copy(update={"split": core.split.model_copy(update=split)})
