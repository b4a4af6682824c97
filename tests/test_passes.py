"""Each pass alone on a hand-made plan, then the pipeline end to end on every shipped layout."""

import dataclasses
import inspect
import re
from pathlib import Path

import jinja2
import pytest
from pydantic import ValidationError

from kgen.blockconfig import BlockConfig, TableFile, TableSource, read_defaults
from kgen.build import build_all, specializations
from kgen.errors import BuildError, SpecError, TableError, UsageError
from kgen.passes.context import load_context
from kgen.passes.fit import fit
from kgen.passes.fix_invariance import CONFIG_BATCH, DRAFT_ROWS, MAX_SPLITS, TOKENS_PER_SPLIT, fix_invariance
from kgen.passes.inspect_source import inspect_source
from kgen.passes.legalize import next_pow2
from kgen.passes.pipeline import PASSES, run_pipeline
from kgen.passes.render import render
from kgen.passes.select_config import select_config
from kgen.passes.specialize import specialize
from kgen.passes.validate import validate
from kgen.plan import SECTION_OF_PASS, BlockConfigs, ConfigEntry, Lowering, Output, config_literal, new_plan
from kgen.spec import SHIPPED_LAYOUT_DIR as SHIPPED_LAYOUTS
from kgen.spec import load_layouts, parse_layout

SPECS = load_layouts()
ODD = parse_layout(
    """
name = "odd"
[attention]
kind = "mla"
nope_dim = 96
pe_dim = 24
v_head_dim = 96
v_source = "k_latent"
group_sizes = [6]
[dtypes]
kv = ["bfloat16"]
q = ["bfloat16"]
""",
    "odd.toml",
)


@pytest.fixture(scope="module")
def ctx():
    return load_context(check_only=True)


def test_next_pow2_never_returns_zero():
    assert [next_pow2(x) for x in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]


def _through(plan, ctx, last: str):
    """The plan after the passes up to and including ``last``, run one by one."""
    for fn in PASSES:
        plan = fn(plan, ctx)
        if fn.__name__ == last:
            return plan
    raise AssertionError(f"no pass {last}")


def test_passes_are_plain_functions_of_plan_and_context():
    for fn in PASSES:
        assert inspect.isfunction(fn) and fn.__name__ != "<lambda>", fn
        assert list(inspect.signature(fn).parameters) == ["plan", "ctx"], fn.__name__


def test_a_pass_names_the_section_it_needs_and_who_fills_it(ctx):
    with pytest.raises(BuildError, match="fit needs plan.config, which select_config fills"):
        fit(validate(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx), ctx)
    with pytest.raises(BuildError, match="render needs plan.lowering, which select_lowering fills"):
        render(_through(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx, "fit"), ctx)


def test_validate_refuses_dtypes_the_spec_does_not_list(ctx):
    spec = SPECS["gqa64"]
    with pytest.raises(SpecError, match="dtypes.kv"):
        validate(new_plan(spec.model_copy(update={"dtypes": spec.dtypes.model_copy(update={"kv": ("bfloat16",)})}),
                          "float8_e4m3fn", "bfloat16"), ctx)


