"""The objective with an injected cost: it finds a known optimum, prunes wrong and failing
configs without crashing the study, and replaces the default only beyond the noise."""

from __future__ import annotations

import time

import optuna
import pytest
from triton.runtime.errors import OutOfResources

from kgen.blockconfig import BlockConfig
from kgen.spec import load_layouts
from kgen.tuner.job import TuneJob
from kgen.tuner.objective import (
    FatalDeviceError,
    SyntheticBowl,
    make_objective,
    outcome_after_twins,
    synthetic_optimum,
)
from kgen.tuner.results import decide, finalize, spread_pct
from kgen.tuner.space import default_config, load_spaces
from kgen.tuner.study import build_space, run_inprocess
from kgen.tuner.workloads import Timing, load_workloads

optuna.logging.set_verbosity(optuna.logging.WARNING)
LAYOUTS = load_layouts()
SPACES = load_spaces()
# Not the Gluon stages' Triton release: these studies search the Triton axes alone, whichever
# Triton runs the tests (tests/test_tuner_gluon.py holds the Gluon branch).
TRITON_ONLY = "3.9.0"
WORKLOADS = load_workloads()


def job_for(arch: str, layout: str, group: int, kv: str = "bfloat16") -> TuneJob:
    bucket = WORKLOADS.bucket_named("b2-8")
    return TuneJob(arch, LAYOUTS[layout], kv, "bfloat16", group, bucket, tuple(WORKLOADS.workloads(bucket)))


def memory() -> optuna.storages.InMemoryStorage:
    return optuna.storages.InMemoryStorage()


@pytest.mark.parametrize(
    ("arch", "layout", "group", "kv", "budget"),
    [
        ("sm_90", "qwen3_5_gqa256", 8, "bfloat16", 200),
        ("gfx950", "mla_absorbed_512_64", 16, "bfloat16", 300),
        ("gfx942", "gqa128", 8, "float8_e4m3fnuz", 300),
    ],
)
def test_study_finds_the_known_optimum_within_budget(arch: str, layout: str, group: int, kv: str, budget: int) -> None:
    job = job_for(arch, layout, group, kv)
    space = build_space(job, SPACES, TRITON_ONLY)
    optimum = synthetic_optimum(space, seed=3)
    assert space.why_not(optimum) is None
    bowl = SyntheticBowl(optimum)
    default = default_config(job.layout, group)
    study = run_inprocess(job, space, bowl, memory(), budget, seed=0, enqueue=(default,), progress=False)
    assert study.best_value == pytest.approx(bowl.base_us)
    assert BlockConfig.model_validate(study.best_trial.user_attrs["config"]) == optimum
    # the default ran first, as the enqueued trial
    assert study.trials[0].params == space.params_of(default)[0]
    finished = [t for t in study.trials if t.state.is_finished()]
    assert len(finished) == budget


def test_wrong_broken_and_oversized_configs_are_pruned_never_best() -> None:
    job = job_for("sm_90", "gqa128", 8)
    space = build_space(job, SPACES, TRITON_ONLY)
    optimum = synthetic_optimum(space, seed=1)
    # The true optimum gives wrong output; anything with block_n 16 fails to launch.
    bowl = SyntheticBowl(optimum, wrong=lambda c: c == optimum, broken=lambda c: c.block_n == 16)
    study = run_inprocess(job, space, bowl, memory(), 150, seed=0, enqueue=(optimum,), progress=False)
    states = {t.state for t in study.trials}
    assert optuna.trial.TrialState.FAIL not in states
    reasons = [t.user_attrs.get("pruned_reason", "") for t in study.trials if t.state.name == "PRUNED"]
    assert any(r.startswith("wrong output") for r in reasons)
    assert any("RuntimeError" in r and "broken" in r for r in reasons)
    best = BlockConfig.model_validate(study.best_trial.user_attrs["config"])
    assert best != optimum and best.block_n != 16
    assert study.best_value > bowl.base_us


