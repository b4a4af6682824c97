"""The Gluon prefix stage as the lowering a table row picks: the launcher's choice
(launch_params) on each side of its conditions, select_lowering's decisions for rows with a
gluon section (and its refusals), and `kgen check` compiling a row's Gluon variant offline for
sm_90. Modules are built into a temporary folder from a table with Gluon rows."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest
import triton

from kgen import check
from kgen.blockconfig import BlockConfig, TableFile, TableSource
from kgen.build import build_one
from kgen.errors import TableError
from kgen.explain import explain
from kgen.launcher import rules
from kgen.passes.context import load_context
from kgen.passes.pipeline import run_pipeline
from kgen.plan import new_plan
from kgen.spec import load_layouts

MLA = "mla_absorbed_512_64"
SPECS = load_layouts()
GLUON = "_gluon_prefix_stage"
TRITON = "_verify_prefix_stage"
TRITON_FIELDS = {"block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 2,
                 "split": {"programs_per_sm": 1, "max_splits": 64, "min_tokens_per_split": 128}}
GLUON_ROW = {"block_n": 32, "num_stages": 3,
             "split": {"programs_per_sm": 1, "max_splits": 8, "min_tokens_per_split": 64}}


def entry(layout: str = MLA, group: int = 16, batch: tuple[int, int] = (1, 8), gluon: dict | None = None,
          kv: str = "bfloat16") -> dict:
    config = {**TRITON_FIELDS, **({"gluon": gluon} if gluon else {})}
    return {"layout": layout, "kv_dtype": kv, "group_size": group, "batch_min": batch[0], "batch_max": batch[1],
            "config": config}


def table(arch: str, *entries: dict) -> TableSource:
    data = {"schema": "kgen.block-config-table/1", "arch": arch,
            "metadata": {"arch": arch, "triton_version": triton.__version__}, "entries": list(entries)}
    return TableSource(arch=arch, path=f"<test {arch} table>", origin="KGEN_TABLE",
                       table=TableFile.model_validate(data))


def context(out_dir: Path, *sources: TableSource):
    return dataclasses.replace(load_context(out_dir), tables={s.arch: s for s in sources})


def plan_through_lowering(ctx, layout: str = MLA, kv: str = "bfloat16", q: str = "bfloat16"):
    return run_pipeline(new_plan(SPECS[layout], kv, q), ctx, stop_after="select_lowering")


# Batch 1-8 of group 16 runs the Gluon stage (32-token tiles, 3 stages, its own split policy);
# batch 9-32 is a Triton row.
GLUON_TABLE = (entry(gluon=GLUON_ROW), entry(batch=(9, 32)))


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The MLA BF16 module built with GLUON_TABLE as sm_90's table."""
    out = tmp_path_factory.mktemp("gluon_module")
    plan = build_one(MLA, "bfloat16", "bfloat16", ctx=context(out, table("sm_90", *GLUON_TABLE)))
    return Path(plan.output_path)


