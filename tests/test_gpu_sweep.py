"""Every generated module over its whole accepted domain on the GPU: each distinct compiled kernel
variant runs at least once, with the boundaries of the draft length, the group and the batch.

Run on a GPU machine (the cost is Triton compiling the variants, so spread it over processes):

    KGEN_TEST_ON_GPU=1 python -m pytest -q -m gpu tests/test_gpu_sweep.py -n 8 --dist loadgroup

What is swept, per shipped layout (``kgen list``) and KV dtype this GPU stores (bfloat16 and the
vendor's float8), with bfloat16 queries (float16 for ``FP16_LAYOUT``):

- groups: each of the layout's ``group_sizes`` and one it does not list (``unlisted_group``:
  1.5 x the largest, so not a power of two, above 16 where the largest is 16 or more);
- draft lengths L = 1..MAX_DRAFT_TOKENS, grouped by the (BLOCK_H, L_PAD) the launcher picks:
  one test id per group, L_PAD class and entry kind (token slots; pages of every size, which
  share one merge kernel) runs every L of the class, with kv_indices (or the block table) int32
  and then int64;
- both entries: ``verify_shared_kv_fwd`` (SGLang token slots, shuffled) and ``verify_paged_fwd``
  with pages of 1, 16 and 64 tokens (shuffled block table);
- 4 requests with different prefix and draft lengths (an empty prefix, prefixes that are not
  a multiple of the page size, one long enough for several splits), and at each batch bucket
  of the module's block-config table for this GPU's arch one case of that batch with tiny
  prefixes (different buckets select different configs);
- every pool slot and page position that no request names holds NaN, and so does o before
  the call: a read outside a request or an unwritten output shows up as NaN;
- trees (EAGLE topk > 1): for every listed group and L_PAD class (draft rows split over
  programs past one program's rows included), each request a random EAGLE-like tree in
  SGLang's custom-mask layout (token slots) and in the paged entry's rows; for the largest
  group also a mask that is no tree (random bits, rows that see no draft token) and the chain
  written as a mask; and the per-head baseline with trees.

On ``MUST_ACCEPT_ARCHS`` (the H200's sm_90) the whole domain must be accepted: a refusal fails
with ``why_not``'s reason. Elsewhere a refusal must leave o untouched. Accepted calls must match
the reference within the GPU parity tests' tolerance (``kernel_cases.tolerance``).

One test runs on the CPU too: the input builders put each prefix where the case names it and
NaN everywhere else (no kernel; what the GPU tests rely on).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from case_tools import nan_tensor, poison_unnamed_slots, set_draft_masks, to_paged
from kernel_cases import LARGE_POOL_GROUP, SPECS, tolerance, wait_for_free_gpu_memory

import kgen
from kgen.problems import VerifyCase, chain_mask, eagle_tree, make_case
from kgen.reference import relative_error
from kgen.spec import FP8_DTYPES

MUST_ACCEPT_ARCHS = ("sm_90",)
FP8 = "float8_e4m3fnuz" if torch.version.hip else "float8_e4m3fn"  # e4m3fnuz is ROCm's format
KV_DTYPES = ("bfloat16", FP8)
INDEX_DTYPES = (torch.int32, torch.int64)
PAGE_SIZES = {"paged1": 1, "paged16": 16, "paged64": 64}
ENTRIES = ("shared", *PAGE_SIZES)
FP16_LAYOUT, FP16_GROUP = "gqa128", 16
SMALL_BATCH = 4
SMALL_PREFIXES = (300, 0, 77, 13)  # several splits, empty, not multiples of 16 or 64
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4m3fn", "float8_e4m3fnuz": "fp8e4m3fnuz"}
SHORT_INDEX = {torch.int32: "i32", torch.int64: "i64"}


def _gpu_arch() -> str:
    """The arch whose table rows the cases are built for: the GPU's, else sm_90 (the H200),
    so that --collect-only on a CPU machine lists the H200's ids."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "sm_90"
    return kgen.load("gqa64").LAUNCHER.device_info("cuda", torch.cuda.current_device())[0]


