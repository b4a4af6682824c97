"""The batch-invariant modules (``kgen.load(..., batch_invariant=True)``): a request's output is
bitwise the same alone, in a batch of 7 and in a batch of 64, whatever its position, its
neighbours' prefix and draft lengths, the multiprocessor count the launcher assumes, the length
of kv_indices (an engine's preallocated buffer) and, on the GPU, CUDA-graph capture. Trees
(SGLang's custom_mask) too: the request's tree alone and among neighbours with other trees,
other draft lengths (more row blocks) and is_causal either way.

Bitwise comparisons read an fp32 o written through ``launch`` (which takes any o dtype): a
bf16 o rounds away most differences of the kernels' fp32 results (the default module's output
for the same request in a batch of 64 differs by ~1e-7 in fp32, and its bf16 bits mostly agree).
The engine entries with their bf16 o are compared too.

CPU tests run in Triton's interpreter. Most shrink the module's split size (TOKENS_PER_SPLIT,
read by the launcher at run time) so that prefixes of a few hundred tokens take several splits
and the merge; one runs the shipped 256. GPU tests (``-m gpu``) run the shipped modules at the
speed bar's sizes and replay CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from case_tools import batch_of, paged_mask, set_draft_masks, to_paged
from kernel_cases import SPECS, tolerance

import kgen
from kgen.errors import UsageError
from kgen.launcher.invariant import InvariantVerifyLauncher
from kgen.launcher.verify import VerifyLauncher
from kgen.problems import VerifyCase, eagle_tree, make_case
from kgen.reference import relative_error

GQA = "gqa64"
SMALL_SPLIT = 64  # tokens per split in the interpreter: a few hundred tokens make several splits
TARGET = (300, 3)  # the request every test follows: prefix, draft
# (prefix, draft) of the neighbours in the batch of 7; the request sits at position 3.
NEIGHBOURS_7 = [(0, 16), (517, 1), (64, 5), (129, 4), (1, 2), (260, 9)]


def _request(layout: str, prefix: int, draft: int, group: int, seed: int, **kw) -> VerifyCase:
    return make_case(SPECS[layout], [prefix], [draft], group, seed=seed, **kw)


def _tree_request(layout: str, prefix: int, draft: int, group: int, seed: int, is_causal: bool = True,
                  **kw) -> VerifyCase:
    """A request whose draft is an EAGLE-like tree (topk 4, seeded like its data)."""
    return set_draft_masks(_request(layout, prefix, draft, group, seed, **kw), [eagle_tree(draft, seed=seed)],
                           is_causal=is_causal)


def _batch(layout: str, group: int, neighbours: list[tuple[int, int]], position: int, target: tuple[int, int],
           seed: int = 0, spare_indices: int = 0, trees: bool = False, is_causal: bool = True, mask_gap: int = 0,
           **kw) -> tuple[VerifyCase, slice]:
    """The request (seed 1000) at ``position`` among ``neighbours`` (seeds 0, 1, ...); with
    ``trees`` every request has its own tree, the call passes ``is_causal`` with the mask and
    the mask blocks lie ``mask_gap`` bytes apart."""
    if trees:
        def request(prefix: int, draft: int, seed: int) -> VerifyCase:
            return _tree_request(layout, prefix, draft, group, seed, is_causal, **kw)
    else:
        def request(prefix: int, draft: int, seed: int) -> VerifyCase:
            return _request(layout, prefix, draft, group, seed, **kw)
    cases = [request(p, d, i) for i, (p, d) in enumerate(neighbours)]
    cases.insert(position, request(*target, 1000))
    batch, rows = batch_of(cases, seed=seed, spare_indices=spare_indices, mask_gap=mask_gap)
    return batch, rows[position]


def _assume_sms(module, num_sms: int, monkeypatch) -> None:
    """The launcher reads the multiprocessor count from _device_info: make it ``num_sms``."""
    monkeypatch.setattr(module.LAUNCHER, "device_info", lambda device_type, index: ("interpreter", num_sms, False))


def _run(module, case: VerifyCase, num_sms: int, monkeypatch) -> torch.Tensor:
    """The fp32 o the module writes for ``case`` (token slots, through ``launch``), with the
    launcher assuming ``num_sms`` multiprocessors."""
    _assume_sms(module, num_sms, monkeypatch)
    out = torch.full(case.o.shape, float("nan"), dtype=torch.float32)
    args = list(case.launch_args())
    args[3] = out
    module.launch(*args, **case.mask_kwargs())
    return out


def _run_entry(module, case: VerifyCase, num_sms: int, monkeypatch) -> torch.Tensor:
    """case.o as the engine entry (verify_shared_kv_fwd) writes it."""
    _assume_sms(module, num_sms, monkeypatch)
    assert module.verify_shared_kv_fwd(*case.sglang_args()), module.why_not(*case.sglang_args())
    return case.o


def _run_paged(module, case: VerifyCase, page_size: int, seed: int) -> torch.Tensor:
    """The fp32 o of the block-table entry's launch (verify_paged_fwd's _run call, which checks
    that o is in the query dtype), the prefixes in pages of ``page_size``."""
    paged = to_paged(case, page_size, seed=seed)
    out = torch.full(case.o.shape, float("nan"), dtype=torch.float32, device=case.o.device)
    k, v = paged.k_cache, paged.v_cache
    mask = {}
    if case.draft_masks is not None:
        custom_mask, mask_indptr = paged_mask(case.draft_masks, device=case.q.device)
        mask = {"custom_mask": custom_mask, "mask_indptr": mask_indptr}
    module.LAUNCHER.run(case.q, case.k_extend, case.v_extend, out, k, v, case.qo_indptr, paged.prefix_lens,
                paged.block_table, case.max_len_extend, case.k_scale, case.v_scale, case.sm_scale, None,
                page_size=page_size, stride_table=paged.block_table.stride(0), k_strides=k.stride()[:3],
                v_strides=v.stride()[:3], **mask)
    return out


@pytest.fixture
def small_splits(monkeypatch):
    """Set a module's split size to SMALL_SPLIT for one test (the launch plans are cached)."""
    touched = []

    def shrink(module):
        monkeypatch.setattr(module, "TOKENS_PER_SPLIT", SMALL_SPLIT)
        module.LAUNCHER.cached_setup.cache_clear()
        touched.append(module)
        return module

    yield shrink
    for module in touched:
        module.LAUNCHER.cached_setup.cache_clear()