@pytest.fixture()
def module(built: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    mod = _import(built, "gluon_row_module")
    monkeypatch.setattr(mod.LAUNCHER, "gluon_enabled", True)  # as under Triton 3.6 with Gluon importable
    return mod


def prefix(module: ModuleType, arch: str = "sm_90", batch: int = 4, draft: int = 4, page_size: int | None = None):
    return module.launch_params(arch, 132, 16, batch, draft, page_size)[0]


# ----------------------------------------------------------------- the launcher's choice


def test_a_gluon_row_launches_the_gluon_stage_with_its_own_choices(module: ModuleType) -> None:
    name, constexprs, options = prefix(module)
    assert name == GLUON
    # USE_PDL: the launcher's PDL choice, as the Triton stage takes it (off under the interpreter).
    assert constexprs == {"GROUP": 16, "BLOCK_H": 16, "L_PAD": 4, "BLOCK_N": 32, "NUM_STAGES": 3,
                          "LAZY_RESCALE": False, "HAS_MASK": False, "BLOCK_TABLE": False,
                          "USE_PDL": module.LAUNCHER.use_pdl("sm_90", False), "Custom_Mask": None,
                          "Mask_Indptr": None, "stride_mask_row": None}
    # num_warps: the default partition's (the scorer); the workers add theirs.
    assert options == {"num_warps": 4, "num_stages": 1, "maxnreg": 168}
    # The Gluon section's split policy sizes the grid, not the row's Triton one (max 64 splits).
    assert module.LAUNCHER.launch_setup("sm_90", 132, 16, 4, 4, None, None).max_splits == 8
    assert prefix(module, batch=16)[0] == TRITON  # the Triton row of the next bucket


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_the_paged_entry_launches_the_gluon_stage_through_its_block_table(module: ModuleType, page_size: int) -> None:
    name, constexprs, _ = prefix(module, page_size=page_size)
    assert name == GLUON and constexprs["BLOCK_TABLE"] is True
    setup = module.LAUNCHER.launch_setup("sm_90", 132, 16, 4, 4, page_size, None)
    assert setup.page_shift == page_size.bit_length() - 1


@pytest.mark.parametrize(("where", "call"), [
    ("sm_100", {"arch": "sm_100"}),
    ("the interpreter", {"arch": "interpreter"}),
    ("a draft longer than BLOCK_N 32", {"draft": 33}),
])
def test_elsewhere_the_row_runs_its_triton_fields(module: ModuleType, where: str, call: dict) -> None:
    name, constexprs, _ = prefix(module, **call)
    assert name == TRITON, where
    assert constexprs["BLOCK_TABLE"] == ("page_size" in call)


def test_without_gluon_the_row_runs_its_triton_fields(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module.LAUNCHER, "gluon_enabled", False)
    name, constexprs, options = prefix(module)
    assert name == TRITON
    assert (constexprs["BLOCK_N"], options["num_warps"], options["num_stages"]) == (64, 8, 2)


@pytest.mark.parametrize("version", ["3.5.1", "3.9.0"])
def test_another_triton_never_launches_the_gluon_stage(built: Path, monkeypatch: pytest.MonkeyPatch,
                                                      version: str) -> None:
    monkeypatch.setattr(triton, "__version__", version)
    copy = _import(built, f"gluon_row_module_triton_{version.replace('.', '_')}")
    assert copy._HAS_GLUON is False
    assert prefix(copy)[0] == TRITON


def test_the_gluon_stage_is_imported_under_its_triton(built: Path) -> None:
    if not triton.__version__.startswith("3.6."):
        pytest.skip("the Gluon prefix stage is written for Triton 3.6")
    copy = _import(built, "gluon_row_module_native")
    assert copy._HAS_GLUON is True and callable(getattr(copy, GLUON))
    assert prefix(copy)[0] == GLUON


# ----------------------------------------------------------------- select_lowering and explain


def test_select_lowering_says_what_each_gluon_row_launches(tmp_path: Path) -> None:
    overflow = {"block_n": 64, "num_stages": 3}
    plan = plan_through_lowering(context(tmp_path, table("sm_90", *GLUON_TABLE, entry(group=128, gluon=overflow))))
    rows = {d.what: d for d in plan.decisions_of("select_lowering")}
    fits = rows["sm_90 row group 16 batch 1-8"]
    # Its 32-token key tiles hold drafts to 32; trees up to MAX_DRAFT_TOKENS (64) run the Triton stage.
    assert fits.value == "Gluon at L 1-32" and not fits.warning
    assert "L 33-64 (longer than BLOCK_N 32)" in fits.why
    need = rules.gluon_shared_bytes(plan.fit.kernel_shape, 32, 3)
    assert f"{need} of 232448 B" in fits.why and "16 x 4 at L 3-4" in fits.why
    assert "both entries" in fits.why and BlockConfig(**TRITON_FIELDS).short() in fits.why
    too_big = rows["sm_90 row group 128 batch 1-8"]
    assert too_big.value == "Triton at every L" and too_big.warning
    overflowing = rules.gluon_shared_bytes(plan.fit.kernel_shape, 64, 3)
    assert overflowing > 232448 and f"{overflowing} B of shared memory, sm_90 has 232448 B" in too_big.why
    assert "sm_90 row group 16 batch 9-32" not in rows  # a Triton row: nothing to say


@pytest.mark.parametrize(("layout", "kv", "q", "missing"), [
    # GQA's stage (gluon_gqa_prefix, the closest package) serves 16-bit, e4m3fn and e5m2 KV
    ("qwen3_5_gqa256", "float8_e4m3fnuz", "bfloat16",
     "kv_dtype: wanted ['bfloat16', 'float16', 'float8_e4m3fn', 'float8_e5m2']"),
    (MLA, "float8_e4m3fnuz", "bfloat16", "stage_dtype: wanted ['bfloat16', 'float16'], layout has None"),
    # rows are shared by the query dtypes
    (MLA, "bfloat16", "float16", "stage_dtype: wanted ['bfloat16', 'float16'], layout has None"),
])
def test_a_module_without_the_gluon_stage_runs_a_gluon_rows_triton_fields(tmp_path: Path, layout: str, kv: str,
                                                                          q: str, missing: str) -> None:
    group = SPECS[layout].attention.group_sizes[0]
    ctx = context(tmp_path, table("sm_90", entry(layout, group, gluon=GLUON_ROW, kv=kv)))
    plan = plan_through_lowering(ctx, layout, kv, q)
    unused = {d.what: d for d in plan.decisions_of("select_lowering")}["gluon sections"]
    assert unused.value == "not launched" and not unused.warning
    assert f"sm_90 row group {group} batch 1-8" in unused.why and missing in unused.why


def test_a_gluon_section_in_another_archs_table_is_refused(tmp_path: Path) -> None:
    for q in ("bfloat16", "float16"):  # whether or not the module has the stage: nothing could launch it
        ctx = context(tmp_path, table("sm_100", entry(gluon=GLUON_ROW)))
        with pytest.raises(TableError, match=f"<test sm_100 table>: the row for {MLA} .*gluon section.*runs on sm_90 "
                                             "only; remove the section"):
            plan_through_lowering(ctx, q=q)


def test_explain_shows_the_lowering_and_the_gluon_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sm_90.json"
    path.write_text(json.dumps({"schema": "kgen.block-config-table/1", "arch": "sm_90",
                                "metadata": {"arch": "sm_90"}, "entries": list(GLUON_TABLE)}))
    monkeypatch.setenv("KGEN_TABLE", str(path))
    text = explain(MLA, "bf16", group=16, arch="sm_90", verbose=True)
    assert "gluon_prefix = gluon/mla_ws_prefix_stage.py.j2" in text
    assert "sm_90 row group 16 batch 1-8 = Gluon at L 1-32\n" in text and "L 33-64 (longer than BLOCK_N 32)" in text
    assert "sm_90 group 16 batch 1-8: BLOCK_H=16 BLOCK_N=64 warps=8 stages=2" in text and "gluon(BLOCK_N=32" in text


# ----------------------------------------------------------------- kgen check compiles it


def test_kgen_check_compiles_a_gluon_row_offline_for_sm90(built: Path) -> None:
    module = check.load_module_file(built)
    if not module._HAS_GLUON:
        pytest.skip("the Gluon prefix stage compiles under Triton 3.6 only (another Triton serves the Triton kernel)")
    infos = check.find_modules(generated=built.parent)
    enum = check.enumerate_variants(infos, ["sm_90"], entries=["token-slot"], index_dtypes=["int32"])
    # The row's Gluon programs (32-token tiles; the default's have 64): one per draft class
    # (L_PAD 1, 2, 4, 8, 16, 32; drafts past 32 run the Triton stage), only at the row's group
    # and batches, on the token-slot entry; each for the chain and for a mask (HAS_MASK).
    gluon = [v for v in enum.variants if v.kernel == GLUON and v.constexprs["BLOCK_N"] == 32]
    for has_mask in (False, True):
        l_pads = sorted(v.constexprs["L_PAD"] for v in gluon if v.constexprs["HAS_MASK"] is has_mask)
        assert l_pads == [1, 2, 4, 8, 16, 32], (has_mask, l_pads)
    assert all(p.group == 16 and 1 <= p.batch <= 8 and p.page_size is None for v in gluon for p in v.points)
    variant = next(v for v in gluon if v.constexprs["L_PAD"] == 4 and v.constexprs["HAS_MASK"])
    # In a spawned worker, as `kgen check` compiles: this process runs Triton's interpreter.
    with check._compile_environment(), ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=check._worker_init) as pool:
        result = pool.submit(check.compile_variant, check._job(variant)).result()
    assert result["error"] is None, result["error"]
    shape = module.LAUNCHER.identity.kernel_shape
    # rules.gluon_shared_bytes bounds what Triton allocates, within its margin.
    estimate = rules.gluon_shared_bytes(shape, 32, 3)
    assert estimate - rules.SHARED_MARGIN_BYTES <= result["shared"] <= estimate
    assert result["registers"] <= 255 and result["spill_stores"] <= check.NVIDIA_SPILL_LIMIT
    assert any(kind.startswith("wgmma.mma_async") for kind in result["mma"]), ("the Gluon stage runs wgmma",
                                                                              result["mma"])



