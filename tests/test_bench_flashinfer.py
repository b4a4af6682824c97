"""kgen bench's FlashInfer peer on the CPU, against a stand-in FlashInfer (tests/fake_flashinfer.py)
that computes FlashInfer's documented semantics in torch and logs every plan() and run().

What a GPU run cannot show cheaply is checked here: the CSR metadata and page tables each
plan() gets, that the page-16 copy holds the same tokens as the token-slot pool, the scales
and masks handed over, that plan() stays out of the timed launch, the names the JSON carries,
and every refusal with its reason. The bench's own correctness check runs end to end against
the stand-in, so wrong metadata fails it (and a stand-in that ignores the mask fails it too).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import fake_flashinfer
import pytest
import torch
from test_bench_peers import ReferenceModule, fake_timer

from kgen.bench import flashinfer as fib
from kgen.bench.cases import FLASHINFER_KERNELS, case_for
from kgen.bench.inputs import build_inputs
from kgen.bench.measure import TOLERANCE_BF16, TOLERANCE_FP8, run_matrix
from kgen.bench.peers import DeviceProvider
from kgen.bench.report import BenchMeta, BenchRun, render_markdown, run_to_json
from kgen.spec import load_layouts

SPECS = load_layouts()
GQA, MLA = "qwen3_5_gqa256", "mla_absorbed_512_64"


def _case(layout: str = GQA, group: int = 16, kv: str = "bfloat16", draft: int = 4, batch: int = 3,
          prefix: int = 40, **kw):  # noqa: ANN003, ANN202
    return case_for(SPECS[layout], group, kv, batch, prefix, draft, **kw)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> fake_flashinfer.Log:
    monkeypatch.delenv(fib.JIT_ENV, raising=False)
    return fake_flashinfer.install(monkeypatch, tmp_path)


def _runs(case, names=FLASHINFER_KERNELS, n_sets: int = 2, **kw):  # noqa: ANN001, ANN003, ANN202
    inputs = build_inputs(case, "cpu", n_sets=n_sets)
    return inputs, fib.flashinfer_runs(case, inputs, list(names), workspace_bytes=1 << 10, **kw)


def test_names_say_backend_and_page_size() -> None:
    assert fib.variant_of("flashinfer_fa2") == fib.Variant("flashinfer_fa2", "fa2", 1)
    assert fib.variant_of("flashinfer_fa3_page16") == fib.Variant("flashinfer_fa3_page16", "fa3", 16)
    assert [fib.variant_of(n).page_size for n in FLASHINFER_KERNELS] == [1, 1, 16, 16]
    with pytest.raises(ValueError, match="not a FlashInfer kernel"):
        fib.variant_of("flashinfer_fa4")


@pytest.mark.parametrize(("layout", "kv", "masked"), [
    (GQA, "bfloat16", False), (GQA, "float8_e4m3fn", False), (GQA, "bfloat16", True),
    (MLA, "bfloat16", False), (MLA, "float8_e4m3fn", False),
])  # fmt: skip
def test_the_modules_a_plan_loads_are_named_as_the_prebuilt_ones(layout: str, kv: str, masked: bool) -> None:
    """Every module the GPU run needs for the cases of record is one .fi-aot carries, by the
    name FlashInfer looks it up with; an FP8 MLA FA2 kernel and head dim 128 are not there."""
    case = _case(layout, kv=kv, mask="tree" if masked else "none")
    backends = ["fa2"] if (layout == GQA and (masked or kv != "bfloat16")) else ["fa2", "fa3"]
    if layout == MLA and kv != "bfloat16":
        backends = ["fa3"]
    for backend in backends:
        names = fib.module_names(case, fib.Variant("x", backend, 1))
        assert set(names) <= set(fake_flashinfer.PREBUILT), names
        assert ("quantization" in names) == masked
    fa2 = fib.Variant("x", "fa2", 1)
    assert fib.module_names(_case(MLA, kv="float8_e4m3fn"), fa2)[0] not in fake_flashinfer.PREBUILT
    assert fib.module_names(_case("gqa128", 8), fa2)[0] not in fake_flashinfer.PREBUILT


def test_pools_flashinfer_is_not_given_are_refused_by_name() -> None:
    """e5m2 pools go to FlashInfer's e5m2 kernels (not prebuilt: JIT or a refusal naming them); an
    fp16 pool beside the bench's bf16 queries, and e4m3fnuz, are refused with the dtype named."""
    fa2 = fib.Variant("x", "fa2", 1)
    e5m2 = _case(GQA, kv="float8_e5m2")
    assert "dtype_kv_e5m2" in fib.module_names(e5m2, fa2)[0]
    assert "dtype_kv_e5m2" in fib.refusal(e5m2, fa2, fake_flashinfer, allow_jit=False)
    assert fib.refusal(e5m2, fa2, fake_flashinfer, allow_jit=True) is None
    assert "not float16" in fib.refusal(_case(GQA, kv="float16"), fa2, None, allow_jit=True)
    assert "no float8_e4m3fnuz pool" in fib.refusal(_case(GQA, kv="float8_e4m3fnuz"), fa2, None, allow_jit=True)


