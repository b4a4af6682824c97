"""`kgen tune` and the Gluon prefix stage: the space has a lowering axis and the Gluon axes only
where the launcher can launch that stage (sm_90, Triton 3.6, a module that has it), prunes every
Gluon config the launcher would run as the Triton kernel, and a Gluon winner lands in the table
with the study's Triton choice as its fallback."""

from __future__ import annotations

import itertools
from pathlib import Path

import optuna
import pytest

import kgen
from kgen.blockconfig import BlockConfig, GluonConfig, SplitPolicy, read_table, table_to_json
from kgen.spec import load_layouts
from kgen.tuner import cli as tune_cli
from kgen.tuner.errors import TuneError
from kgen.tuner.gpu import PREFIX_KERNELS, GpuBackend
from kgen.tuner.job import TuneJob
from kgen.tuner.objective import SyntheticBowl, make_objective, synthetic_optimum
from kgen.tuner.results import decide_lowerings, entry_for, finalize, format_results, write_results
from kgen.tuner.space import (
    GLUON_PARAM,
    LOWERING_AXIS,
    SPLIT_AXES,
    ProblemShape,
    SearchSpace,
    arch_profile,
    default_config,
    load_spaces,
)
from kgen.tuner.study import run_inprocess
from kgen.tuner.workloads import Check, Timing, Workload, load_workloads

optuna.logging.set_verbosity(optuna.logging.WARNING)
LAYOUTS = load_layouts()
SPACES = load_spaces()
WORKLOADS = load_workloads()
MLA = "mla_absorbed_512_64"
TRITON_36 = "3.6.0"  # the Gluon prefix stage's Triton (kgen/templates/gluon/lowering.json)
GLUON_AXES = {GLUON_PARAM + n for n in ("block_n", "num_stages", "lazy_rescale", *SPLIT_AXES)}


def space_for(arch: str, layout: str = MLA, group: int = 16, kv: str = "bfloat16", drafts: tuple[int, ...] = (4,),
              triton: str = TRITON_36, spaces=SPACES) -> SearchSpace:
    shape = ProblemShape.of(LAYOUTS[layout], kv, "bfloat16", group, drafts)
    return SearchSpace.build(arch_profile(arch, spaces), shape, triton)


def without_gluon_table(tmp_path: Path):
    """The shipped spaces file with its [gluon_prefix] tables removed."""
    text = (Path(__file__).parents[1] / "kgen" / "tuner" / "spaces.toml").read_text()
    path = tmp_path / "spaces.toml"
    path.write_text(text[: text.index("[gluon_prefix]")])
    return load_spaces(path)


def gluon_cfg(block_n: int = 64, stages: int = 2, lazy: bool = False, **split: int) -> BlockConfig:
    space = space_for("sm_90")
    gluon = GluonConfig(block_n=block_n, num_stages=stages, lazy_rescale=lazy,
                        split=SplitPolicy(**{"programs_per_sm": 1, **split}))
    return space.shape.default.model_copy(update={"gluon": gluon})


# ----------------------------------------------------------------- where the axes are


@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_sm90_mla_searches_a_lowering_axis_and_the_gluon_axes(kv: str) -> None:
    """bf16, e4m3fn and e5m2 KV: each module has the Gluon prefix stage (FP8's converting producer); the
    studies run bf16 queries, so fp16 KV's studies search the Triton kernel alone."""
    space = space_for("sm_90", kv=kv)
    assert set(space.gluon_axes) == GLUON_AXES and space.conditional
    assert space.gluon_note.startswith("searched")
    text = space.describe()
    assert "lowering" in text and "gluon.num_stages" in text and "gluon_shared_bytes" in text


@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["qwen3_5_gqa256", "gqa128", "gqa64"])
def test_sm90_gqa_searches_its_gluon_stage(layout: str, kv: str) -> None:
    """GQA with 16-bit or FP8 KV has its own Gluon prefix stage (kgen/templates/gluon_gqa/): its
    studies search the lowering axis too, pruned by its rules (128-row programs)."""
    space = space_for("sm_90", layout, LAYOUTS[layout].attention.group_sizes[0], kv)
    landing = {"gluon.landing_stages"} if kv == "float8_e4m3fn" else set()  # FP8 GQA's landing ring
    assert set(space.gluon_axes) == GLUON_AXES | landing and space.conditional
    assert "gluon_gqa/ws_prefix_stage.py.j2" in space.gluon_note