def _warp_roles(job: dict) -> dict:
    """In a spawned worker: compile one Gluon variant for sm_90a and read how its warps split
    the work from the PTX (register reallocation, the ring's barrier operations, wgmma)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    module = check.load_module_file(Path(job["module_path"]))
    kernel = getattr(module, job["kernel"])
    names = kernel.arg_names
    source = GluonASTSource(fn=kernel, signature=dict(job["signature"]),
                            constexprs={(names.index(k),): check._decode(v) for k, v in job["constexprs"].items()},
                            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in job["divisible"]})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(job["options"])).asm["ptx"]
    reallocations = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    return {"setmaxnreg": sorted({(kind, int(n)) for kind, n in reallocations}),
            "copy_arrivals": ptx.count("cp.async.mbarrier.arrive.noinc"),
            "copy_groups": ptx.count("cp.async.commit_group"),
            "waits": ptx.count("mbarrier.try_wait.parity"),
            "wgmma": ptx.count("wgmma.mma_async")}


# The offsets of a 128-byte-swizzled fp16 shared layout (NVMMASharedLayout(128, 16, rank)) of a
# shape, as the linear layout's bases, printed as JSON by a child interpreter: Triton's bindings
# report leaked objects at exit, which stay out of the test run's output.
_SWIZZLED_BASES = """
import json, sys
from triton._C.libtriton import gluon_ir, ir
from triton.experimental.gluon import language as gl
ctx = ir.context()
ir.load_dialects(ctx)
builder = gluon_ir.GluonOpBuilder(ctx)
rank, shape = int(sys.argv[1]), [int(x) for x in sys.argv[2:]]
layout = gl.NVMMASharedLayout(128, 16, rank=rank)._to_ir(builder)
print(json.dumps([list(b) for b in builder.to_linear_layout(layout, shape).offset_bases]))
"""


def _swizzled_bases(shape: list[int]) -> list[list[int]]:
    out = subprocess.run([sys.executable, "-c", _SWIZZLED_BASES, str(len(shape)), *map(str, shape)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9),
                    reason="Triton 3.6's to_linear_layout aborts on shared layouts")
@pytest.mark.parametrize("block_n", [32, 64, 128])
def test_the_mla_latent_slot_is_eight_swizzled_column_blocks(block_n: int) -> None:
    """The FP8 converter of absorbed MLA (gluon/pipeline.py.j2, _gluon_in_place_converter)
    lands chunk k of a tile's e4m3 rows in column block 4 + k // 2 of a stage's latent slot
    [BLOCK_N, 512] (fp16, 128-byte swizzle) and converts it front to back, block by block: that
    needs column block j to be the slot's j-th run of BLOCK_N x 128 bytes, every element
    (r, 64 j + c) at the offset the rank-3 layout [8, BLOCK_N, 64] of the same swizzle gives
    (j, r, c)."""
    slot = _swizzled_bases([block_n, 512])
    blocks = _swizzled_bases([8, block_n, 64])
    # Offsets are linear in the coordinates' bits: equal bases, equal layouts.
    assert [[col >> 6, row, col & 63] for row, col in slot] == blocks
    # Bit i of an offset is basis i: the bases past a block's elements (BLOCK_N x 64) step the block.
    per_block = (block_n * 64).bit_length() - 1
    assert [basis[0] for basis in blocks[per_block:]] == [1, 2, 4]


def test_the_gluon_stage_is_warp_specialized(built: Path) -> None:
    """The compiled stage has three warpgroups: the scorer (the default partition), the second
    P.V and the producer. The workers set their registers (setmaxnreg to
    GLUON_SECOND_PV_REGISTERS and GLUON_PRODUCER_REGISTERS), the scorer takes the most a thread
    may have, the copies signal the ring's `ready` barriers, and every partition waits on one."""
    module = check.load_module_file(built)
    if not module._HAS_GLUON:
        pytest.skip("the Gluon prefix stage compiles under Triton 3.6 only")
    infos = check.find_modules(generated=built.parent)
    enum = check.enumerate_variants(infos, ["sm_90"], entries=["token-slot"], index_dtypes=["int64"])
    variant = next(v for v in enum.variants if v.kernel == GLUON and v.constexprs["L_PAD"] == 4)
    assert variant.options["maxnreg"] == rules.gluon_launch_registers(12) == 168
    with check._compile_environment(), ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=check._worker_init) as pool:
        roles = pool.submit(_warp_roles, check._job(variant)).result()
    set_to = {n for _, n in roles["setmaxnreg"]}
    assert {module.GLUON_SECOND_PV_REGISTERS.value, module.GLUON_PRODUCER_REGISTERS.value, 256} <= set_to, roles
    # Within the register file: 4 warps of each partition at the registers they were given.
    assert 32 * 4 * (256 + module.GLUON_SECOND_PV_REGISTERS.value + module.GLUON_PRODUCER_REGISTERS.value) <= (
        32 * 12 * variant.options["maxnreg"])
    # The producer's prefix tiles and its draft tile each signal `ready`; the scorer waits on
    # `ready`, the second PV on `p_ready` and the rows' stats, the producer on `empty`.
    assert roles["copy_arrivals"] == 2 and roles["waits"] >= 5 and roles["wgmma"] > 0, roles