def _alone(layout: str, group: int, **kw) -> VerifyCase:
    return _request(layout, *TARGET, group, seed=1000, **kw)


def test_alone_in_7_and_in_64_bitwise_equal(small_splits, monkeypatch):
    """The same request alone, in a batch of 7 (neighbours with longer drafts and prefixes) and
    in a batch of 64 (tiny prefixes, drafts 1-6, a kv_indices longer than the batch needs),
    at other positions and SM counts: the same bits, and right against the reference."""
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    alone_case = _alone(GQA, 8)
    alone = _run(module, alone_case, 4, monkeypatch)
    alone_bf16 = _run_entry(module, alone_case, 4, monkeypatch)
    seven, rows7 = _batch(GQA, 8, NEIGHBOURS_7, 3, TARGET, seed=1)
    sixty_four, rows64 = _batch(GQA, 8, _tiny_neighbours(63, max_draft=6), 41, TARGET, seed=2, spare_indices=5000)
    assert torch.equal(_run(module, seven, 132, monkeypatch)[rows7], alone)
    out64 = _run(module, sixty_four, 7, monkeypatch)
    assert torch.equal(out64[rows64], alone)
    assert torch.equal(_run_entry(module, seven, 132, monkeypatch)[rows7], alone_bf16)
    assert relative_error(seven.o, seven.reference(torch.float64)) <= tolerance(seven)
    assert relative_error(out64, sixty_four.reference(torch.float64)) <= tolerance(sixty_four)


def _tiny_neighbours(n: int, max_draft: int = 16, seed: int = 2) -> list[tuple[int, int]]:
    """(prefix 0-40, draft 1-max_draft) for n neighbours."""
    gen = torch.Generator().manual_seed(seed)
    return [(int(p), int(d)) for p, d in zip(torch.randint(0, 41, (n,), generator=gen),
                                             torch.randint(1, max_draft + 1, (n,), generator=gen), strict=True)]


