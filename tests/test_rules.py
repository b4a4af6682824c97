"""Launch rules (kgen/launcher/rules.py): the row blocking and the resource fit every module carries.

The shared-memory estimate is checked against numbers Triton 3.6 gave offline for sm_90
(``kgen check`` compiles every variant; these pin the rules it proves)."""

import pytest
from case_tools import patch_kernels
from kernel_cases import build, check_parity

import kgen
from kgen.launcher import rules
from kgen.launcher.device import INTERPRETER_NUM_SMS
from kgen.spec import load_layouts
from kgen.targets import read_targets, target_dicts

TARGETS = target_dicts(read_targets())
GQA256 = rules.kernel_shape(256, 256, 2, True)
MLA = rules.kernel_shape(512 + 64, 512, 2, False)
CONFIG = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 3}


def test_row_blocking_pads_to_a_dot_and_halves_heads():
    assert rules.row_blocking(16, 16, 4) == (16, 4)
    assert rules.row_blocking(16, 4, 1) == (4, 4)  # heads past the group are padding; 16 rows for tl.dot
    assert rules.row_blocking(16, 16, 9) == (8, 16)  # 256 rows > MAX_ROWS
    assert rules.row_blocking(16, 16, 4, grouped=False) == (1, 16)


def test_a_draft_tile_is_never_wider_than_the_prefix_tile():
    assert rules.draft_tile_columns(64, 4, 64) == 16  # tl.dot's minimum
    assert rules.draft_tile_columns(32, 32, 64) == 32  # the whole draft in one tile
    assert rules.draft_tile_columns(32, 64, 32) == 32  # walked in tiles as wide as the prefix loop's
    assert rules.draft_tile_columns(64, 64, 64) == 32  # at most MAX_DRAFT_SCORES scores
    assert rules.draft_tile_columns(128, 64, 64) == 16


