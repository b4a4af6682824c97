"""Every input a module does not handle: verify_shared_kv_fwd returns False, o untouched."""

import pytest
import torch
from kernel_cases import build

import kgen
from kgen.problems import chain_mask, sglang_mask

GQA = "qwen3_5_gqa256"


def _call(module, case, **overrides):
    kwargs = dict(
        q_extend=case.q, k_extend=case.k_extend, v_extend=case.v_extend, o_extend=case.o,
        k_buffer=case.k_buffer, v_buffer=case.v_buffer, qo_indptr=case.qo_indptr, kv_indptr=case.kv_indptr,
        kv_indices=case.kv_indices, custom_mask=None, is_causal=True, mask_indptr=None,
        max_len_extend=case.max_len_extend, k_scale=case.k_scale, v_scale=case.v_scale,
    )
    kwargs.update(overrides)
    return module.verify_shared_kv_fwd(**kwargs), module.why_not(**kwargs)


def _gqa_case(**kw):
    return build(GQA, [20, 7], [2, 3], 4, **kw)


def _tree(case) -> dict:
    """SGLang's mask arguments for a chain written as a tree (a mask the kernels can read)."""
    mask, indptr = sglang_mask([chain_mask(n) for n in case.draft_lens()], case.prefix_lens())
    return {"custom_mask": mask, "mask_indptr": indptr}


