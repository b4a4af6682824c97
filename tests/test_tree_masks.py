"""Tree verification (EAGLE topk > 1) in Triton's interpreter: the generated modules read each
request's custom mask on the device and follow it, whatever its shape.

The reference (``kgen.reference``) applies the mask literally. SGLang's layout puts request b's
[L, P + L] block at mask_indptr[b]; ``sglang_mask`` writes its prefix columns 0 (never read:
every draft token sees the whole prefix) and puts bytes of 1 between blocks, so a kernel that
read outside its draft block would show. Outputs start as NaN (every valid row must be written).
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from case_tools import paged_mask, set_draft_masks, to_paged
from kernel_cases import SMALL_SPLITS, build, check_parity, tolerance

import kgen
from kgen.launcher import rules
from kgen.launcher.launches import NO_MASK
from kgen.problems import chain_mask, eagle_tree
from kgen.reference import relative_error
from kgen.runtime.adapters import VLLMVerify, vllm_tree_mask
from kgen.runtime.chain import VerifyChain

GQA64, GQA256, MLA = "gqa64", "qwen3_5_gqa256", "mla_absorbed_512_64"


def _trees(lens, seed=0, topk=4):
    return [eagle_tree(n, topk=topk, seed=seed + b) for b, n in enumerate(lens)]


def _random_bits(lens, seed=0):
    """Masks that are no tree: random bits, tokens that do not see themselves, later tokens seen."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(n, n, generator=gen) < 0.4 for n in lens]


def _paged_parity(case, layout, kv, page=16, config=None):
    module = kgen.load(layout, kv)
    cache = to_paged(case, page, seed=page)
    case.o.fill_(float("nan"))
    args = cache.paged_args(case, torch.int64)
    assert module.verify_paged_fwd(*args, config=config), module.why_not_paged(*args)
    err, tol = relative_error(case.o, case.reference(torch.float64)), tolerance(case)
    assert err <= tol, f"paged: relative error {err:.2e} > tolerance {tol:.2e}"


@pytest.mark.parametrize("config", [None, SMALL_SPLITS], ids=["table", "small_splits"])
def test_random_trees_with_ragged_drafts_both_entries(config):
    """EAGLE-like trees, draft lengths not powers of two and different per request (one of 1, an
    empty prefix), blocks apart in the mask; the token-slot entry and the paged one."""
    case = build(GQA64, [37, 0, 50, 9], [7, 3, 12, 1], 8, seed=1)
    set_draft_masks(case, _trees(case.draft_lens(), seed=1), gap=5)
    check_parity(case, GQA64, "bfloat16", config=config)
    _paged_parity(case, GQA64, "bfloat16", config=config)


@pytest.mark.parametrize(("layout", "group"), [(GQA64, 8), (MLA, 16)])
def test_chain_written_as_a_mask_matches_the_causal_path(layout, group):
    """SGLang at topk = 1 sends the chain as a mask: the masked kernel gives the causal kernel's
    output within the suite's tolerance (and both the reference's)."""
    causal = build(layout, [33, 0, 61], [4, 3, 6], group, seed=2)
    check_parity(causal, layout, "bfloat16", config=SMALL_SPLITS)
    masked = build(layout, [33, 0, 61], [4, 3, 6], group, seed=2)
    set_draft_masks(masked, [chain_mask(n) for n in masked.draft_lens()])
    check_parity(masked, layout, "bfloat16", config=SMALL_SPLITS)
    err = relative_error(masked.o, causal.o.double())
    assert err <= tolerance(causal), f"chain as a mask vs causal chain: {err:.2e}"


@pytest.mark.parametrize("is_causal", [True, False])
def test_a_mask_that_is_no_tree_is_followed(is_causal):
    """Random bits (rows that miss their own token, see later ones or nothing of the draft): the
    kernel follows the mask, and the mask governs whatever is_causal says."""
    case = build(GQA64, [21, 40, 5], [6, 5, 9], 8, seed=3)
    set_draft_masks(case, _random_bits(case.draft_lens(), seed=3), gap=3, is_causal=is_causal)
    check_parity(case, GQA64, "bfloat16")
    _paged_parity(case, GQA64, "bfloat16", page=1)


def test_a_draft_token_that_sees_nothing_gets_zeros():
    """An empty prefix and a row of zero bits: zeros, not NaN (SGLang's kernel writes NaN). With a
    prefix the same row sees the prefix alone. Several splits, so the merge sees such rows too."""
    case = build(GQA64, [0, 45, 0], [5, 4, 2], 8, seed=4)
    masks = _trees(case.draft_lens(), seed=4)
    for mask in masks:
        mask[-1] = False
    set_draft_masks(case, masks)
    check_parity(case, GQA64, "bfloat16", config=SMALL_SPLITS)
    rows = [4, 10]  # the last draft token of the two empty-prefix requests
    assert torch.equal(case.o[rows].float(), torch.zeros_like(case.o[rows].float()))
    assert case.o[8].abs().max() > 0  # the one with a prefix sees it
    _paged_parity(case, GQA64, "bfloat16", config=SMALL_SPLITS)
    assert torch.equal(case.o[rows].float(), torch.zeros_like(case.o[rows].float()))


