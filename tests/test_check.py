"""kgen check: domain walk, dedupe, signature typing, resource parsing, a real offline compile,
and a variant over the shared-memory limit failing the command."""

from __future__ import annotations

import json
import multiprocessing
import time
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

import kgen
from kgen import check, cli


@pytest.fixture(scope="module")
def gqa64():
    from kgen.loader import generated_dir

    return check.load_module_file(generated_dir() / "verify_gqa64__kv_bf16__q_bf16.py")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KGEN_CHECK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _modules(**kw):
    return check.find_modules(layouts=["gqa64"], kv_dtypes=["bf16"], q_dtypes=["bf16"], variants=["grouped"], **kw)


def test_enumeration_dedupes_to_the_distinct_launches(gqa64):
    enum = check.enumerate_variants(_modules(), ["sm_90"], entries=["token-slot"], index_dtypes=["int32"])
    # Independently: the distinct (kernel, constexprs, options, JIT int classes) over the same walk.
    distinct = set()
    walked = 0
    for point in check.domain(gqa64, "sm_90", ["token-slot"], ["int32"]):
        walked += 1
        scalars = check.runtime_scalars(gqa64, "sm_90", 132, point)
        for name, constexprs, options in gqa64.launch_params("sm_90", 132, point.group, point.batch, point.draft,
                                                             has_mask=point.mask):
            specialized = {p.name for p in getattr(gqa64, name).params if not p.do_not_specialize}
            full = check.complete_launch(gqa64, name, constexprs)
            signature, _, _ = check.kernel_signature(gqa64, name, full, "int32", scalars)
            distinct.add((name, json.dumps({k: str(v) for k, v in full.items()}, sort_keys=True),
                          json.dumps(options, sort_keys=True),
                          tuple(sorted((k, check.jit_int_class(v)) for k, v in scalars.items()
                                       if k in signature and k in specialized))))
    assert enum.points[(gqa64.URI, "sm_90")] == walked
    assert len(enum.variants) == len(distinct)
    assert sum(len(v.points) for v in enum.variants) == enum.launches["sm_90"]
    assert len(enum.variants) < enum.launches["sm_90"] / 3  # launches repeat: distinct compiles are fewer


def test_both_index_dtypes_double_the_variants_and_type_every_index_pointer():
    one = check.enumerate_variants(_modules(), ["sm_90"], entries=["paged"], index_dtypes=["int32"])
    both = check.enumerate_variants(_modules(), ["sm_90"], entries=["paged"])
    assert len(both.variants) == 2 * len(one.variants)
    for variant in both.variants:
        index_types = {t for n, t in variant.signature.items() if n in ("Qo_Indptr", "Kv_Bounds", "Kv_Table")}
        assert len(index_types) == 1 and index_types <= {"*i32", "*i64"}


def test_domain_covers_every_draft_listed_group_an_unlisted_one_and_table_boundaries(gqa64):
    points = list(check.domain(gqa64, "sm_90"))
    groups = {p.group for p in points}
    assert set(gqa64.GROUP_SIZES) < groups and len(groups - set(gqa64.GROUP_SIZES)) == 1
    assert {p.draft for p in points} == set(range(1, gqa64.MAX_DRAFT_TOKENS + 1))
    assert {p.mask for p in points} == {False, True}  # chains and trees
    assert {p.page_size for p in points} == {None, *gqa64.SUPPORTED_PAGE_SIZES}
    for _group, batch_min, batch_max, _config in gqa64.LAUNCHER.block_configs.get("sm_90", ()):
        assert batch_min in {p.batch for p in points}
        assert min(batch_max, check.BATCH_CAP) in {p.batch for p in points}


def test_jit_int_classes_match_tritons_specialization():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    expected = {"one": ("constexpr", 1), "div16": ("i32", "D"), "plain": ("i32", "")}
    for value in (1, 2, 3, 12, 16, 64, 96, 100, 0):
        assert native_specialize_impl(CUDABackend, value, False, True, True) == expected[check.jit_int_class(value)]