def test_fp8_mla_programs_that_loop_over_draft_columns_hold_32_rows():
    sm_90 = TARGETS["sm_90"]
    config = {"block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 2}
    fp8 = rules.kernel_shape(576, 512, 1, False)
    block_h, l_pad, *_, reasons = rules.fit_program(sm_90, fp8, config, 16, 40)
    assert (block_h, l_pad) == (1, 32) and any("draft columns loop" in r for r in reasons)
    assert rules.fit_program(sm_90, fp8, config, 16, 4)[:2] == (16, 4)  # one draft tile: no loop, 64 rows
    assert rules.fit_program(sm_90, rules.kernel_shape(576, 512, 2, False), config, 16, 40)[:2] == (1, 64)  # 16-bit


@pytest.mark.parametrize(("shape", "rows", "block_n", "stages", "warps", "measured"), [
    (GQA256, 64, 64, 3, 4, 229376),  # sm_90, Triton 3.6: wgmma keeps num_stages buffers and q
    (GQA256, 128, 64, 2, 4, 196608),
    (GQA256, 32, 64, 3, 4, 151552),  # mma.sync: num_stages - 1 buffers, q and p
    (GQA256, 16, 32, 3, 4, 74752),
    (MLA, 64, 32, 3, 8, 184576),
    (MLA, 32, 32, 3, 4, 112640),
])
def test_shared_memory_estimate_matches_what_triton_allocated(shape, rows, block_n, stages, warps, measured):
    estimate = rules.shared_bytes(TARGETS["sm_90"], shape, rows, block_n, stages, warps)
    assert measured <= estimate <= measured + rules.SHARED_MARGIN_BYTES


def test_fit_keeps_what_fits_and_says_why_it_changes_the_rest():
    assert rules.fit_program(TARGETS["sm_90"], GQA256, CONFIG, 16, 4) == (16, 4, 64, 3, CONFIG["num_warps"], [])
    # 128 rows x 256 would spill at 4 warps: sm_90 (wgmma) doubles the warps and keeps every row
    # in one program (two stages then fit its shared memory); mma targets halve the head block.
    wide = rules.fit_program(TARGETS["sm_90"], GQA256, CONFIG, 16, 5)
    assert (wide.block_h, wide.l_pad, wide.num_warps, wide.num_stages) == (16, 8, 8, 2)
    assert "num_warps 4 -> 8" in wide.reasons[0] and "shared memory" in wide.reasons[1]
    fp8 = rules.fit_program(TARGETS["sm_90"], rules.kernel_shape(256, 256, 1, True), CONFIG, 16, 5)
    assert (fp8.block_h, fp8.num_warps) == (8, 4)  # FP8 converts on its MMA warps: not widened
    halved = rules.fit_program(TARGETS["sm_80"], GQA256, CONFIG, 16, 5)
    assert (halved.block_h, halved.l_pad, halved.num_warps) == (8, 8, 4) and "registers" in halved.reasons[0]
    # MLA's 512-wide accumulator does not fit 128 rows even at 8 warps: its head block halves.
    mla = rules.fit_program(TARGETS["sm_90"], MLA, CONFIG, 16, 8)
    assert mla.num_warps == 4 and mla.block_h * mla.l_pad == 32
    block_h, l_pad, block_n, stages, warps, reasons = rules.fit_program(TARGETS["sm_89"], GQA256, CONFIG, 16, 4)
    assert rules.shared_bytes(TARGETS["sm_89"], GQA256, block_h * l_pad, block_n, stages, warps) <= 101376
    assert any("shared memory" in r for r in reasons)


def test_widen_from_rows_doubles_the_warps_of_the_rows_it_names_only():
    # GQA 256 group 4: L 16 is 64 rows, at the 4-warp budget's edge (its loop spilled there:
    # docs/perf-notes.md, "Rows at the register budget"); L 4 and 8 keep the row's 4 warps.
    row = {"block_h": 4, "block_n": 64, "num_warps": 4, "num_stages": 3, "widen_from_rows": 64}
    sm_90 = TARGETS["sm_90"]
    wide = rules.fit_program(sm_90, GQA256, row, 4, 16)
    assert (wide.block_h, wide.l_pad, wide.num_warps) == (4, 16, 8)
    assert "widen_from_rows 64" in wide.reasons[0]
    assert [rules.fit_program(sm_90, GQA256, row, 4, length).num_warps for length in (4, 8)] == [4, 4]
    assert rules.fit_program(sm_90, GQA256, {**row, "widen_from_rows": None}, 4, 16).num_warps == 4
    # Only wgmma with 16-bit KV widens: FP8 and mma.sync targets keep their warps.
    assert rules.fit_program(sm_90, rules.kernel_shape(256, 256, 1, True), row, 4, 16).num_warps == 4
    assert rules.fit_program(TARGETS["sm_80"], GQA256, row, 4, 16).num_warps == 4
    with pytest.raises(ValueError, match="power of two"):
        kgen.blockconfig.BlockConfig(block_h=4, block_n=64, num_warps=4, num_stages=3, widen_from_rows=48)


def test_widened_programs_of_head_dims_128_and_64_hold_256_rows():
    """Two warpgroups of 128 rows on one KV read where the accumulator fits (128 x 128 or 64 fp32
    a warpgroup); 256-wide GQA and MLA keep their budgets, FP8 and mma.sync keep MAX_ROWS."""
    sm_90 = TARGETS["sm_90"]
    for head_dim in (128, 64):
        shape = rules.kernel_shape(head_dim, head_dim, 2, True)
        wide = rules.fit_program(sm_90, shape, CONFIG, 16, 16)
        assert (wide.block_h, wide.l_pad, wide.num_warps) == (16, 16, 8), head_dim
        assert rules.fit_program(sm_90, rules.kernel_shape(head_dim, head_dim, 1, True), CONFIG, 16, 16)[:2] == (8, 16)
        assert rules.fit_program(TARGETS["sm_80"], shape, CONFIG, 16, 16)[:2] == (8, 16)
    assert rules.fit_program(sm_90, GQA256, CONFIG, 16, 16)[:2] == (8, 16)  # 128 rows of 256: the 8-warp budget
    assert rules.fit_program(sm_90, MLA, CONFIG, 16, 16)[0] * rules.fit_program(sm_90, MLA, CONFIG, 16, 16)[1] == 32


@pytest.mark.parametrize(("layout", "group", "drafts"), [("gqa128", 16, [16, 9]), ("gqa64", 16, [16, 12]),
                                                       ("gqa128", 8, [32, 20])])
def test_256_row_programs_match_the_reference(layout, group, drafts):
    module = kgen.load(layout, "bfloat16")
    name, constexprs, options = module.launch_params("interpreter", INTERPRETER_NUM_SMS, group, 2, max(drafts))[0]
    assert constexprs["BLOCK_H"] * constexprs["L_PAD"] == 256 and options["num_warps"] == 8
    check_parity(build(layout, [70, 37], drafts, group, seed=5), layout, "bfloat16")


def test_fit_refuses_only_when_nothing_fits():
    tiny = {**TARGETS["sm_90"], "shared_bytes": 4096}
    assert rules.fit_program(tiny, MLA, CONFIG, 16, 4) is None


def _modules():
    for name, spec in sorted(load_layouts().items()):
        for kv in spec.dtypes.kv:
            yield name, kv, tuple(spec.attention.group_sizes)


@pytest.mark.parametrize(("layout", "kv", "groups"), list(_modules()))
def test_every_module_accepts_its_whole_domain_on_sm_90(layout, kv, groups):
    """Every listed group, one unlisted, every draft length, every batch bucket: a program
    that fits, within the register budget and the shared-memory estimate."""
    module = kgen.load(layout, kv)
    target = TARGETS["sm_90"]
    if kv not in target["fp8"] and kv.startswith("float8"):
        pytest.skip(f"{kv} is not an sm_90 format")
    for group in (*groups, 12):
        for batch in (1, 9, 33, 97):
            for length in range(1, module.MAX_DRAFT_TOKENS + 1):
                launches = module.launch_params("sm_90", 132, group, batch, length)
                assert launches, (group, batch, length)
                constexprs, options = launches[0][1], launches[0][2]
                rows = constexprs["BLOCK_H"] * constexprs["L_PAD"]
                shape = module.LAUNCHER.identity.kernel_shape
                if launches[0][0] == "_gluon_prefix_stage":  # its own rules: its layout's rows, its buffers
                    assert rows == rules.gluon_program_rows(shape)
                    assert (rules.gluon_shared_bytes(shape, constexprs["BLOCK_N"], constexprs["NUM_STAGES"])
                            <= target["shared_bytes"])
                    continue
                assert rows <= rules.max_rows_for(target, shape, options["num_warps"])
                assert rules.shared_bytes(target, module.LAUNCHER.identity.kernel_shape, rows, constexprs["BLOCK_N"],
                                          options["num_stages"], options["num_warps"]) <= target["shared_bytes"]


def test_launch_params_are_what_the_launcher_runs(monkeypatch):
    module = kgen.load("qwen3_5_gqa256", "bfloat16")
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, kwargs))

    patch_kernels(monkeypatch, module, prefix=Recorder("_verify_prefix_stage"), merge=Recorder("_verify_merge_stage"))
    case = build("qwen3_5_gqa256", [600, 90], [6, 3], 16, seed=5)
    module.launch(*case.launch_args())
    expected = module.launch_params("interpreter", INTERPRETER_NUM_SMS, 16, 2, 6)
    assert [name for name, _ in launched] == [name for name, _, _ in expected]
    for (_, kwargs), (_, constexprs, options) in zip(launched, expected, strict=True):
        assert {k: kwargs[k] for k in constexprs} == constexprs
        assert {k: kwargs[k] for k in options} == options


