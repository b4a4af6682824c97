"""What engines pass beyond a causal chain, through the real adapters and chain (issue 20):
SGLang's ``kv_len_adjust``, ``is_causal=False`` without a mask on the paged path, and the KV
scales (floats on a 16-bit pool, vLLM's descale tensors). The generated modules run in Triton's
interpreter at tiny shapes, against ``kgen.reference``; every refusal leaves ``o`` untouched.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime_support import (
    FakeModule,
    device,
    fake_loader,
    real_module_reason,
    runtime_case,
    to_pages,
    tree_mask,
)

from kgen.reference import reference_verify
from kgen.runtime.adapters import SGLangVerify, VLLMVerify, vllm_cache_scale
from kgen.runtime.call import Features, PagedCall, VerifyCall
from kgen.runtime.chain import VerifyChain

REAL = real_module_reason()
needs_real = pytest.mark.skipif(bool(REAL), reason=REAL or "generated modules present")
DEV = device()
LAYOUT = "gqa64"
BF16 = dict(h_kv=2, group=4, d_qk=64, d_v=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
FP8 = dict(BF16, kv_dtype=torch.float8_e4m3fn)
TOL = dict(atol=3e-2, rtol=3e-2)


def case_of(prefix, draft, seed=0, **shape):
    return runtime_case(list(prefix), list(draft), device=DEV, seed=seed, **(shape or BF16))


def ref(case, kv_indptr=None, kv_indices=None, **kw):
    return reference_verify(case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.qo_indptr,
                            case.kv_indptr if kv_indptr is None else kv_indptr,
                            case.kv_indices if kv_indices is None else kv_indices, **kw)  # fmt: skip


def trimmed(case, trim):
    """(kv_indptr, kv_indices) of each request's slice less its last ``trim`` slots."""
    bounds = case.kv_indptr.tolist()
    keep = [case.kv_indices[bounds[b] : bounds[b + 1] - trim] for b in range(len(bounds) - 1)]
    indptr = [0]
    for k in keep:
        indptr.append(indptr[-1] + k.numel())
    return torch.tensor(indptr, dtype=case.kv_indptr.dtype, device=DEV), torch.cat(keep)


def sglang_args(case, o, **kw):
    """SGLang's positional arguments (descales None when not given), the rest by name."""
    mask = (kw.pop("custom_mask", None), kw.pop("is_causal", True), kw.pop("mask_indptr", None))
    scales = (kw.pop("k_scale", None), kw.pop("v_scale", None))
    return (*case.flat_args(o), *mask, kw.pop("max_len_extend", case.max_len), *scales), kw


def vllm_args(case, o, pages):
    seq_lens = pages["prefix_lens"] + (case.qo_indptr[1:] - case.qo_indptr[:-1])
    return (case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"], seq_lens,
            case.qo_indptr, case.max_len)  # fmt: skip


def paged_call(case, o, pages, **kw):
    return PagedCall(case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"],
                     pages["prefix_lens"], case.qo_indptr, case.max_len, **kw)  # fmt: skip


def assert_untouched(o):
    assert torch.isnan(o.float()).all(), "a refused call wrote o"


# ------------------------------------------------------------------ kv_len_adjust


@needs_real
@pytest.mark.parametrize("defer_general", [True, False])
def test_sglang_adapter_takes_kv_len_adjust_by_name(defer_general):
    """SGLang's newer kernel decodes through the verify entry: one query row a request, its token
    already the slice's last slot, kv_len_adjust=-1 by name (sgl-project/sglang
    test/registered/attention/test_verify_shared_kv.py at 08582c222bd8cf28a21dba2eea89a694bd3a6734,
    _run_decode_parity). The grouped kernel serves it; the answer is verification over the trimmed
    slices."""
    adapter = SGLangVerify(VerifyChain(LAYOUT, "bf16", "bf16"), defer_general=defer_general)
    case = case_of([1, 9, 70], [1, 1, 1], seed=3)
    o = case.out()
    args, kw = sglang_args(case, o)
    assert adapter(*args, kv_len_adjust=-1, **kw) is True
    assert adapter.chain.last_path == "grouped", adapter.chain.describe()
    want = ref(case, *trimmed(case, 1))
    torch.testing.assert_close(o.float(), want, **TOL)
    assert (o.float() - ref(case)).abs().max() > 10 * TOL["atol"], "the trim must change the answer"


@pytest.mark.parametrize("max_len", ["given", None])
def test_general_path_honours_kv_len_adjust(max_len):
    """No kernel level (no layout), or no max_len_extend: the general path trims the slices too."""
    chain = VerifyChain(None, "float32", "float32")
    case = runtime_case([20, 3, 41], [3, 1, 2], group=4, seed=5)
    o = case.out()
    args, kw = sglang_args(case, o, max_len_extend=case.max_len if max_len else None)
    assert chain(*args, kv_len_adjust=-2, **kw) == "general"
    torch.testing.assert_close(o, ref(case, *trimmed(case, 2)), atol=2e-5, rtol=2e-5)


