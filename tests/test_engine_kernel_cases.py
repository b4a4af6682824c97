"""Engine calls the kernels serve since issue 20, in Triton's interpreter against kgen/reference.py:
a 16-bit pool with k_scale / v_scale other than 1, SGLang's kv_len_adjust (decode through the
verify entry), is_causal=False without a mask (block drafters), and the absorbed-MLA refusal of a
v_buffer of its own. Each bad input is refused with a reason naming it and o left untouched.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from case_tools import batch_of, set_draft_masks, to_paged
from kernel_cases import SMALL_SPLITS, SPECS, build, tolerance

import kgen
from kgen.problems import VerifyCase, eagle_tree, make_case
from kgen.reference import reference_verify, relative_error

GQA = "qwen3_5_gqa256"
GQA128 = "gqa128"
GQA64 = "gqa64"
MLA = "mla_absorbed_512_64"


def _load(layout: str, kv: str = "bfloat16", invariant: bool = False):
    return kgen.load(layout, kv, "bfloat16", batch_invariant=invariant)


def _check(case: VerifyCase, out: torch.Tensor, ref: torch.Tensor | None = None) -> None:
    ref = case.reference(torch.float64) if ref is None else ref
    err, tol = relative_error(out, ref), tolerance(case)
    assert err <= tol, f"relative error {err:.2e} > tolerance {tol:.2e}"


def _run_sglang(module, case: VerifyCase, **kw) -> bool:
    return module.verify_shared_kv_fwd(*case.sglang_args(), **kw)


def _run_paged(module, case: VerifyCase, page_size: int = 16, **kw) -> bool:
    paged = to_paged(case, page_size)
    return module.verify_paged_fwd(*paged.paged_args(case), **kw)


def _refused(module, case: VerifyCase, why: str, **kw) -> None:
    """why_not names the problem, can_handle agrees, and the entry returns False with o untouched."""
    reason = module.why_not(*case.sglang_args(), **kw)
    assert why in reason, reason
    assert not module.can_handle(*case.sglang_args(), **kw)
    before = case.o.clone()
    assert not _run_sglang(module, case, **kw)
    assert torch.equal(case.o.view(torch.int16), before.view(torch.int16))


# ---- item 5: k_scale / v_scale on a 16-bit pool -------------------------------------------------

@pytest.mark.parametrize("layout", [GQA, MLA])
@pytest.mark.parametrize("entry", ["sglang", "paged"])
def test_bf16_pool_with_scales(layout, entry):
    """SGLang's split-KV test runs a BF16 cache with k_scale 0.5 and v_scale 0.25 against
    extend_attention_fwd, which scales the pool's scores and values (sgl-project/sglang
    test/registered/attention/test_verify_splitkv.py at 4c89a75844cd4a56007d00330d9555edf08882a6)."""
    case = build(layout, [45, 0, 90], [4, 3, 2], 8, k_scale=0.5, v_scale=0.25, seed=5)
    module = _load(layout)
    assert module.why_not(*case.sglang_args()) == ""
    assert (_run_sglang if entry == "sglang" else _run_paged)(module, case)
    _check(case, case.o)
    unscaled = reference_verify(case.q, case.k_extend, case.v_extend, case.k_buffer, case.v_buffer, case.qo_indptr,
                                case.kv_indptr, case.kv_indices, dtype=torch.float64)
    assert relative_error(case.o, unscaled) > 10 * tolerance(case), "the scales must change the answer"


@pytest.mark.parametrize(("k_scale", "v_scale"), [(0.5, 0.25), (1.7, 3.0)])
def test_bf16_scales_across_splits_and_drafts(k_scale, v_scale):
    """Several splits (the merge) and a draft tile before the prefix loop (GQA's draft_tile
    "first"), where the draft's P.V is divided back by v_scale."""
    module = _load(GQA)
    for placement in ("first", "after"):
        case = build(GQA, [150, 33, 0], [4, 7, 2], 8, k_scale=k_scale, v_scale=v_scale, seed=7)
        module.launch(*case.launch_args(), config={**SMALL_SPLITS, "draft_tile": placement})
        _check(case, case.o)