def test_triton_out_of_resources_prunes_and_fatal_device_error_stops() -> None:
    job = job_for("sm_90", "gqa64", 8)
    space = build_space(job, SPACES, TRITON_ONLY)

    class Backend:
        fatal = False

        def parity_error(self, config: BlockConfig) -> str | None:
            return None

        def measure(self, config: BlockConfig) -> float:
            if self.fatal:
                raise FatalDeviceError("illegal memory access")
            raise OutOfResources(300000, 232448, "shared memory")

    backend = Backend()
    study = optuna.create_study(storage=memory())
    study.optimize(make_objective(space, backend), n_trials=5)
    assert all(t.state.name == "PRUNED" for t in study.trials)
    assert any("OutOfResources" in t.user_attrs["pruned_reason"] for t in study.trials)
    backend.fatal = True
    with pytest.raises(FatalDeviceError):
        study.optimize(make_objective(space, backend), n_trials=50)
    assert study.trials[-1].state.name == "FAIL"


def test_repeated_configs_are_not_measured_again() -> None:
    job = job_for("sm_90", "gqa64", 8)
    space = build_space(job, SPACES, TRITON_ONLY)
    bowl = SyntheticBowl(synthetic_optimum(space))
    study = optuna.create_study(storage=memory())
    params = space.params_of(default_config(job.layout, 8))[0]
    for _ in range(3):
        study.enqueue_trial(params)
    study.optimize(make_objective(space, bowl), n_trials=3)
    assert bowl.calls == 1
    assert len({t.value for t in study.trials}) == 1
    assert study.trials[2].user_attrs["repeat_of_earlier_trial"] is True


class SlowBowl(SyntheticBowl):
    """The bowl, with a measurement long enough that two threads overlap in it."""

    def measure(self, config: BlockConfig) -> float:
        time.sleep(0.3)
        return super().measure(config)


def test_concurrent_trials_of_one_config_measure_it_once() -> None:
    """Two workers that draw the same config at once: the lower-numbered trial measures; one
    that starts while it measures is pruned naming it, one after it takes its value (the race a
    shared PostgreSQL study hit)."""
    job = job_for("sm_90", "gqa64", 8)
    space = build_space(job, SPACES, TRITON_ONLY)
    bowl = SlowBowl(synthetic_optimum(space))
    study = optuna.create_study(storage=memory())
    params = space.params_of(default_config(job.layout, 8))[0]
    for _ in range(4):
        study.enqueue_trial(params)
    study.optimize(make_objective(space, bowl), n_trials=4, n_jobs=2)
    assert bowl.calls == 1
    first, *others = study.trials
    assert first.state.name == "COMPLETE" and not first.user_attrs.get("repeat_of_earlier_trial")
    for t in others:
        assert (t.state.name == "PRUNED" and t.user_attrs["pruned_reason"].startswith("same config as trial 0")) or (
            t.state.name == "COMPLETE" and t.user_attrs["repeat_of_earlier_trial"]), t
    assert any(t.state.name == "PRUNED" for t in others), "no trial ran while the first measured"


def test_a_trial_that_never_publishes_its_config_is_waited_for_only_so_long(monkeypatch) -> None:
    """A lower-numbered trial left RUNNING without its config (its worker died while choosing):
    the next trial waits ``wait_s`` at most, then measures itself; once the dead one started
    longer ago than CHOOSING_S it is not waited for at all."""
    from kgen.tuner import objective

    study = optuna.create_study(storage=memory())
    dist = optuna.distributions.CategoricalDistribution([1, 2])
    study.ask({"a": dist})  # stays RUNNING with no config
    trial = study.ask({"a": dist})
    trial.set_user_attr("config", {"a": trial.params["a"]})
    t0 = time.monotonic()
    assert outcome_after_twins(trial, wait_s=0.3, poll_s=0.05) is None
    assert 0.3 <= time.monotonic() - t0 < 5
    monkeypatch.setattr(objective, "CHOOSING_S", 0.0)  # it started longer ago than that
    t0 = time.monotonic()
    assert outcome_after_twins(trial, wait_s=30, poll_s=0.05) is None
    assert time.monotonic() - t0 < 1