@pytest.mark.parametrize(("arch", "layout", "kv", "triton", "note"), [
    ("sm_100", MLA, "bfloat16", TRITON_36, "runs on sm_90 only, this study is sm_100"),
    ("gfx950", MLA, "bfloat16", TRITON_36, "runs on sm_90 only"),
    ("sm_90", MLA, "bfloat16", "3.9.0", "this is Triton 3.9.0"),
    ("sm_90", MLA, "float8_e4m3fnuz", TRITON_36, ""),  # the module has no Gluon prefix stage: nothing to say
    ("sm_90", "qwen3_5_gqa256", "float8_e4m3fnuz", TRITON_36, ""),  # no 16-bit stage dtype: no GQA stage
])
def test_no_gluon_axes_elsewhere_and_those_studies_keep_their_names(tmp_path: Path, arch: str, layout: str, kv: str,
                                                                    triton: str, note: str) -> None:
    group = LAYOUTS[layout].attention.group_sizes[0]
    space = space_for(arch, layout, group, kv, triton=triton)
    assert not space.gluon_axes and not space.conditional
    assert note in space.gluon_note and bool(note) == bool(space.gluon_note)
    assert "gluon.block_n" not in space.describe()
    # The [gluon_prefix] table enters no other study's hash: their names (and stored trials) stay.
    plain = space_for(arch, layout, group, kv, triton=triton, spaces=without_gluon_table(tmp_path))
    assert plain.axes == space.axes and plain.digest() == space.digest()
    # The built-in default's gluon section (MLA 16-bit) is not the study's: the launcher ignores it there.
    assert space.default.gluon is None
    gluon_cfg_there = space.shape.default.model_copy(update={"gluon": GluonConfig(block_n=64, num_stages=2)})
    assert "not searched here" in space.why_not(gluon_cfg_there)
    params, notes = space.params_of(gluon_cfg_there)
    assert LOWERING_AXIS not in params and any("gluon section left out" in n for n in notes)


def test_the_gluon_branch_changes_the_study_name() -> None:
    assert space_for("sm_90").digest() != space_for("sm_90", triton="3.9.0").digest()


def test_gluon_choices_must_be_gluon_configs(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "kgen" / "tuner" / "spaces.toml").read_text()
    path = tmp_path / "spaces.toml"
    path.write_text(text.replace("num_stages = [2, 3, 4]\nlazy_rescale", "num_stages = [1, 2]\nlazy_rescale"))
    with pytest.raises(TuneError, match="gluon_prefix.*num_stages"):
        load_spaces(path)


# ----------------------------------------------------------------- pruning is the launcher's choice


@pytest.fixture()
def mla_module(monkeypatch: pytest.MonkeyPatch):
    module = kgen.load(MLA, "bfloat16")
    monkeypatch.setattr(module.LAUNCHER, "gluon_enabled", True)  # as under Triton 3.6, on any Triton
    return module


@pytest.mark.parametrize("drafts", [(4,), (1, 16), (4, 40)])
def test_a_gluon_config_is_pruned_exactly_where_the_launcher_runs_the_triton_kernel(mla_module, drafts) -> None:
    space = space_for("sm_90", drafts=drafts)
    kept = 0
    for block_n, stages in itertools.product((32, 64), (2, 3, 4)):
        cfg = gluon_cfg(block_n, stages)
        launched = {mla_module.launch_params("sm_90", 132, 16, 64, d, None, cfg.model_dump(exclude_none=True))[0][0]
                    for d in drafts}
        reason = space.why_not(cfg)
        assert (reason is None) == (launched == {PREFIX_KERNELS["gluon"]}), (block_n, stages, reason, launched)
        kept += reason is None
    # 64-token tiles fit 2 stages of sm_90's shared memory, 32-token tiles 2 to 4; a 40-token
    # draft does not fit a 32-token tile.
    assert kept == (1 if 40 in drafts else 4)
    assert "shared memory" in space.why_not(gluon_cfg(64, 3))


def test_trials_pick_a_lowering_then_only_that_branchs_axes() -> None:
    space = space_for("sm_90")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(make_objective(space, SyntheticBowl(synthetic_optimum(space, seed=1))), n_trials=60)
    lowerings = set()
    for trial in study.trials:
        lowering = trial.params[LOWERING_AXIS]
        lowerings.add(lowering)
        gluon_params = {n for n in trial.params if n.startswith(GLUON_PARAM)}
        assert gluon_params == (GLUON_AXES if lowering == "gluon" else set())
        assert ("block_h" in trial.params) == (lowering == "triton")
        if trial.state.name != "COMPLETE":
            continue
        cfg = BlockConfig.model_validate(trial.user_attrs["config"])
        assert (cfg.gluon is not None) == (lowering == "gluon")
        if cfg.gluon is not None:  # a Gluon trial keeps the default's Triton fields
            assert cfg.model_copy(update={"gluon": None}) == space.default.model_copy(update={"gluon": None})
        assert space.params_of(cfg) == (trial.params, [])
    assert lowerings == {"triton", "gluon"}