@pytest.mark.parametrize("mask", ["tree", "chain"])
def test_long_drafts_split_over_row_blocks(monkeypatch, mask):
    """Drafts up to 64 past one program's rows (a 16-row budget here): the draft rows go to
    several programs, each looping over every draft-column tile its rows can see."""
    module = kgen.load(GQA64, "bfloat16")
    monkeypatch.setattr(rules, "MAX_ROWS", 16)
    monkeypatch.setattr(rules, "WIDE_MAX_ROWS", 16)  # and for a program widened to two warpgroups
    prefix, drafts = [30, 0, 70], [64, 17, 40]
    config = {**SMALL_SPLITS, "block_h": 8}
    launched = module.launch_params("interpreter", 4, 8, 3, 64, config=config, has_mask=mask == "tree")
    assert launched[0][1]["ROW_BLOCKS"] == 4 and launched[0][1]["L_PAD"] == 16
    case = build(GQA64, prefix, drafts, 8, seed=5)
    if mask == "tree":
        set_draft_masks(case, _trees(drafts, seed=5, topk=3), gap=2)
    check_parity(case, GQA64, "bfloat16", config=config)
    _paged_parity(case, GQA64, "bfloat16", page=64, config=config)


def test_mla_rows_split_by_the_accumulator_budget():
    """Absorbed MLA at 4 warps holds 32 rows of its 512-wide accumulator: a 40-token tree is
    split over two row blocks by the launch rules themselves (draft tile before the loop)."""
    module = kgen.load(MLA, "bfloat16")
    assert module.launch_params("sm_90", 132, 8, 2, 40, config=SMALL_SPLITS)[0][1]["ROW_BLOCKS"] == 2
    case = build(MLA, [37, 20], [40, 33], 8, seed=6)
    set_draft_masks(case, _trees(case.draft_lens(), seed=6))
    check_parity(case, MLA, "bfloat16", config=SMALL_SPLITS)


@pytest.mark.parametrize(("layout", "kv", "group", "draft_first"), [
    (GQA256, "float8_e4m3fn", 8, True), (GQA256, "float8_e4m3fn", 16, False), (MLA, "float8_e4m3fn", 8, True),
])
def test_fp8_trees_before_and_after_the_prefix_loop(layout, kv, group, draft_first):
    """FP8 KV: a masked draft tile run before the prefix loop divides its P.V by v_scale (the
    raw e4m3 tiles after it are descaled once); after the loop it does not."""
    case = build(layout, [45, 0, 30], [6, 3, 5], group, kv_dtype=kv, k_scale=0.4, v_scale=1.8, seed=7)
    set_draft_masks(case, _trees(case.draft_lens(), seed=7))
    config = {**SMALL_SPLITS, "block_h": group, "draft_tile": "first" if draft_first else "after"}
    if layout == MLA:
        config.pop("draft_tile")  # MLA runs it first always
    check_parity(case, layout, kv, config=config)


@pytest.mark.parametrize("mask", ["tree", "chain"])
def test_drafts_wider_than_a_prefix_tile_run_in_draft_tiles(mask):
    """A draft tile is never wider than the prefix tile (rules.draft_tile_columns): one program
    holding a 40-token draft (L_PAD 64) walks its draft columns 16 at a time, both entries."""
    module = kgen.load(GQA64, "bfloat16")
    config = {**SMALL_SPLITS, "block_h": 1}
    launched = module.launch_params("interpreter", 4, 8, 3, 40, config=config, has_mask=mask == "tree")[0][1]
    assert (launched["L_PAD"], launched["DRAFT_N"], launched["ROW_BLOCKS"]) == (64, 16, 1)
    case = build(GQA64, [21, 0, 50], [40, 9, 23], 8, seed=8)
    if mask == "tree":
        set_draft_masks(case, _trees(case.draft_lens(), seed=8, topk=3), gap=3)
    check_parity(case, GQA64, "bfloat16", config=config)
    _paged_parity(case, GQA64, "bfloat16", page=16, config=config)


def test_per_head_variant_reads_the_mask_too():
    case = build(GQA64, [25, 0], [5, 7], 8, seed=8)
    set_draft_masks(case, _trees(case.draft_lens(), seed=8))
    check_parity(case, GQA64, "bfloat16", variant="per_head")


