"""The Gluon prefix stage (the Hopper lowering, kgen/templates/gluon/) over its accepted domain;
its masks, paged entry and graph replay for GQA's stage (kgen/templates/gluon_gqa/) too, whose
domain tests/test_gpu_gluon_gqa.py walks.

Run on the H200 (sm_90, Triton 3.6), spread over processes:

    KGEN_TEST_ON_GPU=1 python -m pytest -q -m gpu tests/test_gpu_gluon.py -n 16 --dist loadgroup

Every module with a Gluon prefix stage (absorbed MLA of a KV dtype lowering.json's kv_dtype lists,
16-bit KV with q in its dtype, FP8 with one 16-bit q dtype each, fp8_q_pairs) runs through
``launch`` with a config that carries a ``gluon`` section, so the launcher picks the Gluon
kernel (asserted through ``launch_params``) whatever the shipped table holds:

- groups: each listed group and an unlisted one (1.5 x the largest: several programs a KV head,
  the last one partly padding);
- draft lengths 1..MAX_DRAFT_TOKENS (every L_PAD class the kernel compiles) as a ragged batch
  with an empty prefix, prefixes that are not multiples of a tile and one long enough for
  several splits; kv_indices int32 and int64 at the first group, int64 at the others
  (domain_index_dtypes);
- the Gluon configs the tuner may pick: 64-token tiles with 2 stages, 32-token tiles with 3 and
  4, the lazy rescale on and off (FP8: each tile shape, one config each), all with bf16 KV (FP8:
  e4m3fn); fp16 and e5m2 KV with the first config (dtype_config_pairs);
- NaN in every pool slot no request names, in o before the call and in the split scratch
  (a read of an unwritten partial shows up);
- FP8 pools holding every finite byte of the dtype in every column, and a NaN byte in a named
  slot, which must turn its request's outputs NaN;
- CUDA-graph capture and replay with new data and a kv_indices longer than the batch uses,
  and a pool of more than 2**31 elements;
- the paged entry (``verify_paged_fwd``): pages of 1 to 256 tokens in a shuffled cache whose
  unused positions are NaN, block tables int32 and int64, chains and trees as the entry's mask
  rows.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from case_tools import poison_unnamed_slots, set_draft_masks, to_paged
from kernel_cases import LARGE_POOL_GROUP, SPECS, tolerance, wait_for_free_gpu_memory
from test_gpu_sweep import NUM_SMS, request_lengths, unlisted_group

import kgen
from kgen.passes.select_lowering import second_lowerings
from kgen.problems import chain_mask, eagle_tree, make_case, sglang_mask
from kgen.reference import relative_error
from kgen.spec import FP8_DTYPES

LAYOUT = "mla_absorbed_512_64"
# The KV dtypes the stage serves (lowering.json's kv_dtype): a dtype added there runs here. A
# 16-bit pool takes queries in its own dtype (select_lowering); an FP8 one either 16-bit dtype
# (run in pairs, fp8_q_pairs).
SERVED_KV = second_lowerings()["gluon_prefix"]["requires"]["kv_dtype"]
KV16 = [kv for kv in SERVED_KV if kv not in FP8_DTYPES]
FP8_KV = [kv for kv in SERVED_KV if kv in FP8_DTYPES]
INDEX_DTYPES = (torch.int32, torch.int64)
GLUON_CONFIGS = {
    "n64s2": {"block_n": 64, "num_stages": 2, "lazy_rescale": False},
    "n64s2lazy": {"block_n": 64, "num_stages": 2, "lazy_rescale": True},
    "n32s3": {"block_n": 32, "num_stages": 3, "lazy_rescale": False},
    "n32s4lazy": {"block_n": 32, "num_stages": 4, "lazy_rescale": True},
}
BATCH = 4
# The masks, paged-entry and graph-replay tests run both Gluon packages: absorbed MLA's
# (kgen/templates/gluon/) and GQA's (kgen/templates/gluon_gqa/, at each layout's largest listed
# group; tests/test_gpu_gluon_gqa.py walks its domain).
GQA_LAYOUTS = [name for name, spec in SPECS.items() if spec.attention.kind == "gqa"]
GQA_GROUPS = [(layout, max(SPECS[layout].attention.group_sizes)) for layout in GQA_LAYOUTS]


def gluon_config(module, gluon: dict, max_splits: int = 64, min_tokens: int = 64) -> dict:
    """The module's default Triton config with a gluon section: small splits, so that short
    test prefixes still cut into several."""
    split = {"programs_per_sm": 1, "max_splits": max_splits, "min_tokens_per_split": min_tokens}
    return {**module.LAUNCHER.default_config, "gluon": {**gluon, "split": split}}


def _groups() -> list[int]:
    groups = list(SPECS[LAYOUT].attention.group_sizes)
    return [*groups, unlisted_group(tuple(groups))]


def dtype_config_pairs(dtypes: list, configs: list[str]) -> list[tuple]:
    """Every config with the first dtype; each further dtype with the first config. The tile
    config (tile tokens, stages, lazy rescale) and the dtype are separate code in the stage (the
    ring and the softmax loop against the producer's loads and the dots' operand types), and each
    domain walk compiles every draft class: the product would put the gpu-marked suite past one
    10-minute device call."""
    return [(dtypes[0], c) for c in configs] + [(d, configs[0]) for d in dtypes[1:]]


def fp8_q_pairs(fp8_kv: list[str]) -> list[tuple[str, str]]:
    """Each FP8 KV dtype with one 16-bit q dtype, the q dtypes taken in turn: every FP8 kind and
    every q dtype runs. The pairs, not the product: the producer's conversion depends on the KV
    dtype alone and the q load on the q dtype alone (both feed the fp16 stage), and each domain
    walk compiles every draft class, so the product would double the suite's GPU time."""
    q_dtypes = ("bfloat16", "float16")
    return [(kv, q_dtypes[i % len(q_dtypes)]) for i, kv in enumerate(fp8_kv)]