def _gpu_sms() -> int:
    """The GPU's multiprocessors (they size the split grid), else the H200's 132."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


ARCH = _gpu_arch()
NUM_SMS = _gpu_sms()


def unlisted_group(groups: tuple[int, ...]) -> int:
    """A group size the layout does not list: 1.5 x its largest (24 for 16, 12 for 8, 192 for 128),
    so the last head program is partly padding and, from 16 on, a KV head needs several."""
    return max(groups) * 3 // 2


@dataclass(frozen=True)
class SweepCase:
    """One test id: one module and group, the draft lengths of one L_PAD class (each one launch
    of the same compiled kernels), and the (entry, index dtype) runs of each launch."""

    layout: str
    kv: str
    q: str
    variant: str
    group: int
    batch: int
    drafts: tuple[int, ...]
    runs: tuple[tuple[str, torch.dtype], ...]
    mask: str = "none"  # "none" (the causal chain), "tree", "bits" (no tree), "chain" (the chain as a mask)

    @property
    def id(self) -> str:
        entries = dict.fromkeys(entry for entry, _ in self.runs)
        if all(len([r for r in self.runs if r[0] == e]) == len(INDEX_DTYPES) for e in entries):
            runs = "+".join(entries)
        else:
            runs = "+".join(f"{entry}_{SHORT_INDEX[index]}" for entry, index in self.runs)
        lengths = f"L{self.drafts[0]}" if len(self.drafts) == 1 else f"L{self.drafts[0]}-{self.drafts[-1]}"
        variant = "-perhead" if self.variant == "per_head" else ""
        mask = "" if self.mask == "none" else f"-mask_{self.mask}"
        return (f"{self.layout}-kv_{SHORT_DTYPE[self.kv]}-q_{SHORT_DTYPE[self.q]}{variant}-g{self.group}"
                f"-b{self.batch}-{lengths}-{runs}{mask}")


def draft_classes(module, group: int, batch: int, has_mask: bool = False) -> list[tuple[int, ...]]:
    """Draft lengths 1..MAX_DRAFT_TOKENS grouped by the program the launcher picks on ARCH for
    this group and batch (its ``launch_params``, with a custom mask or without): the lengths
    of one class run the same compiled prefix kernel. A length no program fits is a class of
    its own, so its refusal shows up as a failing id."""
    classes: dict[object, list[int]] = {}
    for draft in range(1, module.MAX_DRAFT_TOKENS + 1):
        launches = module.launch_params(ARCH, NUM_SMS, group, batch, draft, has_mask=has_mask)
        key = (tuple(sorted(launches[0][1].items())), tuple(sorted(launches[0][2].items()))) if launches else draft
        classes.setdefault(key, []).append(draft)
    return [tuple(lengths) for lengths in classes.values()]


def _both_indices(entries) -> tuple[tuple[str, torch.dtype], ...]:
    return tuple((entry, index) for entry in entries for index in INDEX_DTYPES)


def _draft_length_cases() -> list[SweepCase]:
    cases = []
    for layout, spec in SPECS.items():
        groups = (*spec.attention.group_sizes, unlisted_group(spec.attention.group_sizes))
        for kv in KV_DTYPES:
            module = kgen.load(layout, kv)
            for group in groups:
                for drafts in draft_classes(module, group, SMALL_BATCH):
                    cases += [SweepCase(layout, kv, "bfloat16", "grouped", group, SMALL_BATCH, drafts,
                                        _both_indices(entries)) for entries in (["shared"], PAGE_SIZES)]
    for kv in KV_DTYPES:  # float16 queries: one layout, one group, every L_PAD class
        module = kgen.load(FP16_LAYOUT, kv, "float16")
        for drafts in draft_classes(module, FP16_GROUP, SMALL_BATCH):
            cases += [SweepCase(FP16_LAYOUT, kv, "float16", "grouped", FP16_GROUP, SMALL_BATCH, drafts,
                                _both_indices([entry])) for entry in ("shared", "paged16")]
    return cases


def _batch_bucket_cases() -> list[SweepCase]:
    """One case at the smallest batch of each table row for ARCH that the small batch does not
    already fall in, every L_PAD class at its edges."""
    cases = []
    for layout in SPECS:
        for kv in KV_DTYPES:
            module = kgen.load(layout, kv)
            for group, batch_min, batch_max, _ in module.LAUNCHER.block_configs.get(ARCH, ()):
                if batch_min <= SMALL_BATCH <= batch_max:
                    continue
                for drafts in draft_classes(module, group, batch_min):
                    edges = tuple(sorted({drafts[0], drafts[-1]}))
                    cases.append(SweepCase(layout, kv, "bfloat16", "grouped", group, batch_min, edges,
                                           (("shared", torch.int64), ("paged16", torch.int32))))
    return cases


def _per_head_cases() -> list[SweepCase]:
    """The per-head baseline: one head a program, so L_PAD is MIN_DOT at every L (one class)."""
    cases = []
    for layout, spec in SPECS.items():
        for kv in KV_DTYPES:
            module = kgen.load(layout, kv, variant="per_head")
            group = unlisted_group(spec.attention.group_sizes)
            for drafts in draft_classes(module, group, SMALL_BATCH):
                cases.append(SweepCase(layout, kv, "bfloat16", "per_head", group, SMALL_BATCH, drafts,
                                       _both_indices(ENTRIES)))
    return cases


def _tree_cases() -> list[SweepCase]:
    """Trees: every listed group and L_PAD class with a random EAGLE-like tree per request
    (token slots with int64 kv_indices, 16-token pages with an int32 block table); for the
    layout's largest group also masks that are no tree and the chain written as a mask (the
    edges of each class); the per-head baseline with trees at the unlisted group."""
    runs = (("shared", torch.int64), ("paged16", torch.int32))
    cases = []
    for layout, spec in SPECS.items():
        groups = spec.attention.group_sizes
        for kv in KV_DTYPES:
            module = kgen.load(layout, kv)
            for group in groups:
                for drafts in draft_classes(module, group, SMALL_BATCH, has_mask=True):
                    cases.append(SweepCase(layout, kv, "bfloat16", "grouped", group, SMALL_BATCH, drafts, runs, "tree"))
                    if group == max(groups):
                        edges = tuple(sorted({drafts[0], drafts[-1]}))
                        cases += [SweepCase(layout, kv, "bfloat16", "grouped", group, SMALL_BATCH, edges, runs, mask)
                                  for mask in ("bits", "chain")]
            per_head = kgen.load(layout, kv, variant="per_head")
            group = unlisted_group(groups)
            for drafts in draft_classes(per_head, group, SMALL_BATCH, has_mask=True):
                cases.append(SweepCase(layout, kv, "bfloat16", "per_head", group, SMALL_BATCH, drafts, runs, "tree"))
    return cases


DRAFT_LENGTH_CASES = _draft_length_cases()
BATCH_BUCKET_CASES = _batch_bucket_cases()
PER_HEAD_CASES = _per_head_cases()
TREE_CASES = _tree_cases()


def _params(cases: list[SweepCase]) -> list:
    return [pytest.param(case, id=case.id) for case in cases]


def request_lengths(draft: int, batch: int) -> tuple[list[int], list[int]]:
    """(prefix lengths, draft lengths) of a batch whose longest draft is ``draft``: prefix
    lengths differ (one empty, the others not multiples of a page), and so do draft lengths as
    far as ``draft`` allows."""
    if batch <= len(SMALL_PREFIXES):
        shift = draft % batch  # the prefixes move against the drafts from one L to the next
        prefixes = list(SMALL_PREFIXES[:batch])
        drafts = [draft, max(1, draft - 1), 1, max(1, (draft + 1) // 2)][:batch]
        return prefixes[shift:] + prefixes[:shift], drafts
    prefixes = [(37 * b + 13) % 150 for b in range(batch)]
    prefixes[1] = 0
    drafts = [draft] + [1 + (7 * b) % draft for b in range(1, batch)]
    return prefixes, drafts


@contextlib.contextmanager
def _naming(what: str) -> Iterator[None]:
    """An exception raised inside says which launch raised it (a test id covers several)."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"while running {what}")
        raise


