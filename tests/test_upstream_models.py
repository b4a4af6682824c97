"""The models SGLang's grouped-head verify kernel serves, routed and checked in kgen.

Written from sgl-project/sglang at 08582c222bd8cf28a21dba2eea89a694bd3a6734:
``test/registered/attention/test_verify_shared_kv.py`` (MiniMax-M3 at TP4: head dim 128, 16
query heads on one KV head, prefixes (1, 77, 4099, 70001, 199999) in BF16 and 24 prefixes
3000 + 37 i in FP8 with K/V descales 0.5 / 0.25; Kimi-K3's DSpark draft: head dim 64, 8 query
heads on 2 KV heads, 7 draft tokens, ``is_causal=False``; 4 draft tokens elsewhere, int64
``kv_indices``) and ``_should_use_verify_shared_kv`` in
``python/sglang/srt/layers/attention/triton_backend.py`` (MiniMax-M3, and an EAGLE draft runner
when its target is MiniMax-M3, with one TP-local KV head). No upstream code is copied.

kgen routes by data: MiniMax-M3 (``MiniMaxM3SparseForCausalLM``,
``MiniMaxM3SparseForConditionalGeneration``) and the EAGLE3 draft (``LlamaForCausalLMEagle3``,
its target's widths) are listed in ``gqa128.toml``; the DSpark draft's group 4 in
``gqa64.toml``. A 199,999-token prefix cannot run in the interpreter: there the module's
acceptance of the call and its launch are checked at that size, and the parity runs at
shortened prefixes; the gpu-marked tests run the upstream sizes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import SPECS, check_parity
from test_runtime_support import real_module_reason

import kgen
from kgen.explain import explain
from kgen.problems import make_case
from kgen.runtime.adapters import sglang_verify_for

REAL = real_module_reason()
needs_real = pytest.mark.skipif(bool(REAL), reason=REAL or "generated modules present")

M3_ARCHS = ["MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"]
EAGLE3 = "LlamaForCausalLMEagle3"
M3_WIDTHS = dict(qk_dim=128, v_dim=128, pe_dim=0)
M3_PREFIXES = [1, 77, 4099, 70001, 199999]
M3_FP8_PREFIXES = [3000 + 37 * i for i in range(24)]
DEVICES = [("gfx950", 256), ("sm_90", 132)]
KV = ["bfloat16", "float8_e4m3fn"]


def m3_case(prefixes, kv="bfloat16", draft=4, device="cpu", seed=0):
    fp8 = kv != "bfloat16"
    return make_case(SPECS["gqa128"], prefixes, [draft] * len(prefixes), 16, kv_dtype=kv, device=device,
                     k_scale=0.5 if fp8 else 1.0, v_scale=0.25 if fp8 else 1.0, index_dtype=torch.int64,
                     seed=seed)  # fmt: skip


def dspark_case(prefixes, device="cpu", seed=0):
    return make_case(SPECS["gqa64"], prefixes, [7] * len(prefixes), 4, num_kv_heads=2, device=device,
                     index_dtype=torch.int64, seed=seed)  # fmt: skip


# ------------------------------------------------------------------ routing


@needs_real
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize(("arch", "_sms"), DEVICES)
@pytest.mark.parametrize("model_arch", [*M3_ARCHS, EAGLE3])
def test_minimax_m3_and_its_eagle3_draft_route_to_the_grouped_path(model_arch, arch, _sms, kv):
    """SGLang's gate: MiniMax-M3 with one TP-local KV head, and an EAGLE draft runner of it
    (the draft mirrors its target's attention shape)."""
    verify = sglang_verify_for(model_arch=model_arch, num_q_heads=16, num_kv_heads=1, kv_dtype=kv,
                               device_arch=arch, env={}, **M3_WIDTHS)  # fmt: skip
    assert (verify.decision.path, verify.decision.layout) == ("grouped", "gqa128"), verify.decision
    assert "group 16" in verify.decision.reason and "1 TP-local KV head" in verify.decision.reason


@needs_real
def test_minimax_m3_with_two_local_kv_heads_follows_the_layout():
    """SGLang's gate refuses M3 with 2 TP-local KV heads; kgen's kernel runs a program group a
    KV head, so the layout decides and the reason says so."""
    verify = sglang_verify_for(model_arch=M3_ARCHS[1], num_q_heads=32, num_kv_heads=2, device_arch="gfx950",
                               env={}, **M3_WIDTHS)  # fmt: skip
    assert verify.decision.path == "grouped"
    assert "2 TP-local KV heads" in verify.decision.reason


@needs_real
def test_an_eagle3_draft_of_other_widths_is_not_sent_to_gqa128():
    """The EAGLE3 draft is routed by its own widths: a draft of a head-dim-256 target is not
    taken for MiniMax-M3's (its layout lists it, the widths do not match)."""
    verify = sglang_verify_for(model_arch=EAGLE3, num_q_heads=16, num_kv_heads=1, qk_dim=256, v_dim=256,
                               device_arch="gfx950", env={})  # fmt: skip
    assert verify.decision.path == "general" and "qk 256" in verify.decision.reason


@needs_real
@pytest.mark.parametrize("model_arch", [M3_ARCHS[1], EAGLE3])
def test_kgen_explain_routes_them_to_the_grouped_path(model_arch):
    text = explain("gqa128", "fp8", arch="gfx950", model=model_arch, group=16, verbose=True)
    assert "decision: grouped (layout gqa128)" in text
    assert f"kgen gate for {model_arch}" in text


# ------------------------------------------------------------------ MiniMax-M3 at the upstream sizes


@needs_real
@pytest.mark.parametrize("kv", KV)
def test_minimax_m3_module_accepts_the_199999_token_call(kv):
    """The upstream batch as tensors (about 140 MB on the CPU): the module takes it, with the
    FP8 descales, and the launch it plans fits every arch SGLang runs it on."""
    module = kgen.load("gqa128", kv)
    prefixes = M3_PREFIXES if kv == "bfloat16" else M3_FP8_PREFIXES
    case = m3_case(prefixes, kv)
    assert module.why_not(*case.sglang_args()) == ""
    for arch, sms in DEVICES:
        for draft in (1, 4):
            launches = module.launch_params(arch, sms, 16, len(prefixes), draft)
            prefix_stage = [c for name, c, _ in launches if name == "_verify_prefix_stage"]
            assert prefix_stage and all(c["GROUP"] == 16 for c in prefix_stage), (arch, draft, launches)
        assert module.scratch_bytes(case.q.shape[0], 16, 1, len(prefixes), 4, arch, sms) > 0


@needs_real
@pytest.mark.parametrize("kv", KV)
def test_minimax_m3_parity_in_the_interpreter(kv):
    """The upstream cases' shape with shortened prefixes (an empty-ish 1, 77, one past a tile)."""
    prefixes = [1, 77, 130] if kv == "bfloat16" else [30 + 37 * i for i in range(3)]
    check_parity(m3_case(prefixes, kv, seed=7), "gqa128", kv)


# ------------------------------------------------------------------ Kimi-K3's DSpark draft


@needs_real
def test_kimi_k3_dspark_shape_causal_form():
    """DSpark's shape (group 4 on 2 KV heads, 7 draft tokens) as a causal chain; upstream's
    prefixes (512, 2048) shortened to (51, 204)."""
    check_parity(dspark_case([51, 204], seed=2), "gqa64", "bfloat16")


@needs_real
def test_kimi_k3_dspark_non_causal_draft_block():
    """Upstream's DSpark case proper: every draft token sees every other (``is_causal=False``)."""
    case = dspark_case([51, 204], seed=3)
    case.is_causal = False
    check_parity(case, "gqa64", "bfloat16")


# ------------------------------------------------------------------ the upstream sizes on a GPU


@pytest.mark.gpu
@needs_real
@pytest.mark.parametrize("kv", KV)
def test_gpu_minimax_m3_at_the_upstream_prefixes(kv):
    """BF16: prefixes (1, 77, 4099, 70001, 199999); FP8: 24 prefixes 3000 + 37 i, K/V descales
    0.5 / 0.25; draft 4, int64 kv_indices."""
    prefixes = M3_PREFIXES if kv == "bfloat16" else M3_FP8_PREFIXES
    check_parity(m3_case(prefixes, kv, device="cuda", seed=11), "gqa128", kv)
    check_parity(m3_case(prefixes[:2], kv, device="cuda", seed=12), "gqa128", kv, variant="per_head")


@pytest.mark.gpu
@needs_real
def test_gpu_kimi_k3_dspark_shape_causal_form():
    check_parity(dspark_case([512, 2048], device="cuda", seed=4), "gqa64", "bfloat16")