def test_kernel_refusing_kv_len_adjust_falls_to_general():
    """A level whose module refuses the trim hands the call on; the general path answers right."""
    mods = {"grouped": FakeModule("g", groups=(4,))}
    chain = VerifyChain("fake", "float32", "float32", loader=fake_loader(mods))
    case = runtime_case([20, 12], [2, 3], group=4, seed=6)
    o = case.out()
    args, kw = sglang_args(case, o)
    assert chain(*args, kv_len_adjust=-1, **kw) == "general" and mods["grouped"].calls == 1
    torch.testing.assert_close(o, ref(case, *trimmed(case, 1)), atol=2e-5, rtol=2e-5)
    o = case.out()
    args, kw = sglang_args(case, o)
    assert chain(*args, kv_len_adjust=0, **kw) == "grouped"


@pytest.mark.parametrize(("adjust", "match"), [(1, "kv_len_adjust = 1 > 0"), (-1.0, "must be a Python int"),
                                               (True, "must be a Python int")])  # fmt: skip
def test_bad_kv_len_adjust_is_an_error(adjust, match):
    adapter = SGLangVerify(VerifyChain(None, "float32", "float32"), defer_general=True)
    case = runtime_case([20], [2], group=4)
    o = case.out()
    args, kw = sglang_args(case, o)
    with pytest.raises(ValueError, match=match):
        adapter(*args, kv_len_adjust=adjust, **kw)
    assert_untouched(o)


def test_kv_len_adjust_with_a_mask_is_refused():
    """No defined meaning (which prefix the mask's [L, P + L] rows count): refused by every entry."""
    case = runtime_case([20, 9], [3, 2], group=4, seed=2)
    mask, indptr = tree_mask(case)
    chain = VerifyChain(None, "float32", "float32")
    o = case.out()
    args, kw = sglang_args(case, o, custom_mask=mask, mask_indptr=indptr)
    assert chain.try_call(VerifyCall.from_sglang(*args, kv_len_adjust=-1, **kw)) is None
    assert "kv_len_adjust = -1 with a custom_mask" in chain.last_refusal
    assert SGLangVerify(chain, defer_general=True)(*args, kv_len_adjust=-1, **kw) is False
    with pytest.raises(ValueError, match="with a custom_mask"):
        chain(*args, kv_len_adjust=-1, **kw)
    assert_untouched(o)
    assert chain.counts["general"] == 0


def test_check_indices_catches_a_slice_shorter_than_the_trim():
    chain = VerifyChain(None, "float32", "float32", check_indices=True)
    case = runtime_case([20, 0], [2, 1], group=4)
    o = case.out()
    args, kw = sglang_args(case, o)
    with pytest.raises(ValueError, match="request 1's kv_indptr slice holds 0 slots"):
        chain(*args, kv_len_adjust=-1, **kw)
    assert_untouched(o)


# ------------------------------------------------------------------ is_causal=False without a mask, paged


def test_paged_block_reaches_the_kernel_with_is_causal_false():
    mods = {"grouped": FakeModule("g", groups=(4,))}
    chain = VerifyChain("fake", "float32", "float32", loader=fake_loader(mods))
    case = runtime_case([40, 0, 17], [3, 2, 4], group=4, seed=8)
    pages = to_pages(case, 16)
    o = case.out()
    path = chain.paged(case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"],
                       pages["prefix_lens"], case.qo_indptr, case.max_len, features=Features(is_causal=False))
    assert path == "grouped" and mods["grouped"].last_paged_is_causal is False
    torch.testing.assert_close(o, ref(case, is_causal=False), atol=2e-5, rtol=2e-5)


@needs_real
@pytest.mark.parametrize("start", ["grouped", "per_head"])
@pytest.mark.parametrize("page", [1, 16])
def test_real_paged_block_runs_a_kernel(start, page):
    """A block drafter's draft (DSpark/DFlash: every draft token sees every other) over pages:
    the modules' verify_paged_fwd serves it instead of the general path."""
    chain = VerifyChain(LAYOUT, "bf16", "bf16", start=start)
    case = case_of([33, 0, 70], [7, 2, 5], seed=page)
    pages = to_pages(case, page)
    o = case.out()
    path = chain.run_paged(paged_call(case, o, pages, features=Features(is_causal=False)))
    assert path == start, chain.describe()
    torch.testing.assert_close(o.float(), ref(case, is_causal=False), **TOL)
    assert (o.float() - ref(case)).abs().max() > 10 * TOL["atol"], "a block differs from a chain"


# ------------------------------------------------------------------ scales