REFUSALS = {
    "sinks": lambda c: {"sinks": torch.zeros(c.q.shape[1])},
    "sliding window": lambda c: {"sliding_window_size": 128},
    "window_kv_offsets": lambda c: {"window_kv_offsets": torch.zeros(2, dtype=torch.int32)},
    "logit cap": lambda c: {"logit_cap": 30.0},
    "xai temperature": lambda c: {"xai_temperature_len": 4},
    "custom mask without mask_indptr": lambda c: {"is_causal": False, "custom_mask": torch.ones(10, dtype=torch.bool)},
    "kv_len_adjust past the request's slots": lambda c: {"kv_len_adjust": 1},
    "kv_len_adjust not an int": lambda c: {"kv_len_adjust": -1.0},
    "kv_len_adjust with a mask": lambda c: {**_tree(c), "kv_len_adjust": -1},
    "mask on the prefix columns": lambda c: {**_tree(c), "skip_prefix_custom_mask": False},
    "int32 custom mask": lambda c: {**_tree(c), "custom_mask": _tree(c)["custom_mask"].int()},
    "mask_indptr too short": lambda c: {**_tree(c), "mask_indptr": _tree(c)["mask_indptr"][:1]},
    "non-contiguous custom mask": lambda c: {**_tree(c), "custom_mask": _tree(c)["custom_mask"].repeat(2)[::2]},
    "D_qk < D_v": lambda c: {"v_extend": torch.randn(c.q.shape[0], 1, 512).bfloat16(),
                             "o_extend": torch.zeros(c.q.shape[0], c.q.shape[1], 512).bfloat16()},
    "H_q not a multiple of H_kv": lambda c: {"q_extend": torch.randn(c.q.shape[0], 6, 256).bfloat16(),
                                             "k_extend": torch.randn(c.q.shape[0], 4, 256).bfloat16()},
    "head count vs buffer": lambda c: {"k_buffer": torch.randn(c.k_buffer.shape[0], 2, 256).bfloat16()},
    "head dim vs layout": lambda c: {"q_extend": torch.randn(c.q.shape[0], 4, 128).bfloat16()},
    "wrong KV dtype": lambda c: {"k_buffer": c.k_buffer.half(), "v_buffer": c.v_buffer.half()},
    "wrong query dtype": lambda c: {"q_extend": c.q.float()},
    "scale tensor on a bf16 module": lambda c: {"k_scale": torch.tensor([0.5])},
    "non-finite scale on a bf16 module": lambda c: {"v_scale": float("inf")},
    "draft longer than supported": lambda c: {"max_len_extend": 65},
    "max_len_extend not an int": lambda c: {"max_len_extend": torch.tensor(3)},
    "kv_indices float": lambda c: {"kv_indices": c.kv_indices.float()},
    "kv_indptr batch mismatch": lambda c: {"kv_indptr": c.kv_indptr[:-1]},
    "non-contiguous q": lambda c: {"q_extend": torch.randn(c.q.shape[0], 4, 512).bfloat16()[..., ::2]},
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusal_leaves_o_untouched(name):
    module = kgen.load(GQA, "bfloat16")
    case = _gqa_case(seed=1)
    before = case.o.clone()
    ok, reason = _call(module, case, **REFUSALS[name](case))
    assert ok is False
    assert reason
    assert torch.equal(case.o.isnan(), before.isnan()) and torch.equal(case.o.nan_to_num(), before.nan_to_num())
    assert module.can_handle(**{**dict(zip(
        ["q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
         "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend", "k_scale", "v_scale"],
        case.sglang_args()[:15], strict=True)), **REFUSALS[name](case)}) is False


def test_mla_needs_v_as_a_view_of_the_latent():
    module = kgen.load("mla_absorbed_512_64", "bfloat16")
    case = build("mla_absorbed_512_64", [9], [2], 8)
    ok, reason = _call(module, case, v_buffer=case.k_buffer[..., :512].clone())
    assert not ok and "view of k_buffer" in reason


def test_fnuz_module_refuses_on_nvidia(monkeypatch):
    module = kgen.load(GQA, "float8_e4m3fnuz")
    case = _gqa_case(kv_dtype="float8_e4m3fnuz", seed=2)
    assert module.why_not(*case.sglang_args()) == ""  # CPU (interpreter) accepts it
    monkeypatch.setattr(module.LAUNCHER, "device_info", lambda device_type, index: ("sm_90", 132, False))
    assert "sm_90 has no float8_e4m3fnuz tensor-core format" in module.why_not(*case.sglang_args())


def test_fp8_module_refuses_where_the_arch_has_no_e4m3(monkeypatch):
    module = kgen.load(GQA, "float8_e4m3fn")
    case = _gqa_case(kv_dtype="float8_e4m3fn", seed=2)
    monkeypatch.setattr(module.LAUNCHER, "device_info", lambda device_type, index: ("sm_80", 108, False))
    assert "sm_80 has no float8_e4m3fn tensor-core format" in module.why_not(*case.sglang_args())
    ok, _ = _call(module, case)
    assert not ok
    monkeypatch.setattr(module.LAUNCHER, "device_info", lambda device_type, index: ("sm_89", 128, False))
    assert module.why_not(*case.sglang_args()) == ""


def test_an_arch_outside_the_checked_set_is_refused(monkeypatch):
    module = kgen.load(GQA, "bfloat16")
    case = _gqa_case(seed=4)
    monkeypatch.setattr(module.LAUNCHER, "device_info", lambda device_type, index: ("sm_75", 40, False))
    reason = module.why_not(*case.sglang_args())
    assert "sm_75 is not a target this module was checked for" in reason and "sm_90" in reason
    ok, _ = _call(module, case)
    assert not ok


def test_accepts_what_it_should():
    module = kgen.load(GQA, "bfloat16")
    case = _gqa_case(seed=3)
    assert module.can_handle(*case.sglang_args())
    ok, _ = _call(module, case, k_scale=None, v_scale=None)
    assert ok


@pytest.mark.parametrize(("arch", "sms", "served"), [("sm_90", 132, True), ("gfx950", 256, True), ("sm_80", 108, False),
                                                      ("gfx942", 304, False)])
def test_e5m2_module_is_served_where_the_arch_has_e5m2(monkeypatch, arch, sms, served):
    """e5m2 (SGLang's fp8_e5m2 pool) on the archs whose tensor cores have it (targets.json),
    refused with the dtype named elsewhere."""
    module = kgen.load(GQA, "float8_e5m2")
    case = _gqa_case(kv_dtype="float8_e5m2", seed=2)
    monkeypatch.setattr(module.LAUNCHER, "device_info", lambda device_type, index: (arch, sms, False))
    reason = module.why_not(*case.sglang_args())
    assert (reason == "") if served else (f"{arch} has no float8_e5m2 tensor-core format" in reason), reason