def _call(module, problem: VerifyCase, entry: str, index_dtype: torch.dtype, pages: dict) -> str:
    """Run one entry on ``problem`` (o written in place); '' when it ran, else why_not's reason."""
    if entry == "shared":
        problem.kv_indices = problem.kv_indices.to(index_dtype)
        args = problem.sglang_args()
        return "" if module.verify_shared_kv_fwd(*args) else module.why_not(*args) or "(why_not gave no reason)"
    page = PAGE_SIZES[entry]
    if page not in pages:
        pages[page] = to_paged(problem, page, seed=page)
    args = pages[page].paged_args(problem, index_dtype)
    return "" if module.verify_paged_fwd(*args) else module.why_not_paged(*args) or "(why_not_paged gave no reason)"


def draft_masks(mask: str, drafts: list[int], seed: int) -> list[torch.Tensor] | None:
    """Each request's [L, L] draft mask for a sweep case's ``mask`` (None: the causal chain)."""
    if mask == "none":
        return None
    if mask == "chain":
        return [chain_mask(n) for n in drafts]
    if mask == "tree":
        return [eagle_tree(n, topk=4, seed=seed + b) for b, n in enumerate(drafts)]
    gen = torch.Generator().manual_seed(seed)  # "bits": no tree; the last row of each sees no draft token
    bits = [torch.rand(n, n, generator=gen) < 0.4 for n in drafts]
    for block in bits:
        block[-1] = False
    return bits