def test_specialize_records_why(ctx):
    plan = specialize(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16"), ctx)
    s = plan.specialization
    assert (s.has_pe, s.fp8_kv, s.v_from_k_tile) == (False, False, False)
    assert all(d.why for d in plan.decisions)
    m = specialize(new_plan(SPECS["mla_absorbed_512_64"], "float8_e4m3fn", "bfloat16"), ctx).specialization
    assert (m.has_pe, m.fp8_kv, m.v_from_k_tile, m.prefix_dot_dtype) == (True, True, True, "float16")
    assert "native conversion" in m.prefix_dot_why and m.draft_first_why == ""


def test_legalize_pads_odd_widths_and_never_asks_pow2_of_zero(ctx):
    tiles = _through(new_plan(ODD, "bfloat16", "bfloat16"), ctx, "legalize").tiles
    assert (tiles.block_d, tiles.block_dpe, tiles.block_dv) == (128, 32, 128)
    assert tiles.mask_d and tiles.mask_dv
    gqa = _through(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx, "legalize").tiles
    assert gqa.block_dpe is None and not gqa.mask_d
    assert gqa.min_dot_rows == 16


def test_select_config_reads_tables_and_drops_amd_knobs_on_cuda(ctx):
    amd = BlockConfig(block_h=4, block_n=64, num_warps=8, num_stages=1, waves_per_eu=2, kpack=2)
    assert amd.for_arch("sm_90").has_rocm_knobs is False
    assert amd.for_arch("gfx950").waves_per_eu == 2
    row = {"block_h": 4, "block_n": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 2, "kpack": 2}
    table = TableFile.model_validate({
        "schema": "kgen.block-config-table/1", "arch": "gfx950",
        "metadata": {"gpu_name": "AMD Instinct MI355X", "arch": "gfx950", "trials": 0, "tuned": False, "note": "test"},
        "entries": [{"layout": "qwen3_5_gqa256", "kv_dtype": "bfloat16", "group_size": g, "batch_min": 1,
                     "batch_max": 1 << 30, "config": row} for g in (4, 8, 16)]})
    ctx = dataclasses.replace(ctx, tables={**ctx.tables, "gfx950": TableSource(
        arch="gfx950", path="test", origin="KGEN_TABLE", table=table)})
    plan = _through(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16"), ctx, "select_config")
    rows = plan.config.by_arch["gfx950"]
    assert all(r.config.waves_per_eu == 2 for r in rows)
    assert all(r.config.waves_per_eu is None for r in plan.config.by_arch["sm_90"])
    assert {r.group_size for r in rows} == {4, 8, 16}
    assert all(r.config.block_h == 4 and r.config.block_n == 64 and r.config.num_warps == 8 for r in rows)
    per_head = select_config(dataclasses.replace(plan, variant="per_head", decisions=()), ctx)
    assert per_head.config.default.block_h == 1
    # The tables are tuned for the grouped kernel: the per-head baseline runs the default.
    assert per_head.config.by_arch == {}
    assert any(d.what == "tables" and d.value == "not used" for d in per_head.decisions)


def _twin_table(kv_rows: dict[str, int]) -> TableSource:
    """An sm_90 table with one group 16 row a KV dtype, its block_n telling them apart."""
    entries = [{"layout": "gqa128", "kv_dtype": kv, "group_size": 16, "batch_min": 1, "batch_max": 8,
                "config": {"block_h": 16, "block_n": n, "num_warps": 4, "num_stages": 2}} for kv, n in kv_rows.items()]
    table = TableFile.model_validate({
        "schema": "kgen.block-config-table/1", "arch": "sm_90",
        "metadata": {"gpu_name": "NVIDIA H200", "arch": "sm_90", "triton_version": "3.6.0", "tuned": True},
        "entries": entries})
    return TableSource(arch="sm_90", path="sm_90.json", origin="shipped", table=table)


@pytest.mark.parametrize(("kv", "twin"), [("float16", "bfloat16"), ("float8_e5m2", "float8_e4m3fn")])
def test_a_kv_dtype_without_rows_takes_its_twins_and_its_own_rows_win(ctx, kv, twin):
    """fp16 KV runs bf16's rows, e5m2 e4m3fn's (the same bytes a token and MMA work), and says so;
    rows of its own replace them; a dtype with no twin (e4m3fn) does not borrow."""
    borrowed = dataclasses.replace(ctx, tables={"sm_90": _twin_table({twin: 32})})
    plan = _through(new_plan(SPECS["gqa128"], kv, "bfloat16"), borrowed, "select_config")
    assert [r.config.block_n for r in plan.config.by_arch["sm_90"]] == [32]
    decision = next(d for d in plan.decisions if d.what == "table sm_90")
    assert decision.value.startswith(f"1 row of {twin}") and f"{kv} has none" in decision.why
    own = dataclasses.replace(ctx, tables={"sm_90": _twin_table({twin: 32, kv: 64})})
    plan = _through(new_plan(SPECS["gqa128"], kv, "bfloat16"), own, "select_config")
    assert [r.config.block_n for r in plan.config.by_arch["sm_90"]] == [64]
    lone = dataclasses.replace(ctx, tables={"sm_90": _twin_table({"float16": 32, "float8_e5m2": 64})})
    plan = _through(new_plan(SPECS["gqa128"], twin, "bfloat16"), lone, "select_config")
    assert "sm_90" not in plan.config.by_arch


def _templates(monkeypatch, templates: dict[str, str]) -> None:
    """Render from these templates (name -> text) instead of kgen/templates."""
    import kgen.passes.render as render_pass

    env = render_pass.environment.__wrapped__()
    env.loader = jinja2.DictLoader(templates)
    monkeypatch.setattr(render_pass, "environment", lambda: env)


def test_render_fails_on_a_name_the_plan_lacks(ctx, monkeypatch):
    plan = _through(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx, "select_lowering")
    _templates(monkeypatch, {"triton/kernel.py.j2": "BLOCK_D = {{ plan.tiles.block_dd }}\n"})
    with pytest.raises(BuildError, match="triton/kernel.py.j2 uses something the plan lacks.*block_dd"):
        render(plan, ctx)


def test_the_lowering_picks_the_template_folder(ctx, monkeypatch):
    """A second lowering is a folder of templates and a choice in the plan, not a rewrite."""
    # fp16 KV with bf16 queries: no Gluon prefix stage (its stages hold q in the KV dtype).
    plan = _through(new_plan(SPECS["gqa64"], "float16", "bfloat16"), ctx, "select_lowering")
    assert plan.lowering.name == "triton"
    decisions = {d.what: d.value for d in plan.decisions_of("select_lowering")}
    assert (decisions["lowering"], decisions["gluon_prefix"]) == ("triton", None)
    assert plan.lowering.gluon_prefix is None
    _templates(monkeypatch, {"triton/kernel.py.j2": "triton\n",
                             "other/kernel.py.j2": "{{ plan.lowering.name }}: {{ plan.tiles.block_d }}\n"})
    other = render(plan.with_(lowering=Lowering("other")), ctx)
    assert other.output.source == "other: 64\n"
    assert other.decisions_of("render")[0].why == "rendered other/kernel.py.j2"


def test_package_data_ships_every_template():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kgen"]
    # The templates and each lowering package's manifest (select_lowering reads them at build time).
    templates = [p.relative_to(root / "kgen") for pattern in ("*.j2", "lowering.json")
                 for p in (root / "kgen" / "templates").rglob(pattern)]
    # As setuptools globs: a '*' stays within one folder.
    shipped = [t for t in templates if any(len(Path(g).parts) == len(t.parts) and t.match(g) for g in globs)]
    assert templates and shipped == templates, sorted(set(templates) - set(shipped))


def test_check_rejects_bad_source(ctx):
    plan = specialize(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx).with_(lowering=Lowering("triton"))
    with pytest.raises(BuildError, match="does not compile"):
        inspect_source(plan.with_(output=Output("def broken(:\n")), ctx)
    with pytest.raises(BuildError, match="imports"):
        inspect_source(plan.with_(output=Output("import numpy\n")), ctx)
    with pytest.raises(BuildError, match="imports"):  # Gluon only where select_lowering offered it
        inspect_source(plan.with_(output=Output("from triton.experimental import gluon\n")), ctx)
    with pytest.raises(BuildError, match="mentions a PE part"):
        inspect_source(plan.with_(output=Output("q_pe = 1\n")), ctx)


def _code(source: str) -> str:
    """The source without comments and docstring-free enough for token checks."""
    return "\n".join(line.split("#", 1)[0] for line in source.splitlines())


def test_pe_free_text_and_float_scales(ctx):
    plan = run_pipeline(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16"), ctx)
    code = _code(plan.output.source)
    # No PE pointer, load, dot or argument: no identifier of the PE part at all.
    assert not re.search(r"(?i)_pe\b|\bpe_dim\b|dpe", code)
    # q.k and p.v in the prefix stage and in the draft tile's helper (called before the loop
    # and after it; the launcher's DRAFT_FIRST picks one by the program's rows), whose p.v has
    # a second form that divides by v_scale (the pool's P.V after it is scaled once).
    assert code.count("tl.dot(") == 5
    # A 16-bit pool's k_scale / v_scale are float arguments: no device read.
    assert "score_scale = qk_scale * k_scale" in code and "acc = acc * v_descale" in code
    assert "tl.load(k_scale)" not in code
    assert "V_Buffer" in code  # GQA reads V from its own buffer

    mla = run_pipeline(new_plan(SPECS["mla_absorbed_512_64"], "float8_e4m3fn", "bfloat16"), ctx)
    mcode = _code(mla.output.source)
    assert "q_pe" in mcode and "k_pe" in mcode and "kd_pe" in mcode
    # q.k, q_pe.k_pe and p.v in the one prefix loop (FP8 MLA has no whole-tile loop), and the
    # same three in the draft tile's helper, whose p.v has a second form that divides by v_descale.
    assert mcode.count("tl.dot(") == 7
    # FP8 reads its scales from device tensors, always: one program for float and tensor callers.
    # K's descale is folded into q (and q_pe) before the loop, whose scores take qk_scale alone.
    assert "k_descale = tl.load(k_scale)" in mcode
    assert "q = (q * k_descale).to(DOT_DTYPE)" in mcode and "q_pe = (q_pe * k_descale).to(DOT_DTYPE)" in mcode
    assert "score_scale = qk_scale\n" in mcode
    assert "V_Buffer" not in mcode  # V comes from the K tile already loaded
    assert "GENERATED BY kgen" in mla.output.source and "DO NOT EDIT" in mla.output.source


@pytest.mark.parametrize(("layout", "kv", "split"), [
    ("mla_absorbed_512_64", "bfloat16", True), ("mla_absorbed_512_64", "float8_e4m3fn", False),
    ("qwen3_5_gqa256", "bfloat16", False), ("gqa128", "bfloat16", False),
])
def test_unmasked_full_tiles_is_a_generation_time_decision(ctx, layout, kv, split):
    """MLA BF16 loops over whole tiles without the -inf select, then selects only in the partial tile."""
    plan = run_pipeline(new_plan(SPECS[layout], kv, "bfloat16"), ctx)
    assert plan.specialization.unmasked_full_tiles is split
    assert any(d.what == "full tiles" for d in plan.decisions)
    code = _code(plan.output.source)
    stage = code[code.index("def _verify_prefix_stage"):code.index("def _verify_merge_stage")]
    loops = stage.split("for start_n in range(")[1:]
    assert len(loops) == (2 if split else 1)
    if split:
        assert loops[0].startswith("split_start, full_end,") and loops[1].startswith("full_end, split_end,")
        whole = loops[0][:loops[0].index("m_i = m_new")]
        assert "n_ok" not in whole and "float(\"-inf\")" not in whole
    tail = loops[-1][:loops[-1].index("m_i = m_new")]
    # The partial tile gathers clamped token indices and selects -inf; no load is row-masked.
    assert "n_ok = offs_n < split_end" in tail and "tok = tl.minimum(offs_n, split_end - 1)" in tail
    assert 'tl.where(n_ok[None, :], qk * score_scale, float("-inf"))' in tail
    assert "mask=n_ok" not in stage


def test_draft_tile_position_is_a_generation_time_decision(ctx):
    """MLA emits the draft tile before the prefix loop only; the per-head baseline after it
    only; grouped GQA both, each under the launcher's DRAFT_FIRST (the config's draft_tile,
    else the rows)."""
    for layout, variant, first, both in (("mla_absorbed_512_64", "grouped", True, False),
                                         ("qwen3_5_gqa256", "per_head", False, False),
                                         ("qwen3_5_gqa256", "grouped", False, True)):
        plan = run_pipeline(new_plan(SPECS[layout], "float8_e4m3fn", "bfloat16", variant), ctx)
        s = plan.specialization
        assert s.draft_tile_first is first and s.draft_tile_either is both
        assert bool(s.draft_first_rows) is both
        code = _code(plan.output.source)
        prefix_stage = code[code.index("def _verify_prefix_stage"):code.index("def _verify_merge_stage")]
        loop = prefix_stage.index("for start_n in range(")
        calls = [m.start() for m in re.finditer(r"m_i, l_i, acc = _draft_tile\(", prefix_stage)]
        placements = [True, False] if both else [first]
        # Each placement calls it twice: in the loop over draft-column tiles of split draft rows
        # (ROW_BLOCKS > 1) and once for a program that holds the whole draft.
        assert [c < loop for c in calls] == [p for p in placements for _ in range(2)]
        # Drafts first: the prefix tiles after them are still raw e4m3 V, so the draft is divided back.
        raw_v = re.findall(r"RAW_V_FOLLOWS=(True|False)", prefix_stage)
        assert raw_v == [str(p) for p in placements for _ in range(2)] if (first or both) else raw_v == []
        helper = code[code.index("def _draft_tile("):code.index("def _combine_splits")]
        assert ("if RAW_V_FOLLOWS:" in helper and "/ v_descale" in helper) is (first or both)
        assert "K_Extend + " in helper
        assert "K_Extend + " not in prefix_stage, "the draft tile's body is emitted once, in _draft_tile"
        assert ("if DRAFT_FIRST:" in prefix_stage and "if not DRAFT_FIRST:" in prefix_stage) is both
        # The launcher chooses the placement per launch only where the module declares the row rule.
        assert ("draft_first_rows=" in code) is both


def test_entry_points_and_their_why_not_share_one_signature(tmp_path: Path):
    """SGLang's 23 arguments and its newer kv_len_adjust (and the paged call's) are written once
    in the templates."""
    from kernel_cases import build_module

    _, module = build_module(tmp_path, "gqa64", "bfloat16")
    sglang = inspect.signature(module.verify_shared_kv_fwd).parameters
    assert list(sglang)[-2:] == ["kv_len_adjust", "check_indices"] and len(sglang) == 25
    assert list(inspect.signature(module.why_not).parameters.values()) == list(sglang.values())[:-1]
    paged = inspect.signature(module.verify_paged_fwd).parameters
    assert list(inspect.signature(module.why_not_paged).parameters.values()) == list(paged.values())[:-2]
    assert list(paged)[-2:] == ["config", "check_indices"]


def test_every_pass_leaves_reasons(ctx):
    seen = []
    run_pipeline(new_plan(SPECS["gqa128"], "bfloat16", "float16"), ctx, on_pass=lambda n, p: seen.append((n, p)))
    assert [n for n, _ in seen] == [fn.__name__ for fn in PASSES]
    for name, plan in seen:
        decisions = plan.decisions_of(name)
        assert decisions, f"{name} recorded no decision"
        assert all(d.why for d in decisions)


def test_pipeline_stop_after(ctx):
    plan = run_pipeline(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx, stop_after="legalize")
    assert plan.tiles.block_d == 64 and plan.output is None
    with pytest.raises(ValueError, match="unknown pass"):
        run_pipeline(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx, stop_after="nope")


@pytest.fixture
def one_layout_dir(tmp_path: Path) -> Path:
    """A layout directory holding gqa64's spec alone: what the writing and staleness tests
    need, without building every shipped module (the shipped-dir test below builds them all)."""
    layouts = tmp_path / "layouts"
    layouts.mkdir()
    (layouts / "gqa64.toml").write_text((SHIPPED_LAYOUTS / "gqa64.toml").read_text())
    return layouts


def test_a_rebuild_writes_only_changed_text(tmp_path: Path, one_layout_dir: Path):
    out = tmp_path / "out"
    result = build_all(out_dir=out, layout_dir=one_layout_dir)
    assert len(result.plans) == len(list(specializations(load_layouts(one_layout_dir)))) > 1
    assert all(p.output.inspected and p.output.written for p in result.plans)
    again = build_all(out_dir=out, layout_dir=one_layout_dir)
    assert not again.changed  # written only when the text changed
    first = out / Path(result.plans[0].output_path).name
    mtime = first.stat().st_mtime_ns
    build_all(out_dir=out, layout_dir=one_layout_dir)
    assert first.stat().st_mtime_ns == mtime


def test_build_check_detects_stale_and_orphan_files(tmp_path: Path, one_layout_dir: Path):
    from kgen.cli import main

    out, layouts = str(tmp_path / "out"), ["--layout-dir", str(one_layout_dir)]
    assert main(["build", "-q", "--out", out, *layouts]) == 0
    assert main(["build", "--check", "--out", out, *layouts]) == 0
    victim = sorted((tmp_path / "out").glob("verify_gqa64*.py"))[0]
    victim.write_text(victim.read_text() + "# edited by hand\n")
    (tmp_path / "out" / "verify_gone__kv_bf16__q_bf16.py").write_text("")
    assert main(["build", "--check", "--out", out, *layouts]) == 1
    assert main(["build", "-q", "--out", out, *layouts]) == 0
    assert main(["build", "--check", "--out", out, *layouts]) == 0


def test_shipped_generated_dir_is_up_to_date():
    """Every specialization of every shipped layout runs every pass (check included: each
    module's source compiles) and matches the committed generated/."""
    result = build_all(check_only=True)
    assert len(result.plans) == len(list(specializations(SPECS)))
    assert all(p.output.inspected for p in result.plans)
    assert not result.changed and not result.orphans, "run `kgen build` and commit generated/"


def _tuned_sm90_table() -> TableSource:
    """An sm_90 table from Triton 3.6 with one qwen3_5_gqa256 row (independent of the shipped one)."""
    table = TableFile.model_validate({
        "schema": "kgen.block-config-table/1", "arch": "sm_90",
        "metadata": {"gpu_name": "NVIDIA H200", "arch": "sm_90", "torch_version": "2.11.0",
                     "triton_version": "3.6.0", "date": "2026-11-29T00:00:00Z", "trials": 1, "tuned": True},
        "entries": [{"layout": "qwen3_5_gqa256", "kv_dtype": "bfloat16", "group_size": 16, "batch_min": 1,
                     "batch_max": 8, "config": {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 3}}],
    })
    return TableSource(arch="sm_90", path="sm_90.json", origin="shipped", table=table)


def test_table_from_another_triton_is_used_with_a_warning(ctx):
    ctx = dataclasses.replace(ctx, tables={**ctx.tables, "sm_90": _tuned_sm90_table()})
    newer = dataclasses.replace(ctx, triton_version="9.9.0")
    base = _through(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16"), ctx, "legalize")
    plan = select_config(base, newer)
    warnings = plan.warnings
    assert [d.what for d in warnings] == ["table sm_90"]
    assert "tuned with Triton 3.6" in warnings[0].why and "kgen tune" in warnings[0].why
    assert plan.config.by_arch["sm_90"], "the table is still used"
    same = select_config(base, dataclasses.replace(ctx, triton_version="3.6.1"))
    assert not same.warnings


def _table_with_draft_tile(layout: str, placement: str) -> TableSource:
    table = TableFile.model_validate({
        "schema": "kgen.block-config-table/1", "arch": "sm_90",
        "metadata": {"gpu_name": "NVIDIA H200", "arch": "sm_90", "triton_version": "3.6.0", "tuned": True},
        "entries": [{"layout": layout, "kv_dtype": "bfloat16", "group_size": 16, "batch_min": 1, "batch_max": 8,
                     "config": {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 3,
                                "draft_tile": placement}}],
    })
    return TableSource(arch="sm_90", path="sm_90.json", origin="shipped", table=table)


def test_a_table_row_chooses_the_draft_tile_only_where_both_are_emitted(ctx):
    gqa = _through(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16"), ctx, "legalize")
    good = dataclasses.replace(ctx, tables={"sm_90": _table_with_draft_tile(gqa.spec.name, "after")})
    plan = select_config(gqa, good)
    assert plan.config.by_arch["sm_90"][0].config.draft_tile == "after"
    assert config_literal(plan.config.by_arch["sm_90"][0].config).endswith("'draft_tile': 'after'}")
    mla = _through(new_plan(SPECS["mla_absorbed_512_64"], "bfloat16", "bfloat16"), ctx, "legalize")
    bad = dataclasses.replace(ctx, tables={"sm_90": _table_with_draft_tile(mla.spec.name, "after")})
    with pytest.raises(TableError, match=r"sets draft_tile 'after'.*always runs the draft tile before"):
        select_config(mla, bad)
    with pytest.raises(ValidationError, match="draft_tile"):
        BlockConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, draft_tile="middle")


def test_default_rules_pick_by_k_width_then_kv_storage():
    rules = read_defaults()
    bf16, fp8 = rules.rule_for(256, "bfloat16"), rules.rule_for(256, "float8_e4m3fn")
    assert bf16.kv_storage is None and fp8.kv_storage == "fp8"
    assert fp8.config != bf16.config
    assert rules.rule_for(256, "float8_e4m3fnuz").kv_storage == "fp8"
    assert rules.rule_for(128, "float8_e4m3fn").max_qk_dim == 128  # no fp8 rule that narrow: the K width wins
    assert rules.rule_for(576, "bfloat16").max_qk_dim == 1024
    assert rules.rule_for(4096, "bfloat16").kv_storage is None  # past every width: the widest general rule


def test_fp8_layout_bakes_the_fp8_default(ctx):
    plan = _through(new_plan(SPECS["qwen3_5_gqa256"], "float8_e4m3fn", "bfloat16"), ctx, "select_config")
    assert plan.config.default == read_defaults().rule_for(256, "float8_e4m3fn").config
    assert any("fp8 KV" in d.why for d in plan.decisions if d.what == "default config")


def test_explain_shows_every_field_each_pass_fills(ctx):
    """A section field a pass fills and `kgen explain --verbose` does not show is a decision
    nobody sees: it is a field line, or a decision of that pass shows its value."""
    from kgen.explain import _show, explain

    cases = (("qwen3_5_gqa256", "float8_e4m3fn", False), ("mla_absorbed_512_64", "bfloat16", False),
             ("qwen3_5_gqa256", "bfloat16", True))
    for layout, kv, invariant in cases:
        text = explain(layout, kv, batch_invariant=invariant, verbose=True)
        blocks = dict(re.findall(r"── (\w+) ─+\n(.*?)(?=\n── |\Z)", text, re.S))
        plan = new_plan(SPECS[layout], kv, "bfloat16", batch_invariant=invariant)
        for fn in PASSES:
            after = fn(plan, ctx)
            section = SECTION_OF_PASS.get(fn.__name__)
            filled = [] if section is None else [
                f.name for f in dataclasses.fields(getattr(after, section))
                if getattr(plan, section) is None or getattr(getattr(plan, section), f.name) != getattr(
                    getattr(after, section), f.name)]
            block = blocks[fn.__name__]
            values = {f: getattr(getattr(after, section), f) for f in filled}
            named = {d.what.lower().replace(" ", "_") for d in after.decisions_of(fn.__name__)}
            missing = [f for f, v in values.items() if f"plan.{section}.{f} = " not in block
                       and _show(v) not in block and f not in named]  # fmt: skip
            assert not missing, f"{layout}: explain does not show {missing} after {fn.__name__}"
            for d in after.decisions_of(fn.__name__):  # a decision's value is not printed again as a field
                assert not re.search(rf"^  plan\.{section}\.\w+ = {re.escape(str(d.value))}$", block, re.M), d
            plan = after
        assert blocks.keys() == {fn.__name__ for fn in PASSES}


def test_explain_one_pass_gives_its_whole_reasons():
    from kgen.explain import explain

    text = explain("gqa128", only_pass="fit")
    assert "── fit " in text and "── legalize" not in text and "gate" not in text
    assert "B of tile buffers exceed" in text  # the whole reason, not its first clause
    with pytest.raises(UsageError, match="unknown --pass 'fitt': the passes are validate, specialize"):
        explain("gqa128", only_pass="fitt")


@pytest.mark.parametrize(("kv", "q", "offered"), [("bfloat16", "bfloat16", True), ("float8_e4m3fn", "bfloat16", True),
                                                  ("float8_e4m3fn", "float16", True),
                                                  ("float8_e4m3fnuz", "bfloat16", False),
                                                  ("bfloat16", "float16", False),
                                                  ("float8_e5m2", "bfloat16", True),
                                                  ("float16", "float16", True),
                                                  ("float16", "bfloat16", False)])
def test_the_gluon_prefix_stage_is_offered_only_where_it_applies(ctx, kv, q, offered):
    """kgen/templates/gluon/lowering.json: absorbed MLA 512+64 whose stage holds 16-bit tiles: 16-bit
    KV with q in its dtype, or FP8 KV but e4m3fnuz (converted to fp16), of the KV dtypes the stage
    has run on a GPU for; the decision says which requirement a layout misses."""
    plan = _through(new_plan(SPECS["mla_absorbed_512_64"], kv, q), ctx, "select_lowering")
    decision = plan.decisions_of("select_lowering")[1]
    assert (plan.lowering.gluon_prefix is not None) is offered
    if offered:
        assert decision.value == "gluon/mla_ws_prefix_stage.py.j2" and "sm_90" in decision.why
    else:
        assert decision.value is None and "stage_dtype" in decision.why


def _configs_with_rows(ctx, rows):
    plan = _through(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16", batch_invariant=True), ctx,
                    "select_config")
    return dataclasses.replace(plan, config=BlockConfigs(default=plan.config.default, default_why="test",
                                                          by_arch={"sm_90": tuple(rows)}))


def test_fix_invariance_keeps_one_row_per_group_for_every_batch(ctx):
    """Each group's row whose bucket holds the speed bar's batch, widened to every batch; a
    group whose rows miss it takes the default config (no row)."""
    cfg = {n: BlockConfig(block_h=16, block_n=n, num_warps=4, num_stages=2) for n in (16, 32, 64)}
    rows = [ConfigEntry(16, 1, 8, cfg[16]), ConfigEntry(16, 9, CONFIG_BATCH, cfg[32]),
            ConfigEntry(16, CONFIG_BATCH + 1, 1 << 30, cfg[16]), ConfigEntry(8, 100, 200, cfg[64])]
    plan = fix_invariance(_configs_with_rows(ctx, rows), ctx)
    assert plan.config.by_arch["sm_90"] == (ConfigEntry(16, 1, 1 << 30, cfg[32]),)
    section = plan.invariance
    assert (section.enabled, section.tokens_per_split, section.max_splits, section.draft_rows) == (
        True, TOKENS_PER_SPLIT, MAX_SPLITS, DRAFT_ROWS)
    decided = {d.what: d for d in plan.decisions_of("fix_invariance")}
    assert decided["config sm_90"].value == "rows of group 16"
    assert "group 8: the default config" in decided["config sm_90"].why
    split = decided["tokens per split"]
    assert split.value == TOKENS_PER_SPLIT and "fixed split size" in split.why


def test_fix_invariance_says_a_default_module_is_not_invariant(ctx):
    plan = _through(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16"), ctx, "fix_invariance")
    assert plan.invariance.enabled is False
    (decision,) = plan.decisions_of("fix_invariance")
    assert decision.value is False and "depend on the batch" in decision.why


def test_fit_walks_only_the_invariant_draft_rows(ctx):
    """A batch-invariant module fits every program for DRAFT_ROWS: no fit decision names
    another draft length (the default module's range over 1..16 changes programs at L 5-16)."""
    default = _through(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16"), ctx, "fit")
    invariant = _through(new_plan(SPECS["qwen3_5_gqa256"], "bfloat16", "bfloat16", batch_invariant=True), ctx, "fit")
    assert any(d.value != f"L {DRAFT_ROWS}" for d in default.decisions_of("fit") if d.what.startswith("sm_90 group"))
    assert all(d.value == f"L {DRAFT_ROWS}" for d in invariant.decisions_of("fit") if d.what.startswith("sm_90 group"))


def test_fit_walks_every_draft_length_of_every_group(ctx, monkeypatch):
    """Each (target, config, group) is fitted at every draft length 1..MAX_DRAFT_TOKENS: the loop
    over a group's cells once rebound the draft lengths, so every later group walked only the last
    cell's (absorbed MLA's groups 16-128: 32 of the 64)."""
    import kgen.passes.fit as fit_pass

    asked: set[tuple[int, int]] = set()
    real = fit_pass.fit_program

    def recording(target, shape, config, group, length, grouped):
        asked.add((group, length))
        return real(target, shape, config, group, length, grouped)

    monkeypatch.setattr(fit_pass, "fit_program", recording)
    plan = _through(new_plan(SPECS["mla_absorbed_512_64"], "bfloat16", "bfloat16"), ctx, "fit")
    groups = SPECS["mla_absorbed_512_64"].attention.group_sizes
    assert asked == {(g, n) for g in groups for n in range(1, plan.tiles.max_draft_tokens + 1)}


def test_validate_refuses_a_per_head_batch_invariant_plan(ctx):
    with pytest.raises(SpecError, match="no batch-invariant mode"):
        validate(new_plan(SPECS["gqa64"], "bfloat16", "bfloat16", "per_head", batch_invariant=True), ctx)


def test_explain_batch_invariant_from_the_cli(capsys):
    from kgen.cli import main

    assert main(["explain", "gqa64", "--batch-invariant"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^emit +file += generated/verify_batch_invariant_gqa64__kv_bf16__q_bf16\.py — ", text, re.M)
    assert re.search(rf"^fix_invariance .* tokens per split +\= {TOKENS_PER_SPLIT} — ", text, re.M | re.S)
    assert main(["explain", "gqa64", "--variant", "per_head", "--batch-invariant"]) == 2
