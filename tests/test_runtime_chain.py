"""The fallback chain: which level runs each call, and that its output is right.

The first half uses fake modules that follow the module contract (fast, and independent
of the generator); the second half runs the real generated modules in Triton's
interpreter (skipped, with the reason, when they are absent).
"""

from __future__ import annotations

import pytest
import torch
from test_runtime_support import (
    FakeModule,
    brute_force,
    chain_mask,
    device,
    fake_loader,
    real_module_reason,
    runtime_case,
    tree_mask,
)

from kgen.reference import reference_verify
from kgen.runtime.chain import VerifyChain

TOL = dict(atol=2e-5, rtol=2e-5)


def ref(case, **kw):
    return reference_verify(case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.qo_indptr,
                            case.kv_indptr, case.kv_indices, **kw)  # fmt: skip


def fakes(grouped_groups=(4,), per_head_groups=(1, 2, 4, 8), **kw):
    return {
        "grouped": FakeModule("fake_grouped", groups=grouped_groups, **kw),
        "per_head": FakeModule("fake_per_head", groups=per_head_groups, **kw),
    }


def chain_with(mods, **kw):
    return VerifyChain("fake", "float32", "float32", loader=fake_loader(mods), **kw)


def call(chain, case, **kw):
    o = case.out()
    path = chain(*case.flat_args(o), kw.pop("custom_mask", None), kw.pop("is_causal", True),
                 kw.pop("mask_indptr", None), kw.pop("max_len_extend", case.max_len), **kw)  # fmt: skip
    return path, o


# ------------------------------------------------------------------ fakes: routing


def test_plain_call_runs_grouped():
    mods = fakes()
    case = runtime_case([12, 30], [3, 2], group=4)
    path, o = call(chain_with(mods), case)
    assert path == "grouped" and mods["per_head"].calls == 0
    torch.testing.assert_close(o, ref(case), **TOL)


def test_grouped_refusal_reaches_per_head():
    mods = fakes()
    case = runtime_case([12, 30], [3, 2], group=2)  # the fake grouped kernel takes group 4 only
    chain = chain_with(mods)
    path, o = call(chain, case)
    assert path == "per_head" and mods["grouped"].calls == 1
    assert chain.last_path == "per_head" and chain.counts["per_head"] == 1
    torch.testing.assert_close(o, ref(case), **TOL)


