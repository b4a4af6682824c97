"""The SGLang-shaped adapter and the start-up factories (gate + chain)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from test_runtime_support import (
    FakeModule,
    brute_force,
    device,
    fake_loader,
    real_module_reason,
    runtime_case,
)

from kgen.plan import module_uri
from kgen.reference import reference_verify
from kgen.runtime.adapters import SGLangVerify, dtype_name, sglang_verify_for, vllm_verify_for
from kgen.runtime.call import VerifyCall
from kgen.runtime.chain import VerifyChain
from kgen.runtime.gate import Inventory
from kgen.spec import load_layouts

REAL = real_module_reason()
needs_real = pytest.mark.skipif(bool(REAL), reason=REAL or "generated modules present")

# SGLang's TritonAttnBackend.forward_extend passes these at target verify (verify_shared_kv_fwd).
SGLANG_PARAMS = [
    "q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr",
    "kv_indptr", "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend",
    "k_scale", "v_scale", "sm_scale", "logit_cap", "skip_prefix_custom_mask",
    "sliding_window_size", "sinks", "window_kv_offsets", "xai_temperature_len", "max_bs",
]  # fmt: skip


def ref(case, **kw):
    return reference_verify(case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.qo_indptr,
                            case.kv_indptr, case.kv_indices, **kw)  # fmt: skip


def sglang_args(case, o, **kw):
    """Positional arguments as SGLang passes them (descales None: not fp8)."""
    mask = (kw.pop("custom_mask", None), kw.pop("is_causal", True), kw.pop("mask_indptr", None))
    scales = (kw.pop("k_scale", None), kw.pop("v_scale", None))
    return (*case.flat_args(o), *mask, case.max_len, *scales), kw


def test_sglang_signature_is_the_module_contract():
    """SGLang's 23 positional arguments, then its keyword-only kv_len_adjust, as the modules take them."""
    assert [f.name for f in dataclasses.fields(VerifyCall) if not f.kw_only] == SGLANG_PARAMS
    assert [f.name for f in dataclasses.fields(VerifyCall) if f.kw_only] == ["kv_len_adjust"]
    for fn in (SGLangVerify.__call__, VerifyChain.__call__):
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert [p.name for p in params if p.kind != p.KEYWORD_ONLY] == SGLANG_PARAMS
        assert [p.name for p in params if p.kind == p.KEYWORD_ONLY] == ["kv_len_adjust"]
    if not REAL:
        import kgen

        mod = kgen.load("gqa64", "bf16", "bf16")
        params = inspect.signature(mod.verify_shared_kv_fwd).parameters.values()
        # SGLang's arguments, then keyword-only ones: SGLang's newer kv_len_adjust (which it passes by
        # name) and kgen's own check_indices, which SGLang never passes.
        assert [p.name for p in params if p.kind != p.KEYWORD_ONLY] == SGLANG_PARAMS
        assert [p.name for p in params if p.kind == p.KEYWORD_ONLY] == ["kv_len_adjust", "check_indices"]


def test_sglang_adapter_runs_the_chain_and_returns_true():
    mods = {"grouped": FakeModule("g", groups=(4,))}
    adapter = SGLangVerify(VerifyChain("fake", loader=fake_loader(mods)))
    case = runtime_case([20, 8], [3, 2], group=4)
    o = case.out()
    args, kw = sglang_args(case, o)
    assert adapter(*args) is True and adapter.chain.last_path == "grouped"
    torch.testing.assert_close(o, ref(case), atol=2e-5, rtol=2e-5)
    o = case.out()
    args, _ = sglang_args(case, o)
    assert adapter(*args, logit_cap=3.0) is True and adapter.chain.last_path == "general"
    torch.testing.assert_close(o.double(), brute_force(case, logit_cap=3.0), atol=3e-5, rtol=3e-5)


