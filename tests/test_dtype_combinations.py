"""Every entry and adapter over every dtype combination an engine can hand it.

Query bf16 / fp16 / e4m3 (vLLM's FP8 attention path, with a ``q_descale``), KV cache bf16 /
fp16 / e4m3fn / e5m2, output bf16 / fp16. Each call either matches ``kgen.reference`` or is
refused with ``o`` bitwise untouched (filled with a NaN sentinel before the call). Entries:
the generated modules' ``verify_shared_kv_fwd`` and ``verify_paged_fwd`` (every gqa64
module: grouped, per-head and batch-invariant, the smallest layout), the chain's ``run`` and
``run_paged``, ``kgen.runtime``'s SGLang adapter (with and without ``defer_general``) and its
vLLM adapter. Shapes are tiny so the accepted calls stay quick in Triton's interpreter.

An FP8 query must never be answered: no kgen path applies ``q_descale`` (issue 20, item 1:
the vLLM adapter used to answer it without the descale, off by up to 1.15).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from case_tools import to_paged
from test_runtime_support import real_module_reason

import kgen
from kgen.problems import VerifyCase, make_case
from kgen.reference import reference_verify, relative_error
from kgen.runtime.adapters import SGLangVerify, VLLMVerify
from kgen.runtime.call import PagedCall, VerifyCall
from kgen.runtime.chain import VerifyChain
from kgen.spec import load_layouts

REAL = real_module_reason()
needs_real = pytest.mark.skipif(bool(REAL), reason=REAL or "generated modules present")

LAYOUT = "gqa64"
Q_DTYPES = {"q_bf16": torch.bfloat16, "q_fp16": torch.float16, "q_e4m3": torch.float8_e4m3fn}
KV_DTYPES = {
    "kv_bf16": torch.bfloat16, "kv_fp16": torch.float16,
    "kv_e4m3fn": torch.float8_e4m3fn, "kv_e5m2": torch.float8_e5m2,
}  # fmt: skip
OUT_DTYPES = {"o_bf16": torch.bfloat16, "o_fp16": torch.float16}
COMBOS = list(itertools.product(Q_DTYPES, KV_DTYPES, OUT_DTYPES))
COMBO_IDS = ["-".join(c) for c in COMBOS]
# A NaN whose payload no kernel or torch op writes: "untouched" is checked bit for bit.
SENTINEL_BITS = {torch.bfloat16: 0x7FA5, torch.float16: 0x7E5A}
Q_DESCALE = 0.5
PAGE = 16
MODULES = [
    (kv, q, variant, invariant)
    for kv in ("bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2")
    for q in ("bf16", "fp16")
    for variant, invariant in (("grouped", False), ("per_head", False), ("grouped", True))
]
MODULE_IDS = [f"{v}{'-invariant' if inv else ''}-kv_{kv}-q_{q}" for kv, q, v, inv in MODULES]


@dataclass
class Problem:
    """One verify problem with the engine's dtypes: ``q`` as the engine hands it (FP8 with its
    descale, or 16-bit), draft K/V in the model dtype, the pool in the cache dtype."""

    case: VerifyCase
    q: torch.Tensor
    q_descale: float | None
    out_dtype: torch.dtype
    want: torch.Tensor
    tolerance: float

    def fresh_output(self) -> torch.Tensor:
        o = torch.empty(self.case.q.shape[0], self.case.q.shape[1], self.case.o.shape[2], dtype=self.out_dtype)
        o.view(torch.int16).fill_(SENTINEL_BITS[self.out_dtype])
        return o

    def flat_call(self, o: torch.Tensor) -> VerifyCall:
        c = self.case
        return VerifyCall(
            self.q, c.k_extend, c.v_extend, o, c.k_buffer, c.v_buffer, c.qo_indptr, c.kv_indptr, c.kv_indices,
            None, True, None, c.max_len_extend, c.k_scale, c.v_scale,
        )  # fmt: skip


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_problem(q_dtype: torch.dtype, kv_dtype: torch.dtype, out_dtype: torch.dtype) -> Problem:
    """Two requests (prefixes 21 and 5, drafts 3 and 2), group 8 on 2 KV heads; FP8 caches
    carry descales (0.5 / 0.25), 16-bit ones none."""
    fp8_kv = kv_dtype.itemsize == 1
    model_dtype = out_dtype if q_dtype.itemsize == 1 else q_dtype
    case = make_case(
        load_layouts()[LAYOUT], [21, 5], [3, 2], group=8, num_kv_heads=2, kv_dtype=_name(kv_dtype),
        q_dtype=_name(model_dtype), k_scale=0.5 if fp8_kv else 1.0, v_scale=0.25 if fp8_kv else 1.0, seed=3,
    )  # fmt: skip
    q, q_descale, q_exact = case.q, None, case.q.double()
    if q_dtype.itemsize == 1:  # what an FP8 attention path hands over: q / q_descale in e4m3
        q = (case.q.float() / Q_DESCALE).to(q_dtype)
        q_descale, q_exact = Q_DESCALE, q.double() * Q_DESCALE
    want = reference_verify(
        q_exact, case.k_extend, case.v_extend, case.k_buffer, case.v_buffer, case.qo_indptr, case.kv_indptr,
        case.kv_indices, case.k_scale, case.v_scale, dtype=torch.float64,
    )  # fmt: skip
    # Three times the exact answer's own error when rounded to the output dtype (tests/kernel_cases.py).
    tolerance = 3 * relative_error(want.to(out_dtype), want)
    return Problem(case, q, q_descale, out_dtype, want, tolerance)


def check_outcome(entry: str, ran: bool, o: torch.Tensor, problem: Problem) -> None:
    """Accepted: the reference's answer. Refused: ``o`` bit for bit as it was."""
    if ran:
        err = relative_error(o, problem.want)
        assert err <= problem.tolerance, f"{entry} answered, relative error {err:.2e} > {problem.tolerance:.2e}"
    else:
        untouched = problem.fresh_output()
        assert torch.equal(o.view(torch.int16), untouched.view(torch.int16)), f"{entry} refused but wrote o"
    if problem.q.dtype.itemsize == 1:
        assert not ran, f"{entry} answered an FP8 query, which no kgen path computes (no q_descale)"


