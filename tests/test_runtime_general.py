"""The general torch path: every valid input, against kgen.reference and a brute force."""

from __future__ import annotations

import math

import pytest
import torch
from test_runtime_support import brute_force, runtime_case, to_pages, tree_mask

from kgen.reference import reference_verify
from kgen.runtime.attend import GeneralPath, PagedPrefix, attend, general_verify
from kgen.runtime.call import Features, PagedCall

TOL = dict(atol=2e-5, rtol=2e-5)


def run(case, path=None, out_dtype=None, **kw):
    path = path or GeneralPath()
    o = case.out(out_dtype)
    general_verify(*case.flat_args(o), max_len_extend=case.max_len, path=path, check_indices=True, **kw)
    return o


def ref(case, **kw):
    return reference_verify(case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.qo_indptr,
                            case.kv_indptr, case.kv_indices, **kw)  # fmt: skip


# ------------------------------------------------------------------ plain causal vs kgen.reference


@pytest.mark.parametrize(
    "shape",
    [
        dict(h_kv=1, group=4, d_qk=32, d_v=32),
        dict(h_kv=2, group=8, d_qk=16, d_v=16),
        dict(h_kv=1, group=16, d_qk=48, d_v=32, mla=True),  # latent + rope, V = latent columns
        dict(h_kv=3, group=1, d_qk=8, d_v=12),
    ],
)
def test_plain_matches_reference(shape):
    case = runtime_case([37, 0, 90, 5], [3, 2, 1, 4], **shape)
    torch.testing.assert_close(run(case), ref(case), **TOL)


def test_chunking_does_not_change_the_result():
    case = runtime_case([300, 17, 129], [4, 1, 3], group=2)
    whole = run(case, GeneralPath(chunk_tokens=1 << 20, token_budget=1 << 30))
    tiny = run(case, GeneralPath(chunk_tokens=16, token_budget=16))
    torch.testing.assert_close(tiny, whole, **TOL)
    torch.testing.assert_close(whole, ref(case), **TOL)


def test_pool_is_never_gathered_whole():
    """The gathered chunk stays within the token budget whatever the prefix length."""
    case = runtime_case([1000, 700], [2, 3], spare=5000)
    seen = []

    class Spy(PagedPrefix):
        def gather(self, pos, valid):
            seen.append(pos.numel() * valid.shape[0])
            return super().gather(pos, valid)

    pages = to_pages(case, 16)
    o = case.out()
    prefix = Spy(pages["k_cache"], pages["v_cache"], pages["block_table"], pages["prefix_lens"], 2)
    call = PagedCall(case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"],
                     pages["prefix_lens"], case.qo_indptr)  # fmt: skip
    attend(call, prefix, chunk_tokens=4096, token_budget=256)
    assert max(seen) <= 256 and len(seen) >= 1000 // 128
    torch.testing.assert_close(o, ref(case), **TOL)