# ----------------------------------------------------------------- GQA's Gluon stage

GQA = "gqa128"
GQA_GLUON_ROW = {"block_n": 64, "num_stages": 4,
                 "split": {"programs_per_sm": 1, "max_splits": 64, "min_tokens_per_split": 128}}


def build_gqa(out: Path, group: int, gluon: dict, kv: str = "bfloat16") -> Path:
    """The GQA 128 module (bf16 queries) built into ``out`` with one gluon row at ``group``,
    batch 1-8, as sm_90's table."""
    rows = table("sm_90", entry(GQA, group, gluon=gluon, kv=kv))
    return Path(build_one(GQA, kv, "bfloat16", ctx=context(out, rows)).output_path)


@pytest.fixture(scope="module")
def built_gqa(tmp_path_factory) -> Path:
    """The GQA 128 BF16 module with a gluon row at group 8, batch 1-8, as sm_90's table."""
    return build_gqa(tmp_path_factory.mktemp("gluon_gqa_module"), 8, GQA_GLUON_ROW)


@pytest.mark.parametrize(("draft", "block_h", "l_pad"), [(1, 128, 1), (4, 32, 4), (16, 8, 16), (64, 2, 64)])
def test_a_gqa_gluon_row_launches_128_row_programs(built_gqa: Path, monkeypatch: pytest.MonkeyPatch, draft: int,
                                                   block_h: int, l_pad: int) -> None:
    """GQA's stage: 128 rows a program (two consumers of 64), whatever the group; the heads past
    the group are padding, and a program whose rows fit the first consumer leaves the second idle."""
    mod = _import(built_gqa, "gluon_gqa_row_module")
    monkeypatch.setattr(mod.LAUNCHER, "gluon_enabled", True)
    name, constexprs, options = mod.launch_params("sm_90", 132, 8, 4, draft, None)[0]
    assert name == GLUON and (constexprs["BLOCK_H"], constexprs["L_PAD"]) == (block_h, l_pad)
    assert (constexprs["BLOCK_N"], constexprs["NUM_STAGES"]) == (64, 4)
    assert options == {"num_warps": 4, "num_stages": 1, "maxnreg": 168}
    assert mod.launch_params("sm_90", 132, 8, 16, draft, None)[0][0] == TRITON  # no row: the default's Triton