def refused_or(run: Callable[[], object], chain: VerifyChain) -> bool:
    """Run an entry that raises ValueError to refuse; True when it answered."""
    try:
        run()
    except ValueError as exc:
        assert chain.last_refusal and chain.last_refusal in str(exc), f"not a refusal: {exc}"
        return False
    return True


def paged_call(problem: Problem, o: torch.Tensor) -> tuple[PagedCall, torch.Tensor]:
    """(the PagedCall, vLLM's seq_lens) over the problem's prefixes in pages of ``PAGE``."""
    c = problem.case
    pages = to_paged(c, PAGE)
    call = PagedCall(
        problem.q, c.k_extend, c.v_extend, o, pages.k_cache, pages.v_cache, pages.block_table, pages.prefix_lens,
        c.qo_indptr, c.max_len_extend, c.k_scale, c.v_scale, q_descale=problem.q_descale,
    )  # fmt: skip
    return call, pages.prefix_lens + (c.qo_indptr[1:] - c.qo_indptr[:-1])


def engine_chain(kv_dtype: torch.dtype, out_dtype: torch.dtype) -> VerifyChain:
    """The chain an engine builds at start-up: the cache dtype and the model dtype (an FP8
    query path quantizes the model-dtype query per call)."""
    return VerifyChain(LAYOUT, _name(kv_dtype), _name(out_dtype))


# ------------------------------------------------------------------ the modules


@needs_real
@pytest.mark.parametrize(("kv", "q", "variant", "invariant"), MODULES, ids=MODULE_IDS)
@pytest.mark.parametrize(("q_key", "kv_key", "out_key"), COMBOS, ids=COMBO_IDS)
def test_module_entries(q_key, kv_key, out_key, kv, q, variant, invariant):
    module = kgen.load(LAYOUT, kv, q, variant, batch_invariant=invariant)
    problem = build_problem(Q_DTYPES[q_key], KV_DTYPES[kv_key], OUT_DTYPES[out_key])
    o = problem.fresh_output()
    ran = module.verify_shared_kv_fwd(*problem.flat_call(o).as_sglang_args())
    check_outcome(f"{module.URI}.verify_shared_kv_fwd", ran, o, problem)
    o = problem.fresh_output()
    call, _ = paged_call(problem, o)
    ran = module.verify_paged_fwd(*call.tensors, call.max_len_extend, call.k_scale, call.v_scale)
    check_outcome(f"{module.URI}.verify_paged_fwd", ran, o, problem)


# ------------------------------------------------------------------ the chain and the adapters