def _poison_scratch(module) -> None:
    for partial_o, partial_lse in module.LAUNCHER.scratch.values():
        partial_o.fill_(float("nan"))
        partial_lse.fill_(float("nan"))


def _assert_gluon(module, config: dict, group: int, batch: int, draft: int, page_size: int | None = None,
                  has_mask: bool = False) -> None:
    launches = module.launch_params("sm_90", NUM_SMS, group, batch, draft, page_size, config, has_mask=has_mask)
    assert launches and launches[0][0] == "_gluon_prefix_stage", launches
    assert launches[0][1]["BLOCK_TABLE"] is (page_size is not None), launches[0]


def domain_index_dtypes(group: int, groups: list[int]) -> tuple[torch.dtype, ...]:
    """The kv_indices dtypes of a domain walk at ``group``: both at the walk's first group, int64
    (what SGLang sends) at the others. The dtype changes the producer's table reads alone, which
    no group changes, and each one compiles every draft class again (the gpu-marked suite must fit
    one 10-minute device call)."""
    return INDEX_DTYPES if group == groups[0] else (torch.int64,)


def _check_each_index_dtype(module, problem, config: dict, where: str,
                            index_dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES) -> None:
    """Launch the case with each kv_indices dtype into NaN-filled outputs and scratch; each
    output within the case's tolerance of the float64 reference."""
    reference = problem.reference(torch.float64)
    bound = tolerance(problem)
    for index_dtype in index_dtypes:
        problem.kv_indices = problem.kv_indices.to(index_dtype)
        problem.o.fill_(float("nan"))
        _poison_scratch(module)
        module.launch(*problem.launch_args(), config=config)
        err = relative_error(problem.o, reference)
        assert err <= bound, f"{where}, {index_dtype}: relative error {err:.2e} > {bound:.2e}"


def check_domain(module, layout: str, group: int, gluon: dict, q_dtype: str, kv_dtype: str, seed: str,
                 index_dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES, **scales: float) -> None:
    """Every draft length to the key tile as a ragged batch (an empty prefix, prefixes that are
    no multiple of a tile, one long enough for several 64-token splits), in several splits and
    in one, NaN in every slot no request names, with each of ``index_dtypes``: the Gluon stage
    launched, within tolerance."""
    for splits in (64, 1):
        config = gluon_config(module, gluon, max_splits=splits)
        for draft in range(1, min(module.MAX_DRAFT_TOKENS, gluon["block_n"]) + 1):
            prefixes, drafts = request_lengths(draft, BATCH)
            prefixes = [p * 7 for p in prefixes]  # 2100 tokens: several 64-token splits
            problem = make_case(SPECS[layout], prefixes, drafts, group, q_dtype=q_dtype, kv_dtype=kv_dtype,
                                device="cuda", seed=zlib.crc32(f"{seed}/{draft}".encode()), **scales)
            poison_unnamed_slots(problem)  # FP8 NaN too: a producer that reads past its request writes NaN
            _assert_gluon(module, config, group, BATCH, problem.max_len_extend)
            _check_each_index_dtype(module, problem, config, f"L {draft}, splits {splits}, prefixes {prefixes}, "
                                                             f"drafts {drafts}", index_dtypes)