def test_select_lowering_gives_gqa_its_own_stage(tmp_path: Path) -> None:
    rows = table("sm_90", entry(GQA, 8, gluon=GQA_GLUON_ROW))
    plan = plan_through_lowering(context(tmp_path, rows), GQA)
    decisions = {d.what: d for d in plan.decisions_of("select_lowering")}
    assert decisions["gluon_prefix"].value == "gluon_gqa/ws_prefix_stage.py.j2"
    fits = decisions["sm_90 row group 8 batch 1-8"]
    need = rules.gluon_shared_bytes(plan.fit.kernel_shape, 64, 4)
    # q of 128 rows and four stages of K and V, 64 tokens of 128 columns each.
    assert need == 128 * 128 * 2 + 4 * 64 * 256 * 2 + rules.SHARED_MARGIN_BYTES
    assert fits.value == "Gluon at L 1-64" and f"{need} of 232448 B" in fits.why and "32 x 4 at L 3-4" in fits.why


def _compiled_with_roles(variant) -> tuple[dict, dict]:
    """kgen check's result of a Gluon variant and its warps' roles (_warp_roles), compiled in a
    spawned worker as `kgen check` compiles (this process runs Triton's interpreter)."""
    with check._compile_environment(), ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=check._worker_init) as pool:
        return (pool.submit(check.compile_variant, check._job(variant)).result(),
                pool.submit(_warp_roles, check._job(variant)).result())


def gqa_variant(built: Path, l_pad: int, **constexprs: int) -> tuple[ModuleType, check.Variant]:
    """A built GQA module and its Gluon program at this L_PAD (and these constexprs), without a
    mask, as `kgen check` enumerates it (token slots, int64 indices). Skips where this Triton
    does not compile the Gluon stage."""
    module = check.load_module_file(built)
    if not module._HAS_GLUON:
        pytest.skip("the Gluon prefix stage compiles under Triton 3.6 only")
    infos = check.find_modules(generated=built.parent)
    enum = check.enumerate_variants(infos, ["sm_90"], entries=["token-slot"], index_dtypes=["int64"])
    return module, next(v for v in enum.variants if v.kernel == GLUON and v.constexprs["L_PAD"] == l_pad
                        and not v.constexprs["HAS_MASK"]
                        and all(v.constexprs[k] == value for k, value in constexprs.items()))


def test_kgen_check_compiles_the_gqa_stage_warp_specialized(built_gqa: Path) -> None:
    """Offline for sm_90: two consumers at GLUON_CONSUMER_REGISTERS beside the producer at
    GLUON_PRODUCER_REGISTERS, the producer's cp.async arrivals on `ready` (prefix and draft
    tiles), wgmma, and shared memory within rules.gluon_shared_bytes."""
    module, variant = gqa_variant(built_gqa, 16)
    result, roles = _compiled_with_roles(variant)
    assert result["error"] is None, result["error"]
    estimate = rules.gluon_shared_bytes(module.LAUNCHER.identity.kernel_shape, 64, 4)
    assert estimate - rules.SHARED_MARGIN_BYTES <= result["shared"] <= estimate
    assert result["spill_stores"] == 0, result
    set_to = {n for _, n in roles["setmaxnreg"]}
    assert {module.GLUON_CONSUMER_REGISTERS.value, module.GLUON_PRODUCER_REGISTERS.value} <= set_to, roles
    assert roles["copy_arrivals"] == 2 and roles["wgmma"] > 0, roles