def test_the_default_module_is_not_batch_invariant(monkeypatch):
    """What the mode is for: the default module gives the request other bits in a batch of 64
    (its split count and draft padding follow the batch), so the invariance above is not an
    accident of the inputs."""
    module = kgen.load(GQA, "bfloat16")
    alone = _run(module, _alone(GQA, 8), 4, monkeypatch)
    sixteen, rows16 = _batch(GQA, 8, _tiny_neighbours(15), 9, TARGET, seed=2)
    assert not torch.equal(_run(module, sixteen, 4, monkeypatch)[rows16], alone)


@pytest.mark.parametrize("num_sms", [1, 132, 1000])
def test_the_multiprocessor_count_changes_nothing(small_splits, monkeypatch, num_sms):
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    alone = _run(module, _alone(GQA, 8), 4, monkeypatch)
    assert torch.equal(_run(module, _alone(GQA, 8), num_sms, monkeypatch), alone)


def test_last_in_the_batch(small_splits, monkeypatch):
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    alone = _run(module, _alone(GQA, 8), 4, monkeypatch)
    batch, rows = _batch(GQA, 8, NEIGHBOURS_7, 6, TARGET, seed=6)  # last (the others test 3 and 41)
    assert torch.equal(_run(module, batch, 4, monkeypatch)[rows], alone)


def test_splits_past_the_cap_grow_and_stay_invariant(small_splits, monkeypatch):
    """A prefix of more than MAX_SPLITS_PER_REQUEST splits takes splits of a whole multiple of
    the split size; a neighbour that fills the split grid changes nothing."""
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    monkeypatch.setattr(module, "MAX_SPLITS_PER_REQUEST", 2)
    module.LAUNCHER.cached_setup.cache_clear()
    alone = _run(module, _alone(GQA, 8), 4, monkeypatch)  # 300 tokens: 2 splits of 192
    batch, rows = _batch(GQA, 8, [(700, 2), (40, 6)], 1, TARGET, seed=3)
    assert torch.equal(_run(module, batch, 4, monkeypatch)[rows], alone)
    assert relative_error(_run_entry(module, batch, 4, monkeypatch), batch.reference(torch.float64)) <= tolerance(batch)


def test_paged_entry_alone_and_in_7(small_splits, monkeypatch):
    """The block-table entry: the block table's width (the longest prefix it can hold) changes
    the split grid and the scratch layout, not the bits."""
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    _assume_sms(module, 4, monkeypatch)
    alone = _alone(GQA, 8)
    alone_out = _run_paged(module, alone, 16, seed=0)
    seven, rows = _batch(GQA, 8, NEIGHBOURS_7, 3, TARGET, seed=4)
    assert torch.equal(_run_paged(module, seven, 16, seed=4)[rows], alone_out)
    paged = to_paged(seven, 16, seed=4)
    assert module.verify_paged_fwd(*paged.paged_args(seven))
    assert relative_error(seven.o, seven.reference(torch.float64)) <= tolerance(seven)


@pytest.mark.parametrize(("layout", "group", "kv", "scales"), [
    ("mla_absorbed_512_64", 16, "bfloat16", {}),
    ("qwen3_5_gqa256", 16, "bfloat16", {}),
    (GQA, 8, "float8_e4m3fn", {"k_scale": 0.6, "v_scale": 1.7}),
])
def test_other_layouts_and_fp8(small_splits, monkeypatch, layout, group, kv, scales):
    module = small_splits(kgen.load(layout, kv, batch_invariant=True))
    target = (150, 3)  # 3 splits
    alone = _run(module, _request(layout, *target, group, seed=1000, kv_dtype=kv, **scales), 4, monkeypatch)
    batch, rows = _batch(layout, group, [(70, 6), (0, 1)], 1, target, seed=5, kv_dtype=kv, **scales)
    assert torch.equal(_run(module, batch, 132, monkeypatch)[rows], alone)
    out = _run_entry(module, batch, 132, monkeypatch)
    assert relative_error(out, batch.reference(torch.float64)) <= tolerance(batch)