def test_sglang_adapter_can_leave_the_fallback_to_the_engine():
    mods = {"grouped": FakeModule("g", groups=(4,))}
    adapter = SGLangVerify(VerifyChain("fake", loader=fake_loader(mods)), defer_general=True)
    case = runtime_case([20, 8], [3, 2], group=4)
    o = case.out()
    args, _ = sglang_args(case, o)
    assert adapter(*args) is True
    o = case.out()
    args, _ = sglang_args(case, o)
    assert adapter(*args, sinks=torch.zeros(4)) is False
    assert torch.isnan(o).all()  # untouched: the engine's own kernel will write it


def _inventory(uris) -> Inventory:
    return Inventory(layouts=load_layouts(), available_uris=frozenset(uris))


def test_factory_follows_the_gate():
    uris = {module_uri("qwen3_5_gqa256", "bfloat16", "bfloat16", v) for v in ("grouped", "per_head")}
    mods = {"grouped": FakeModule("g"), "per_head": FakeModule("p")}
    kw = dict(model_arch="Qwen3_5ForCausalLM", qk_dim=256, v_dim=256, device_arch="gfx950",
              env={}, inventory=_inventory(uris), loader=fake_loader(mods))  # fmt: skip
    a = sglang_verify_for(num_q_heads=16, num_kv_heads=1, kv_dtype=torch.bfloat16, **kw)
    assert a.decision.path == "grouped" and [lv.name for lv in a.chain.levels] == ["grouped", "per_head"]
    a = sglang_verify_for(num_q_heads=16, num_kv_heads=1, topk=4, **kw)  # a tree: the modules read its mask
    assert a.decision.path == "grouped" and "topk=4: a tree" in a.decision.reason
    a = sglang_verify_for(num_q_heads=32, num_kv_heads=1, **kw)  # group 32: not in the layout
    assert a.decision.path == "per_head" and [lv.name for lv in a.chain.levels] == ["per_head"]
    v = vllm_verify_for(num_q_heads=32, num_kv_heads=2, **kw)
    assert v.decision.path == "grouped" and "2 TP-local KV heads" in v.decision.reason
    with pytest.raises(ValueError, match="multiple of KV heads per rank"):
        sglang_verify_for(num_q_heads=6, num_kv_heads=4, **kw)


def test_dtype_name():
    assert dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    assert dtype_name("bf16") == "bf16"


@needs_real
def test_factory_with_real_modules_in_the_interpreter():
    """What an engine does at start-up, with the real inventory and kgen.load."""
    from kgen.runtime.device import detect_arch

    dev = device()
    env = {} if dev == "cuda" else {"TRITON_INTERPRET": "1"}
    adapter = sglang_verify_for(
        model_arch="KimiK3ForConditionalGeneration", num_q_heads=16, num_kv_heads=1,
        qk_dim=576, pe_dim=64, v_dim=512, env=env, device_arch=detect_arch(),
    )  # fmt: skip
    assert adapter.decision.path == "grouped", adapter.decision
    shape = dict(h_kv=1, group=16, d_qk=576, d_v=512, mla=True, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    case = runtime_case([50, 3], [2, 3], device=dev, **shape)
    o = case.out()
    args, _ = sglang_args(case, o)
    assert adapter(*args) is True and adapter.chain.last_path == "grouped"
    torch.testing.assert_close(o.float().cpu(), ref(case).cpu(), atol=2e-2, rtol=2e-2)


def test_verify_call_names_sglang_arguments_when_misused():
    case = runtime_case([5], [2])
    call = VerifyCall.from_sglang(*case.flat_args(case.out()), None, True, None, case.max_len, sm_scale=0.5)
    assert call.as_sglang_args()[12:16] == (case.max_len, 1.0, 1.0, 0.5)
    assert call.features.plain
    with pytest.raises(TypeError, match="SGLang's verify arguments are \\(q_extend, k_extend"):
        VerifyCall.from_sglang(*case.flat_args(case.out()), bogus=1)
    with pytest.raises(TypeError, match="at most 23 positional arguments, got 24"):
        VerifyCall.from_sglang(*range(24))