def test_the_default_of_a_gluon_study_is_the_built_in_one_with_its_gluon_section() -> None:
    space = space_for("sm_90")
    built_in = default_config(LAYOUTS[MLA], 16, "bfloat16")
    assert built_in.gluon is not None and space.default == built_in
    assert space.why_not(space.default) is None and space.params_of(space.default)[0][LOWERING_AXIS] == "gluon"


def test_a_synthetic_study_finds_a_gluon_optimum() -> None:
    bucket = WORKLOADS.bucket_named("b2-8")
    job = TuneJob("sm_90", LAYOUTS[MLA], "bfloat16", "bfloat16", 16, bucket, tuple(WORKLOADS.workloads(bucket)))
    space = space_for("sm_90")
    optimum = next(c for seed in range(50) if (c := synthetic_optimum(space, seed)).gluon is not None)
    bowl = SyntheticBowl(optimum)
    default = space.default
    study = run_inprocess(job, space, bowl, optuna.storages.InMemoryStorage(), 120, seed=0,
                          enqueue=(default, default.model_copy(update={"gluon": None})), progress=False)
    assert [t.params[LOWERING_AXIS] for t in study.trials[:2]] == ["gluon", "triton"]
    assert BlockConfig.model_validate(study.best_trial.user_attrs["config"]) == optimum
    assert study.best_value == pytest.approx(bowl.base_us)


def test_the_dry_run_and_the_enqueued_trials_show_the_gluon_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    import kgen.tuner.space as space_module

    monkeypatch.setattr(space_module, "installed_triton_version", lambda: TRITON_36)
    bucket = WORKLOADS.bucket_named("b33-96")
    job = TuneJob("sm_90", LAYOUTS[MLA], "bfloat16", "bfloat16", 16, bucket, tuple(WORKLOADS.workloads(bucket)))
    text = tune_cli.dry_run([job], SPACES, "sqlite:///:memory:", None)
    assert "gluon.block_n" in text and "  default: BLOCK_H=16 BLOCK_N=32 warps=8 stages=3" in text
    assert "gluon(BLOCK_N=64 stages=2" in text
    space = tune_cli.build_space(job, SPACES)
    current = gluon_cfg(32, 3).model_copy(update={"block_n": 64, "num_stages": 2})
    monkeypatch.setattr(tune_cli, "current_config", lambda job: current)
    # the default, its Triton fields alone, the table's Gluon row, its Triton fields alone
    assert tune_cli._enqueue(job, space) == (space.default, space.default.model_copy(update={"gluon": None}),
                                             current, current.model_copy(update={"gluon": None}))
    # Where the study does not search the Gluon stage, the default and a Gluon row enqueue as Triton configs.
    monkeypatch.setattr(space_module, "installed_triton_version", lambda: "3.9.0")
    plain = tune_cli.build_space(job, SPACES)
    assert [plain.params_of(c)[0].get(LOWERING_AXIS) for c in tune_cli._enqueue(job, plain)] == [None] * 3


# ----------------------------------------------------------------- the decision and the table


class FixedTimes:
    """A backend whose times are set per config (no noise): the final decision alone is tested."""

    def __init__(self, times: dict[BlockConfig, float]) -> None:
        self.times = times

    def parity_error(self, config: BlockConfig) -> str | None:
        return None

    def measure(self, config: BlockConfig) -> float:
        return self.times[config]


TRITON_BETTER = {"block_n": 64, "num_stages": 2}  # Triton fields that beat the default's in these tests


def _finalized(times: dict[str, float], top_k: int = 3):
    """finalize over four configs with these medians: the default D (its Triton fields T0 and
    its Gluon stage), T0 alone, a better Triton config T1 and another Gluon config G1."""
    space = space_for("sm_90")
    bucket = WORKLOADS.bucket_named("b33-96")
    job = TuneJob("sm_90", LAYOUTS[MLA], "bfloat16", "bfloat16", 16, bucket, tuple(WORKLOADS.workloads(bucket)))
    configs = {"D": space.default, "T0": space.default.model_copy(update={"gluon": None}),
               "T1": space.default.model_copy(update={"gluon": None, **TRITON_BETTER}), "G1": gluon_cfg(32, 3)}
    backend = FixedTimes({configs[k]: us for k, us in times.items()})
    study = run_inprocess(job, space, backend, optuna.storages.InMemoryStorage(), 4,
                          enqueue=tuple(configs[k] for k in times), progress=False)
    return finalize(job, study, space.default, backend, Timing(repeats=3, top_k=top_k, min_gain_pct=1.0)), configs