@pytest.mark.gpu
@pytest.mark.parametrize("group", _groups())
@pytest.mark.parametrize(("kv_dtype", "config_name"), dtype_config_pairs(KV16, list(GLUON_CONFIGS)))
def test_gluon_domain(kv_dtype, config_name, group):
    module = kgen.load(LAYOUT, kv_dtype, kv_dtype)
    check_domain(module, LAYOUT, group, GLUON_CONFIGS[config_name], kv_dtype, kv_dtype,
                 f"{kv_dtype}/{group}/{config_name}", domain_index_dtypes(group, _groups()))


@pytest.mark.gpu
@pytest.mark.parametrize("group", _groups())
@pytest.mark.parametrize(("kv_dtype", "q_dtype", "config_name"),
                         [(kv, q, c) for (kv, q), c in dtype_config_pairs(fp8_q_pairs(FP8_KV),
                                                                         ["n64s2", "n32s3", "n32s4lazy"])])
def test_gluon_fp8_domain(kv_dtype, q_dtype, config_name, group):
    """FP8 KV through the converting producer (fp16 stages, q scaled by K's descale), at the
    tile shapes the tuner may pick (a 64-token tile's rows, or a 32-token tile's, in the
    producer's registers): every draft length to the tile, several splits and one, non-unit
    scales, both index dtypes."""
    module = kgen.load(LAYOUT, kv_dtype, q_dtype)
    check_domain(module, LAYOUT, group, GLUON_CONFIGS[config_name], q_dtype, kv_dtype,
                 f"fp8/{q_dtype}/{group}/{config_name}", domain_index_dtypes(group, _groups()), k_scale=0.75,
                 v_scale=1.25)


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["n64s2", "n32s4lazy"])
@pytest.mark.parametrize(("layout", "group"), [(LAYOUT, 16), *GQA_GROUPS])
def test_gluon_graph_replay_with_oversized_indices(layout, group, config_name):
    """Capture once, replay on new data of the same shapes: kv_indices longer than the batch
    uses (its tail names NaN slots), new prefix lengths in kv_indptr."""
    module = kgen.load(layout, "bfloat16")
    config = gluon_config(module, GLUON_CONFIGS[config_name])
    spec = SPECS[layout]

    def problem(seed: int, prefixes: list[int]):
        case = make_case(spec, prefixes, [4, 1, 3, 2], group, device="cuda", seed=seed, index_dtype=torch.int64,
                         spare_slots=600)
        poison_unnamed_slots(case)
        spare = torch.randperm(case.k_buffer.shape[0], device="cuda")[:512].to(torch.int64)
        case.kv_indices = torch.cat([case.kv_indices, spare])  # the oversized tail no request uses
        return case

    static = problem(1, [900, 0, 333, 64])
    _assert_gluon(module, config, group, 4, static.max_len_extend)
    module.launch(*static.launch_args(), config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.launch(*static.launch_args(), config=config)
    for seed, prefixes in ((2, [900, 0, 333, 64]), (3, [100, 797, 0, 400])):  # the same total: same shapes
        new = problem(seed, prefixes)
        # MLA's V is a view of K (copied with it); GQA's has buffers of its own.
        for name in ("q", "k_extend", "v_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr", "kv_indices"):
            getattr(static, name).copy_(getattr(new, name))
        static.o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(static.o, new.reference(torch.float64))
        assert err <= tolerance(new), f"replay with prefixes {prefixes}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.xdist_group(LARGE_POOL_GROUP)
def test_gluon_pool_past_2_pow_31_elements():
    """Every named slot lies past element 2**31 of the pool: slot x stride must be int64."""
    module = kgen.load(LAYOUT, "bfloat16")
    config = gluon_config(module, GLUON_CONFIGS["n64s2"])
    spec = SPECS[LAYOUT]
    problem = make_case(spec, [400, 0, 130], [3, 1, 4], 16, device="cuda", seed=31)
    reference = problem.reference(torch.float64)
    width = spec.attention.qk_dim
    wait_for_free_gpu_memory((1 << 31) * problem.k_buffer.element_size() + (1 << 30))  # one pool: V is K's view
    slots = -(-(1 << 31) // width) + problem.k_buffer.shape[0]
    big = torch.full((slots, *problem.k_buffer.shape[1:]), float("nan"), dtype=problem.k_buffer.dtype, device="cuda")
    offset = slots - problem.k_buffer.shape[0]
    big[offset:].copy_(problem.k_buffer)
    assert offset * width >= 1 << 31
    problem.k_buffer, problem.v_buffer = big, big[..., : spec.attention.v_head_dim]
    named = problem.kv_indices.long() + offset
    _assert_gluon(module, config, 16, 3, problem.max_len_extend)
    for index_dtype in INDEX_DTYPES:
        problem.kv_indices = named.to(index_dtype)
        problem.o.fill_(float("nan"))
        module.launch(*problem.launch_args(), config=config)
        err = relative_error(problem.o, reference)
        assert err <= tolerance(problem), f"{index_dtype}: relative error {err:.2e}"


def _draft_masks(kind: str, drafts: list[int], seed: int) -> list[torch.Tensor]:
    """Per-request [L, L] masks: EAGLE trees, random bits (no tree; a row may see nothing), or
    the chain written as a mask."""
    if kind == "tree":
        return [eagle_tree(n, seed=seed + i) for i, n in enumerate(drafts)]
    if kind == "random":
        gen = torch.Generator().manual_seed(seed)
        return [torch.rand(n, n, generator=gen) < 0.5 for n in drafts]
    return [chain_mask(n) for n in drafts]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tree", "random", "chain"])
@pytest.mark.parametrize(("layout", "group"), [(LAYOUT, 16), (LAYOUT, 128),
                                               (LAYOUT, unlisted_group(tuple(SPECS[LAYOUT].attention.group_sizes))),
                                               *GQA_GROUPS])
def test_gluon_masks(layout, group, kind):
    """A custom mask (SGLang's [L, P + L] layout, 1-filled gaps between blocks) in the Gluon
    stage's draft tile: trees, masks that are no tree (rows that see nothing, with an empty
    prefix: zeros) and the chain as a mask, for every draft class up to the 64-token tile."""
    module = kgen.load(layout, "bfloat16")
    config = gluon_config(module, GLUON_CONFIGS["n64s2"])
    for draft in (1, 3, 4, 7, 8, 13, 16, 31, 32, 45, 64):
        prefixes = [700, 0, 130, 64]
        drafts = [draft, max(1, draft - 2), max(1, draft // 2), 1]
        problem = make_case(SPECS[layout], prefixes, drafts, group, device="cuda",
                            seed=zlib.crc32(f"mask/{group}/{kind}/{draft}".encode()))
        poison_unnamed_slots(problem)
        masks = _draft_masks(kind, drafts, seed=draft)
        problem.custom_mask, problem.mask_indptr = sglang_mask(masks, prefixes, gap=5, device="cuda")
        reference = problem.reference(torch.float64)
        launches = module.launch_params("sm_90", NUM_SMS, group, 4, problem.max_len_extend, None, config,
                                        has_mask=True)
        assert launches[0][0] == "_gluon_prefix_stage" and launches[0][1]["HAS_MASK"], launches[0]
        for index_dtype in INDEX_DTYPES:
            problem.kv_indices = problem.kv_indices.to(index_dtype)
            problem.o.fill_(float("nan"))
            _poison_scratch(module)
            module.launch(*problem.launch_args(), config=config, **problem.mask_kwargs())
            err = relative_error(problem.o, reference)
            assert err <= tolerance(problem), f"{kind} L {draft} {index_dtype}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("config_name", ["n64s2", "n32s4lazy"])
@pytest.mark.parametrize(("layout", "group"), [(LAYOUT, 16), (LAYOUT, 128), *GQA_GROUPS])
def test_gluon_paged_entry(layout, group, config_name, kind):
    """The paged entry in the Gluon stage: the producer finds each token's page in the request's
    block-table row and its row in the page. Pages smaller than a key tile (1, 16), as large
    (64 at 64-token tiles) and larger (256); prefixes that end inside a page, an empty one;
    several splits; a tree reads the entry's [rows, W] mask."""
    module = kgen.load(layout, "bfloat16")
    gluon = GLUON_CONFIGS[config_name]
    config = gluon_config(module, gluon, min_tokens=128)
    for draft in (1, 4, 8, 16, 32):
        prefixes, drafts = request_lengths(draft, BATCH)
        prefixes = [p * 7 for p in prefixes]
        problem = make_case(SPECS[layout], prefixes, drafts, group, device="cuda",
                            seed=zlib.crc32(f"paged/{group}/{config_name}/{kind}/{draft}".encode()))
        if kind == "tree":
            set_draft_masks(problem, [eagle_tree(n, seed=draft + i) for i, n in enumerate(drafts)])
        reference = problem.reference(torch.float64)
        for page_size in (1, 16, 64, 256):
            _assert_gluon(module, config, group, BATCH, problem.max_len_extend, page_size, kind == "tree")
            paged = to_paged(problem, page_size, seed=page_size)
            for index_dtype in INDEX_DTYPES:
                problem.o.fill_(float("nan"))
                _poison_scratch(module)
                args = paged.paged_args(problem, index_dtype)
                assert module.verify_paged_fwd(*args, config=config), module.why_not_paged(*args)
                err = relative_error(problem.o, reference)
                where = f"{kind} L {draft}, page {page_size}, {index_dtype}, prefixes {prefixes}, drafts {drafts}"
                assert err <= tolerance(problem), f"{where}: relative error {err:.2e}"


# The FP8 converter is exact on every byte: every finite byte of the dtype in every column
# chunk (the converter writes the latent's blocks 0-3, 4-7 and the PE at different points of its
# tile), at a scale that keeps the largest byte's value near 1; and one NaN byte in each chunk's
# range makes every output of its request NaN and leaves the other requests exact (a conversion
# that maps NaN to a finite value, as a bit trick can, would return a wrong answer instead).
FP8_FINITE_SCALE = {"float8_e4m3fn": 2.0**-8, "float8_e5m2": 2.0**-15}
FP8_NAN_BYTE = 0x7F  # NaN in e4m3fn and in e5m2
NAN_COLUMNS = (5, 200, 300, 511, 530)  # latent chunks 0, 3, 4, 7 and the PE


def _every_finite_byte_case(kv_dtype: str):
    """A three-request case whose named slots hold every finite byte of kv_dtype in every column."""
    scale = FP8_FINITE_SCALE[kv_dtype]
    problem = make_case(SPECS[LAYOUT], [300, 200, 129], [4, 2, 3], 16, q_dtype="bfloat16", kv_dtype=kv_dtype,
                        device="cuda", seed=zlib.crc32(f"every-byte/{kv_dtype}".encode()), k_scale=scale,
                        v_scale=scale)
    codes = torch.arange(256, device="cuda", dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(getattr(torch, kv_dtype)).float())]
    named = problem.kv_indices.long()
    width = problem.k_buffer.shape[-1]
    position = torch.arange(named.numel(), device="cuda")[:, None] * 7 + torch.arange(width, device="cuda")[None]
    problem.k_buffer.view(torch.uint8)[named, 0] = finite[position % finite.numel()]
    return problem, finite


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8_KV)
def test_gluon_fp8_every_byte_and_nan(kv_dtype):
    """Every finite byte through the converting producer within tolerance; a NaN byte in chunk 0,
    3, 4 or 7 of the latent or in the PE turns its request's outputs NaN and no other's."""
    module = kgen.load(LAYOUT, kv_dtype, "bfloat16")
    config = gluon_config(module, GLUON_CONFIGS["n64s2"])
    problem, finite = _every_finite_byte_case(kv_dtype)
    assert finite.numel() >= 240  # the case holds the dtype's finite range, not a slice of it
    _assert_gluon(module, config, 16, 3, problem.max_len_extend)
    _check_each_index_dtype(module, problem, config, f"{kv_dtype}, every finite byte", (torch.int64,))
    rows = problem.qo_indptr.tolist()
    others = torch.cat([torch.arange(rows[0], rows[1]), torch.arange(rows[2], rows[3])]).cuda()
    slot = int(problem.kv_indices[problem.kv_indptr[1] + 57])  # request 1's token 57
    pool = problem.k_buffer.view(torch.uint8)
    reference, bound = problem.reference(torch.float64), tolerance(problem)  # of the pool without NaN
    for column in NAN_COLUMNS:
        kept = int(pool[slot, 0, column])
        pool[slot, 0, column] = FP8_NAN_BYTE
        problem.o.fill_(0.0)
        module.launch(*problem.launch_args(), config=config)
        pool[slot, 0, column] = kept
        hit = problem.o[rows[1]:rows[2]]
        assert torch.isnan(hit).all(), f"{kv_dtype}, NaN at column {column}: {int((~torch.isnan(hit)).sum())} " \
                                       f"outputs of its request are not NaN"
        err = relative_error(problem.o[others], reference[others])
        assert err <= bound, f"{kv_dtype}, NaN at column {column}: the other requests' error {err:.2e}"
