"""The opt-in index-value check of generated modules (check_indices=True / KGEN_CHECK_INDICES=1).

Without it an out-of-range kv_indices or block_table entry reads outside the pool (a crash
on the GPU) and a negative length gives garbage; with it the module raises ValueError
naming the tensor, the request and the value, before anything is launched.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from test_runtime_support import runtime_case, to_pages

import kgen
import kgen.launcher.entries
from kgen.reference import reference_verify

LAYOUT = "gqa64"
SHAPE = dict(h_kv=1, group=8, d_qk=64, d_v=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)


def module():
    return kgen.load(LAYOUT, "bfloat16")


def flat_case(seed: int = 0):
    return runtime_case([20, 0, 13], [2, 1, 3], seed=seed, **SHAPE)


def flat_call(mod, case, o, **overrides):
    kwargs = dict(q_extend=case.q, k_extend=case.k, v_extend=case.v, o_extend=o, k_buffer=case.k_buffer,
                  v_buffer=case.v_buffer, qo_indptr=case.qo_indptr, kv_indptr=case.kv_indptr,
                  kv_indices=case.kv_indices, custom_mask=None, is_causal=True, mask_indptr=None,
                  max_len_extend=case.max_len, k_scale=1.0, v_scale=1.0)
    kwargs.update(overrides)
    return mod.verify_shared_kv_fwd(**kwargs)


def paged_call(mod, case, pages, o, **overrides):
    kwargs = dict(q_extend=case.q, k_extend=case.k, v_extend=case.v, o_extend=o, k_cache=pages["k_cache"],
                  v_cache=pages["v_cache"], block_table=pages["block_table"], prefix_lens=pages["prefix_lens"],
                  qo_indptr=case.qo_indptr, max_len_extend=case.max_len)
    kwargs.update(overrides)
    return mod.verify_paged_fwd(**kwargs)


def ptr(values):
    return torch.tensor(values, dtype=torch.int32)


def reference(case):
    return reference_verify(case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.qo_indptr,
                            case.kv_indptr, case.kv_indices)


# Each bad flat input: (argument overrides, the message it must raise). case: the good case.
FLAT_BAD = {
    "slot past the pool": (
        lambda c: {"kv_indices": torch.cat([c.kv_indices[:24], ptr([c.k_buffer.shape[0] + 5]), c.kv_indices[25:]])},
        r"kv_indices\[24\] = 47 \(request 2, prefix token 4\) is outside the pool's slots 0\.\.41 "
        r"\(k_buffer\.shape\[0\] = 42\)",
    ),
    "negative slot": (
        lambda c: {"kv_indices": torch.cat([ptr([-3]), c.kv_indices[1:]])},
        r"kv_indices\[0\] = -3 \(request 0, prefix token 0\) is outside the pool",
    ),
    "negative prefix length": (
        lambda c: {"kv_indptr": ptr([0, 20, 18, 33])},
        r"kv_indptr decreases at request 1: kv_indptr\[1\] = 20 > kv_indptr\[2\] = 18, a negative prefix length",
    ),
    "negative draft length": (
        lambda c: {"qo_indptr": ptr([0, 4, 3, 6])},
        r"qo_indptr decreases at request 1: .* a negative draft length",
    ),
    "kv_indptr not starting at 0": (lambda c: {"kv_indptr": ptr([2, 22, 22, 35])}, r"kv_indptr\[0\] must be 0, got 2"),
    "qo_indptr not ending at the token count": (
        lambda c: {"qo_indptr": ptr([0, 2, 3, 5])},
        r"qo_indptr\[-1\] = 5 but q_extend has 6 tokens",
    ),
    "kv_indptr past kv_indices": (
        lambda c: {"kv_indptr": ptr([0, 20, 20, 40])},
        r"kv_indptr\[-1\] = 40 exceeds len\(kv_indices\) = 33",
    ),
    "draft longer than max_len_extend": (
        lambda c: {"max_len_extend": 2},
        r"request 2 has 3 draft tokens \(qo_indptr\[3\] - qo_indptr\[2\]\) but max_len_extend = 2",
    ),
}


@pytest.mark.parametrize("name", sorted(FLAT_BAD))
def test_bad_flat_indices_raise_naming_tensor_request_and_value(name):
    case = flat_case()
    assert case.k_buffer.shape[0] == 42 and case.kv_indices.numel() == 33  # the messages above count on it
    edit, message = FLAT_BAD[name]
    o = case.out()
    with pytest.raises(ValueError, match=message):
        flat_call(module(), case, o, check_indices=True, **edit(case))
    assert o.isnan().all(), "nothing may be launched before the check passes"


def test_good_flat_indices_pass_the_check_and_run():
    case = flat_case(seed=3)
    o = case.out()
    assert flat_call(module(), case, o, check_indices=True)
    torch.testing.assert_close(o.float(), reference(case), atol=2e-2, rtol=2e-2)


def test_refused_input_still_returns_false_with_the_check_on():
    case = flat_case()
    assert flat_call(module(), case, case.out(), check_indices=True, logit_cap=30.0) is False


PAGE = 16


def paged_case():
    case = flat_case(seed=5)
    return case, to_pages(case, PAGE)


PAGED_BAD = {
    "block past the cache": (
        lambda p: {"block_table": p["block_table"].clone().index_put_((torch.tensor(2), torch.tensor(0)),
                                                                      torch.tensor(99, dtype=torch.int32))},
        r"block_table\[2, 0\] = 99 \(request 2\) is outside the cache's blocks 0\.\.\d+ \(k_cache\.shape\[0\] = \d+\)",
    ),
    "negative prefix length": (
        lambda p: {"prefix_lens": ptr([20, -1, 13])},
        r"prefix_lens\[1\] = -1 is outside 0\.\.48 \(block_table width 3 x page size 16\)",
    ),
    "prefix past the table": (lambda p: {"prefix_lens": ptr([49, 0, 13])}, r"prefix_lens\[0\] = 49 is outside 0\.\.48"),
    "negative draft length": (lambda p: {"qo_indptr": ptr([0, 4, 3, 6])}, r"qo_indptr decreases at request 1"),
}


@pytest.mark.parametrize("name", sorted(PAGED_BAD))
def test_bad_paged_indices_raise(name):
    case, pages = paged_case()
    assert pages["block_table"].shape == (3, 3)  # the messages above count on it
    edit, message = PAGED_BAD[name]
    o = case.out()
    with pytest.raises(ValueError, match=message):
        paged_call(module(), case, pages, o, check_indices=True, **edit(pages))
    assert o.isnan().all()


def test_unused_block_table_entries_are_not_checked():
    """Columns past a request's pages may hold anything (vLLM pads with -1 or stale ids)."""
    case, pages = paged_case()
    table = pages["block_table"].clone()
    table[1, :] = -1  # request 1 has no prefix: none of its entries is read
    table[0, 2] = 10**6  # request 0 uses 2 of its 3 columns
    o = case.out()
    assert paged_call(module(), case, {**pages, "block_table": table}, o, check_indices=True)
    torch.testing.assert_close(o.float(), reference(case), atol=2e-2, rtol=2e-2)