@pytest.mark.parametrize(("draft", "kernel"), [(1, TRITON), (7, TRITON), (8, GLUON), (16, GLUON)])
def test_from_rows_keeps_short_drafts_on_the_triton_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          draft: int, kernel: str) -> None:
    """A gluon section's from_rows: at group 8, 64 rows a KV head from L 8 on; below, the row's
    Triton fields (BLOCK_N 64, 8 warps). select_lowering says the same per draft length."""
    rows = table("sm_90", entry(GQA, 8, gluon={**GQA_GLUON_ROW, "from_rows": 64}))
    ctx = context(tmp_path, rows)
    mod = _import(Path(build_one(GQA, "bfloat16", "bfloat16", ctx=ctx).output_path), f"from_rows_{draft}")
    monkeypatch.setattr(mod.LAUNCHER, "gluon_enabled", True)
    name, _, options = mod.launch_params("sm_90", 132, 8, 4, draft, None)[0]
    assert name == kernel and (options["num_warps"] == 8) is (kernel == TRITON)
    decisions = {d.what: d for d in run_pipeline(new_plan(SPECS[GQA], "bfloat16", "bfloat16"), ctx,
                                                 stop_after="select_lowering").decisions_of("select_lowering")}
    fits = decisions["sm_90 row group 8 batch 1-8"]
    assert fits.value == "Gluon at L 8-64" and "L 1-7 (under 64 rows a KV head, group x L (from_rows))" in fits.why


@pytest.mark.parametrize(("l_pad", "converters"), [(16, 1), (4, 2)])
def test_the_gqa_stage_converts_fp8_off_the_mma_warps(tmp_path: Path, l_pad: int, converters: int) -> None:
    """GQA's FP8 converting producer (gluon/pipeline.py.j2), compiled offline for sm_90: no
    cp.async (the producer loads through registers and converts), wgmma, no spills at 64-token
    tiles. Group 8 at L_PAD 16 fills both consumers: they run at GLUON_CONSUMER_REGISTERS beside
    one converter. At L_PAD 4 its 32 rows fit consumer 0, and consumer 1's warpgroup converts
    too: both workers are converters at GLUON_PRODUCER_REGISTERS."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip("the Gluon prefix stage compiles under Triton 3.6 only")
    module, variant = gqa_variant(build_gqa(tmp_path, 8, GQA_GLUON_ROW, "float8_e4m3fn"), l_pad, GROUP=8)
    result, roles = _compiled_with_roles(variant)
    assert result["error"] is None, result["error"]
    assert result["spill_stores"] == 0, result
    set_to = {n for _, n in roles["setmaxnreg"]}
    consumer, producer = module.GLUON_CONSUMER_REGISTERS.value, module.GLUON_PRODUCER_REGISTERS.value
    # One converter: consumer 1 is a worker at the consumers' registers; two: no worker is a consumer.
    assert producer in set_to and (consumer in set_to) == (converters == 1), roles
    assert roles["copy_arrivals"] == 0 and roles["wgmma"] > 0, roles


# ------------------------------------------------ FP8 GQA: two converters beside two consumers

FP8_GQA_ROW = {"block_n": 64, "num_stages": 2,
               "split": {"programs_per_sm": 1, "max_splits": 64, "min_tokens_per_split": 128}}


def _fp8_gqa_module(tmp_path: Path, converters: int | None, name: str) -> ModuleType:
    gluon = {**FP8_GQA_ROW, **({"converters": converters} if converters else {})}
    return _import(build_gqa(tmp_path, 8, gluon, "float8_e4m3fn"), name)


@pytest.mark.parametrize(("converters", "draft", "expected", "maxnreg"), [
    (None, 4, 2, 168), (None, 16, 1, 168),  # the rule: two where consumer 1 has no rows (32 rows), else one
    (2, 4, 2, 168), (2, 16, 2, 128),  # beside two consumers (128 rows) a fourth warpgroup: 16 warps
    (1, 4, 1, 168), (1, 16, 1, 168),
])
def test_an_fp8_gqa_launch_chooses_its_converters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  converters: int | None, draft: int, expected: int,
                                                  maxnreg: int) -> None:
    """CONVERTERS and the launch's maxnreg follow rules.gluon_converters / gluon_warps: a 16-warp
    program launches at 128 registers a thread, a 12-warp one at 168."""
    mod = _fp8_gqa_module(tmp_path, converters, f"fp8_converters_{converters}_{draft}")
    monkeypatch.setattr(mod.LAUNCHER, "gluon_enabled", True)
    name, constexprs, options = mod.launch_params("sm_90", 132, 8, 4, draft, None)[0]
    assert name == GLUON and constexprs["CONVERTERS"] == expected and options["maxnreg"] == maxnreg


@pytest.mark.parametrize(("layout", "kv", "why"), [
    ("qwen3_5_gqa256", "float8_e4m3fn", "head dim 256: beside two consumers a second converter makes 16 warps"),
    (GQA, "bfloat16", "only GQA's FP8 programs convert"),
    (MLA, "float8_e4m3fn", "only GQA's FP8 programs convert"),
])
def test_converters_no_program_could_have_are_refused(tmp_path: Path, layout: str, kv: str, why: str) -> None:
    gluon = {**(FP8_GQA_ROW if layout != MLA else GLUON_ROW), "converters": 2}
    ctx = context(tmp_path, table("sm_90", entry(layout, 16, gluon=gluon, kv=kv)))
    with pytest.raises(TableError, match=f"the row for {layout} .*2 converters.*{why}.*remove converters"):
        plan_through_lowering(ctx, layout, kv)


def test_two_converters_beside_two_consumers_compile_at_16_warps(tmp_path: Path) -> None:
    """Offline for sm_90: the four-warpgroup FP8 program (GQA 128, group 8, L_PAD 16: both
    consumers have rows) at maxnreg 128: the consumers at GLUON_FOUR_WARPGROUP_CONSUMER_REGISTERS,
    both converters at GLUON_PRODUCER_REGISTERS, no cp.async, no spills at 64-token tiles."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip("the Gluon prefix stage compiles under Triton 3.6 only")
    module, variant = gqa_variant(build_gqa(tmp_path, 8, {**FP8_GQA_ROW, "converters": 2}, "float8_e4m3fn"), 16,
                                  GROUP=8)
    assert variant.options["maxnreg"] == rules.gluon_launch_registers(16) == 128
    result, roles = _compiled_with_roles(variant)
    assert result["error"] is None, result["error"]
    assert result["spill_stores"] == 0, result
    consumer = module.GLUON_FOUR_WARPGROUP_CONSUMER_REGISTERS.value
    producer = module.GLUON_PRODUCER_REGISTERS.value
    assert 32 * 4 * (2 * consumer + 2 * producer) == rules.REGISTER_FILE
    assert {consumer, producer} <= {n for _, n in roles["setmaxnreg"]}, roles
    assert roles["copy_arrivals"] == 0 and roles["wgmma"] > 0, roles


