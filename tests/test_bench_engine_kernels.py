"""kgen bench's engine peers (kgen/bench/engine_kernels.py) on the CPU: SGLang's and vLLM's own
Triton verify kernels, from their pinned releases (.ci/engines/), run in Triton's interpreter on
the bench's own case inputs and checked by the bench's own check against the reference.

What runs is the engines' code: SGLang's ``extend_attention_fwd`` and vLLM's
``unified_attention`` / ``decode_attention_fwd``, called as their backends call them
(sglang/srt/layers/attention/triton_backend.py, ``forward_extend``; vLLM's
v1/attention/backends/triton_attn.py, ``TritonAttentionImpl.forward``, and
backends/mla/triton_mla.py, ``TritonMLAImpl.forward_mqa``, at the pinned releases). So a wrong
argument (a page table, a scale, an extent, a mask) fails the check here.

The bench's inputs are bfloat16; these run them in float16 (the same values: the cases' values
are far inside its range), since the interpreter's ``tl.dot`` multiplies bfloat16 operands
wrongly (/work/shared/notes/testing-without-a-gpu.md). On an FP8 pool the queries are rounded to
e4m3 values: SGLang's kernel casts q to the pool's type, and with such queries that cast is
exact, so any other difference from the reference is a wrong argument.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from engines import import_engine, import_vllm

from kgen.bench import engine_kernels as ek
from kgen.bench.cases import ENGINE_KERNELS, case_for
from kgen.bench.inputs import CaseInputs, build_inputs
from kgen.bench.measure import tolerance_for
from kgen.bench.pools import paged_copy, pool_reference, token_pool
from kgen.reference import relative_error
from kgen.spec import load_layouts

SPECS = load_layouts()
GQA, MLA = "qwen3_5_gqa256", "mla_absorbed_512_64"

pytestmark = pytest.mark.skipif(
    __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="these run the engines' kernels on CPU tensors in Triton's interpreter",
)


@pytest.fixture(scope="module")
def engines() -> None:
    import_engine("sglang", ek.SGLANG_EXTEND)
    import_vllm(ek.VLLM_UNIFIED, ek.VLLM_TRITON_ATTN, ek.VLLM_DECODE, ek.VLLM_TRITON_MLA)


def _fp16(inputs: CaseInputs) -> CaseInputs:
    """The same inputs with every 16-bit tensor in float16 (MLA's V stays a view of K's latent)."""
    case = inputs.case

    def half(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16) if t.dtype == torch.bfloat16 else t

    k_buffer = half(inputs.k_buffer)
    v_buffer = half(inputs.v_buffer) if case.separate_v else k_buffer[..., : case.v_dim]
    sets = []
    for s in inputs.sets:
        k_ext = half(s.k_extend)
        v_ext = half(s.v_extend) if case.separate_v else k_ext[..., : case.v_dim]
        sets.append(dataclasses.replace(s, q=half(s.q), k_extend=k_ext, v_extend=v_ext, o=half(s.o)))
    return dataclasses.replace(inputs, k_buffer=k_buffer, v_buffer=v_buffer, sets=sets, _reference=None)


def _e4m3_queries(inputs: CaseInputs) -> CaseInputs:
    """The same inputs with every query rounded to an e4m3 value, so SGLang's cast of q to an FP8
    pool's type (its prefix q·k runs in e4m3) loses nothing and its answer is the reference's."""
    sets = [dataclasses.replace(s, q=s.q.to(torch.float8_e4m3fn).to(s.q.dtype)) for s in inputs.sets]
    return dataclasses.replace(inputs, sets=sets, _reference=None)


def _inputs(layout: str = GQA, kv: str = "bfloat16", mask: str = "none", **kw) -> CaseInputs:  # noqa: ANN003
    case = case_for(SPECS[layout], 16, kv, 2, 40, 4, mask=mask, **kw)
    inputs = _fp16(build_inputs(case, "cpu", n_sets=2))
    return _e4m3_queries(inputs) if case.is_fp8 else inputs


CASES = [(GQA, "bfloat16"), (GQA, "float8_e4m3fn"), (MLA, "bfloat16"), (MLA, "float8_e4m3fn")]


# SGLang's kernel on an FP8 MLA pool: see test_sglang_runs_fp8_mla_in_e4m3_products.
EXACT = [(name, layout, kv) for name in ENGINE_KERNELS for layout, kv in CASES
         if (name, layout, kv) != ("sglang_triton", MLA, "float8_e4m3fn")]  # fmt: skip


@pytest.mark.parametrize(("name", "layout", "kv"), EXACT)
def test_each_engine_kernel_passes_the_bench_check(engines: None, name: str, layout: str, kv: str) -> None:
    inputs = _inputs(layout, kv)
    run = ek.engine_runs(inputs, [name])[name]
    assert run.unsupported is None and run.error is None, run.unsupported or run.error
    err = run.check()
    assert err <= tolerance_for(inputs.case), f"{name} {layout} {kv}: max rel err {err:.3e}"
    run.fn(inputs.n_sets - 1)  # every input set is launchable


def test_sglangs_check_catches_a_scale_it_was_not_given(engines: None) -> None:
    """The check can fail: SGLang's kernel told another V scale than the pool's is off the reference."""
    inputs = _inputs(GQA, "float8_e4m3fn")
    launch = ek.sglang_launch(dataclasses.replace(inputs, v_scale=inputs.v_scale * 2), "none")
    launch.fn(0)
    ref = inputs.reference()
    assert relative_error(launch.outs[0][: ref.shape[0]], ref, "max") > tolerance_for(inputs.case)


def test_sglang_runs_fp8_mla_in_e4m3_products(engines: None) -> None:
    """On an FP8 pool SGLang's kernel casts q and the softmax weights P to e4m3 for the prefix's
    two products (``q.to(k.dtype)``, ``p.to(v.dtype)``; e4m3 queries keep only the first exact),
    so on MLA's 576-wide rows its error is e4m3's, at the bench tolerance's edge, and the bench
    reports it as measured. The call is still proven right: a scale it was not given moves the
    answer several times further off than the e4m3 products do."""
    inputs = _inputs(MLA, "float8_e4m3fn")
    ref = inputs.reference()

    def error(given: CaseInputs) -> float:
        launch = ek.sglang_launch(given, "none")
        launch.fn(0)
        return relative_error(launch.outs[0][: ref.shape[0]], ref, "max")

    right = error(inputs)
    assert right < 2 * tolerance_for(inputs.case)
    for wrong in (dataclasses.replace(inputs, k_scale=inputs.k_scale * 2),
                  dataclasses.replace(inputs, v_scale=inputs.v_scale * 2)):  # fmt: skip
        assert error(wrong) > 4 * right


def test_sglang_takes_a_tree_as_its_custom_mask_and_times_the_chain_beside_it(engines: None) -> None:
    inputs = _inputs(GQA, mask="tree", mask_ab="none")
    run = ek.sglang_run(inputs)
    assert run.unsupported is None, run.unsupported
    assert run.check() <= tolerance_for(inputs.case)
    assert run.mask == "tree" and run.mask_alt is not None and run.mask_alt.mask == "none"
    assert run.mask_alt.check() <= tolerance_for(inputs.case)
    assert run.index_dtype == "int64"  # SGLang's page table as the engine sends it


def test_vllm_refuses_a_custom_mask_and_notes_a_mask_ab_it_cannot_time(engines: None) -> None:
    refused = ek.vllm_run(_inputs(GQA, mask="tree"))
    assert refused.fn is None and "no custom mask" in refused.unsupported
    chain = ek.vllm_run(_inputs(GQA, mask="none", mask_ab="tree"))
    assert chain.fn is not None and chain.mask_alt is None and "no tree side of the mask A/B" in chain.note


@pytest.mark.parametrize("layout", [GQA, MLA])
def test_vllm_rows_see_the_prefix_and_their_own_draft_prefix(engines: None, layout: str) -> None:
    """Row t of a request sees P + t + 1 tokens: the same launch told each request is L - 1
    tokens longer (rows see past their own token) fails the check."""
    inputs = _inputs(layout)
    pool = token_pool(inputs)
    paged = paged_copy(inputs.case, pool, ek.VLLM_BLOCK_SIZE)
    launch = ek.vllm_gqa_launch if inputs.case.separate_v else ek.vllm_mla_launch
    longer = dataclasses.replace(paged, kv_len=paged.kv_len + inputs.case.draft - 1)
    ref = pool_reference(inputs, pool, inputs.case.mask)
    for built, ok in ((launch(inputs, paged), True), (launch(inputs, longer), False)):
        built.fn(0)
        err = relative_error(built.outs[0][: ref.shape[0]], ref, "max")
        assert (err <= tolerance_for(inputs.case)) == ok, err


def test_a_missing_engine_is_unsupported_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _inputs(GQA)
    monkeypatch.setitem(sys.modules, "sglang", None)
    monkeypatch.setitem(sys.modules, "vllm", None)
    runs = ek.engine_runs(inputs, list(ENGINE_KERNELS))
    assert "pip install sglang==" in runs["sglang_triton"].unsupported
    assert "pip install vllm==" in runs["vllm_triton"].unsupported


def test_another_release_is_unsupported_naming_the_pinned_one(engines: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ek, "SGLANG", ek.Engine("sglang", "0.0.1"))
    run = ek.sglang_run(_inputs(GQA))
    assert run.fn is None and "this peer follows 0.0.1" in run.unsupported


def test_an_unknown_engine_kernel_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="sglang_triton, vllm_triton"):
        ek.engine_runs(_inputs(GQA), ["tgi_triton"])


def test_the_provider_runs_the_engine_kernels_and_the_report_gives_them_a_section(
    engines: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device provider end to end through run_matrix with a fake timer (the grouped kernel a
    reference stand-in, the inputs in float16 as above): results keyed sglang_triton /
    vllm_triton, the grouped kernel's speed-up over each, and bench.md's section for them."""
    from test_bench_peers import ReferenceModule, fake_timer

    from kgen.bench import peers
    from kgen.bench.cases import build_matrix
    from kgen.bench.measure import run_matrix
    from kgen.bench.peers import DeviceProvider
    from kgen.bench.report import BenchMeta, BenchRun, render_markdown, run_to_json

    monkeypatch.setattr(peers, "build_inputs", lambda *a, **kw: _e4m3_queries(_fp16(build_inputs(*a, **kw))))
    cases = build_matrix(SPECS, [(GQA, 16)], ["float8_e4m3fn"], batches=[2], prefixes=[32], drafts=[2],
                         masks=("none", None))  # fmt: skip
    provider = DeviceProvider(device="cpu", l2_bytes=1 << 16, compile_flex=False, select_timer=fake_timer,
                              loader=lambda *a: ReferenceModule())  # fmt: skip
    (result,) = run_matrix(cases, provider, fake_timer, 1000.0, kernels=["grouped", *ENGINE_KERNELS])
    assert {k: v.status for k, v in result.kernels.items()} == dict.fromkeys(["grouped", *ENGINE_KERNELS], "ok")
    assert set(result.speedup) == set(ENGINE_KERNELS)
    run = BenchRun(meta=BenchMeta(gpu_name="cpu"), cases=[result])
    assert '"sglang_triton"' in run_to_json(run)
    md = render_markdown(run)
    assert "## The engines' Triton kernels" in md and "× SGLang Triton" in md and "× vLLM Triton" in md


def test_asking_for_an_engine_kernel_without_the_engine_exits_2_naming_the_install(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from kgen.bench import cli

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog="kgen")
        cli.add_bench_parser(parser.add_subparsers(dest="command"))
        return parser.parse_args(["bench", *argv])

    # Each engine hidden in turn, then both: every missing one is named, whatever is installed.
    for hidden in (["vllm"], ["sglang"], ["sglang", "vllm"]):
        with monkeypatch.context() as patch:
            for package in hidden:
                patch.setitem(sys.modules, package, None)
            assert cli.run_bench(parse("--kernels", "grouped,engines", "--out", str(tmp_path))) == 2
            err = capsys.readouterr().err
        for package in hidden:
            assert f"{package}_triton: {package} is not installed; pip install {package}==" in err
    assert not (tmp_path / "bench.json").exists()
    assert cli.select_kernels(parse("--kernels", "engines")) == list(ENGINE_KERNELS)
    assert "sglang_triton" not in cli.select_kernels(parse())  # never in a default run