@pytest.mark.parametrize(("layout", "kv", "group", "draft"), [
    ("qwen3_5_gqa256", "bfloat16", 16, 5),  # 128 rows halved to 64: BLOCK_H 8
    ("qwen3_5_gqa256", "float8_e4m3fn", 16, 9),
    ("mla_absorbed_512_64", "bfloat16", 16, 8),
    ("mla_absorbed_512_64", "bfloat16", 12, 16),  # a group the layout does not list
])
def test_long_drafts_match_the_reference(layout, kv, group, draft):
    fp8 = kv != "bfloat16"
    case = build(layout, [70, 0, 33], [draft, 2, draft - 1], group, kv_dtype=kv, seed=draft + group,
                 k_scale=0.6 if fp8 else 1.0, v_scale=1.7 if fp8 else 1.0)
    check_parity(case, layout, kv, config={"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 2,
                                           "split": {"programs_per_sm": 4, "min_tokens_per_split": 16}})


GQA128_BF16 = rules.kernel_shape(128, 128, 2, True)


GQA128_FP8 = rules.kernel_shape(128, 128, 1, True)


@pytest.mark.parametrize(("shape", "consumers", "asked", "converters", "warps"), [
    (GQA128_FP8, 1, None, 2, 12),  # consumer 1's warpgroup converts
    (GQA128_FP8, 2, None, 1, 12),
    (GQA128_FP8, 2, 2, 2, 16),  # a fourth warpgroup
    (GQA128_FP8, 1, 1, 1, 12),  # consumer 1 idle
    (rules.kernel_shape(256, 256, 1, True), 2, 2, 1, 12),  # refused at head dim 256: the rule's
    (GQA128_BF16, 2, None, 0, 12),  # cp.async: no converter
    (rules.kernel_shape(512 + 64, 512, 1, False), 2, None, 0, 12),  # MLA's converting producer is its own
])
def test_converters_and_the_warps_they_make(shape, consumers, asked, converters, warps):
    assert rules.gluon_converters(shape, consumers, asked) == converters
    assert rules.gluon_warps(consumers, converters) == warps


def test_a_gluon_launch_takes_the_register_files_share():
    assert [rules.gluon_launch_registers(w) for w in (12, 16)] == [168, 128]


@pytest.mark.parametrize(("group", "l_pad", "consumers"), [(8, 4, 1), (8, 8, 1), (8, 16, 2), (4, 16, 1)])
def test_consumers_with_rows(group, l_pad, consumers):
    assert rules.gluon_consumers(group, l_pad) == consumers


@pytest.mark.parametrize(("arch", "rows", "max_splits", "stages"),
                         [("sm_90", 16, 64, 2), ("sm_90", 64, 64, 2), ("sm_80", 64, 16, 2), ("sm_89", 16, 9, 2),
                          ("sm_89", 64, 64, 1), ("sm_90", 16, 8, 1), ("sm_90", 16, 2, 1), ("gfx950", 16, 64, 1),
                          ("gfx942", 16, 64, 1)])
def test_the_merge_pipelines_more_than_one_chunk_where_a_chunk_fits_shared_memory(arch, rows, max_splits, stages):
    """A chunk of 8 splits of 64 columns: 33 KB at 16 rows, 133 KB at 64 (over sm_89's 99 KB, where
    kgen check found the pipelined program over its limit); a grid of at most one chunk of splits
    has no next chunk to overlap; HIP targets keep register loads."""
    target = TARGETS[arch]
    assert rules.merge_split_stages(target, rows, 64, 8, max_splits) == stages