def check_sweep_case(case: SweepCase) -> None:
    module = kgen.load(case.layout, case.kv, case.q, case.variant)
    fp8 = case.kv in FP8_DTYPES
    for draft in case.drafts:
        prefixes, drafts = request_lengths(draft, case.batch)
        seed = zlib.crc32(f"{case.id}/{draft}".encode())
        problem = make_case(SPECS[case.layout], prefixes, drafts, case.group, kv_dtype=case.kv, q_dtype=case.q,
                            k_scale=0.6 if fp8 else 1.0, v_scale=1.7 if fp8 else 1.0, device="cuda", seed=seed)
        masks = draft_masks(case.mask, drafts, seed)
        if masks is not None:
            set_draft_masks(problem, masks, gap=3)
        poison_unnamed_slots(problem)
        reference = problem.reference(torch.float64)
        bound = tolerance(problem)
        pages: dict = {}
        for entry, index_dtype in case.runs:
            what = f"{entry} with {index_dtype}, prefixes {prefixes}, drafts {drafts}"
            problem.o.fill_(float("nan"))
            with _naming(what):
                refusal = _call(module, problem, entry, index_dtype, pages)
                untouched = bool(problem.o.isnan().all())
                err = relative_error(problem.o, reference)
            if refusal:
                assert ARCH not in MUST_ACCEPT_ARCHS, f"{what}: refused on {ARCH}: {refusal}"
                assert untouched, f"{what}: refused ({refusal}) but o was written"
                continue
            assert err <= bound, f"{what}: relative error {err:.2e} > tolerance {bound:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _params(DRAFT_LENGTH_CASES))
def test_draft_length_classes(case):
    check_sweep_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _params(BATCH_BUCKET_CASES))
def test_batch_buckets(case):
    check_sweep_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _params(PER_HEAD_CASES))
def test_per_head_variant(case):
    check_sweep_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _params(TREE_CASES))
def test_trees(case):
    check_sweep_case(case)