def test_select_lowering_says_each_fp8_programs_converters(tmp_path: Path) -> None:
    """Group 8: 32 rows at L 4 (consumer 1 converts), 128 at L 16 (a fourth warpgroup converts)."""
    for converters, at_16 in ((None, "8 x 16 (1 converter)"), (2, "8 x 16 (2 converters)")):
        gluon = {**FP8_GQA_ROW, **({"converters": converters} if converters else {})}
        rows = table("sm_90", entry(GQA, 8, gluon=gluon, kv="float8_e4m3fn"))
        plan = plan_through_lowering(context(tmp_path, rows), GQA, "float8_e4m3fn")
        fits = {d.what: d for d in plan.decisions_of("select_lowering")}["sm_90 row group 8 batch 1-8"]
        assert "32 x 4 (2 converters) at L 3-4" in fits.why and f"{at_16} at L 9-16" in fits.why, fits.why


# ------------------------------------------------ FP8 GQA: one converter with a landing ring


@pytest.mark.parametrize(("landing", "draft", "converters"), [(3, 4, 1), (3, 16, 1), (None, 4, 2)])
def test_a_landing_ring_makes_one_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            landing: int | None, draft: int, converters: int) -> None:
    """A section's landing_stages reaches the launch as LANDING_STAGES with one converter, even
    where consumer 1 has no rows (L 4: 32 rows); without it LANDING_STAGES is 0 and the rule's
    converters stand."""
    gluon = {**FP8_GQA_ROW, **({"landing_stages": landing} if landing else {})}
    mod = _import(build_gqa(tmp_path, 8, gluon, "float8_e4m3fn"), f"fp8_landing_{landing}_{draft}")
    monkeypatch.setattr(mod.LAUNCHER, "gluon_enabled", True)
    name, constexprs, options = mod.launch_params("sm_90", 132, 8, 4, draft, None)[0]
    assert name == GLUON and constexprs["LANDING_STAGES"] == (landing or 0)
    assert constexprs["CONVERTERS"] == converters and options["maxnreg"] == 168