def test_nonpositive_times_are_pruned() -> None:
    job = job_for("sm_90", "gqa64", 8)
    space = build_space(job, SPACES, TRITON_ONLY)

    class Zero:
        def parity_error(self, config: BlockConfig) -> str | None:
            return None

        def measure(self, config: BlockConfig) -> float:
            return float("nan")

    study = optuna.create_study(storage=memory())
    study.optimize(make_objective(space, Zero()), n_trials=3)
    assert all(t.state.name == "PRUNED" for t in study.trials)


# ----------------------------------------------------------------- the final decision


def test_spread_is_the_noise() -> None:
    assert spread_pct([99.0, 100.0, 101.0]) == pytest.approx(2.0)


def test_tuned_config_replaces_default_only_beyond_noise() -> None:
    a, b = (
        BlockConfig(block_h=4, block_n=32, num_warps=4, num_stages=2),
        BlockConfig(block_h=8, block_n=64, num_warps=8, num_stages=2),
    )
    default = [100.0, 104.0, 96.0]  # 8 % spread
    assert decide(default, [(a, [95.0, 95.0, 95.0])], min_gain_pct=1.0) == (None, pytest.approx(8.0))
    winner, _ = decide(default, [(a, [95.0] * 3), (b, [90.0] * 3)], min_gain_pct=1.0)
    assert winner == 1
    quiet = [100.0, 100.0, 100.0]
    assert decide(quiet, [(a, [99.5] * 3)], min_gain_pct=1.0)[0] is None  # below the 1 % floor
    assert decide(quiet, [(a, [98.0] * 3)], min_gain_pct=1.0)[0] == 0
    assert decide([], [(a, [])], min_gain_pct=1.0)[0] is None
    assert decide([], [(a, [120.0])], min_gain_pct=1.0)[0] == 0  # a broken default loses to anything


def test_finalize_remeasures_top_configs_and_keeps_noisy_near_wins_out() -> None:
    job = job_for("sm_90", "gqa128", 8)
    space = build_space(job, SPACES, TRITON_ONLY)
    default = default_config(job.layout, 8)
    # The optimum is only 0.5 % better than the default, inside 3 % jitter: keep the default.
    near = SyntheticBowl(default, jitter_pct=3.0, seed=5)
    near.exact = lambda c: 99.5 if c != default else 100.0  # type: ignore[method-assign]
    study = run_inprocess(job, space, near, memory(), 30, enqueue=(default,), progress=False)
    timing = Timing(repeats=5, top_k=3, min_gain_pct=1.0)
    kept = finalize(job, study, default, near, timing)
    assert not kept.replaced and kept.chosen == default and kept.noise_pct > 0.5
    # A far better optimum wins.
    far = SyntheticBowl(synthetic_optimum(space, 2), jitter_pct=1.0)
    study2 = run_inprocess(job, space, far, memory(), 120, enqueue=(default,), progress=False)
    won = finalize(job, study2, default, far, timing)
    assert won.replaced and won.chosen != default
    assert won.chosen_us < won.default_us * (1 - won.noise_pct / 100)
    assert 1 <= len(won.candidates) <= 3


def test_finalize_with_a_failing_default_takes_the_best_working_config() -> None:
    job = job_for("sm_90", "gqa128", 8)
    space = build_space(job, SPACES, TRITON_ONLY)
    default = default_config(job.layout, 8)
    bowl = SyntheticBowl(synthetic_optimum(space, 4), broken=lambda c: c == default)
    study = run_inprocess(job, space, bowl, memory(), 40, enqueue=(default,), progress=False)
    result = finalize(job, study, default, bowl, Timing())
    assert result.default_error and "broken" in result.default_error
    assert result.replaced and result.default_us is None and result.chosen != default