def test_the_shipped_split_size(monkeypatch):
    """TOKENS_PER_SPLIT as shipped (256): a 2500-token prefix is 10 of them, past
    MAX_SPLITS_PER_REQUEST, so it takes 5 splits of 512 and the merge, alone and beside a request
    of one split."""
    module = kgen.load(GQA, "bfloat16", batch_invariant=True)
    assert (module.TOKENS_PER_SPLIT, module.MAX_SPLITS_PER_REQUEST) == (256, 8)
    target = (2500, 2)
    alone = _run(module, _request(GQA, *target, 8, seed=1000), 4, monkeypatch)
    batch, rows = _batch(GQA, 8, [(9, 5)], 1, target, seed=6)
    assert torch.equal(_run(module, batch, 132, monkeypatch)[rows], alone)
    out = _run_entry(module, batch, 132, monkeypatch)
    assert relative_error(out, batch.reference(torch.float64)) <= tolerance(batch)


# ---------------------------------------------------------------------------------------- trees

TREE_TARGET = (300, 11)  # a tree of 11 draft tokens: 3 row blocks of L_PAD 4, the last one ragged
# Neighbours with trees up to 20 tokens (5 row blocks in the grid) and empty or long prefixes.
TREE_NEIGHBOURS_7 = [(0, 20), (517, 1), (64, 5), (129, 16), (1, 2), (260, 9)]


def test_tree_alone_in_7_and_in_64_bitwise_equal(small_splits, monkeypatch):
    """The request's tree alone, in a batch of 7 (longer trees around it, so more row blocks;
    is_causal=False with the mask, which governs either way; mask blocks apart) and in a batch
    of 64 (tiny prefixes, trees of 1-6, a longer kv_indices), at other SM counts: the same bits
    through launch and the engine entry, and right against the reference applying the masks."""
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    alone_case = _tree_request(GQA, *TREE_TARGET, 8, seed=1000)
    alone = _run(module, alone_case, 4, monkeypatch)
    alone_bf16 = _run_entry(module, alone_case, 4, monkeypatch)
    assert relative_error(alone_bf16, alone_case.reference(torch.float64)) <= tolerance(alone_case)
    seven, rows7 = _batch(GQA, 8, TREE_NEIGHBOURS_7, 3, TREE_TARGET, seed=1, trees=True, is_causal=False,
                          mask_gap=7)
    sixty_four, rows64 = _batch(GQA, 8, _tiny_neighbours(63, max_draft=6), 41, TREE_TARGET, seed=2,
                                spare_indices=5000, trees=True)
    assert torch.equal(_run(module, seven, 132, monkeypatch)[rows7], alone)
    out64 = _run(module, sixty_four, 7, monkeypatch)
    assert torch.equal(out64[rows64], alone)
    assert torch.equal(_run_entry(module, seven, 132, monkeypatch)[rows7], alone_bf16)
    assert relative_error(seven.o, seven.reference(torch.float64)) <= tolerance(seven)
    assert relative_error(out64, sixty_four.reference(torch.float64)) <= tolerance(sixty_four)


def test_tree_paged_entry_and_mla(small_splits, monkeypatch):
    """A tree through the block-table entry (the paged mask's rows) alone and in 7, and MLA's
    tree (on sm_90 its chain takes the Gluon stage, a tree the Triton one) alone and in 3."""
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    _assume_sms(module, 4, monkeypatch)
    alone = _run_paged(module, _tree_request(GQA, *TREE_TARGET, 8, seed=1000), 16, seed=0)
    seven, rows = _batch(GQA, 8, TREE_NEIGHBOURS_7, 3, TREE_TARGET, seed=4, trees=True)
    assert torch.equal(_run_paged(module, seven, 16, seed=4)[rows], alone)
    paged = to_paged(seven, 16, seed=4)
    assert module.verify_paged_fwd(*paged.paged_args(seven))
    assert relative_error(seven.o, seven.reference(torch.float64)) <= tolerance(seven)
    mla = small_splits(kgen.load("mla_absorbed_512_64", "bfloat16", batch_invariant=True))
    target = (150, 9)
    alone = _run(mla, _tree_request("mla_absorbed_512_64", *target, 16, seed=1000), 4, monkeypatch)
    batch, rows = _batch("mla_absorbed_512_64", 16, [(70, 13), (0, 1)], 1, target, seed=5, trees=True)
    assert torch.equal(_run(mla, batch, 132, monkeypatch)[rows], alone)
    out = _run_entry(mla, batch, 132, monkeypatch)
    assert relative_error(out, batch.reference(torch.float64)) <= tolerance(batch)