def _moved_up(pool: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    """A NaN pool of ``rows`` rows (first dim) with ``pool`` copied into its last rows, and
    the offset of the copy."""
    big = nan_tensor((rows, *pool.shape[1:]), pool.dtype, pool.device)
    offset = rows - pool.shape[0]
    big[offset:].view(torch.uint8).copy_(pool.contiguous().view(torch.uint8))
    return big, offset


@pytest.mark.gpu
@pytest.mark.xdist_group(LARGE_POOL_GROUP)
@pytest.mark.parametrize(("layout", "kv"), [("gqa64", "bfloat16"), ("mla_absorbed_512_64", FP8)])
def test_pool_past_2_pow_31_elements(layout, kv):
    """A pool of more than 2**31 elements whose named slots (and pages) all lie past element
    2**31: slot x stride overflows int32, so every address must be formed in int64. (The CPU
    test in test_int64_addressing.py runs the interpreter, not the compiled kernel.) The paged
    caches are freed before the token-slot pools are made: one pair at a time on the GPU."""
    module = kgen.load(layout, kv)
    fp8 = kv in FP8_DTYPES
    spec = SPECS[layout]
    problem = make_case(spec, [40, 0, 25], [3, 1, 5], 8, kv_dtype=kv, k_scale=0.6 if fp8 else 1.0,
                        v_scale=1.7 if fp8 else 1.0, device="cuda", seed=31)
    reference = problem.reference(torch.float64)
    bound = tolerance(problem)
    absorbed = problem.v_buffer.data_ptr() == problem.k_buffer.data_ptr()
    width = spec.attention.qk_dim
    pools = 1 if absorbed else 2
    wait_for_free_gpu_memory(pools * (1 << 31) * problem.k_buffer.element_size() + (1 << 30))

    paged = to_paged(problem, 64)
    blocks = -(-(1 << 31) // (64 * width)) + paged.k_cache.shape[0]  # the copied blocks start past 2**31
    k_cache, offset = _moved_up(paged.k_cache, blocks)
    assert offset * 64 * width >= 1 << 31
    v_cache = k_cache[..., : spec.attention.v_head_dim] if absorbed else _moved_up(paged.v_cache, blocks)[0]
    paged.k_cache, paged.v_cache, paged.block_table = k_cache, v_cache, paged.block_table + offset
    for index_dtype in INDEX_DTYPES:
        problem.o.fill_(float("nan"))
        args = paged.paged_args(problem, index_dtype)
        assert module.verify_paged_fwd(*args), module.why_not_paged(*args)
        err = relative_error(problem.o, reference)
        assert err <= bound, f"paged, {index_dtype}: relative error {err:.2e} > tolerance {bound:.2e}"
    del paged, k_cache, v_cache, args  # args holds the caches too
    torch.cuda.empty_cache()

    slots = -(-(1 << 31) // width) + problem.k_buffer.shape[0]  # the copied slots start past 2**31
    k_pool, offset = _moved_up(problem.k_buffer, slots)
    assert offset * width >= 1 << 31
    v_pool = k_pool[..., : spec.attention.v_head_dim] if absorbed else _moved_up(problem.v_buffer, slots)[0]
    problem.k_buffer, problem.v_buffer = k_pool, v_pool
    named = problem.kv_indices.long() + offset
    for index_dtype in INDEX_DTYPES:
        problem.kv_indices = named.to(index_dtype)
        problem.o.fill_(float("nan"))
        assert module.verify_shared_kv_fwd(*problem.sglang_args()), module.why_not(*problem.sglang_args())
        err = relative_error(problem.o, reference)
        assert err <= bound, f"token slots, {index_dtype}: relative error {err:.2e} > tolerance {bound:.2e}"


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("layout", ["gqa64", "mla_absorbed_512_64"])
def test_builders_put_nan_wherever_no_request_reads(layout, kv):
    """CPU, no kernel: after poison_unnamed_slots the named slots hold the case's prefix and
    every other slot NaN; to_paged's caches hold the same tokens at the block table's pages
    (shuffled) and NaN at every other position; absorbed MLA's V stays a view of K."""
    prefixes, drafts = request_lengths(5, SMALL_BATCH)
    problem = make_case(SPECS[layout], prefixes, drafts, 8, kv_dtype=kv, seed=1)
    prefix_k = problem.k_buffer[problem.kv_indices.long()].float()
    prefix_v = problem.v_buffer[problem.kv_indices.long()].float()
    absorbed = problem.v_buffer.data_ptr() == problem.k_buffer.data_ptr()
    poison_unnamed_slots(problem)
    named = torch.zeros(problem.k_buffer.shape[0], dtype=torch.bool)
    named[problem.kv_indices.long()] = True
    assert not named[0] and int(named.sum()) == sum(prefixes)
    for pool, prefix in ((problem.k_buffer, prefix_k), (problem.v_buffer, prefix_v)):
        assert torch.equal(pool[problem.kv_indices.long()].float(), prefix)
        assert pool[~named].float().isnan().all()
    assert (problem.v_buffer.data_ptr() == problem.k_buffer.data_ptr()) == absorbed

    for page in PAGE_SIZES.values():
        paged = to_paged(problem, page, seed=page)
        assert (paged.v_cache.data_ptr() == paged.k_cache.data_ptr()) == absorbed
        assert paged.prefix_lens.tolist() == prefixes
        used = torch.zeros(paged.k_cache.shape[:2], dtype=torch.bool)
        for b, prefix_len in enumerate(prefixes):
            first = sum(prefixes[:b])
            for t in range(prefix_len):
                block, offset = int(paged.block_table[b, t // page]), t % page
                used[block, offset] = True
                assert torch.equal(paged.k_cache[block, offset].float(), prefix_k[first + t])
                assert torch.equal(paged.v_cache[block, offset].float(), prefix_v[first + t])
        assert int(used.sum()) == sum(prefixes)
        assert paged.k_cache[~used].float().isnan().all() and paged.v_cache[~used].float().isnan().all()
        blocks = [int(paged.block_table[b, j]) for b, n in enumerate(prefixes) for j in range(-(-n // page))]
        assert blocks != sorted(blocks), "the block table is not shuffled"
