"""vLLM-style block tables (page sizes 1, 16, 64) through the chain and the vLLM adapter."""

from __future__ import annotations

import pytest
import torch
from test_runtime_support import (
    FakeModule,
    brute_force,
    device,
    fake_loader,
    real_module_reason,
    runtime_case,
    to_pages,
)

from kgen.reference import reference_verify
from kgen.runtime.adapters import VLLMVerify, vllm_window
from kgen.runtime.call import Features
from kgen.runtime.chain import VerifyChain

REAL = real_module_reason()
needs_real = pytest.mark.skipif(bool(REAL), reason=REAL or "generated modules present")
DEV = device()
PAGES = [1, 16, 64]


def ref(case, **kw):
    return reference_verify(case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.qo_indptr,
                            case.kv_indptr, case.kv_indices, **kw)  # fmt: skip


def paged_call(chain, case, pages, features=Features(), **kw):  # noqa: B008 - frozen
    o = case.out()
    path = chain.paged(case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"],
                       pages["prefix_lens"], case.qo_indptr, case.max_len, features=features, **kw)  # fmt: skip
    return path, o


def vllm_call(adapter, case, pages, **kw):
    o = case.out()
    seq_lens = pages["prefix_lens"] + (case.qo_indptr[1:] - case.qo_indptr[:-1])
    path = adapter(case.q, case.k, case.v, o, pages["k_cache"], pages["v_cache"], pages["block_table"],
                   seq_lens, case.qo_indptr, case.max_len, **kw)  # fmt: skip
    return path, o


# ------------------------------------------------------------------ fakes


def fake_chain():
    mods = {"grouped": FakeModule("g", groups=(4,)), "per_head": FakeModule("p", groups=(1, 2, 4))}
    return VerifyChain("fake", "float32", "float32", loader=fake_loader(mods)), mods