def test_the_landing_ring_counts_in_shared_memory() -> None:
    """GQA 128 FP8, 64-token tiles, 2 stages: each landing tile adds 64 tokens of e4m3 K and V."""
    shape = rules.kernel_shape(128, 128, 1, True)
    without = rules.gluon_shared_bytes(shape, 64, 2)
    assert rules.gluon_shared_bytes(shape, 64, 2, 3) - without == 3 * 64 * 2 * 128


@pytest.mark.parametrize(("layout", "kv", "extra", "why"), [
    (GQA, "bfloat16", {}, "only GQA's FP8 programs land"),
    (MLA, "float8_e4m3fn", {}, "only GQA's FP8 programs land"),
    (GQA, "float8_e4m3fn", {"converters": 2}, "one converter; two converters hold their tiles in registers"),
])
def test_a_landing_ring_no_program_could_have_is_refused(tmp_path: Path, layout: str, kv: str, extra: dict,
                                                         why: str) -> None:
    gluon = {**(FP8_GQA_ROW if layout != MLA else GLUON_ROW), "landing_stages": 3, **extra}
    ctx = context(tmp_path, table("sm_90", entry(layout, 16, gluon=gluon, kv=kv)))
    with pytest.raises(TableError, match=f"the row for {layout} .*3-tile landing ring.*{why}.*remove landing_stages"):
        plan_through_lowering(ctx, layout, kv)


def test_select_lowering_says_a_programs_landing_ring(tmp_path: Path) -> None:
    rows = table("sm_90", entry(GQA, 8, gluon={**FP8_GQA_ROW, "landing_stages": 3}, kv="float8_e4m3fn"))
    plan = plan_through_lowering(context(tmp_path, rows), GQA, "float8_e4m3fn")
    fits = {d.what: d for d in plan.decisions_of("select_lowering")}["sm_90 row group 8 batch 1-8"]
    assert "32 x 4 (1 converter, a 3-tile landing ring) at L 3-4" in fits.why, fits.why


@pytest.mark.parametrize("l_pad", [4, 16])
def test_the_landing_converter_compiles_with_its_ring(tmp_path: Path, l_pad: int) -> None:
    """Offline for sm_90 (GQA 128, group 8): the converter lands its rows by cp.async in commit
    groups (no arrival on `ready` from the copies: it arrives after converting), the consumers
    run wgmma, no spills at 64-token tiles, and shared memory within rules.gluon_shared_bytes
    (at L_PAD 4 q takes one tile: consumer 1 has no rows)."""
    if not triton.__version__.startswith("3.6."):
        pytest.skip("the Gluon prefix stage compiles under Triton 3.6 only")
    gluon = {**FP8_GQA_ROW, "landing_stages": 3}
    module, variant = gqa_variant(build_gqa(tmp_path, 8, gluon, "float8_e4m3fn"), l_pad, GROUP=8)
    assert variant.constexprs["LANDING_STAGES"] == 3 and variant.constexprs["CONVERTERS"] == 1
    result, roles = _compiled_with_roles(variant)
    assert result["error"] is None, result["error"]
    assert result["spill_stores"] == 0, result
    assert result["shared"] <= rules.gluon_shared_bytes(module.LAUNCHER.identity.kernel_shape, 64, 2, 3)
    assert roles["copy_groups"] > 0 and roles["copy_arrivals"] == 0 and roles["wgmma"] > 0, roles


def test_a_landing_ring_that_does_not_fit_beside_two_consumers_is_left_out(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA 256, group 4, 64-token tiles, 2 stages, a 2-tile ring: at L 16 (64 rows) q takes one
    tile and the ring fits; at L 32 (128 rows) two consumers' q leave it no room, and the
    program converts through registers (rules.gluon_landing_stages). select_lowering says both."""
    layout = "qwen3_5_gqa256"
    gluon = {**FP8_GQA_ROW, "landing_stages": 2}
    rows = table("sm_90", entry(layout, 4, gluon=gluon, kv="float8_e4m3fn"))
    ctx = context(tmp_path, rows)
    mod = _import(Path(build_one(layout, "float8_e4m3fn", "bfloat16", ctx=ctx).output_path), "landing_gqa256")
    monkeypatch.setattr(mod.LAUNCHER, "gluon_enabled", True)
    landing = {}
    for draft in (16, 32):
        name, constexprs, _ = mod.launch_params("sm_90", 132, 4, 4, draft, None)[0]
        assert name == GLUON
        landing[draft] = (constexprs["LANDING_STAGES"], constexprs["CONVERTERS"])
    assert landing == {16: (2, 1), 32: (0, 1)}
    plan = plan_through_lowering(ctx, layout, "float8_e4m3fn")
    fits = {d.what: d for d in plan.decisions_of("select_lowering")}["sm_90 row group 4 batch 1-8"]
    assert "8 x 16 (1 converter, a 2-tile landing ring) at L 9-16" in fits.why, fits.why
    assert "4 x 32 (1 converter) at L 17-32" in fits.why, fits.why