# ---------------------------------------------------------------------------------------- refusals

def _grouped_pairs() -> list[tuple[str, str, str]]:
    return [(layout, kv, q) for layout, spec in sorted(SPECS.items()) for kv in spec.dtypes.kv for q in spec.dtypes.q]


@pytest.mark.parametrize(("layout", "kv", "q"), _grouped_pairs())
def test_refuses_nothing_the_default_takes(layout, kv, q):
    """The batch-invariant module's checks are the default's (its launcher overrides none of
    them), and on every target it has a program wherever the default has one (a refusal would
    send the request to a kernel with other bits)."""
    default = kgen.load(layout, kv, q)
    invariant = kgen.load(layout, kv, q, batch_invariant=True)
    assert type(invariant.LAUNCHER) is InvariantVerifyLauncher and type(default.LAUNCHER) is VerifyLauncher
    for name in ("why_not", "why_not_paged", "common_reason", "target_reason", "verify_shared_kv_fwd",
                 "verify_paged_fwd"):
        assert getattr(InvariantVerifyLauncher, name) is getattr(VerifyLauncher, name), name
    groups = sorted({*SPECS[layout].attention.group_sizes, 1, 2, 6, 12, 24, 32})
    for arch in default.CHECKED_ARCHS:
        for group in groups:
            for has_mask in (False, True):
                # The invariant module's launch depends on neither the batch nor the draft length.
                if invariant.launch_params(arch, 132, group, 1, 1, has_mask=has_mask):
                    continue
                taken = [(batch, draft) for batch in (1, 9, 64, 200)
                         for draft in range(1, default.MAX_DRAFT_TOKENS + 1)
                         if default.launch_params(arch, 132, group, batch, draft, has_mask=has_mask)]
                assert not taken, (f"{arch} group {group} mask {has_mask}: the default takes {taken[:4]}, the "
                                   "invariant module nothing")


@pytest.mark.parametrize(("layout", "groups"), [("qwen3_5_gqa256", (4, 8, 16)), ("mla_absorbed_512_64", (8, 16))])
def test_one_program_for_every_batch_and_draft(layout, groups):
    """What the invariant module launches (on sm_90, where MLA's table rows pick the Gluon
    prefix stage for chains) depends on no batch size, draft length (up to MAX_DRAFT_TOKENS:
    longer drafts add row blocks, a runtime argument) or SM count, for chains and trees."""
    module = kgen.load(layout, "bfloat16", batch_invariant=True)
    drafts = range(1, module.MAX_DRAFT_TOKENS + 1)
    for group in groups:
        for page_size in (None, 16):
            for has_mask in (False, True):
                launches = {repr(module.launch_params("sm_90", sms, group, batch, draft, page_size, has_mask=has_mask))
                            for sms in (1, 132) for batch in (1, 16, 64, 500) for draft in drafts}
                assert len(launches) == 1, (group, page_size, has_mask)


# ---------------------------------------------------------------------------------------- loading

def test_load_names_and_flags():
    default = kgen.load(GQA, "bf16")
    invariant = kgen.load(GQA, "bf16", batch_invariant=True)
    assert invariant.URI == "verify_batch_invariant_gqa64__kv_bf16__q_bf16"
    assert invariant.BATCH_INVARIANT is True and default.BATCH_INVARIANT is False
    assert invariant.VARIANT == "grouped"
    with pytest.raises(UsageError, match="grouped kernel"):
        kgen.load(GQA, "bf16", variant="per_head", batch_invariant=True)
    with pytest.raises(UsageError, match="True or False"):
        kgen.load(GQA, "bf16", batch_invariant="yes")


def test_one_config_row_per_group_covers_every_batch():
    module = kgen.load("qwen3_5_gqa256", "bfloat16", batch_invariant=True)
    for arch, rows in module.LAUNCHER.block_configs.items():
        groups = [row[0] for row in rows]
        assert len(groups) == len(set(groups)), arch
        assert all((row[1], row[2]) == (1, 1 << 30) for row in rows), arch
        for group, _, _, config in rows:
            # The row the default module takes at batch 64.
            assert config == kgen.load("qwen3_5_gqa256", "bfloat16").select_config(arch, group, 64)