@pytest.mark.parametrize("page", PAGES)
def test_plain_paged_goes_to_the_kernel(page):
    chain, mods = fake_chain()
    case = runtime_case([40, 0, 77], [2, 1, 3], group=4)
    path, o = paged_call(chain, case, to_pages(case, page))
    assert path == "grouped"
    torch.testing.assert_close(o, ref(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page", PAGES)
def test_paged_features_go_general(page):
    chain, mods = fake_chain()
    case = runtime_case([40, 77], [2, 3], group=4, seed=page)
    feats = dict(sliding_window_size=9, logit_cap=4.0, sinks=torch.zeros(4))
    path, o = paged_call(chain, case, to_pages(case, page), Features(**feats))
    assert path == "general" and mods["grouped"].calls == 0  # paged kernels take no extras
    torch.testing.assert_close(o.double(), brute_force(case, **feats), atol=3e-5, rtol=3e-5)


def test_paged_validation():
    chain, _ = fake_chain()
    case = runtime_case([40, 77], [2, 3], group=4)
    pages = to_pages(case, 16)
    bad = dict(pages, block_table=pages["block_table"].float())
    with pytest.raises(ValueError, match="block_table must be int32 or int64"):
        paged_call(chain, case, bad)
    bad = dict(pages, k_cache=pages["k_cache"][0])
    with pytest.raises(ValueError, match="k_cache must have 4 dimensions"):
        paged_call(chain, case, bad)
    checking = VerifyChain("fake", loader=fake_loader({}), check_indices=True)
    bad = dict(pages, prefix_lens=pages["prefix_lens"] + 1000)
    with pytest.raises(ValueError, match="prefix_lens must lie in"):
        paged_call(checking, case, bad)
    bad = dict(pages, block_table=pages["block_table"] + 1000)
    with pytest.raises(ValueError, match="block_table points at blocks"):
        paged_call(checking, case, bad)


@pytest.mark.parametrize(("given", "want"), [(None, -1), (8, 7), (1, 0), (-1, -1), ((7, 0), 7), ((-1, -1), -1)])
def test_vllm_window(given, want):
    assert vllm_window(given) == want


def test_vllm_window_rejects_lookahead():
    with pytest.raises(ValueError, match="cannot look ahead"):
        vllm_window((4, 2))


def test_vllm_adapter_converts_seq_lens():
    chain, _ = fake_chain()
    case = runtime_case([40, 3], [2, 3], group=4)
    path, o = vllm_call(VLLMVerify(chain), case, to_pages(case, 16))
    assert path == "grouped"
    torch.testing.assert_close(o, ref(case), atol=2e-5, rtol=2e-5)
    path, o = vllm_call(VLLMVerify(chain), case, to_pages(case, 16), sliding_window=8, logits_soft_cap=5.0)
    assert path == "general"
    want = brute_force(case, sliding_window_size=7, logit_cap=5.0)
    torch.testing.assert_close(o.double(), want, atol=3e-5, rtol=3e-5)


# ------------------------------------------------------------------ real generated modules


@needs_real
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("start", ["grouped", "per_head"])
def test_real_paged_parity(page, start):
    chain = VerifyChain("gqa64", "bf16", "bf16", start=start)
    shape = dict(h_kv=1, group=8, d_qk=64, d_v=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    case = runtime_case([70, 0, 130], [3, 2, 1], device=DEV, seed=page, **shape)
    path, o = paged_call(chain, case, to_pages(case, page))
    assert path == start
    torch.testing.assert_close(o.float().cpu(), ref(case).cpu(), atol=2e-2, rtol=2e-2)


@needs_real
@pytest.mark.parametrize("page", [16, 64])
def test_real_paged_unused_slots_are_never_read(page):
    """NaN in every slot past a request's prefix (its last page's tail, the spare blocks): the
    kernel clamps a partial tile's tokens to the split's last one, slot as well as page."""
    chain = VerifyChain("gqa64", "bf16", "bf16")
    shape = dict(h_kv=1, group=8, d_qk=64, d_v=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    case = runtime_case([37, 0, 70], [3, 2, 1], device=DEV, seed=page + 5, **shape)
    pages = to_pages(case, page)
    used = torch.zeros(pages["k_cache"].shape[:2], dtype=torch.bool, device=pages["k_cache"].device)
    for b, p in enumerate(case.prefix_lens):
        for j in range(-(-p // page)):
            used[pages["block_table"][b, j], : min(page, p - j * page)] = True
    pages["k_cache"][~used] = float("nan")
    pages["v_cache"][~used] = float("nan")
    path, o = paged_call(chain, case, pages)
    assert path == "grouped" and torch.isfinite(o.float()).all()
    torch.testing.assert_close(o.float().cpu(), ref(case).cpu(), atol=2e-2, rtol=2e-2)


@needs_real
@pytest.mark.parametrize("page", PAGES)
def test_real_vllm_adapter_paged(page):
    chain = VerifyChain("gqa64", "bf16", "bf16")
    shape = dict(h_kv=2, group=8, d_qk=64, d_v=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    case = runtime_case([33, 65], [2, 4], device=DEV, seed=page + 1, **shape)
    path, o = vllm_call(VLLMVerify(chain), case, to_pages(case, page))
    assert path == "grouped"
    torch.testing.assert_close(o.float().cpu(), ref(case).cpu(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
@needs_real
@pytest.mark.parametrize("page", PAGES)
def test_gpu_paged_mla(page):
    """On the device: absorbed MLA through block tables, long prefixes (many splits)."""
    chain = VerifyChain("mla_absorbed_512_64", "bf16", "bf16")
    shape = dict(h_kv=1, group=16, d_qk=576, d_v=512, mla=True, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    case = runtime_case([3000, 129, 1], [3, 2, 1], device=DEV, seed=page, **shape)
    pages = to_pages(case, page)
    # V is the latent part of K in the same cache
    pages["v_cache"] = pages["k_cache"][..., :512]
    path, o = paged_call(chain, case, pages)
    assert path == "grouped"
    torch.testing.assert_close(o.float(), ref(case), atol=2e-2, rtol=2e-2)