REFUSALS = {
    "sinks": dict(sinks="per_head"),
    "sliding_window": dict(sliding_window_size=6),
    "logit_cap": dict(logit_cap=2.0),
    "xai_temperature": dict(xai_temperature_len=8),
    "non_causal": dict(is_causal=False),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_each_refusal_reaches_general_and_is_right(name):
    mods = fakes()
    case = runtime_case([25, 9], [3, 4], group=4, d_qk=16, d_v=16, seed=2)
    feats = dict(REFUSALS[name])
    if feats.get("sinks") == "per_head":
        feats["sinks"] = torch.linspace(0.0, 1.0, 4)
    path, o = call(chain_with(mods), case, **feats)
    assert path == "general"
    assert mods["grouped"].calls == 1 and mods["per_head"].calls == 1  # both asked, both refused
    torch.testing.assert_close(o.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)


def test_wrong_dtype_reaches_general():
    mods = fakes()
    case = runtime_case([25, 9], [3, 4], group=4, q_dtype=torch.float16, kv_dtype=torch.float16)
    path, o = call(chain_with(mods), case)
    assert path == "general"
    torch.testing.assert_close(o.float(), ref(case), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("is_causal", [True, False])
def test_tree_mask_goes_to_the_kernels(is_causal):
    """Modules read a custom mask (it governs, is_causal True or False), so a tree runs grouped."""
    mods = fakes()
    case = runtime_case([14, 20], [4, 3], group=4, seed=9)
    mask, indptr = tree_mask(case)
    path, o = call(chain_with(mods), case, custom_mask=mask, mask_indptr=indptr, is_causal=is_causal)
    assert path == "grouped" and mods["grouped"].accepted == 1
    want = brute_force(case, custom_mask=mask, mask_indptr=indptr)
    torch.testing.assert_close(o.double(), want, atol=3e-5, rtol=3e-5)


def test_chain_mask_runs_the_kernel_and_a_short_mask_is_caught():
    mods = fakes()
    case = runtime_case([14, 20], [4, 3], group=4, seed=9)
    mask, indptr = chain_mask(case)
    chain = chain_with(mods, check_indices=True)
    path, o = call(chain, case, custom_mask=mask, mask_indptr=indptr)
    assert path == "grouped"
    torch.testing.assert_close(o, ref(case), **TOL)
    with pytest.raises(ValueError, match="custom_mask has .* entries"):
        call(chain, case, custom_mask=mask[:-1], mask_indptr=indptr)


def test_mask_on_the_prefix_goes_general():
    mods = fakes()
    case = runtime_case([14, 20], [4, 3], group=4, seed=9)
    mask, indptr = tree_mask(case, prefix_bits=True)
    feats = dict(custom_mask=mask, mask_indptr=indptr, skip_prefix_custom_mask=False)
    path, o = call(chain_with(mods), case, **feats)
    assert path == "general" and mods["grouped"].calls == 1
    torch.testing.assert_close(o.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)


def test_start_skips_levels():
    mods = fakes()
    case = runtime_case([10], [2], group=4)
    assert call(chain_with(mods, start="per_head"), case)[0] == "per_head"
    assert call(chain_with(mods, start="general"), case)[0] == "general"
    assert mods["grouped"].calls == 0
    with pytest.raises(ValueError, match="start must be one of"):
        chain_with(mods, start="fastest")


def test_missing_modules_are_skipped_and_described():
    chain = chain_with({"per_head": FakeModule("fake_per_head", groups=(4,))})
    assert "grouped: missing (FileNotFoundError" in chain.describe()
    case = runtime_case([10], [2], group=4)
    assert call(chain, case)[0] == "per_head"
    assert call(VerifyChain(None, loader=fake_loader({})), case)[0] == "general"


def test_without_max_len_only_general_runs():
    mods = fakes()
    case = runtime_case([10], [2], group=4)
    assert call(chain_with(mods), case, max_len_extend=None)[0] == "general"
    assert mods["grouped"].calls == 0


def test_modules_are_looked_up_once():
    counter: dict = {}
    chain = VerifyChain("fake", loader=fake_loader(fakes(), counter))
    case = runtime_case([10], [2], group=4)
    for _ in range(5):
        call(chain, case)
    assert counter == {"grouped": 1, "per_head": 1}


def test_kernel_path_makes_no_host_sync(monkeypatch):
    """Between the call and the kernel, the chain only reads tensor metadata."""
    mods = fakes(compute=False)
    chain = chain_with(mods)
    case = runtime_case([10, 4], [2, 3], group=4)
    o = case.out()

    def sync(*a, **k):
        raise AssertionError("host sync on the kernel path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    assert chain(*case.flat_args(o), None, True, None, case.max_len) == "grouped"


def test_invalid_input_raises_before_any_kernel():
    mods = fakes()
    case = runtime_case([10], [2], group=4)
    o = case.out()
    args = list(case.flat_args(o))
    args[8] = case.kv_indices.float()
    with pytest.raises(ValueError, match="kv_indices must be int32 or int64"):
        chain_with(mods)(*args, None, True, None, case.max_len)
    assert mods["grouped"].calls == 0
    args[8] = case.kv_indices + 1000
    with pytest.raises(ValueError, match="outside the pool"):
        chain_with(mods, check_indices=True)(*args, None, True, None, case.max_len)


def test_check_indices_from_env(monkeypatch):
    monkeypatch.setenv("KGEN_CHECK_INDICES", "1")
    assert chain_with(fakes()).check_indices
    monkeypatch.setenv("KGEN_CHECK_INDICES", "0")
    assert not chain_with(fakes()).check_indices


# ------------------------------------------------------------------ the real generated modules

REAL = real_module_reason()
needs_real = pytest.mark.skipif(bool(REAL), reason=REAL or "generated modules present")
DEV = device()


def real_case(seed=0, prefix=(45, 130), draft=(3, 2), **kw):
    shape = dict(h_kv=1, group=8, d_qk=64, d_v=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    shape.update(kw)
    return runtime_case(list(prefix), list(draft), device=DEV, seed=seed, **shape)


@needs_real
@pytest.mark.parametrize("start", ["grouped", "per_head"])
def test_real_modules_plain(start):
    chain = VerifyChain("gqa64", "bf16", "bf16", start=start)
    case = real_case()
    path, o = call(chain, case)
    assert path == start
    torch.testing.assert_close(o.float().cpu(), ref(case).cpu(), atol=2e-2, rtol=2e-2)


@needs_real
def test_real_modules_two_kv_heads():
    chain = VerifyChain("gqa64", "bf16", "bf16")
    case = real_case(h_kv=2, prefix=(33, 70, 0), draft=(1, 4, 2))
    path, o = call(chain, case)
    assert path == "grouped"
    torch.testing.assert_close(o.float().cpu(), ref(case).cpu(), atol=2e-2, rtol=2e-2)


@needs_real
def test_real_fp8_module_with_scales():
    chain = VerifyChain("gqa64", "fp8_e4m3fn", "bf16")
    case = real_case(kv_dtype=torch.float8_e4m3fn)
    path, o = call(chain, case, k_scale=0.5, v_scale=torch.tensor([2.0], device=DEV))
    assert path == "grouped"
    want = ref(case, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(o.float().cpu(), want.cpu(), atol=3e-2, rtol=3e-2)


@needs_real
@pytest.mark.parametrize("name", sorted(set(REFUSALS) - {"non_causal"})  # served: a block drafter's draft
                         + ["wrong_q_dtype", "long_draft", "prefix_mask"])
def test_real_refusals_fall_through_to_general(name):
    chain = VerifyChain("gqa64", "bf16", "bf16")
    case = real_case(seed=1, prefix=(20, 37), draft=(2, 3))
    feats = dict(REFUSALS.get(name, {}))
    if name == "wrong_q_dtype":
        case = real_case(seed=1, prefix=(20, 37), draft=(2, 3), q_dtype=torch.float32)
    if name == "long_draft":
        case = real_case(seed=1, prefix=(20, 7), draft=(65, 3))  # beyond MAX_DRAFT_TOKENS
    if name == "prefix_mask":  # skip_prefix_custom_mask=False: the kernels read only the draft block
        mask, indptr = tree_mask(case, prefix_bits=True)
        feats = dict(custom_mask=mask, mask_indptr=indptr, skip_prefix_custom_mask=False)
    if feats.get("sinks") == "per_head":
        feats["sinks"] = torch.linspace(0.0, 1.0, 8, device=DEV)
    path, o = call(chain, case, **feats)
    assert path == "general", chain.describe()
    want = brute_force(case, **feats)
    torch.testing.assert_close(o.double().cpu(), want, atol=2e-2, rtol=2e-2)


@needs_real
def test_real_non_causal_block_runs_grouped():
    """is_causal=False without a mask (a block drafter's draft): the real modules serve it."""
    chain = VerifyChain("gqa64", "bf16", "bf16")
    case = real_case(seed=1, prefix=(20, 37), draft=(2, 3))
    path, o = call(chain, case, is_causal=False)
    assert path == "grouped", chain.describe()
    want = brute_force(case, is_causal=False)
    torch.testing.assert_close(o.double().cpu(), want, atol=2e-2, rtol=2e-2)


@needs_real
def test_real_tree_mask_runs_grouped():
    """A tree (random bits, each token sees itself) through the real module: the mask governs."""
    chain = VerifyChain("gqa64", "bf16", "bf16")
    case = real_case(seed=4, prefix=(20, 0, 37), draft=(5, 3, 6))
    mask, indptr = tree_mask(case, seed=2)
    path, o = call(chain, case, custom_mask=mask, mask_indptr=indptr)
    assert path == "grouped", chain.describe()
    want = brute_force(case, custom_mask=mask, mask_indptr=indptr)
    torch.testing.assert_close(o.double().cpu(), want, atol=2e-2, rtol=2e-2)


@needs_real
def test_real_mla_module_short_width():
    """Absorbed MLA (576 = 512 + 64, V = latent columns), draft widths 1 and 2."""
    chain = VerifyChain("mla_absorbed_512_64", "bf16", "bf16")
    case = real_case(group=16, d_qk=576, d_v=512, mla=True, prefix=(40, 21), draft=(1, 2))
    path, o = call(chain, case)
    assert path == "grouped"
    torch.testing.assert_close(o.float().cpu(), ref(case).cpu(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@needs_real
def test_gpu_qwen35_grouped_vs_per_head_vs_general():
    """On the device: every level agrees with the reference on a Qwen3.5 TP4 shape."""
    case = real_case(group=8, d_qk=256, d_v=256, prefix=(4096, 1500, 17), draft=(3, 1, 2), seed=5)
    want = ref(case)
    for start in ("grouped", "per_head", "general"):
        chain = VerifyChain("qwen3_5_gqa256", "bf16", "bf16", start=start)
        path, o = call(chain, case)
        assert path == start
        torch.testing.assert_close(o.float(), want, atol=2e-2, rtol=2e-2)