@pytest.mark.parametrize("layout", [GQA64, MLA])
def test_batch_invariant_bf16_with_scales(layout):
    case = build(layout, [300, 5], [3, 9], 8, k_scale=0.5, v_scale=0.25, seed=9)
    module = _load(layout, invariant=True)
    assert _run_sglang(module, case), module.why_not(*case.sglang_args())
    _check(case, case.o)
    paged_case = build(layout, [300, 5], [3, 9], 8, k_scale=0.5, v_scale=0.25, seed=9)
    assert _run_paged(module, paged_case)
    _check(paged_case, paged_case.o)


def test_bf16_scale_tensors_and_bad_values_are_refused():
    module = _load(GQA)
    case = build(GQA, [20], [2], 4, seed=1)
    case.k_scale = torch.tensor([0.5])
    _refused(module, case, "k_scale is a tensor")
    case.k_scale, case.v_scale = 1.0, float("nan")
    _refused(module, case, "v_scale must be None or a finite float")
    case.v_scale = "0.25"
    _refused(module, case, "v_scale must be None or a finite float")


@pytest.mark.parametrize("layout", [GQA, MLA])
def test_non_positive_score_scales_are_refused(layout):
    """The Gluon prefix stage scales a row's max of the raw scores, which is the max of the
    scaled scores only for a positive scale: sm_scale and a 16-bit pool's k_scale at or below
    zero (or not finite) are refused by both entries, whichever lowering would run."""
    module = _load(layout)
    case = build(layout, [20], [2], 4, seed=1)
    for bad in (0.0, -0.125, float("nan"), float("inf")):
        case.sm_scale = bad
        _refused(module, case, "sm_scale must be None or a finite float > 0")
        assert "sm_scale must be None or a finite float > 0" in module.why_not_paged(
            *to_paged(case, 16).paged_args(case))
    case.sm_scale = np.float32(0.125)  # a NumPy scalar is a number
    assert module.why_not(*case.sglang_args()) == ""
    case.sm_scale = None
    for bad in (0.0, -1.0):
        case.k_scale = bad
        _refused(module, case, "k_scale must be > 0")


def test_fp8_scales_unchanged_as_tensors():
    """FP8 modules take device-tensor descales as well as floats (the kernel reads tensors)."""
    case = build(GQA, [33], [3], 4, kv_dtype="float8_e4m3fn", k_scale=0.5, v_scale=0.25, seed=4)
    case.k_scale, case.v_scale = torch.tensor([0.5]), torch.tensor([0.25])
    assert _run_sglang(_load(GQA, "float8_e4m3fn"), case)
    _check(case, case.o)


# ---- item 2: kv_len_adjust ----------------------------------------------------------------------

def _decode_case(layout: str, seq_lens: list[int], kv: str, kv_scale: float, seed: int = 1) -> VerifyCase:
    """One query row a request whose token is already the last slot of its kv_indptr slice (stored
    divided by kv_scale, as the upstream test stores it)."""
    case = make_case(SPECS[layout], seq_lens, [1] * len(seq_lens), 16, kv_dtype=kv, k_scale=kv_scale,
                     v_scale=kv_scale, seed=seed)
    last = case.kv_indices[(case.kv_indptr[1:] - 1).long()].long()
    pool_dtype = case.k_buffer.dtype
    case.k_buffer[last] = (case.k_extend.float() / kv_scale).to(pool_dtype)
    case.v_buffer[last] = (case.v_extend.float() / kv_scale).to(pool_dtype)
    # The draft token the kernel sees is what the pool holds, scaled back (fp8 rounds it).
    case.k_extend = (case.k_buffer[last].float() * kv_scale).to(case.q.dtype)
    case.v_extend = (case.v_buffer[last].float() * kv_scale).to(case.q.dtype)
    return case