class Spy:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1


def test_default_path_does_not_check(monkeypatch):
    """Off by default: no check (and so no host sync) before the launch."""
    mod = module()
    spy = Spy()
    monkeypatch.setattr(kgen.launcher.entries, "check_index_values", spy)
    monkeypatch.setattr(mod.LAUNCHER, "run", lambda *a, **k: None)
    case, pages = paged_case()
    assert not mod.LAUNCHER.check_indices
    assert flat_call(mod, case, case.out()) and paged_call(mod, case, pages, case.out())
    assert spy.calls == 0
    assert flat_call(mod, case, case.out(), check_indices=True)
    assert paged_call(mod, case, pages, case.out(), check_indices=True)
    assert spy.calls == 2


def test_environment_turns_the_check_on_at_import(monkeypatch):
    monkeypatch.setenv("KGEN_CHECK_INDICES", "1")
    path = kgen.loader.generated_dir() / f"{module().URI}.py"
    spec = importlib.util.spec_from_file_location("index_check_env_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.LAUNCHER.check_indices
    case = flat_case()
    bad = case.kv_indices.clone()
    bad[5] = 1000
    with pytest.raises(ValueError, match=re.escape("kv_indices[5] = 1000 (request 0, prefix token 5)")):
        flat_call(mod, case, case.out(), kv_indices=bad)