def test_page1_plan_gets_int32_csr_over_the_token_slot_pool(fake: fake_flashinfer.Log) -> None:
    case = _case(GQA, 16, "bfloat16", draft=4, batch=3, prefix=40)
    inputs, runs = _runs(case, ["flashinfer_fa2"])
    run = runs["flashinfer_fa2"]
    assert run.fn is not None, run.unsupported
    assert run.n_sets == 2 and [p["kind"] for p in fake.plans] == ["prefill", "prefill"]
    assert all(i["use_cuda_graph"] and i["backend"] == "fa2" for i in fake.inits)
    assert len({i["workspace"] for i in fake.inits}) == 1  # one float workspace for every wrapper
    slots = inputs.k_buffer.shape[0]
    for s, plan in enumerate(fake.plans):
        for key in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
            assert plan[key].dtype == torch.int32, key
        assert plan["qo_indptr"].tolist() == [0, 4, 8, 12]
        assert plan["paged_kv_indptr"].tolist() == [0, 44, 88, 132]  # P + L pages of one token
        assert plan["paged_kv_last_page_len"].tolist() == [1, 1, 1]
        table = plan["paged_kv_indices"].view(3, 44).long()
        assert torch.equal(table[:, :40].reshape(-1), inputs.sets[s].kv_indices)  # the case's shuffled slots
        drafts = slots + s * 12 + torch.arange(12).view(3, 4)
        assert torch.equal(table[:, 40:], drafts)  # then the draft rows appended to the pool
        heads = (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim_qk"], plan["head_dim_vo"])
        assert heads == (16, 1, 256, 256)
        assert plan["page_size"] == 1 and plan["causal"] is True and plan["custom_mask"] is None
        assert plan["sm_scale"] == pytest.approx(1 / math.sqrt(256)) and plan["uniform_q_len"] == 4
        assert plan["q_data_type"] == plan["o_data_type"] == torch.bfloat16 and plan["kv_data_type"] == torch.bfloat16
        assert plan["jit_disabled"] == "1"  # no compile without --flashinfer-jit
    assert run.check() < TOLERANCE_BF16
    assert run.index_dtype == "int32" and "converted from int64" in run.note


def test_page16_copy_holds_the_same_tokens_in_shuffled_pages() -> None:
    for layout, kv in ((GQA, "float8_e4m3fn"), (MLA, "bfloat16")):
        case = _case(layout, kv=kv, draft=3, batch=2, prefix=37)  # 40 tokens: 3 pages, 8 in the last
        inputs = build_inputs(case, "cpu", n_sets=2)
        pool = fib.token_pool(inputs)
        paged = fib.paged_copy(case, pool, 16)
        assert paged.kv_indptr.tolist() == [0, 3, 6] and paged.last_page_len.tolist() == [8, 8]
        assert paged.kv_len.tolist() == [40, 40] and paged.k.shape[1] == 16
        flat = torch.cat([p.reshape(-1) for p in paged.pages])
        assert sorted(flat.tolist()) == list(range(12)) and flat.tolist() != sorted(flat.tolist())
        pages_k = paged.k.view(torch.uint8) if case.is_fp8 else paged.k
        slots_k = pool.k.view(torch.uint8) if case.is_fp8 else pool.k
        for s in range(2):
            for b in range(2):
                gathered = pages_k[paged.pages[s][b]].reshape(-1, *pages_k.shape[2:])[:40]
                by_slot = slots_k[pool.tokens[s][b]].reshape(gathered.shape)
                assert torch.equal(gathered, by_slot), (layout, s, b)
        if pool.v is not None:
            pages_v = paged.v.view(torch.uint8)
            gathered = pages_v[paged.pages[1][0]].reshape(-1, *pages_v.shape[2:])[:40]
            assert torch.equal(gathered, pool.v.view(torch.uint8)[pool.tokens[1][0]])


def test_token_pool_keeps_the_case_slots_and_appends_the_drafts_as_stored() -> None:
    case = _case(GQA, 4, "float8_e4m3fn", draft=2, batch=2, prefix=16)
    inputs = build_inputs(case, "cpu", n_sets=2)
    pool = fib.token_pool(inputs)
    slots = inputs.k_buffer.shape[0]
    assert torch.equal(pool.k.view(torch.uint8)[:slots], inputs.k_buffer.view(torch.uint8))
    assert pool.k.dtype == torch.float8_e4m3fn and pool.k.shape[0] == slots + 2 * 2 * 2
    stored = pool.k[slots + 4 :].float() * inputs.k_scale  # set 1's drafts, dequantized
    assert torch.allclose(stored, inputs.sets[1].k_extend.float(), rtol=0.07, atol=0.02)


@pytest.mark.parametrize(("layout", "group", "kv", "draft"), [
    (GQA, 16, "bfloat16", 4), (GQA, 4, "float8_e4m3fn", 3), (MLA, 16, "bfloat16", 2), (MLA, 16, "float8_e4m3fn", 3),
])  # fmt: skip
def test_every_variant_passes_the_check_and_a_broken_mask_fails_it(fake: fake_flashinfer.Log, layout: str,
                                                                   group: int, kv: str, draft: int) -> None:
    case = _case(layout, group, kv, draft=draft, batch=2, prefix=40)
    _, runs = _runs(case)
    tolerance = TOLERANCE_FP8 if case.is_fp8 else TOLERANCE_BF16
    ran = {name: run for name, run in runs.items() if run.fn is not None}
    refused = set()
    if case.is_fp8:  # GQA: FlashInfer's FA3 needs FP8 queries; MLA: no prebuilt FP8 FA2 kernel
        refused = {f"flashinfer_{'fa3' if layout == GQA else 'fa2'}{page}" for page in ("", "_page16")}
    expected = set(FLASHINFER_KERNELS) - refused
    assert set(ran) == expected, {n: r.unsupported for n, r in runs.items()}
    for name, run in ran.items():
        assert run.check() < tolerance, name
    fake.ignore_mask = True  # every draft token sees the whole draft: the check must notice
    for name, run in ran.items():
        assert run.check() > 0.1, name


def test_mla_fp8_scales_fold_into_one_ckv_scale(fake: fake_flashinfer.Log) -> None:
    """K's latent by k_scale and V by v_scale is ckv = kpe = v_scale with sm_scale * k / v; the
    plain hand-over (ckv = kpe = k_scale, sm_scale as is) would get V wrong by v / k."""
    case = _case(MLA, 16, "float8_e4m3fn", draft=2, batch=2, prefix=32)
    inputs, runs = _runs(case, ["flashinfer_fa3"])
    sm, scales = fib.mla_scales(inputs)
    assert scales == {"ckv_scale": inputs.v_scale, "kpe_scale": inputs.v_scale}
    assert sm == pytest.approx(inputs.sm_scale * inputs.k_scale / inputs.v_scale)
    assert fake.plans[0]["sm_scale"] == pytest.approx(sm)
    assert runs["flashinfer_fa3"].check() < TOLERANCE_FP8


def test_fp8_prefill_hands_k_and_v_scales_to_run(fake: fake_flashinfer.Log, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    original = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.run

    def spy(self, q, kv, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append({k: v for k, v in kw.items() if k != "out"})
        return original(self, q, kv, **kw)

    monkeypatch.setattr(fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper, "run", spy)
    case = _case(GQA, 4, "float8_e4m3fn", draft=2, batch=2, prefix=24)
    inputs, runs = _runs(case, ["flashinfer_fa2"], n_sets=1)
    assert fake.plans[0]["kv_data_type"] == torch.float8_e4m3fn and fake.plans[0]["sm_scale"] == inputs.sm_scale
    assert seen[-1] == {"k_scale": inputs.k_scale, "v_scale": inputs.v_scale}
    assert "draft K/V stored in the FP8 pool" in runs["flashinfer_fa2"].note


def test_plan_runs_once_per_set_in_set_up_and_the_timed_fn_only_runs(fake: fake_flashinfer.Log) -> None:
    case = _case(GQA, 16, "bfloat16", draft=2, batch=2, prefix=24)
    _, runs = _runs(case, ["flashinfer_fa2_page16"], n_sets=3)
    run = runs["flashinfer_fa2_page16"]
    assert len(fake.plans) == 3 and fake.runs == 1  # set-up: one plan per set, one first run
    for i in range(12):
        run.fn(i % run.n_sets)
    assert len(fake.plans) == 3 and fake.runs == 13
    assert {p["page_size"] for p in fake.plans} == {16}
    assert [p["paged_kv_indptr"].tolist() for p in fake.plans] == [[0, 2, 4]] * 3  # 26 tokens: 2 pages each


def test_a_tree_mask_reaches_fa2_prefill_with_the_prefix_visible(fake: fake_flashinfer.Log) -> None:
    case = _case(GQA, 16, "bfloat16", draft=8, batch=2, prefix=24, mask="tree", mask_ab="none")
    inputs, runs = _runs(case, n_sets=1)
    for name in ("flashinfer_fa2", "flashinfer_fa2_page16"):
        run = runs[name]
        assert run.fn is not None, run.unsupported
        assert run.check() < TOLERANCE_BF16 and run.mask == "tree"
        assert run.mask_alt is not None and run.mask_alt.mask == "none" and run.mask_alt.check() < TOLERANCE_BF16
    for name in ("flashinfer_fa3", "flashinfer_fa3_page16"):
        assert "FA3 batch prefill takes no custom mask" in runs[name].unsupported
    plan = next(p for p in fake.plans if p["custom_mask"] is not None)
    mask = plan["custom_mask"].view(2, 8, 32)
    assert mask[:, :, :24].all() and plan["causal"] is False  # FlashInfer has no skip-prefix rule
    flat, _ = inputs.masks["tree"]
    assert torch.equal(mask[:, :, 24:], flat.view(2, 8, 32)[:, :, 24:])
    assert not mask[:, :, 24:].all()  # a tree, not the full draft


def test_mla_refuses_a_custom_mask(fake: fake_flashinfer.Log) -> None:
    _, runs = _runs(_case(MLA, 16, "bfloat16", draft=4, batch=2, prefix=16, mask="chain"), n_sets=1)
    for run in runs.values():
        assert run.fn is None and "BatchMLAPagedAttentionWrapper takes no custom mask" in run.unsupported
    assert fake.plans == []


def test_kernels_without_a_prebuilt_module_are_skipped_unless_compiling_is_allowed(
    fake: fake_flashinfer.Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = _case("gqa128", 8, "bfloat16", draft=2, batch=2, prefix=16)
    _, runs = _runs(case, ["flashinfer_fa2"], n_sets=1)
    assert "no prebuilt sm_90a kernel batch_prefill_with_kv_cache" in runs["flashinfer_fa2"].unsupported
    assert "KGEN_FLASHINFER_JIT=1" in runs["flashinfer_fa2"].unsupported and fake.plans == []
    mla_fp8 = _case(MLA, 16, "float8_e4m3fn", draft=2, batch=2, prefix=16)
    _, runs = _runs(mla_fp8, ["flashinfer_fa2", "flashinfer_fa3"], n_sets=1)
    assert "no prebuilt" in runs["flashinfer_fa2"].unsupported and runs["flashinfer_fa3"].fn is not None
    monkeypatch.setenv(fib.JIT_ENV, "1")
    _, runs = _runs(case, ["flashinfer_fa2"], n_sets=1)
    assert runs["flashinfer_fa2"].check() < TOLERANCE_BF16
    assert fake.plans[-1]["jit_disabled"] is None  # compiling allowed: FlashInfer's guard left off


def test_fa3_prefill_refuses_fp8_kv_whatever_is_compiled(fake: fake_flashinfer.Log) -> None:
    _, runs = _runs(_case(GQA, 4, "float8_e4m3fn"), ["flashinfer_fa3"], n_sets=1, allow_jit=True)
    assert "FP8 KV only with FP8 queries" in runs["flashinfer_fa3"].unsupported


def test_a_flashinfer_refusal_at_plan_is_unsupported_with_its_message(fake: fake_flashinfer.Log,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self, **kw):  # noqa: ANN001, ANN003, ANN202
        raise RuntimeError("FA MLA needs 20000 work items; native capacity is 16384.")

    monkeypatch.setattr(fake_flashinfer.BatchMLAPagedAttentionWrapper, "plan", refuse)
    _, runs = _runs(_case(MLA, 16), ["flashinfer_fa3"], n_sets=1)
    assert runs["flashinfer_fa3"].fn is None and "native capacity is 16384" in runs["flashinfer_fa3"].unsupported


def test_without_flashinfer_every_kernel_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    _, runs = _runs(_case(), n_sets=1)
    for run in runs.values():
        assert run.fn is None and "pip install 'kgen[flashinfer]'" in run.unsupported
    assert "pip install 'kgen[flashinfer]'" in fib.flashinfer_missing()


def test_the_jit_guard_sets_and_restores_flashinfers_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHINFER_DISABLE_JIT", raising=False)
    with fib.no_jit(False):
        assert fib.os.environ["FLASHINFER_DISABLE_JIT"] == "1"
    assert "FLASHINFER_DISABLE_JIT" not in fib.os.environ
    monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "0")
    with fib.no_jit(False):
        pass
    assert fib.os.environ["FLASHINFER_DISABLE_JIT"] == "0"
    with fib.no_jit(True):
        assert fib.os.environ["FLASHINFER_DISABLE_JIT"] == "0"


def test_the_provider_names_flashinfer_kernels_in_the_json(fake: fake_flashinfer.Log) -> None:
    """The device provider end to end (inputs, kgen kernels, FlashInfer, checks) through
    run_matrix with a fake timer: results keyed flashinfer_<backend>[_page16], FP8 measured
    per case (not shared like the dense peers), refusals reported with their reasons."""
    from kgen.bench.cases import build_matrix

    cases = build_matrix(SPECS, [(GQA, 4)], ["bfloat16", "float8_e4m3fn"], batches=[2], prefixes=[32], drafts=[2])
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: ReferenceModule())  # fmt: skip
    kernels = ["grouped", *FLASHINFER_KERNELS]
    results = run_matrix(cases, provider, fake_timer, 1000.0, kernels=kernels)
    bf16, fp8 = results
    assert {k: v.status for k, v in bf16.kernels.items()} == dict.fromkeys(kernels, "ok")
    assert fp8.kernels["flashinfer_fa2"].status == "ok" and fp8.kernels["flashinfer_fa2"].shared_from is None
    assert fp8.kernels["flashinfer_fa3"].status == "unsupported" and "FP8" in fp8.kernels["flashinfer_fa3"].note
    assert set(bf16.speedup) == set(FLASHINFER_KERNELS)
    run = BenchRun(meta=BenchMeta(gpu_name="cpu"), cases=results)
    text = run_to_json(run)
    for name in FLASHINFER_KERNELS:
        assert f'"{name}"' in text
    md = render_markdown(run)
    assert "## FlashInfer" in md and "FP8 KV only with FP8 queries" in md


# ----------------------------------------------------------------- the command line


def _parse(*argv: str):  # noqa: ANN202
    import argparse

    from kgen.bench.cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="kgen")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_kernels_option_names_and_default(fake: fake_flashinfer.Log, monkeypatch: pytest.MonkeyPatch) -> None:
    from kgen.bench import cli
    from kgen.bench.cases import FLASHINFER_KERNELS, KERNELS

    assert cli.select_kernels(_parse()) == [*KERNELS, *FLASHINFER_KERNELS]  # installed: a peer like any other
    assert cli.select_kernels(_parse("--kernels", "grouped,flashinfer")) == ["grouped", *FLASHINFER_KERNELS]
    assert cli.select_kernels(_parse("--kernels", "flashinfer_fa2_page16")) == ["flashinfer_fa2_page16"]
    with pytest.raises(cli.BenchUsageError, match="flashinfer for the four"):
        cli.select_kernels(_parse("--kernels", "flashinfer_fa4"))
    assert cli.require_flashinfer(_parse()) is None
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert cli.select_kernels(_parse()) == list(KERNELS)  # not installed: left out of the default
    assert "FlashInfer peer not run" in cli.require_flashinfer(_parse())
    assert cli.require_flashinfer(_parse("--kernels", "grouped")) is None


def test_asking_for_flashinfer_without_it_exits_2_naming_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kgen.bench.cli import run_bench

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert run_bench(_parse("--kernels", "grouped,flashinfer_fa2", "--out", str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert "--kernels flashinfer_fa2" in err and "pip install 'kgen[flashinfer]'" in err
    assert not (tmp_path / "bench.json").exists()
    assert run_bench(_parse("--list", "--kernels", "flashinfer", "--quick")) == 0  # listing needs no FlashInfer


def test_execute_times_a_tree_against_the_chain_for_flashinfer_fa2(fake: fake_flashinfer.Log, tmp_path: Path) -> None:
    """--mask tree,none through cli.execute: FlashInfer FA2 gets the tree and its causal other
    side timed in alternation (mask_ab); FA3 and MLA say why they cannot."""
    from kgen.bench import cli
    from kgen.bench.timing import PairedTiming

    class PairingTimer:
        pairs = 0

        def __call__(self, fn, n_sets):  # noqa: ANN001, ANN204
            return fake_timer(fn, n_sets)

        def pair(self, fn_a, fn_b, n_sets):  # noqa: ANN001, ANN202
            PairingTimer.pairs += 1
            fn_a(n_sets - 1)
            fn_b(n_sets - 1)
            return PairedTiming.from_samples([11.0] * 5, [10.0] * 5, n_sets, "fake")

    args = _parse("--layout", f"{GQA}:16,{MLA}:16", "--kv-dtype", "bf16", "--batch", "2", "--prefix", "32",
                  "--draft", "8", "--mask", "tree,none", "--kernels", "flashinfer", "--no-progress",
                  "--flex-sweep", "none")  # fmt: skip
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: ReferenceModule())  # fmt: skip
    run = cli.execute(args, cli.select_cases(args), provider, PairingTimer(), BenchMeta(gpu_name="cpu"), tmp_path)
    gqa, mla = run.cases
    for name in ("flashinfer_fa2", "flashinfer_fa2_page16"):
        res = gqa.kernels[name]
        assert res.status == "ok" and res.mask_ab is not None and res.mask_ab.mask == "none", res.note
        assert res.mask_ab.ratio == pytest.approx(1.1) and res.mask_ab.max_rel_err < TOLERANCE_BF16
    assert gqa.kernels["flashinfer_fa3"].status == "unsupported"
    assert all(mla.kernels[n].status == "unsupported" for n in FLASHINFER_KERNELS)
    assert "takes no custom mask" in mla.kernels["flashinfer_fa2"].note