def _decode_reference(case: VerifyCase, kv_scale: float) -> torch.Tensor:
    """Plain decode: each query row over every slot of its request's slice, the pool scaled."""
    group = case.q.shape[1] // case.k_buffer.shape[1]
    sm_scale = 1.0 / math.sqrt(case.q.shape[-1])
    out = torch.zeros(case.o.shape, dtype=torch.float64)
    bounds = case.kv_indptr.tolist()
    for b in range(len(bounds) - 1):
        slots = case.kv_indices[bounds[b]:bounds[b + 1]].long()
        k = (case.k_buffer[slots].double() * kv_scale).repeat_interleave(group, dim=1)
        v = (case.v_buffer[slots].double() * kv_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", case.q[b].double(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out


@pytest.mark.parametrize(("kv", "kv_scale"), [("bfloat16", 1.0), ("bfloat16", 2.0), ("float8_e4m3fn", 2.0)])
@pytest.mark.parametrize("invariant", [False, True])
def test_decode_through_the_verify_entry(kv, kv_scale, invariant):
    """SGLang's MiniMax-M3 decode case (head dim 128, 16 query heads on one KV head, a 1-token
    request whose trimmed prefix is empty), at interpreter sizes: verify_shared_kv_fwd with
    max_len_extend 1 and kv_len_adjust=-1 against decode over the whole slice
    (sgl-project/sglang test/registered/attention/test_verify_shared_kv.py at
    08582c222bd8cf28a21dba2eea89a694bd3a6734, _run_decode_parity / test_minimax_m3_decode and
    test_minimax_m3_decode_fp8_kv_cache)."""
    case = _decode_case(GQA128, [1, 5, 70, 129], kv, kv_scale)
    module = _load(GQA128, kv, invariant)
    assert module.why_not(*case.sglang_args(), kv_len_adjust=-1) == ""
    assert _run_sglang(module, case, kv_len_adjust=-1, check_indices=True)
    ref = _decode_reference(case, kv_scale)
    err = relative_error(case.o, ref)
    assert err <= tolerance(case), err
    # Without the trim the new token counts twice: a different answer.
    again = _decode_case(GQA128, [1, 5, 70, 129], kv, kv_scale)
    assert _run_sglang(module, again)
    assert relative_error(again.o, ref) > 3 * err


def test_kv_len_adjust_across_splits():
    """A trim of 2 with several splits (the merge reads the trimmed split plan too)."""
    case = build(GQA, [150, 40, 2], [3, 2, 1], 8, seed=3)
    module = _load(GQA)
    module.launch(*case.launch_args(), config=SMALL_SPLITS, kv_len_adjust=-2)
    bounds = case.kv_indptr.tolist()
    keep = torch.cat([case.kv_indices[bounds[b]:bounds[b + 1] - 2] for b in range(len(bounds) - 1)])
    trimmed = torch.tensor([0] + [bounds[b + 1] - bounds[0] - 2 * (b + 1) for b in range(len(bounds) - 1)],
                           dtype=case.kv_indptr.dtype)
    ref = reference_verify(case.q, case.k_extend, case.v_extend, case.k_buffer, case.v_buffer, case.qo_indptr,
                           trimmed, keep, dtype=torch.float64)
    assert relative_error(case.o, ref) <= tolerance(case)


def test_kv_len_adjust_refusals():
    module = _load(GQA)
    case = build(GQA, [20, 0], [2, 1], 4, seed=2)
    _refused(module, case, "kv_len_adjust=1 > 0", kv_len_adjust=1)
    _refused(module, case, "kv_len_adjust must be a Python int", kv_len_adjust=-1.0)
    _refused(module, case, "kv_len_adjust must be a Python int", kv_len_adjust=torch.tensor(-1))
    _refused(module, case, "trimming more than MAX_DRAFT_TOKENS", kv_len_adjust=-10_000)
    before = case.o.clone()
    # Request 1's slice is empty: a trim of 1 makes its prefix negative. check_indices says so.
    with pytest.raises(ValueError, match="request 1's kv_indptr slice holds 0 slots"):
        _run_sglang(module, case, kv_len_adjust=-1, check_indices=True)
    assert torch.equal(case.o.view(torch.int16), before.view(torch.int16))


def test_kv_len_adjust_with_a_mask_is_refused():
    case = set_draft_masks(build(GQA, [20], [4], 4, seed=2), [eagle_tree(4)])
    _refused(_load(GQA), case, "kv_len_adjust with a custom_mask", kv_len_adjust=-1)


# ---- item 3: is_causal=False without a mask ----------------------------------------------------

def _block_case(layout: str, prefixes, drafts, group: int, seed: int) -> VerifyCase:
    case = build(layout, prefixes, drafts, group, seed=seed, draft_affinity=4.0)
    case.is_causal = False
    return case


@pytest.mark.parametrize("draft", [1, 3, 7, 16, 17, 33, 64])
@pytest.mark.parametrize("layout", [GQA, MLA])
def test_non_causal_block_against_chain(layout, draft):
    """Every draft token sees every other (and the whole prefix), as SGLang's newer kernel serves
    Kimi-K3's DSpark draft (is_causal=False, no mask; sgl-project/sglang
    test/registered/attention/test_verify_shared_kv.py at 08582c222bd8cf28a21dba2eea89a694bd3a6734,
    test_kimi_k3_dspark_gqa_shape). Lengths past 16 take row blocks and draft-column tiles."""
    group = 16 if layout == MLA else 8
    module = _load(layout)
    block = _block_case(layout, [40, 0], [draft, max(1, draft // 2)], group, seed=draft)
    assert module.why_not(*block.sglang_args()) == ""
    assert _run_sglang(module, block)
    _check(block, block.o)
    if draft > 1:
        chain = _block_case(layout, [40, 0], [draft, max(1, draft // 2)], group, seed=draft)
        chain.is_causal = True
        assert _run_sglang(module, chain)
        _check(chain, chain.o)
        assert relative_error(block.o, chain.reference(torch.float64)) > 10 * tolerance(block)


@pytest.mark.parametrize("draft", [7, 33])
def test_non_causal_paged_and_split(draft):
    module = _load(GQA)
    block = _block_case(GQA, [70, 3, 130], [draft, 2, 5], 8, seed=11)
    assert _run_paged(module, block, is_causal=False)
    _check(block, block.o)
    split = _block_case(GQA, [150, 40], [draft, 3], 8, seed=12)
    module.launch(*split.launch_args(), config=SMALL_SPLITS, is_causal=False)
    _check(split, split.o)


def test_kimi_k3_dspark_shape():
    """The upstream DSpark case's widths: head dim 64, 8 query heads on 2 KV heads, 7 draft
    tokens, non-causal (there on gqa64, the 64-wide layout; prefixes shrunk for the interpreter)."""
    case = make_case(SPECS[GQA64], [51, 200], [7, 7], 4, num_kv_heads=2, seed=13, draft_affinity=4.0)
    case.is_causal = False
    module = _load(GQA64)
    assert _run_sglang(module, case), module.why_not(*case.sglang_args())
    _check(case, case.o)


@pytest.mark.parametrize("layout", [GQA64, MLA])
def test_non_causal_batch_invariant(layout):
    """The batch-invariant module: a ragged batch of blocks, right against the reference and
    bitwise the same as the request alone."""
    module = _load(layout, invariant=True)
    drafts = [(33, 17), (0, 3), (129, 40), (5, 1)]
    cases = [_block_case(layout, [p], [d], 8, seed=20 + i) for i, (p, d) in enumerate(drafts)]
    batch, rows = batch_of(cases, seed=1)
    batch.is_causal = False
    assert _run_sglang(module, batch), module.why_not(*batch.sglang_args())
    _check(batch, batch.o)
    alone = cases[2]
    o_alone = torch.empty(alone.o.shape, dtype=torch.float32)
    o_batch = torch.empty(batch.o.shape, dtype=torch.float32)
    module.launch(*alone.launch_args()[:3], o_alone, *alone.launch_args()[4:], is_causal=False)
    module.launch(*batch.launch_args()[:3], o_batch, *batch.launch_args()[4:], is_causal=False)
    assert torch.equal(o_batch[rows[2]], o_alone)
    paged = _block_case(layout, [129, 2], [40, 5], 8, seed=30)
    assert _run_paged(module, paged, is_causal=False)
    _check(paged, paged.o)


# ---- item 4: absorbed MLA with its own v_buffer -----------------------------------------------

@pytest.mark.parametrize("invariant", [False, True])
def test_absorbed_mla_separate_v_buffer_is_refused(invariant):
    module = _load(MLA, invariant=invariant)
    case = build(MLA, [20], [2], 16, seed=3)
    case.v_buffer = case.k_buffer[..., :512].clone()
    _refused(module, case, "v_buffer is not a view of k_buffer's first 512 columns")
    paged = to_paged(build(MLA, [20], [2], 16, seed=3), 16)
    args = list(paged.paged_args(case))
    args[5] = paged.k_cache[..., :512].clone()
    assert "v_buffer is not a view" in module.why_not_paged(*args)
    assert not module.verify_paged_fwd(*args)


# ---- the Gluon MLA stage (sm_90): the same three runtime arguments -----------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("invariant", [False, True])
def test_gpu_gluon_stage_scales_blocks_and_trim(invariant):
    """The Gluon prefix stage takes k_scale / v_scale, draft_lookahead_len and prefix_trim_len as
    the Triton stage does (compiled by `kgen check`; the interpreter cannot run Gluon): a BF16
    pool scaled 0.5 / 0.25, non-causal blocks and a kv_len_adjust of -1, each against the
    reference, with the Gluon stage asserted to be the one launched."""
    from test_gpu_gluon import GLUON_CONFIGS, gluon_config

    module = _load(MLA, invariant=invariant)
    config = None if invariant else gluon_config(module, GLUON_CONFIGS["n64s2"])
    launches = module.launch_params("sm_90", 132, 16, 3, 7, None, config)
    assert launches[0][0] == "_gluon_prefix_stage", launches

    scaled = make_case(SPECS[MLA], [900, 0, 333], [4, 1, 3], 16, k_scale=0.5, v_scale=0.25, device="cuda", seed=1)
    module.launch(*scaled.launch_args(), config=config)
    _check(scaled, scaled.o)

    block = make_case(SPECS[MLA], [900, 0, 333], [7, 2, 5], 16, device="cuda", seed=2, draft_affinity=4.0)
    block.is_causal = False
    module.launch(*block.launch_args(), config=config, is_causal=False)
    _check(block, block.o)

    trimmed = make_case(SPECS[MLA], [901, 1, 334], [1, 1, 1], 16, device="cuda", seed=3)
    module.launch(*trimmed.launch_args(), config=config, kv_len_adjust=-1)
    bounds = trimmed.kv_indptr.tolist()
    keep = torch.cat([trimmed.kv_indices[bounds[b]:bounds[b + 1] - 1] for b in range(len(bounds) - 1)])
    indptr = torch.tensor([0] + [bounds[b + 1] - (b + 1) for b in range(len(bounds) - 1)], device="cuda",
                          dtype=trimmed.kv_indptr.dtype)
    ref = reference_verify(trimmed.q, trimmed.k_extend, trimmed.v_extend, trimmed.k_buffer, trimmed.v_buffer,
                           trimmed.qo_indptr, indptr, keep, dtype=torch.float64)
    assert relative_error(trimmed.o, ref) <= tolerance(trimmed)