def test_runtime_int_of_one_becomes_a_constexpr_in_the_signature(gqa64):
    """As the JIT does for a parameter it specializes (the shipped kernels mark these
    do_not_specialize; the rule is checked with the mark taken off)."""
    launch = gqa64.launch_params("sm_90", 132, 8, 1, 2)[0]
    constexprs = check.complete_launch(gqa64, launch[0], launch[1])
    params = {p.name: p for p in getattr(gqa64, launch[0]).params}
    names = ("max_splits", "min_tokens_per_split", "page_shift")
    try:
        for name in names:
            params[name].do_not_specialize = False
        signature, constants, divisible = check.kernel_signature(
            gqa64, launch[0], constexprs, "int64", {"max_splits": 1, "min_tokens_per_split": 128, "page_shift": 3})
    finally:
        for name in names:
            params[name].do_not_specialize = True
    assert signature["max_splits"] == "constexpr" and constants["max_splits"] == 1
    assert signature["min_tokens_per_split"] == "i32" and "min_tokens_per_split" in divisible
    assert signature["page_shift"] == "i32" and "page_shift" not in divisible
    assert signature["Kv_Table"] == "*i64" and signature["K_Buffer"] == "*bf16"
    assert "stride_k_page" in divisible and "stride_table" not in divisible


def test_unknown_kernel_parameter_is_an_error_naming_it():
    kernel = types.SimpleNamespace(arg_names=["Q", "Mystery_Weights", "BLOCK_N"])
    module = types.SimpleNamespace(URI="verify_fake", Q_DTYPE="torch.bfloat16", KV_DTYPE="torch.bfloat16",
                                   _fake=kernel)
    with pytest.raises(check.CheckError, match="Mystery_Weights"):
        check.kernel_signature(module, "_fake", {"BLOCK_N": 64}, "int32")


def test_a_constexpr_launch_params_leaves_out_is_an_error(gqa64):
    name, constexprs, _ = gqa64.launch_params("sm_90", 132, 8, 1, 2)[0]
    del constexprs["BLOCK_N"]
    with pytest.raises(check.CheckError, match="BLOCK_N"):
        check.complete_launch(gqa64, name, constexprs)


PTXAS_LOG = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_verify_prefix_stage' for 'sm_90a'
ptxas info    : Function properties for _verify_prefix_stage
    24 bytes stack frame, 156 bytes spill stores, 148 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 229392 bytes smem
ptxas info    : Compile time = 917.262 ms
"""

AMDGCN_METADATA = """    .group_segment_fixed_size: 0
    .kernarg_segment_align: 8
    .max_flat_workgroup_size: 512
    .name:           _verify_prefix_stage
    .private_segment_fixed_size: 552
    .sgpr_count:     104
    .sgpr_spill_count: 71
    .symbol:         _verify_prefix_stage.kd
    .vgpr_count:     512
    .vgpr_spill_count: 136
    .wavefront_size: 64
  - .agpr_count:     256
"""


def test_ptxas_log_parsing():
    parsed = check.parse_ptxas_log(PTXAS_LOG)
    assert parsed == {"registers": 255, "stack_bytes": 24, "spill_stores": 156, "spill_loads": 148}
    with pytest.raises(ValueError, match="registers"):
        check.parse_ptxas_log("ptxas info    : Compile time = 1 ms")


def test_amdgcn_metadata_parsing_and_mfma_count():
    text = AMDGCN_METADATA + "\tv_mfma_f32_16x16x32_bf16 a[0:3], v[2:5], v[6:9], 0\n" * 3 + \
        "\tv_mfma_f32_32x32x16_bf16 a[0:15], v[2:5], v[6:9], 0\n"
    parsed = check.parse_amdgcn(text)
    assert (parsed["vgprs"], parsed["sgprs"], parsed["agprs"]) == (512, 104, 256)
    assert (parsed["vgpr_spills"], parsed["sgpr_spills"], parsed["scratch_bytes"]) == (136, 71, 552)
    assert parsed["mma"] == {"v_mfma_f32_16x16x32_bf16": 3, "v_mfma_f32_32x32x16_bf16": 1}
    ptx = """
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 0, 1;
	@%p3 wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%r2}, %rd3, %rd4, p, 1, 1;
	mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r3}, {%r4}, {%f2};
	tcgen05.mma.cta_group::1.kind::f16 [%r5], %rd5, %rd6, %r6, p;
	// wgmma.mma_async in a comment is not an instruction
	wgmma.fence.sync.aligned;