@pytest.mark.parametrize("top_k", [1, 3])
def test_a_gluon_winner_carries_the_studys_triton_choice_as_its_fallback(tmp_path: Path, top_k: int) -> None:
    result, configs = _finalized({"D": 60.0, "T0": 100.0, "T1": 90.0, "G1": 50.0}, top_k=top_k)
    # With top_k 1 the Gluon config G1 is the only top one: the fastest Triton config joins the finalists.
    assert result.chosen == configs["T1"].model_copy(update={"gluon": configs["G1"].gluon})
    assert (result.chosen_us, result.triton_us, result.default_us) == (50.0, 90.0, 60.0)
    assert result.replaced and "Gluon prefix stage, its Triton fields 90.00 us" in format_results([result])
    entry = entry_for(result, "NVIDIA H200")
    assert entry.measured.triton_us == 90.0 and entry.config.gluon == configs["G1"].gluon
    # The table writer writes the gluon section; the file reads back the same row.
    path = tmp_path / "sm_90.json"
    table, _ = write_results(path, "sm_90", "NVIDIA H200", [result])
    assert '"gluon": {' in table_to_json(table) and '"triton_us": 90.0' in path.read_text()
    assert read_table(path).entries == [entry]


def test_a_gluon_config_must_beat_the_defaults_gluon_stage_and_the_triton_part() -> None:
    # G1 within 1 % of the default's Gluon stage: the default's stays, with the better Triton fields.
    result, configs = _finalized({"D": 60.0, "T0": 100.0, "T1": 90.0, "G1": 59.8})
    assert result.chosen == configs["T1"].model_copy(update={"gluon": configs["D"].gluon})
    assert (result.chosen_us, result.triton_us) == (60.0, 90.0)
    # No Gluon stage beats the Triton part: the row is Triton alone.
    result, configs = _finalized({"D": 95.0, "T0": 100.0, "T1": 90.0, "G1": 99.0})
    assert result.chosen == configs["T1"] and result.triton_us is None
    assert entry_for(result).measured.triton_us is None and result.replaced
    # Nothing beats the default beyond noise: it stays, gluon section and all.
    result, configs = _finalized({"D": 60.0, "T0": 100.0, "T1": 99.5, "G1": 59.9})
    assert result.chosen == configs["D"] and not result.replaced
    assert "kept default" in format_results([result])


def test_without_a_gluon_default_the_fastest_gluon_config_must_beat_the_triton_part() -> None:
    t0, t1, g1 = (gluon_cfg().model_copy(update={"gluon": None}), gluon_cfg().model_copy(
        update={"gluon": None, **TRITON_BETTER}), gluon_cfg(32, 3))
    default = (t0, [100.0] * 3)
    assert decide_lowerings(default, default, [(t1, [90.0] * 3), (g1, [60.0] * 3)], 1.0)[:2] == (
        (t1, [90.0] * 3), (g1, [60.0] * 3))
    assert decide_lowerings(default, default, [(t1, [90.0] * 3), (g1, [89.5] * 3)], 1.0)[:2] == (
        (t1, [90.0] * 3), None)


# ----------------------------------------------------------------- the GPU backend times what it names


def _backend(module) -> GpuBackend:
    return GpuBackend(module, "sm_90", LAYOUTS[MLA], "bfloat16", "bfloat16", 16, 1,
                      [Workload(batch=64, prefix=16384, draft=4), Workload(batch=96, prefix=4096, draft=4)],
                      Check(prefixes=(1, 77), atol=0.02, rtol=0.02), Timing(), device="cpu")


def test_the_backend_refuses_a_gluon_config_the_module_would_run_as_triton(mla_module, monkeypatch) -> None:
    monkeypatch.setattr(mla_module.LAUNCHER, "device_info", lambda device_type, index: ("sm_90", 132, False))
    backend = _backend(mla_module)
    assert set(backend.prefix_kernels(gluon_cfg()).values()) == {PREFIX_KERNELS["gluon"]}
    assert set(backend.prefix_kernels(gluon_cfg().model_copy(update={"gluon": None})).values()) == {
        PREFIX_KERNELS["triton"]}
    backend._require_lowering(gluon_cfg())  # launches the Gluon stage: nothing to refuse
    monkeypatch.setattr(mla_module.LAUNCHER, "gluon_enabled", False)  # as under another Triton
    with pytest.raises(TuneError, match="_verify_prefix_stage.*bs64/P16384/L4"):
        backend.parity_error(gluon_cfg())
    # In a study the trial is pruned with that reason, before anything runs.
    space = space_for("sm_90")
    study = optuna.create_study()
    study.enqueue_trial(space.params_of(gluon_cfg())[0])
    study.optimize(make_objective(space, backend), n_trials=1)
    assert "parity failed: TuneError" in study.trials[0].user_attrs["pruned_reason"]