@needs_real
@pytest.mark.parametrize(("q_key", "kv_key", "out_key"), COMBOS, ids=COMBO_IDS)
def test_chain_entries(q_key, kv_key, out_key):
    problem = build_problem(Q_DTYPES[q_key], KV_DTYPES[kv_key], OUT_DTYPES[out_key])
    chain = engine_chain(KV_DTYPES[kv_key], OUT_DTYPES[out_key])
    o = problem.fresh_output()
    check_outcome("VerifyChain.run", refused_or(lambda: chain.run(problem.flat_call(o)), chain), o, problem)
    o = problem.fresh_output()
    call, _ = paged_call(problem, o)
    check_outcome("VerifyChain.run_paged", refused_or(lambda: chain.run_paged(call), chain), o, problem)


@needs_real
@pytest.mark.parametrize("defer_general", [True, False], ids=["defer_general", "own_general"])
@pytest.mark.parametrize(("q_key", "kv_key", "out_key"), COMBOS, ids=COMBO_IDS)
def test_sglang_adapter(q_key, kv_key, out_key, defer_general):
    problem = build_problem(Q_DTYPES[q_key], KV_DTYPES[kv_key], OUT_DTYPES[out_key])
    adapter = SGLangVerify(engine_chain(KV_DTYPES[kv_key], OUT_DTYPES[out_key]), defer_general=defer_general)
    o = problem.fresh_output()
    args = problem.flat_call(o).as_sglang_args()
    if defer_general:
        ran = adapter(*args)
    else:
        ran = refused_or(lambda: adapter(*args), adapter.chain)
    check_outcome("SGLangVerify", ran, o, problem)


@needs_real
@pytest.mark.parametrize(("q_key", "kv_key", "out_key"), COMBOS, ids=COMBO_IDS)
def test_vllm_adapter(q_key, kv_key, out_key):
    problem = build_problem(Q_DTYPES[q_key], KV_DTYPES[kv_key], OUT_DTYPES[out_key])
    adapter = VLLMVerify(engine_chain(KV_DTYPES[kv_key], OUT_DTYPES[out_key]))
    o = problem.fresh_output()
    call, seq_lens = paged_call(problem, o)
    path = adapter(
        call.q_extend, call.k_extend, call.v_extend, o, call.k_cache, call.v_cache, call.block_table, seq_lens,
        call.qo_indptr, call.max_len_extend, call.k_scale, call.v_scale, q_descale=problem.q_descale,
    )  # fmt: skip
    check_outcome("VLLMVerify", path is not None, o, problem)
    if path is None:
        assert "q_descale" in adapter.last_refusal


def test_vllm_fp8_query_is_refused_with_the_reason():
    """Issue 20, item 1: vLLM's FP8 query (e4m3 with q_descale) over an FP8 cache, as the
    engine sent it. Refused before any path runs, whatever modules exist (none are loaded)."""
    problem = build_problem(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.bfloat16)
    adapter = VLLMVerify(VerifyChain(None))
    o = problem.fresh_output()
    call, seq_lens = paged_call(problem, o)
    path = adapter(
        call.q_extend, call.k_extend, call.v_extend, o, call.k_cache, call.v_cache, call.block_table, seq_lens,
        call.qo_indptr, call.max_len_extend, call.k_scale, call.v_scale, q_descale=torch.tensor([Q_DESCALE]),
    )  # fmt: skip
    assert path is None and adapter.chain.counts["general"] == 0
    assert "q_extend is torch.float8_e4m3fn" in adapter.last_refusal and "engine's own kernel" in adapter.last_refusal
    check_outcome("VLLMVerify", False, o, problem)


def test_vllm_descale_with_a_16_bit_query_is_refused():
    """A tensor q_descale cannot be read without a host sync, so it is not assumed to be 1."""
    problem = build_problem(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    adapter = VLLMVerify(VerifyChain(None))
    o = problem.fresh_output()
    call, seq_lens = paged_call(problem, o)
    args = (call.q_extend, call.k_extend, call.v_extend, o, call.k_cache, call.v_cache, call.block_table, seq_lens,
            call.qo_indptr, call.max_len_extend)  # fmt: skip
    assert adapter(*args, q_descale=torch.tensor([1.0])) is None
    assert "q_descale is given with a torch.bfloat16 query" in adapter.last_refusal
    assert adapter(*args, q_descale=1.0) == "general"  # the number 1 is no descale at all
    check_outcome("VLLMVerify", True, o, problem)