def test_a_config_s_invariant_head_block_serves_the_invariant_mode_only(monkeypatch: pytest.MonkeyPatch):
    """MLA FP8's default rule sets invariant_block_h 8: the invariant module's Triton programs hold
    8 heads x 4 rows (16 x 4 spill 2.7 KB a thread in its draft-column loop on sm_90); the default
    module keeps 16 heads and does not carry the field. The field is the Triton kernel's: where
    the Gluon stage runs (sm_90 under Triton 3.6) its programs are 64 rows in both modes."""
    invariant = kgen.load("mla_absorbed_512_64", "float8_e4m3fn", batch_invariant=True)
    default = kgen.load("mla_absorbed_512_64", "float8_e4m3fn")
    for module, heads in ((invariant, 8), (default, 16)):
        config = module.select_config("sm_90", 16, 64)
        assert config["block_h"] == heads and "invariant_block_h" not in config
        # An explicit config bypasses the launcher's set-up cache, filled with Gluon as found.
        monkeypatch.setattr(module.LAUNCHER, "gluon_enabled", False)
        name, launched, _ = module.launch_params("sm_90", 132, 16, 64, 4, config=config)[0]
        assert name == "_verify_prefix_stage" and (launched["BLOCK_H"], launched["L_PAD"]) == (heads, 4)
        monkeypatch.setattr(module.LAUNCHER, "gluon_enabled", True)
        name, launched, _ = module.launch_params("sm_90", 132, 16, 64, 4, config=config)[0]
        assert name == "_gluon_prefix_stage" and (launched["BLOCK_H"], launched["L_PAD"]) == (16, 4)


def test_scratch_is_what_the_launcher_allocates_and_bounded(small_splits):
    module = small_splits(kgen.load(GQA, "bfloat16", batch_invariant=True))
    case, _ = _batch(GQA, 8, NEIGHBOURS_7, 3, TARGET, seed=7)
    module.LAUNCHER.scratch.clear()
    module.launch(*case.launch_args())
    allocated = sum(t.numel() * t.element_size() for bufs in module.LAUNCHER.scratch.values() for t in bufs)
    predicted = module.scratch_bytes(case.q.shape[0], 8, 1, 7, case.max_len_extend, "interpreter", 4,
                                     kv_indices_len=case.kv_indices.numel())
    assert allocated == predicted


def test_scratch_of_a_preallocated_kv_indices_is_bounded_by_the_batch():
    """A CUDA-graph call passes the engine's whole kv_indices buffer (SGLang: max_bs x
    max_context_len entries): the scratch is bounded by MAX_SPLITS_PER_REQUEST slots a request,
    not by that length. MLA at batch 128, L 4 on an H200."""
    module = kgen.load("mla_absorbed_512_64", "bfloat16", batch_invariant=True)
    worst = module.scratch_bytes(128 * 4, 16, 1, 128, 4, "sm_90", 132)
    assert module.scratch_bytes(128 * 4, 16, 1, 128, 4, "sm_90", 132, kv_indices_len=128 << 20) == worst
    rows, heads, width = 4, 16, module.V_HEAD_DIM.value + 1
    assert worst == 4 * rows * heads * 128 * module.MAX_SPLITS_PER_REQUEST * width <= 135 << 20
    # An eager call whose kv_indices holds just the batch's prefixes takes compact slots: batch 128,
    # prefix 1K: 1024 // 256 + 1 slots a request.
    compact = module.scratch_bytes(128 * 4, 16, 1, 128, 4, "sm_90", 132, kv_indices_len=128 * 1024)
    assert compact == 4 * rows * heads * 128 * 5 * width


def test_host_side_never_syncs(monkeypatch):
    """The launcher takes the split grid and the scratch from shapes (len(kv_indices)), never
    from index values: no tensor is converted to Python (graph-safe)."""
    module = kgen.load(GQA, "bfloat16", batch_invariant=True)
    case, _ = _batch(GQA, 8, NEIGHBOURS_7, 3, TARGET, seed=8)

    def boom(*a, **k):
        raise AssertionError("host sync in the launcher")

    args = case.sglang_args()
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    assert module.why_not(*args) == ""
    plan = module.LAUNCHER.launch_setup("interpreter", 4, 8, 7, case.max_len_extend, None, None)
    grid, _, slots = module.LAUNCHER.split_grid(plan, 7, case.kv_indices.numel(), compact=True)
    module.LAUNCHER.scratch_buffers(case.q.device, plan.row_blocks * plan.prefix_constexprs["L_PAD"], 8, slots)
    assert grid >= 1