def test_the_interpreter_never_times_a_gluon_config(mla_module) -> None:
    backend = _backend(mla_module)  # a CPU device: the module sees the interpreter
    assert set(backend.prefix_kernels(gluon_cfg()).values()) == {PREFIX_KERNELS["triton"]}
    with pytest.raises(TuneError, match="not _gluon_prefix_stage"):
        backend.parity_error(gluon_cfg())



@pytest.mark.gpu
def test_on_the_h200_a_gluon_trial_checks_and_times_the_gluon_kernel() -> None:
    """The real backend on sm_90: the default's Gluon stage is what launch_params names, passes
    the reference check and is timed apart from its Triton fields (faster, as measured)."""
    from kgen.tuner.gpu import detect_device

    device = detect_device()
    if device.arch != "sm_90":
        pytest.skip(f"the Gluon prefix stage runs on sm_90, this GPU is {device.arch}")
    module = kgen.load(MLA, "bfloat16")
    backend = GpuBackend(module, "sm_90", LAYOUTS[MLA], "bfloat16", "bfloat16", 16, 1,
                         [Workload(batch=16, prefix=4096, draft=4)], WORKLOADS.check,
                         Timing(replays=5, min_input_sets=2, max_input_sets=4), l2_bytes=device.l2_bytes)
    gluon = space_for("sm_90").default
    triton_fields = gluon.model_copy(update={"gluon": None})
    assert gluon.gluon is not None
    assert set(backend.prefix_kernels(gluon).values()) == {PREFIX_KERNELS["gluon"]}
    assert set(backend.prefix_kernels(triton_fields).values()) == {PREFIX_KERNELS["triton"]}
    assert backend.parity_error(gluon) is None and backend.parity_error(triton_fields) is None
    gluon_us, triton_us = backend.measure(gluon), backend.measure(triton_fields)
    # docs/perf-notes.md, "Gluon prefix stage (MLA, sm_90)": faster than the Triton config wherever measured.
    assert 0 < gluon_us < triton_us, (gluon_us, triton_us)


def test_a_gluon_section_below_its_from_rows_is_not_timed_as_gluon() -> None:
    """A candidate row's from_rows (set by hand) above the study's rows: its trial would time the
    Triton kernel under a Gluon name, so the space says why it is not a Gluon trial."""
    space = space_for("sm_90", "gqa128", 8, "bfloat16", drafts=(4,))
    gluon = GluonConfig(block_n=64, num_stages=4, from_rows=64)
    config = space.shape.default.model_copy(update={"gluon": gluon})
    assert "32 rows a KV head, under the section's from_rows 64" in space.why_not(config)
    assert space.why_not(config.model_copy(update={"gluon": gluon.model_copy(update={"from_rows": 32})})) is None


def test_a_landing_trial_carries_its_ring_and_one_that_fits_no_program_is_pruned() -> None:
    """FP8 GQA 256: a trial's landing_stages reaches its gluon section (0: none); at group 16
    and L 16 (two consumers, head dim 256) a ring fits no program, so such a trial is pruned,
    while at L 4 (one consumer) it runs."""
    params = {"lowering": "gluon", "gluon.block_n": 64, "gluon.num_stages": 2, "gluon.lazy_rescale": 0,
              "gluon.programs_per_sm": 1, "gluon.max_splits": 64, "gluon.min_tokens_per_split": 128}
    for draft, pruned in ((4, False), (16, True)):
        space = space_for("sm_90", "qwen3_5_gqa256", 16, "float8_e4m3fn", drafts=(draft,))
        ring = space.config({**params, "gluon.landing_stages": 2})
        assert ring.gluon.landing_stages == 2
        assert space.config({**params, "gluon.landing_stages": 0}).gluon.landing_stages is None
        why = space.why_not(ring)
        assert (why is not None and "landing ring fits no program" in why) is pruned, why
        assert space.params_of(ring)[0]["gluon.landing_stages"] == 2