"""
    assert check.count_nvidia_mma(ptx) == {"mma.sync f16": 1, "tcgen05.mma f16": 1, "wgmma.mma_async bf16": 1,
                                           "wgmma.mma_async e4m3": 1}


def test_real_offline_compile_gqa64_sm90(gqa64):
    point = check.Point(8, 2, 64, None, "int32", False)
    name, constexprs, options = gqa64.launch_params("sm_90", 132, 8, 64, 2)[0]
    constexprs = check.complete_launch(gqa64, name, constexprs)
    signature, constants, divisible = check.kernel_signature(gqa64, name, constexprs, "int32",
                                                             check.runtime_scalars(gqa64, "sm_90", 132, point))
    job = {"arch": "sm_90", "module_path": str(gqa64.__file__), "kernel": name, "options": options,
           "constexprs": {k: check._encode(v) for k, v in constants.items()}, "signature": signature,
           "divisible": divisible}
    started = time.perf_counter()
    # In a spawned worker, as `kgen check` compiles: this process runs Triton's interpreter.
    with check._compile_environment(), ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=check._worker_init) as pool:
        result = pool.submit(check.compile_variant, job).result()
    assert result["error"] is None, result["error"]
    assert 0 < result["shared"] <= check.ARCHS["sm_90"].shared_limit
    assert 0 < result["registers"] <= 255 and 0 <= result["spill_stores"] <= check.NVIDIA_SPILL_LIMIT
    assert result["mma"], "a prefix stage with tl.dot has tensor-core instructions"
    assert time.perf_counter() - started < 60


def _huge_launch_params(module):
    """launch_params that stages a 512-token tile 4 deep: far past any target's shared memory."""
    real = module.launch_params

    def launch_params(arch, num_sms, group, batch, max_len, page_size=None, config=None, has_mask=False):
        launches = real(arch, num_sms, group, 1, 1, None, config)[:1]  # one prefix launch everywhere
        name, constexprs, options = launches[0]
        return [(name, {**constexprs, "BLOCK_N": 512}, {**options, "num_stages": 4})]

    return launch_params


def _ci_fails_too(args: list[str], ledger: Path, capsys, named: str) -> None:
    """kgen check --ci judges what the plain check does (here from the check cache the plain run
    filled): a program missing from the ledger is never trusted."""
    assert cli.main([*args, "--ci", "--ledger", str(ledger)]) == 1
    captured = capsys.readouterr()
    assert named in captured.err and "; program " in captured.err
    assert captured.out.splitlines()[-1].startswith("ledger: ") and " 0 differ" in captured.out