def test_vllm_tree_attention_bias_shared_by_the_batch():
    """vLLM's tree backend: one [T, T] bias (0 / -inf) for every request. The adapter reads it as
    the paged entry's rows with mask_indptr all zeros, with no copy per request."""
    tree = eagle_tree(9, topk=3, seed=9)
    bias = torch.where(tree, 0.0, float("-inf"))
    case = build(GQA64, [20, 0, 33], [9, 9, 9], 8, seed=9)
    set_draft_masks(case, [tree] * 3)
    mask, indptr = vllm_tree_mask(bias, 3)
    assert torch.equal(mask, tree) and indptr.tolist() == [0, 0, 0, 0]
    cache = to_paged(case, 16, seed=9)
    adapter = VLLMVerify(VerifyChain(GQA64, "bfloat16", "bfloat16"))
    seq_lens = cache.prefix_lens + 9
    path = adapter(case.q, case.k_extend, case.v_extend, case.o, cache.k_cache, cache.v_cache, cache.block_table,
                   seq_lens, case.qo_indptr, 9, tree_attn_bias=bias)
    assert path == "grouped"
    err, tol = relative_error(case.o, case.reference(torch.float64)), tolerance(case)
    assert err <= tol, f"relative error {err:.2e} > tolerance {tol:.2e}"


def test_index_check_catches_a_mask_too_short_for_a_request():
    module = kgen.load(GQA64, "bfloat16")
    case = build(GQA64, [10, 12], [3, 4], 8, seed=10)
    set_draft_masks(case, _trees(case.draft_lens(), seed=10))
    case.custom_mask = case.custom_mask[:-1]
    with pytest.raises(ValueError, match="request 1's mask reads custom_mask entries 39..102"):
        module.verify_shared_kv_fwd(*case.sglang_args(), check_indices=True)
    rows, indptr = paged_mask(case.draft_masks)
    cache = to_paged(case, 16)
    args = cache.paged_args(case)[:13]
    with pytest.raises(ValueError, match="request 1's mask reads custom_mask rows 3..6"):
        module.verify_paged_fwd(*args, rows[:6], indptr, check_indices=True)


def test_the_chain_kernel_is_compiled_without_the_mask():
    """Without a mask the prefix stage gets HAS_MASK False and None for its mask arguments (no
    mask parameter, no mask code in the chain kernel); with one, HAS_MASK and nothing else
    changes."""
    module = kgen.load(GQA256, "bfloat16")
    chain = module.launch_params("sm_90", 132, 16, 64, 8)[0][1]
    tree = module.launch_params("sm_90", 132, 16, 64, 8, has_mask=True)[0][1]
    assert chain["HAS_MASK"] is False and chain["Custom_Mask"] is None and chain["stride_mask_row"] is None
    assert tree["HAS_MASK"] is True and "Custom_Mask" not in tree
    assert {k: v for k, v in chain.items() if k not in ("HAS_MASK", *NO_MASK)} == {
        k: v for k, v in tree.items() if k != "HAS_MASK"}


def test_mask_path_has_no_host_sync(monkeypatch):
    """why_not and the mask's launch arguments read only metadata (CUDA-graph safe)."""
    module = kgen.load(GQA64, "bfloat16")
    case = build(GQA64, [30, 9], [5, 3], 8, seed=11)
    set_draft_masks(case, _trees(case.draft_lens(), seed=11))
    cache = to_paged(case, 16)
    paged = cache.paged_args(case)

    def boom(*a, **k):
        raise AssertionError("host sync in the launcher")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    assert module.why_not(*case.sglang_args()) == ""
    assert module.why_not_paged(*paged) == ""
    module.LAUNCHER.mask_arguments(case.custom_mask, case.mask_indptr, False)
    module.LAUNCHER.mask_arguments(paged[13], paged[14], True)


def test_a_tree_takes_the_gluon_stage_where_a_chain_does(monkeypatch):
    """On sm_90 absorbed MLA's BF16 calls run the Gluon prefix stage (its table rows say so),
    a tree too (its draft tile reads the mask), on both entries. KGEN_NO_GLUON=1 puts every
    call on the Triton stage."""
    path = Path(kgen.load(MLA, "bfloat16").__file__)

    def load(no_gluon: bool):
        monkeypatch.setenv("KGEN_NO_GLUON", "1" if no_gluon else "0")
        spec = importlib.util.spec_from_file_location(f"no_gluon_{no_gluon}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    module = load(False)
    if not module._HAS_GLUON:
        pytest.skip("this Triton is not the one the Gluon stage is written for")
    assert module.launch_params("sm_90", 132, 16, 64, 4)[0][0] == "_gluon_prefix_stage"
    tree = module.launch_params("sm_90", 132, 16, 64, 4, has_mask=True)[0]
    assert tree[0] == "_gluon_prefix_stage" and tree[1]["HAS_MASK"] is True
    paged_tree = module.launch_params("sm_90", 132, 16, 64, 4, 16, has_mask=True)[0]
    assert paged_tree[0] == "_gluon_prefix_stage" and paged_tree[1]["BLOCK_TABLE"] is True
    assert load(True).launch_params("sm_90", 132, 16, 64, 4, has_mask=True)[0][0] == "_verify_prefix_stage"
    assert load(True).launch_params("sm_90", 132, 16, 64, 4)[0][0] == "_verify_prefix_stage"