@needs_real
@pytest.mark.parametrize("entry", ["sglang", "paged"])
def test_bf16_pool_float_scales_reach_the_kernel(entry):
    """SGLang's split-KV test: a BF16 cache with k_scale 0.5 / v_scale 0.25 (sgl-project/sglang
    test/registered/attention/test_verify_splitkv.py at 4c89a75844cd4a56007d00330d9555edf08882a6)."""
    chain = VerifyChain(LAYOUT, "bf16", "bf16")
    case = case_of([45, 0, 90], [4, 3, 2], seed=5)
    o = case.out()
    if entry == "sglang":
        args, kw = sglang_args(case, o, k_scale=0.5, v_scale=0.25)
        assert SGLangVerify(chain, defer_general=True)(*args, **kw) is True
    else:
        chain.run_paged(paged_call(case, o, to_pages(case, 16), k_scale=0.5, v_scale=0.25))
    assert chain.last_path == "grouped", chain.describe()
    torch.testing.assert_close(o.float(), ref(case, k_scale=0.5, v_scale=0.25), **TOL)
    assert (o.float() - ref(case)).abs().max() > 10 * TOL["atol"], "the scales must change the answer"


@needs_real
def test_bf16_pool_scale_tensor_on_the_token_slot_path_is_applied():
    """SGLang with a device-tensor scale on a 16-bit pool: the modules take floats only (a tensor
    would be a second program), so the general path applies it, on the device."""
    chain = VerifyChain(LAYOUT, "bf16", "bf16")
    case = case_of([30, 12], [3, 2], seed=6)
    o = case.out()
    args, kw = sglang_args(case, o, k_scale=torch.tensor([0.5], device=DEV), v_scale=0.25)
    assert chain(*args, **kw) == "general"
    torch.testing.assert_close(o.float(), ref(case, k_scale=0.5, v_scale=0.25), **TOL)


def test_vllm_cache_scale_follows_vllm():
    bf16, fp8 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float8_e4m3fn)
    t = torch.tensor([0.5])
    assert vllm_cache_scale(t, bf16) == 1.0 and vllm_cache_scale(0.5, bf16) == 0.5
    assert vllm_cache_scale(t, fp8) is t and vllm_cache_scale(None, fp8) is None


@needs_real
@pytest.mark.parametrize("shape", ["[1]", "[batch, H_kv]"])
def test_vllm_16_bit_cache_ignores_descale_tensors_as_vllm_does(shape):
    """vLLM's Triton backend passes its descales expanded to [batch, H_kv] for 16-bit caches too,
    and its kernel never reads them there (``vllm_cache_scale`` cites where): the grouped kernel
    runs and the answer is the unscaled one, as vLLM's."""
    chain = VerifyChain(LAYOUT, "bf16", "bf16")
    case = case_of([33, 65], [2, 4], seed=7)
    scale = torch.tensor([0.5], device=DEV)
    if shape != "[1]":
        scale = scale.expand(2, case.k.shape[1])
    o = case.out()
    path = VLLMVerify(chain)(*vllm_args(case, o, to_pages(case, 16)), scale, scale)
    assert path == "grouped", chain.describe()
    torch.testing.assert_close(o.float(), ref(case), **TOL)


@needs_real
@pytest.mark.parametrize("shape", ["[1]", "[batch, H_kv] expand"])
def test_vllm_fp8_cache_descale_tensors_are_applied(shape):
    """vLLM's FP8 cache: ``layer._k_scale`` as it is, or expanded to [batch, H_kv] (one value:
    every element aliases it), reaches the FP8 module as one descale."""
    chain = VerifyChain(LAYOUT, "fp8_e4m3fn", "bf16")
    case = case_of([33, 65], [2, 4], seed=8, **FP8)
    k_scale, v_scale = torch.tensor([0.5], device=DEV), torch.tensor([2.0], device=DEV)
    if shape != "[1]":
        k_scale, v_scale = k_scale.expand(2, case.k.shape[1]), v_scale.expand(2, case.k.shape[1])
    o = case.out()
    path = VLLMVerify(chain)(*vllm_args(case, o, to_pages(case, 16)), k_scale, v_scale)
    assert path == "grouped", chain.describe()
    torch.testing.assert_close(o.float(), ref(case, k_scale=0.5, v_scale=2.0), **TOL)


@pytest.mark.parametrize("values", ["equal", "distinct"])
def test_vllm_fp8_cache_descale_of_separate_values_is_refused(values):
    """A [batch, H_kv] descale held as separate values (vLLM's kernel test builds them with
    torch.full: vllm-project/vllm tests/kernels/attention/test_triton_unified_attention.py at
    003ee61625d33ae27df77f97748cb5867d0747b6, test_triton_unified_attn_bf16_query_fp8_kv): kgen
    applies one descale per cache and cannot tell equal values without a host sync, so it refuses
    with the reason, o untouched, and never raises."""
    chain = VerifyChain(None, "fp8_e4m3fn", "bf16")
    case = case_of([33, 65], [2, 4], seed=9, **FP8)
    h_kv = case.k.shape[1]
    scale = torch.full((2, h_kv), 0.5) if values == "equal" else torch.rand(2, h_kv) + 0.5
    o = case.out()
    adapter = VLLMVerify(chain)
    assert adapter(*vllm_args(case, o, to_pages(case, 16)), scale.to(DEV), 0.25) is None
    assert f"k_scale is a [2, {h_kv}] tensor of separate values" in adapter.last_refusal
    assert_untouched(o)
    assert chain.counts["general"] == 0