def test_shared_memory_overflow_fails_the_command_and_names_the_variant(cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(check, "module_launch_params", _huge_launch_params)
    monkeypatch.setattr(check, "runtime_scalars", lambda module, arch, num_sms, point: {})
    args = ["check", "--arch", "sm_90", "--layout", "gqa64", "--kv-dtype", "bf16", "--q-dtype", "bf16",
            "--variant", "grouped", "--entry", "token-slot", "--index-dtype", "int32", "--jobs", "1", "-q"]
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 1
    named = "FAIL verify_gqa64__kv_bf16__q_bf16 sm_90 _verify_prefix_stage: shared memory"
    assert named in err
    assert "> 232448 B limit" in err and "BLOCK_N=512" in err and "num_stages=4" in err
    assert "draft length 1-64" in err and "(chain/tree)" in err
    _ci_fails_too(args, tmp_path / "ledger.jsonl", capsys, named)


def _one_warp_launch_params(module):
    """launch_params that runs GQA 256's 64-row program (group 16 at batch 64, L 4) on one warp:
    its 64 x 256 fp32 accumulator alone is 512 registers a thread, so ptxas spills far past the
    limit."""
    real = module.launch_params

    def launch_params(arch, num_sms, group, batch, max_len, page_size=None, config=None, has_mask=False):
        name, constexprs, options = real(arch, num_sms, 16, 64, 4, None, config)[0]
        assert constexprs["BLOCK_H"] * constexprs["L_PAD"] == 64, constexprs
        return [(name, constexprs, {**options, "num_warps": 1})]

    return launch_params


def test_a_variant_that_spills_past_the_limit_fails_the_command_and_is_named(cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(check, "module_launch_params", _one_warp_launch_params)
    monkeypatch.setattr(check, "runtime_scalars", lambda module, arch, num_sms, point: {})
    args = ["check", "--arch", "sm_90", "--layout", "qwen3_5_gqa256", "--kv-dtype", "bf16", "--q-dtype", "bf16",
            "--variant", "grouped", "--entry", "token-slot", "--index-dtype", "int32", "--jobs", "1", "-q"]
    code = cli.main(args)
    captured = capsys.readouterr()
    assert code == 1
    named = "FAIL verify_qwen3_5_gqa256__kv_bf16__q_bf16 sm_90 _verify_prefix_stage: spills"
    assert named in captured.err
    assert f"B a thread > {check.NVIDIA_SPILL_LIMIT} B" in captured.err and "num_warps=1" in captured.err
    assert "1 variant(s) do not fit their target" in captured.err
    assert "kernel family" in captured.out  # where the time went is printed, failing or not
    _ci_fails_too(args, tmp_path / "ledger.jsonl", capsys, named)


_KERNEL_FILE = """
import triton
import triton.language as tl

WIDTH: tl.constexpr = {width}
{padding}

@triton.jit
def _helper(x):
    return x * {factor}


@triton.jit
def _kernel(X, Y):
    offs = tl.arange(0, WIDTH)
    tl.store(Y + offs, _helper(tl.load(X + offs)))
"""


def _program_hash_of(tmp_path, name, width=16, factor=2, padding=""):
    path = tmp_path / f"{name}.py"
    path.write_text(_KERNEL_FILE.format(width=width, factor=factor, padding=padding))
    return check.program_hash(check.load_module_file(path)._kernel)


def test_a_program_is_its_content_not_the_line_it_starts_on(tmp_path):
    """Modules that hold the same kernel text at other lines share one compile; any change to
    the kernel, a function it calls or a global constexpr it reads makes another."""
    base = _program_hash_of(tmp_path, "base")
    assert _program_hash_of(tmp_path, "moved", padding="\n\n# another module's text above\n\n") == base
    assert _program_hash_of(tmp_path, "helper_changed", factor=3) != base
    assert _program_hash_of(tmp_path, "global_changed", width=32) != base


def test_programs_shared_between_modules_compile_once_and_count_for_each():
    """The default module's merge stage is the same program for its BF16 and FP8 KV modules where
    their prefix stages block the rows alike (drafts to 4; past that, under Triton 3.6, BF16's
    group 8 row runs the Gluon stage from 64 rows with its own split policy, and past 8 BF16's
    programs widen to 256 rows, FP8's keep 128), so one compile serves both."""
    enum = check.select_variants(["sm_90"], layouts=["gqa64"], kv_dtypes=["bf16", "fp8_e4m3fn"], q_dtypes=["bf16"],
                            variants=["grouped"], entries=["token-slot"], index_dtypes=["int64"])
    merges = [v for v in enum.variants if v.kernel == "_verify_merge_stage" and int(v.constexprs["L_PAD"]) <= 4]
    assert merges and all(len(v.modules) == 2 for v in merges), [sorted(v.modules) for v in merges]
    assert check.module_variant_count(enum) > len(enum.variants)


def test_verdicts_apply_the_limits():
    point_table = check.Point(16, 8, 1, None, "int64", True)
    point_default = check.Point(16, 8, 1, None, "int64", False)

    def variant(arch, point):
        return check.Variant("k", "verify_x", "x.py", "_verify_prefix_stage", arch, {}, {}, {}, [], [point])

    amd = {"shared": 1000, "vgpr_spills": 83, "sgpr_spills": 0}
    assert check.verdict(variant("gfx950", point_table), amd) == [
        "a shipped table row spills on gfx950: 83 VGPRs, 0 SGPRs"]
    assert check.verdict(variant("gfx950", point_default), amd) == []  # listed in the report, not a failure
    assert check.verdict(variant("gfx942", point_default), {**amd, "shared": 65537})[0].startswith(
        "LDS 65537 B > 65536 B limit")
    nvidia = {"shared": 1000, "spill_stores": 2049}
    assert check.verdict(variant("sm_90", point_default), nvidia) == ["spills 2049 B a thread > 2048 B"]
    assert check.verdict(variant("sm_90", point_default), {**nvidia, "spill_stores": 2048}) == []
    assert check.verdict(variant("sm_80", point_default), {"error": "PTXASError: boom"}) == [
        "compile error: PTXASError: boom"]


def test_refusals_name_module_and_arch():
    mods = check.find_modules(layouts=["gqa64"], kv_dtypes=["fp8"], q_dtypes=["bf16"], variants=["grouped"])
    enum = check.enumerate_variants(mods, ["sm_80", "gfx942"], entries=["token-slot"], index_dtypes=["int32"])
    assert {(r.arch, r.module) for r in enum.refused} == {
        ("sm_80", "verify_gqa64__kv_fp8_e4m3fn__q_bf16"), ("gfx942", "verify_gqa64__kv_fp8_e4m3fn__q_bf16")}
    assert not enum.variants


def test_cache_makes_a_rerun_compile_nothing(cache, monkeypatch):
    monkeypatch.setattr(check, "compile_variant", lambda job: {"shared": 1, "registers": 1, "spill_stores": 0,
                                                               "spill_loads": 0, "stack_bytes": 0, "mma": {},
                                                               "error": None, "compile_s": 0.0})
    store = check.ResultCache(cache)
    enum = check.enumerate_variants(_modules(), ["sm_90"], entries=["token-slot"], index_dtypes=["int32"])
    for v in enum.variants:
        store.put(v.key, check.compile_variant({}))
    results, timing = check.compile_all(enum.variants, ["sm_90"], 1, store, progress=False)
    assert timing["sm_90"]["compiled"] == 0 and timing["sm_90"]["cached"] == len(enum.variants)
    assert all(r["cached"] for r in results.values())


def test_do_not_specialize_parameters_keep_one_variant(gqa64):
    name, constexprs, _ = gqa64.launch_params("sm_90", 132, 8, 1, 2)[0]
    constexprs = check.complete_launch(gqa64, name, constexprs)
    kernel = getattr(gqa64, name)
    assert {p.name for p in kernel.params if p.do_not_specialize} >= {"max_splits", "min_tokens_per_split"}
    signature, constants, divisible = check.kernel_signature(gqa64, name, constexprs, "int32",
                                                             {"max_splits": 1, "min_tokens_per_split": 128})
    assert signature["max_splits"] == "i32" and "max_splits" not in constants and "max_splits" not in divisible
    assert "min_tokens_per_split" not in divisible


def test_json_and_markdown_reports_carry_every_variant_and_the_failures(monkeypatch, cache):
    def fake_compile_all(variants, archs, jobs, store, progress=True):
        results = {v.key: {"shared": 300000 if v.kernel == "_verify_prefix_stage" else 64, "registers": 100,
                           "spill_stores": 8, "spill_loads": 8, "stack_bytes": 0, "mma": {}, "error": None,
                           "compile_s": 0.0, "cached": False} for v in variants}
        return results, {a: {"programs": len(variants), "compiled": len(variants), "cached": 0, "compile_s": 0.0}
                         for a in archs}

    monkeypatch.setattr(check, "compile_all", fake_compile_all)
    report = check.run_check(["sm_90"], layouts=["gqa64"], kv_dtypes=["bf16"], q_dtypes=["bf16"],
                             variants=["grouped"], entries=["token-slot"], index_dtypes=["int32"], progress=False)
    data = json.loads(json.dumps(check.to_json(report), default=sorted))
    prefix = [v for v in data["variants"] if v["kernel"] == "_verify_prefix_stage"]
    assert len(data["variants"]) == len(report.enumeration.variants)
    assert data["failures"] == len(prefix) > 0
    markdown = check.format_markdown(report)
    assert f"## Failures ({len(prefix)})" in markdown and "shared memory 300000 B > 232448 B" in markdown
    assert "8 B spill stores" in markdown  # merge stages: spills under the limit are listed, not hidden
    assert f"FAIL ({len(prefix)})" in check.format_table(report)


def _offline_compile_tool(monkeypatch):
    """benchmarks/offline_compile.py as a module. It drops TRITON_INTERPRET at import (it compiles
    for a real target): monkeypatch puts it back for the tests after the caller."""
    import importlib.util

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "offline_compile.py"
    spec = importlib.util.spec_from_file_location("offline_compile", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_offline_compile_finds_the_longest_loop(monkeypatch):
    """benchmarks/offline_compile.py counts spills inside the widest loop (nvdisasm's .L_x_N
    labels and backward branches), not the ones outside it."""
    tool = _offline_compile_tool(monkeypatch)
    sass = "\n".join([
        "        /*0000*/                   STL [R1], R2 ;",
        ".L_x_1:",
        "        /*0010*/                   LDL R3, [R1] ;",
        "        /*0020*/                   @P0 BRA `(.L_x_1) ;",
        ".L_x_2:",
        "        /*0030*/                   LDL R4, [R1] ;",
        "        /*0040*/                   STL [R1], R4 ;",
        "        /*0050*/                   HGMMA.64x64x16 R8, gdesc[UR4], R8 ;",
        "        /*0060*/                   @P1 BRA `(.L_x_2) ;",
        "        /*0070*/                   BRA `(.L_x_3) ;",
        ".L_x_3:",
        "        /*0080*/                   EXIT ;",
    ])
    loop = tool.longest_loop(sass)
    assert len(loop) == 4 and sum(" LDL" in i for i in loop) == 1 and sum(" STL" in i for i in loop) == 1
    assert tool.longest_loop("        /*0000*/                   EXIT ;") == []


def test_offline_compile_counts_code_not_data(monkeypatch):
    """The code size offline_compile.py prints counts instructions, not the data nvdisasm lists
    after them as .byte lines."""
    tool = _offline_compile_tool(monkeypatch)
    sass = "\n".join([
        ".L_x_1:",
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   @!P0 EXIT ;",
        "        /*0020*/                   { HGMMA.64x64x16.F32 R8, gdesc[UR4], R8 ;",
        "        /*0030*/ \t.byte\t0x20, 0x25, 0x72, 0x35",
        "        /*0040*/ \t.byte\t0x09, 0x25, 0x72, 0x38",
    ])
    assert tool.code_instructions(sass) == 3


def test_offline_compile_lists_each_partitions_loop(monkeypatch):
    """A warp-specialized program's partitions each loop over the tiles inside one wide loop:
    offline_compile.py lists the innermost loops past a size, with what each issues a pass."""
    tool = _offline_compile_tool(monkeypatch)
    sass = "\n".join([
        ".L_x_0:",
        "        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x3, 0x80 ;",
        ".L_x_1:",
        "        /*0010*/                   F2FP.F16.E4M3.UNPACK_B R2, R3 ;",
        "        /*0020*/                   LDGSTS.E.BYPASS.128 [R0], desc[UR4][R4.64] ;",
        "        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x3, 0x80 ;",
        "        /*0040*/                   @P0 BRA `(.L_x_1) ;",
        ".L_x_2:",
        "        /*0050*/                   HGMMA.64x64x16.F32 R8, gdesc[UR4], R8 ;",
        "        /*0060*/                   LDL R4, [R1] ;",
        "        /*0070*/                   @P1 BRA `(.L_x_2) ;",
        "        /*0080*/                   @P2 BRA `(.L_x_0) ;",
        "        /*0090*/                   EXIT ;",
    ])
    converter, consumer = tool.innermost_loops(sass, min_instructions=3)
    assert [tool._count(op, converter) for op in tool._PER_TILE] == [0, 1, 1, 1, 0, 0]
    assert [tool._count(op, consumer) for op in tool._PER_TILE] == [1, 0, 0, 0, 1, 0]
    assert len(tool.longest_loop(sass)) == 9


def test_a_compile_does_not_change_the_next_one_in_its_worker():
    """Every compile runs in a fork of its worker (compile_isolated): under Triton 3.6 an AMD
    compile changes what the next one of the other AMD target gives in the same process (this
    gfx950 FP8 program got 236 VGPRs and 8 SGPR spills after a gfx942 one in the same process,
    232 and 7 alone), which made a result depend on the queue, not only on its key."""
    enum = check.select_scope(["gfx942", "gfx950"], True, layouts=["gqa64"], kv_dtypes=["fp8_e4m3fn", "fp8_e4m3fnuz"],
                              q_dtypes=["bf16"], variants=["per_head"], index_dtypes=["int64"])
    prefix = sorted((v for v in enum.variants if v.kernel == "_verify_prefix_stage"), key=check._expected_cost)
    target = next(v for v in prefix if v.arch == "gfx950" and v.constexprs["HAS_MASK"] and v.constexprs["BLOCK_TABLE"])
    other = [v for v in prefix if v.arch == "gfx942"][1]

    def compiled(*variants):
        pool = check._start_pool(1)
        try:
            results = [pool.submit(check.compile_isolated, check._job(v)).result() for v in variants]
        finally:
            pool.shutdown()
        return {k: v for k, v in results[-1].items() if k != "compile_s"}

    alone = compiled(target)
    assert alone["error"] is None and compiled(other, target) == alone


def test_offline_compile_takes_the_program_a_call_launches(monkeypatch):
    """--as-launched: the module's own choice (the Gluon stage where the launcher runs it); the
    config flags otherwise, through the launch rules; no fitting program is an error."""
    import argparse

    tool = _offline_compile_tool(monkeypatch)
    # A module object of its own: its launcher's set-up cache must not keep a Gluon choice for
    # the shared module under another Triton.
    module = tool._module_from(kgen.load("mla_absorbed_512_64", "float8_e4m3fn").__file__)
    monkeypatch.setattr(module.LAUNCHER, "gluon_enabled", True)  # as under Triton 3.6
    args = argparse.Namespace(layout="mla_absorbed_512_64", as_launched=True, group=16, batch=64, draft=4,
                              page_size=16, mask=False, block_h=8, block_n=32, warps=4, stages=2, lazy=False,
                              draft_first=False, gluon=None)
    name, constexprs, _ = tool.chosen_program(module, args)
    assert name == "_gluon_prefix_stage" and constexprs["BLOCK_TABLE"] is True
    args.as_launched = False
    name, constexprs, options = tool.chosen_program(module, args)
    assert name == "_verify_prefix_stage" and (constexprs["BLOCK_N"], options["num_warps"]) == (32, 4)
    monkeypatch.setattr(module, "launch_params", lambda *a, **k: [])
    with pytest.raises(SystemExit, match="no mla_absorbed_512_64 program fits sm_90"):
        tool.chosen_program(module, args)
