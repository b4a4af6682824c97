"""The search space of `kgen tune`: per-arch data, mocked devices, pruning before compiling."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

from kgen.blockconfig import BlockConfig, GluonConfig, SplitPolicy
from kgen.launcher import rules
from kgen.loader import load
from kgen.spec import load_layouts
from kgen.tuner.errors import TuneError
from kgen.tuner.gpu import device_info_from_props, select_gpu
from kgen.tuner.space import (
    ProblemShape,
    SearchSpace,
    arch_family,
    arch_profile,
    default_config,
    launch_rows,
    load_spaces,
)

LAYOUTS = load_layouts()
SPACES = load_spaces()


# Not the Gluon stages' Triton release: these studies search the Triton axes alone, whichever
# Triton runs the tests (tests/test_tuner_gluon.py holds the lowering axis and the Gluon branch).
TRITON_ONLY = "3.9.0"


def space_for(arch: str, layout: str, group: int, kv: str = "bfloat16", drafts: tuple[int, ...] = (4,)) -> SearchSpace:
    shape = ProblemShape.of(LAYOUTS[layout], kv, "bfloat16", group, drafts)
    return SearchSpace.build(arch_profile(arch, SPACES), shape, TRITON_ONLY)


def targets_file(tmp_path: Path, **rows: dict) -> Path:
    """kgen/tables/targets.json with rows replaced (a row given as None is left out)."""
    shipped = json.loads((Path(__file__).parents[1] / "kgen" / "tables" / "targets.json").read_text())
    for name, row in rows.items():
        if row is None:
            del shipped["targets"][name]
        else:
            shipped["targets"][name] = {**shipped["targets"][name], **row}
    path = tmp_path / "targets.json"
    path.write_text(json.dumps(shipped))
    return path


def cfg(**kw: object) -> BlockConfig:
    base = {"block_h": 4, "block_n": 64, "num_warps": 4, "num_stages": 2}
    return BlockConfig(**{**base, **kw})


# ----------------------------------------------------------------- mocked devices


@pytest.mark.parametrize(
    ("props", "hip", "arch"),
    [
        (
            SimpleNamespace(
                name="NVIDIA H200",
                major=9,
                minor=0,
                multi_processor_count=132,
                L2_cache_size=60 << 20,
                total_memory=141 << 30,
            ),
            False,
            "sm_90",
        ),
        (
            SimpleNamespace(
                name="NVIDIA B200",
                major=10,
                minor=0,
                multi_processor_count=148,
                L2_cache_size=126 << 20,
                total_memory=180 << 30,
            ),
            False,
            "sm_100",
        ),
        (
            SimpleNamespace(
                name="AMD Instinct MI300X",
                gcnArchName="gfx942:sramecc+:xnack-",
                multi_processor_count=304,
                L2_cache_size=4 << 20,
                total_memory=192 << 30,
            ),
            True,
            "gfx942",
        ),
        (
            SimpleNamespace(
                name="AMD Instinct MI355X",
                gcnArchName="gfx950:sramecc+:xnack-",
                multi_processor_count=256,
                L2_cache_size=4 << 20,
                total_memory=288 << 30,
            ),
            True,
            "gfx950",
        ),
    ],
)
def test_mocked_device_properties_map_to_arch_and_family(props: SimpleNamespace, hip: bool, arch: str) -> None:
    info = device_info_from_props(props, hip=hip)
    assert info.arch == arch
    assert info.num_sms == props.multi_processor_count
    assert arch_family(info.arch, SPACES) == ("rocm" if hip else "cuda")


def test_rocm_device_without_gfx_name_is_a_clear_error() -> None:
    props = SimpleNamespace(name="odd", gcnArchName="", multi_processor_count=1, total_memory=1)
    with pytest.raises(TuneError, match="--arch"):
        device_info_from_props(props, hip=True)


def test_workers_index_into_the_visible_devices() -> None:
    assert select_gpu(1, {"CUDA_VISIBLE_DEVICES": "4,5"}) == "5"
    assert select_gpu(2, {}) == "2"
    with pytest.raises(TuneError, match="lists only"):
        select_gpu(2, {"CUDA_VISIBLE_DEVICES": "4,5"})


# ----------------------------------------------------------------- spaces per arch


def test_sm_90_space_is_cuda_without_amd_knobs() -> None:
    space = space_for("sm_90", "qwen3_5_gqa256", 8)
    prof = space.profile
    assert prof.family == "cuda" and prof.warp_size == 32
    assert prof.target["shared_bytes"] == 232448 and prof.target["mma"] == "wgmma"
    assert set(space.axes) == {
        "block_h",
        "block_n",
        "num_warps",
        "num_stages",
        "programs_per_sm",
        "max_splits",
        "min_tokens_per_split",
        "merge",
        "lazy_rescale",
        "draft_tile",
    }
    assert space.axes["lazy_rescale"] == (0, 1)
    assert space.axes["draft_tile"] == ("after", "first")
    assert space.axes["merge"] == ("cluster", "cluster_pipelined", "launch")
    assert space.axes["block_h"] == (1, 2, 4, 8)  # <= next_pow2(group 8)
    assert prof.kv_dtypes == ("bfloat16", "float8_e4m3fn")


def test_draft_tile_is_searched_only_where_the_module_has_both_placements() -> None:
    """MLA's module always drafts first: no draft_tile axis. For GQA a choice the row rule
    would make anyway stays unset (None), so one kernel never gets two names."""
    assert "draft_tile" not in space_for("sm_90", "mla_absorbed_512_64", 16).axes
    assert "draft_tile" not in space_for("gfx950", "qwen3_5_gqa256", 8).axes  # not measured on ROCm
    g8, g4 = space_for("sm_90", "qwen3_5_gqa256", 8), space_for("sm_90", "qwen3_5_gqa256", 4)
    base = {"block_n": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 1, "max_splits": 64,
            "min_tokens_per_split": 128, "lazy_rescale": 0}
    # Group 8 at L4 is 32 rows: the rule drafts first there, after the loop at group 4's 16.
    assert g8.config({**base, "block_h": 8, "draft_tile": "first"}).draft_tile is None
    assert g8.config({**base, "block_h": 8, "draft_tile": "after"}).draft_tile == "after"
    assert g4.config({**base, "block_h": 4, "draft_tile": "after"}).draft_tile is None
    assert g4.config({**base, "block_h": 4, "draft_tile": "first"}).draft_tile == "first"
    # Enqueueing a table row: unset means the rule's placement; a set one is kept.
    assert g8.params_of(cfg(block_h=8, num_stages=3))[0]["draft_tile"] == "first"
    assert g4.params_of(cfg(block_h=4, num_stages=3))[0]["draft_tile"] == "after"
    assert g4.params_of(cfg(block_h=4, draft_tile="first"))[0]["draft_tile"] == "first"
    # Both placements of one tile config are separate points of the space, none a duplicate.
    feasible = g8.feasible_configs()
    assert len(feasible) == len(set(feasible))
    assert {c.draft_tile for c in feasible if c.block_h == 8} == {None, "after"}


def test_gfx950_space_has_amd_knobs_and_160k_lds() -> None:
    space = space_for("gfx950", "mla_absorbed_512_64", 16)
    prof = space.profile
    assert prof.family == "rocm" and prof.warp_size == 64
    assert prof.target["shared_bytes"] == 160 * 1024
    assert space.axes["matrix_instr_nonkdim"] == (16, 32)
    assert space.axes["kpack"] == (1,)  # Triton forces kpack 1 on gfx950: not a real choice
    assert 0 in space.axes["waves_per_eu"]
    assert space.axes["block_h"] == (1, 2, 4, 8, 16)
    assert "lazy_rescale" not in space.axes  # measured on CUDA only: not searched on ROCm yet


def test_gfx942_space_has_kpack_and_64k_lds_and_fnuz() -> None:
    space = space_for("gfx942", "gqa128", 8, kv="float8_e4m3fnuz")
    prof = space.profile
    assert prof.target["shared_bytes"] == 64 * 1024
    assert space.axes["kpack"] == (1, 2)
    assert prof.kv_dtypes == ("bfloat16", "float8_e4m3fnuz")


def test_block_h_never_exceeds_next_pow2_of_the_group() -> None:
    assert space_for("sm_90", "qwen3_5_gqa256", 4).axes["block_h"] == (1, 2, 4)
    assert max(space_for("sm_90", "mla_absorbed_512_64", 128).axes["block_h"]) == 64
    assert max(space_for("gfx950", "gqa128", 8).axes["block_h"]) == 8


def test_targets_come_from_targets_json_and_suffix_is_stripped() -> None:
    sm90a = arch_profile("sm_90a", SPACES)
    assert (sm90a.target_name, sm90a.target["shared_bytes"]) == ("sm_90", 232448)
    assert arch_profile("sm_89", SPACES).target["shared_bytes"] == 101376
    # sm_80 has no FP8 tensor-core format: its module refuses FP8 KV, so it is not tuned.
    assert arch_profile("sm_80", SPACES).kv_dtypes == ("bfloat16",)


def test_an_arch_without_a_target_row_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TuneError, match=r"sm_75 has no row in .*targets\.json.*add a row"):
        arch_profile("sm_75", SPACES)
    without_gfx950 = targets_file(tmp_path, gfx950=None)
    with pytest.raises(TuneError, match="gfx950 has no row"):
        arch_profile("gfx950", SPACES, without_gfx950)


def test_unknown_arch_names_the_known_prefixes() -> None:
    with pytest.raises(TuneError, match=r"unknown arch 'tpu_v5'.*sm_"):
        arch_family("tpu_v5", SPACES)


# ----------------------------------------------------------------- estimates and pruning


def test_launch_rows_are_the_generated_launchers() -> None:
    shape = space_for("sm_90", "gqa128", 16).shape
    assert launch_rows(1, shape, 4) == (1, 16)  # rows padded to 16 for tl.dot
    assert launch_rows(4, shape, 4) == (4, 4)
    assert launch_rows(16, shape, 16) == (8, 16)  # halved to <= 128 rows
    for block_h, draft in ((1, 4), (4, 4), (16, 16), (8, 4), (4, 2), (16, 1)):
        assert rules.row_blocking(block_h, 16, draft) == launch_rows(block_h, shape, draft)


@pytest.mark.parametrize(("arch", "layout", "kv", "group"), [
    ("sm_90", "qwen3_5_gqa256", "bfloat16", 16),
    ("sm_89", "mla_absorbed_512_64", "float8_e4m3fn", 16),
    ("gfx942", "qwen3_5_gqa256", "bfloat16", 8),
])
def test_the_space_turns_away_exactly_what_the_modules_fit_changes(arch: str, layout: str, kv: str,
                                                                  group: int) -> None:
    """The generated module's own fit (what its launch runs) is the judge: a config passes
    exactly when the module runs it as written at every draft length of the study."""
    space = space_for(arch, layout, group, kv=kv, drafts=(1, 4))
    module = load(layout, kv)
    target = module.LAUNCHER.identity.targets[arch]
    assert space.shape.kernel == module.LAUNCHER.identity.kernel_shape
    for block_h, block_n, warps, stages in itertools.product((1, 4, 16), (16, 64, 128), (2, 4, 8), (1, 2, 4)):
        c = cfg(block_h=min(block_h, group), block_n=block_n, num_warps=warps, num_stages=stages)
        launch = c.model_dump(exclude_none=True)
        fitted = [rules.fit_program(target, module.LAUNCHER.identity.kernel_shape, launch, group, d) for d in (1, 4)]
        changed = any(f is None or f.reasons for f in fitted)
        reason = space.why_not(c) or ""
        assert changed == reason.startswith(("duplicate: at L=", "no program fits")), (c.short(), reason)


def test_configs_the_launcher_changes_are_pruned_with_a_reason() -> None:
    sm90 = space_for("sm_90", "qwen3_5_gqa256", 8)
    stages = sm90.why_not(cfg(block_n=128, num_stages=4))
    assert stages.startswith("duplicate: at L=4") and "shared memory" in stages and "num_stages 4 -> 3" in stages
    g16 = space_for("sm_90", "qwen3_5_gqa256", 16)
    # 64 rows x 256 at 2 warps exceed the registers; sm_90 runs them at 4 warps (one program).
    regs = g16.why_not(cfg(block_h=16, block_n=32, num_warps=2, num_stages=1))
    assert "num_warps 2 -> 4" in regs and "registers" in regs
    assert "next_pow2" in sm90.why_not(cfg(block_h=16))
    assert sm90.why_not(cfg()) is None
    gfx942 = space_for("gfx942", "qwen3_5_gqa256", 8)
    fits_h100 = cfg(block_n=64, num_stages=3)
    assert sm90.why_not(fits_h100) is None and "65536 B of shared memory" in gfx942.why_not(fits_h100)
    gfx950 = space_for("gfx950", "qwen3_5_gqa256", 8)
    assert "matrix_instr_nonkdim" in gfx950.why_not(cfg(block_n=16, num_stages=1, matrix_instr_nonkdim=32))
    assert gfx950.why_not(cfg(block_n=64, num_stages=1, matrix_instr_nonkdim=32, block_h=8)) is None


def test_a_config_with_no_program_that_fits_is_refused(tmp_path: Path) -> None:
    tiny = arch_profile("sm_90", SPACES, targets_file(tmp_path, sm_90={"shared_bytes": 4096}))
    space = SearchSpace.build(tiny, ProblemShape.of(LAYOUTS["gqa128"], "bfloat16", "bfloat16", 8, (4,)))
    assert space.why_not(cfg()).startswith("no program fits sm_90 at L=4")
    assert space.feasible_configs() == []


def test_duplicates_the_launcher_would_halve_are_pruned() -> None:
    space = space_for("sm_90", "mla_absorbed_512_64", 128, drafts=(16,))
    assert "duplicate" in space.why_not(cfg(block_h=16, block_n=16, num_warps=8, num_stages=1))
    # 64 heads x 4 rows: the row rule halves BLOCK_H to 32 at every draft (<= 128 rows).
    l4 = space_for("sm_90", "gqa128", 64, drafts=(4,))
    halved = l4.why_not(cfg(block_h=64, block_n=16, num_warps=8, num_stages=1))
    assert halved.startswith("duplicate: the launcher halves")


def test_suggest_prunes_before_anything_runs() -> None:
    space = space_for("sm_90", "qwen3_5_gqa256", 8)
    too_big = {
        "block_h": 8,
        "block_n": 128,
        "num_warps": 4,
        "num_stages": 4,
        "programs_per_sm": 2,
        "max_splits": 64,
        "min_tokens_per_split": 256,
        "merge": "launch",
        "lazy_rescale": 0,
        "draft_tile": "first",
    }
    with pytest.raises(optuna.TrialPruned, match="does not fit"):
        space.suggest(optuna.trial.FixedTrial(too_big))
    ok = space.suggest(optuna.trial.FixedTrial({**too_big, "num_stages": 1, "block_n": 64}))
    assert ok.split == SplitPolicy(programs_per_sm=2, max_splits=64, min_tokens_per_split=256)
    assert ok.lazy_rescale is None  # off is the default, so tables never spell it out
    lazy = space.suggest(optuna.trial.FixedTrial({**too_big, "num_stages": 1, "block_n": 64, "lazy_rescale": 1}))
    assert lazy.lazy_rescale is True and "lazy_rescale" in lazy.short()
    after = space.suggest(optuna.trial.FixedTrial({**too_big, "num_stages": 1, "block_n": 64, "draft_tile": "after"}))
    assert after.draft_tile == "after" and "draft_tile=after" in after.short()
    clustered = space.suggest(optuna.trial.FixedTrial({**too_big, "num_stages": 1, "block_n": 64, "merge": "cluster"}))
    assert clustered.split.merge == "cluster" and space.params_of(clustered)[0]["merge"] == "cluster"
    assert space.params_of(ok)[0]["merge"] == "launch"
    pipelined = space.suggest(optuna.trial.FixedTrial({**too_big, "num_stages": 1, "block_n": 64,
                                                       "merge": "cluster_pipelined"}))
    assert pipelined.split.merge == "cluster" and pipelined.split.merge_pipelined is True
    assert space.params_of(pipelined)[0]["merge"] == "cluster_pipelined"
    assert "/cluster+cp.async" in pipelined.compact()


def test_the_merge_is_searched_where_the_target_has_clusters() -> None:
    assert "merge" in space_for("sm_100", "qwen3_5_gqa256", 8).axes
    for arch in ("sm_80", "gfx950"):
        assert "merge" not in space_for(arch, "qwen3_5_gqa256", 8).axes


def test_every_shipped_default_is_a_point_of_its_space() -> None:
    for arch in ("sm_90", "sm_100", "gfx950"):
        for layout in LAYOUTS.values():
            for group in layout.attention.group_sizes:
                space = space_for(arch, layout.name, group)
                default = space.default  # the built-in one, less a gluon section the study does not search
                assert default.model_copy(update={"gluon": None}) == default_config(layout, group).model_copy(
                    update={"gluon": None})
                params, notes = space.params_of(default)
                assert notes == [] or all("nearest" in n for n in notes)
                assert space.config(params).block_n == default.block_n
                reason = space.why_not(default)
                if arch != "sm_90":  # an upper-bound shared-memory estimate there: the launcher may fit it
                    assert reason is None or "the launcher runs it" in reason, (arch, layout.name, group, reason)
                else:
                    assert reason is None, (arch, layout.name, group)


def test_rocm_default_gets_baseline_knobs_when_enqueued() -> None:
    space = space_for("gfx950", "gqa128", 8)
    params, _ = space.params_of(default_config(LAYOUTS["gqa128"], 8))
    assert (params["waves_per_eu"], params["matrix_instr_nonkdim"], params["kpack"]) == (0, 16, 1)


def test_space_digest_changes_with_the_choices_and_the_target(tmp_path: Path) -> None:
    a = space_for("sm_90", "gqa128", 8)
    b = space_for("sm_90", "gqa128", 16)
    assert a.digest() == space_for("sm_90", "gqa128", 8).digest() != b.digest()
    smaller = arch_profile("sm_90", SPACES, targets_file(tmp_path, sm_90={"shared_bytes": 101376}))
    assert SearchSpace.build(smaller, a.shape).digest() != a.digest()


def test_counts_and_description() -> None:
    space = space_for("sm_90", "qwen3_5_gqa256", 8)
    assert 0 < space.feasible_count() < space.size() == 4 * 4 * 3 * 4 * 4 * 5 * 5 * 3 * 2 * 2  # merge: 3
    text = space.describe()
    assert "232448" in text and "block_n" in text and "fit" in text


# ----------------------------------------------------------------- the data file


def test_bad_spaces_file_names_file_and_field(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "kgen" / "tuner" / "spaces.toml").read_text()
    bad = tmp_path / "spaces.toml"
    bad.write_text(text.replace('gpus = "H100, H200, GH200"', 'gpus = "H100, H200, GH200"\nkv_dtypes = "bf16"'))
    with pytest.raises(TuneError, match=r"spaces\.toml: field 'arch\.sm_90\.kv_dtypes'"):
        load_spaces(bad)
    bad.write_text(text.replace("dot_multiple_of_nonkdim = false", "dot_multiple_of_nonkdim = false\nwarp_sise = 32"))
    with pytest.raises(TuneError, match=r"field 'family\.cuda\.warp_sise': unknown key"):
        load_spaces(bad)
    # Limits live in kgen/tables/targets.json and the launch rules in kgen/launcher/rules.py only.
    bad.write_text(text + "\n[kernel]\nmax_rows = 128\n")
    with pytest.raises(TuneError, match=r"field 'kernel': unknown key"):
        load_spaces(bad)
    bad.write_text(text + "\n[[[")
    with pytest.raises(TuneError, match="not valid TOML"):
        load_spaces(bad)


def test_a_tuned_row_keeps_the_unsearched_fields_its_study_could_not_have_judged():
    """widen_from_rows and invariant_block_h are no axis: a row written from a study keeps those of
    the config the bucket runs today, unless a launch the study timed (without them) depends on it."""
    source = BlockConfig(block_h=4, block_n=64, num_warps=4, num_stages=3, widen_from_rows=64, invariant_block_h=2)
    tuned = BlockConfig(block_h=4, block_n=64, num_warps=4, num_stages=2)
    # L 4 is 16 rows: widening from 64 rows changes none of the study's launches.
    kept, notes = space_for("sm_90", "qwen3_5_gqa256", 4).keep_unsearched(tuned, source)
    assert (kept.widen_from_rows, kept.invariant_block_h) == (64, 2) and len(notes) == 2
    assert all("kept" in n for n in notes)
    # At L 16 the 64-row program would widen: its time was taken at 4 warps, so the field is dropped.
    kept, notes = space_for("sm_90", "qwen3_5_gqa256", 4, drafts=(4, 16)).keep_unsearched(tuned, source)
    assert kept.widen_from_rows is None and any("widen_from_rows 64 dropped" in n for n in notes)
    # An invariant head block must stay below the tuned one.
    narrower = tuned.model_copy(update={"block_h": 2})
    kept, notes = space_for("sm_90", "qwen3_5_gqa256", 4).keep_unsearched(narrower, source)
    assert kept.invariant_block_h is None and any("invariant_block_h 2 dropped" in n for n in notes)
    # A field the tuned config sets itself, or none to keep, stays as it is.
    assert space_for("sm_90", "qwen3_5_gqa256", 4).keep_unsearched(tuned, None) == (tuned, [])


def test_a_triton_winner_keeps_a_gluon_section_its_study_never_launched():
    """A hand-set gluon section whose from_rows lies above every draft the study timed is kept
    under a Triton winner (the study judged Triton launches only); one that launched at a timed
    draft is dropped (the winner beat it there); a Gluon winner keeps its own."""
    gluon = GluonConfig(block_n=128, num_stages=4, from_rows=64)
    source = BlockConfig(block_h=4, block_n=64, num_warps=2, num_stages=3, gluon=gluon)
    tuned = BlockConfig(block_h=4, block_n=64, num_warps=4, num_stages=3)
    kept, notes = space_for("sm_90", "gqa64", 8).keep_unsearched(tuned, source)  # L 4: 32 rows
    assert kept.gluon == gluon and any("gluon section kept" in n for n in notes)
    kept, notes = space_for("sm_90", "gqa64", 8, drafts=(4, 8)).keep_unsearched(tuned, source)  # L 8: 64 rows
    assert kept.gluon is None and any("gluon section (from_rows 64) dropped" in n for n in notes)
    own = tuned.model_copy(update={"gluon": GluonConfig(block_n=64, num_stages=2)})
    assert space_for("sm_90", "gqa64", 8).keep_unsearched(own, source)[0].gluon == own.gluon