# ---------------------------------------------------------------------------------------- GPU

GPU_LAYOUTS = [("qwen3_5_gqa256", 16), ("mla_absorbed_512_64", 16)]


def _gpu_run(module, case: VerifyCase, num_sms: int | None = None, graph: bool = False,
             fp32: bool = False) -> torch.Tensor:
    """o on the GPU: the engine entry's bf16 case.o, or (fp32) an fp32 o through ``launch``.
    num_sms replaces the multiprocessor count the launcher reads from the device; graph: the
    call is captured into a CUDA graph (after an eager warm-up) and replayed."""
    real = module.LAUNCHER.device_info
    if num_sms is not None:
        arch = real("cuda", case.q.device.index)[0]
        module.LAUNCHER.device_info = lambda device_type, index: (arch, num_sms, False)
    out = torch.full(case.o.shape, float("nan"), dtype=torch.float32, device=case.o.device) if fp32 else case.o
    args = list(case.launch_args())
    args[3] = out

    def call() -> None:
        if fp32:
            module.launch(*args, **case.mask_kwargs())
        else:
            assert module.verify_shared_kv_fwd(*case.sglang_args()), module.why_not(*case.sglang_args())

    try:
        call()
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                call()
            torch.cuda.current_stream().wait_stream(stream)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                call()
            out.fill_(float("nan"))
            captured.replay()
        torch.cuda.synchronize()
        return out.clone()
    finally:
        module.LAUNCHER.device_info = real


def _gpu_neighbours(n: int, max_prefix: int, seed: int) -> list[tuple[int, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(p), int(d)) for p, d in zip(torch.randint(0, max_prefix + 1, (n,), generator=gen),
                                             torch.randint(1, 17, (n,), generator=gen), strict=True)]


def _vendor_fp8(kv: str) -> str:
    """float8_e4m3fn on NVIDIA, ROCm's float8_e4m3fnuz there."""
    return "float8_e4m3fnuz" if kv == "float8_e4m3fn" and torch.version.hip else kv


GPU_TARGET = (16384 + 5, 4)  # the speed bar's request: 8 splits of 2304, the last of 261; draft 4


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize(("layout", "group"), GPU_LAYOUTS)
def test_gpu_alone_in_7_and_in_64_eager_and_graph(layout, group, kv):
    """The speed bar's request alone, in a batch of 7 (prefixes up to 20K, drafts up to 16) and
    in a batch of 64 (prefixes up to 2K, a kv_indices of 1M entries more than the batch needs),
    at the GPU's, 66 and 7 assumed SMs, eager and replayed from a CUDA graph: one set of bits
    (the engine entry's bf16 o, and an fp32 o through launch), right against the reference."""
    kv = _vendor_fp8(kv)
    module = kgen.load(layout, kv, batch_invariant=True)
    scales = {"k_scale": 0.75, "v_scale": 1.25} if kv != "bfloat16" else {}
    kw = {"device": "cuda", "kv_dtype": kv, **scales}
    alone_case = _request(layout, *GPU_TARGET, group, seed=1000, **kw)
    if "tensor-core format" in module.why_not(*alone_case.sglang_args()):
        pytest.skip(module.why_not(*alone_case.sglang_args()))
    alone = {fp32: _gpu_run(module, alone_case, fp32=fp32) for fp32 in (False, True)}
    assert relative_error(alone[False], alone_case.reference(torch.float64)) <= tolerance(alone_case)
    seven, rows7 = _batch(layout, group, _gpu_neighbours(6, 20000, 1), 3, GPU_TARGET, seed=1, **kw)
    sixty_four, rows64 = _batch(layout, group, _gpu_neighbours(63, 2048, 2), 41, GPU_TARGET, seed=2,
                                spare_indices=1 << 20, **kw)
    for case, rows in ((seven, rows7), (sixty_four, rows64)):
        for num_sms, graph in ((None, False), (66, True), (7, False)):
            for fp32 in (False, True):
                out = _gpu_run(module, case, num_sms, graph, fp32)
                assert torch.equal(out[rows], alone[fp32]), (case.q.shape[0], num_sms, graph, fp32)
        assert relative_error(case.o, case.reference(torch.float64)) <= tolerance(case)
    for fp32 in (False, True):
        assert torch.equal(_gpu_run(module, alone_case, graph=True, fp32=fp32), alone[fp32])