def test_scales_floats_and_tensors():
    case = runtime_case([40, 9], [2, 3], kv_dtype=torch.float8_e4m3fn, q_dtype=torch.bfloat16)
    for ks, vs in ((0.5, 2.0), (torch.tensor([0.25]), torch.tensor(3.0))):
        want = ref(case, k_scale=ks, v_scale=vs)
        got = run(case, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_sm_scale_and_float64_compute():
    case = runtime_case([20, 33], [3, 3])
    got = run(case, GeneralPath(compute_dtype=torch.float64), out_dtype=torch.float64, sm_scale=0.3)
    torch.testing.assert_close(got, ref(case, sm_scale=0.3, dtype=torch.float64), atol=1e-10, rtol=1e-10)


def test_requests_without_draft_or_prefix():
    case = runtime_case([10, 0, 25, 0], [0, 2, 0, 1])
    got = run(case)
    torch.testing.assert_close(got, ref(case), **TOL)


def test_nothing_to_do_is_fine():
    case = runtime_case([], [])
    run(case)


# ------------------------------------------------------------------ features vs brute force

FEATURES = {
    "non_causal": dict(is_causal=False),
    "sliding_window": dict(sliding_window_size=7),
    "sliding_window_1": dict(sliding_window_size=1),
    "logit_cap": dict(logit_cap=1.5),
    "sinks": dict(sinks="per_head"),
    "xai_temperature": dict(xai_temperature_len=12),
    "cap_window_sinks_noncausal": dict(logit_cap=2.0, sliding_window_size=5, sinks="per_head", is_causal=False),
}


def _materialize(case, feats):
    feats = dict(feats)
    if feats.get("sinks") == "per_head":
        feats["sinks"] = torch.linspace(-1.0, 2.0, case.q.shape[1])
    return feats


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_feature_matches_brute_force(name):
    case = runtime_case([23, 0, 40], [3, 2, 4], h_kv=2, group=2, d_qk=16, d_v=8, seed=3)
    feats = _materialize(case, FEATURES[name])
    got = run(case, GeneralPath(chunk_tokens=16, token_budget=32), **feats)
    torch.testing.assert_close(got.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("skip_prefix", [True, False])
def test_tree_mask_matches_brute_force(skip_prefix):
    case = runtime_case([31, 6, 18], [4, 3, 5], h_kv=1, group=3, d_qk=16, d_v=16, seed=5)
    mask, indptr = tree_mask(case, prefix_bits=not skip_prefix)
    feats = dict(custom_mask=mask, mask_indptr=indptr, is_causal=False, skip_prefix_custom_mask=skip_prefix)
    got = run(case, GeneralPath(chunk_tokens=16, token_budget=16), **feats)
    torch.testing.assert_close(got.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)


def test_tree_mask_with_sliding_window_uses_window_offsets():
    case = runtime_case([20, 12], [3, 2], group=2, d_qk=16, d_v=16, seed=7)
    offsets = [5, 2]
    mask, indptr = tree_mask(case, prefix_bits=True, offsets=offsets)
    feats = dict(
        custom_mask=mask, mask_indptr=indptr, is_causal=False, skip_prefix_custom_mask=False,
        sliding_window_size=9, window_kv_offsets=torch.tensor(offsets, dtype=torch.int32),
    )  # fmt: skip
    got = run(case, **feats)
    torch.testing.assert_close(got.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)


def test_chain_mask_equals_causal():
    from test_runtime_support import chain_mask

    case = runtime_case([15, 4], [3, 4], seed=2)
    mask, indptr = chain_mask(case)
    got = run(case, custom_mask=mask, mask_indptr=indptr, skip_prefix_custom_mask=False)
    torch.testing.assert_close(got, ref(case), **TOL)


def test_fully_masked_rows_write_zeros():
    case = runtime_case([10], [3], group=2, d_qk=8, d_v=8)
    mask, indptr = tree_mask(case, prefix_bits=True)
    mask = mask.clone().reshape(3, 13)
    mask[1] = False  # row 1 sees nothing
    mask = mask.reshape(-1)
    feats = dict(custom_mask=mask, mask_indptr=indptr, is_causal=False, skip_prefix_custom_mask=False)
    got = run(case, **feats)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)
    sinks = torch.ones(2)
    got = run(case, sinks=sinks, **feats)  # a sink alone still gives zeros (it has no value)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_xai_temperature_formula():
    """Rows past the temperature length scale scores by log2(pos) / log2(len)."""
    case = runtime_case([30], [2], group=1, d_qk=8, d_v=8, seed=4)
    feats = dict(xai_temperature_len=4)
    got = run(case, **feats)
    torch.testing.assert_close(got.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)
    assert not torch.allclose(got, run(case))
    assert math.log2(30) / math.log2(4) > 1


# ------------------------------------------------------------------ block tables


@pytest.mark.parametrize("page", [1, 16, 64])
def test_paged_matches_flat(page):
    case = runtime_case([70, 0, 131, 16], [3, 1, 4, 2], h_kv=2, group=4, d_qk=16, d_v=16, seed=page)
    pages = to_pages(case, page)
    o = case.out()
    GeneralPath(chunk_tokens=32).run(
        PagedCall(
            case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"],
            pages["prefix_lens"], case.qo_indptr,
        )
    )  # fmt: skip
    torch.testing.assert_close(o, ref(case), **TOL)
    feats = Features(sliding_window_size=20, logit_cap=3.0, sinks=torch.zeros(8))
    o2 = case.out()
    GeneralPath(chunk_tokens=32).run(
        PagedCall(
            case.q, case.k, case.v, o2, pages["k_cache"], pages["v_cache"], pages["block_table"],
            pages["prefix_lens"], case.qo_indptr, features=feats,
        )
    )  # fmt: skip
    want = brute_force(case, sliding_window_size=20, logit_cap=3.0, sinks=torch.zeros(8))
    torch.testing.assert_close(o2.double(), want, atol=3e-5, rtol=3e-5)


# ------------------------------------------------------------------ invalid input


def _bad(case, match, **kw):
    o = kw.pop("o", None)
    o = case.out() if o is None else o
    args = list(case.flat_args(o))
    for i, name in enumerate(("q", "k", "v", "o", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr", "kv_indices")):
        if name in kw:
            args[i] = kw.pop(name)
    with pytest.raises(ValueError, match=match):
        general_verify(*args, max_len_extend=kw.pop("max_len_extend", case.max_len), check_indices=True, **kw)


def test_invalid_inputs_say_what_is_wrong():
    case = runtime_case([10, 5], [2, 3], group=2, d_qk=8, d_v=8)
    _bad(case, "k_extend width 4 differs", k=case.k[..., :4])
    _bad(case, "same number of tokens", q=case.q[:3])
    two = runtime_case([10, 5], [2, 3], h_kv=2, group=2, d_qk=8, d_v=8)
    _bad(two, "must be a multiple of KV heads", q=torch.randn(5, 3, 8), o=torch.zeros(5, 3, 8))
    _bad(case, r"o_extend must be \[T, 2, 8\]", o=torch.zeros(5, 2, 4))
    _bad(case, r"k_buffer must be \[slots, 1, 8\]", k_buffer=case.k_buffer[..., :4])
    _bad(case, "kv_indices must be int32 or int64", kv_indices=case.kv_indices.float())
    _bad(case, "qo_indptr must be int32 or int64", qo_indptr=case.qo_indptr.to(torch.int16))
    _bad(case, "batch_size \\+ 1", kv_indptr=case.kv_indptr[:2])
    _bad(case, "outside the pool", kv_indices=case.kv_indices + 100)
    _bad(case, "kv_indptr\\[-1\\] = 15 exceeds", kv_indices=case.kv_indices[:10])
    _bad(case, "non-decreasing", kv_indptr=torch.tensor([0, 12, 10], dtype=torch.int32))
    _bad(case, "max_len_extend = 2 but a request has 3", max_len_extend=2)
    _bad(case, r"k_scale is a \[2\] tensor of separate values", k_scale=torch.ones(2))
    _bad(case, "v_scale must be a finite float", v_scale=float("nan"))
    _bad(case, "one logit per query head", sinks=torch.zeros(3))
    _bad(case, "mask_indptr must be a torch.Tensor", custom_mask=torch.ones(100, dtype=torch.bool))
    _bad(case, "custom_mask has 10 entries", custom_mask=torch.ones(10, dtype=torch.bool),
         mask_indptr=torch.tensor([0, 24, 48], dtype=torch.int32))  # fmt: skip
    _bad(case, "needs window_kv_offsets", custom_mask=torch.ones(100, dtype=torch.bool),
         mask_indptr=torch.tensor([0, 24, 48], dtype=torch.int32), sliding_window_size=4)  # fmt: skip
    _bad(case, "logit_cap must be a float >= 0", logit_cap=-1.0)
    _bad(case, "xai_temperature_len = 1", xai_temperature_len=1)
    _bad(case, "must be a floating-point tensor", q=case.q.to(torch.int32))


def test_index_checks_are_off_by_default():
    """Without check_indices only metadata is validated (no sync): bad slots are not seen."""
    case = runtime_case([10, 5], [2, 3], group=2, d_qk=8, d_v=8)
    o = case.out()
    args = list(case.flat_args(o))
    args[7] = torch.tensor([0, 12, 10], dtype=torch.int32)  # decreasing, but in range
    general_verify(*args, max_len_extend=case.max_len)