GPU_TREE_TARGET = (16384 + 5, 16)  # the tree bar's request: 8 splits, a tree of 16 (row blocks of 4)


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "group"), GPU_LAYOUTS)
def test_gpu_tree_alone_in_7_and_in_64_eager_and_graph(layout, group):
    """A tree (SGLang's custom_mask, is_causal=True with it) at the tree bar's sizes alone, in a
    batch of 7 (trees up to 64 tokens, is_causal=False, mask blocks apart) and in a batch of 64
    (a kv_indices of 1M entries more than the batch needs), at the GPU's, 66 and 7 assumed SMs,
    eager and replayed from a CUDA graph: one set of bits, right against the reference."""
    module = kgen.load(layout, "bfloat16", batch_invariant=True)
    kw = {"device": "cuda"}
    alone_case = _tree_request(layout, *GPU_TREE_TARGET, group, seed=1000, **kw)
    alone = {fp32: _gpu_run(module, alone_case, fp32=fp32) for fp32 in (False, True)}
    assert relative_error(alone[False], alone_case.reference(torch.float64)) <= tolerance(alone_case)
    gen = torch.Generator().manual_seed(7)
    long_trees = [(int(p), int(d)) for p, d in zip(torch.randint(0, 20001, (6,), generator=gen),
                                                   torch.randint(1, 65, (6,), generator=gen), strict=True)]
    seven, rows7 = _batch(layout, group, long_trees, 3, GPU_TREE_TARGET, seed=1, trees=True, is_causal=False,
                          mask_gap=9, **kw)
    sixty_four, rows64 = _batch(layout, group, _gpu_neighbours(63, 2048, 2), 41, GPU_TREE_TARGET, seed=2,
                                spare_indices=1 << 20, trees=True, **kw)
    for case, rows in ((seven, rows7), (sixty_four, rows64)):
        for num_sms, graph in ((None, False), (66, True), (7, False)):
            for fp32 in (False, True):
                out = _gpu_run(module, case, num_sms, graph, fp32)
                assert torch.equal(out[rows], alone[fp32]), (case.q.shape[0], num_sms, graph, fp32)
        assert relative_error(case.o, case.reference(torch.float64)) <= tolerance(case)
    for fp32 in (False, True):
        assert torch.equal(_gpu_run(module, alone_case, graph=True, fp32=fp32), alone[fp32])


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "group"), GPU_LAYOUTS)
def test_gpu_the_default_module_is_not_batch_invariant(layout, group):
    """The same request in the default module: other fp32 bits in the batch of 64 (its split
    count follows the batch), so the GPU test above would see a batch-dependent kernel."""
    module = kgen.load(layout, "bfloat16")
    alone = _gpu_run(module, _request(layout, *GPU_TARGET, group, seed=1000, device="cuda"), fp32=True)
    sixty_four, rows64 = _batch(layout, group, _gpu_neighbours(63, 2048, 2), 41, GPU_TARGET, seed=2, device="cuda")
    assert not torch.equal(_gpu_run(module, sixty_four, fp32=True)[rows64], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("trees", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize(("layout", "group"), GPU_LAYOUTS)
def test_gpu_paged_alone_and_in_7(layout, group, trees):
    module = kgen.load(layout, "bfloat16", batch_invariant=True)
    target = (9000, 12 if trees else 4)
    request = _tree_request if trees else _request
    alone = request(layout, *target, group, seed=1000, device="cuda")
    alone_out = _run_paged(module, alone, 64, seed=0)
    seven, rows = _batch(layout, group, _gpu_neighbours(6, 20000, 3), 3, target, seed=3, trees=trees, device="cuda")
    assert torch.equal(_run_paged(module, seven, 64, seed=3)[rows], alone_out)
    paged = to_paged(seven, 64, seed=3)
    assert module.verify_paged_fwd(*paged.paged_args(seven))
    torch.cuda.synchronize()
    assert relative_error(seven.o, seven.reference(torch.float64)) <= tolerance(seven)
