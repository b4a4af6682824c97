"""Generated kernels against the float64 reference, in Triton's interpreter (CPU).

Scratch buffers start as NaN (cached per shape, so a merge that read a split nobody wrote
would produce NaN), outputs start as NaN (every valid element must be written), page
tables are shuffled, and sizes are small enough for the interpreter.
"""

import pytest
import torch
from case_tools import patch_identity, patch_kernels
from kernel_cases import SMALL_SPLITS, build, check_parity
from triton.runtime.errors import InterpreterError

import kgen
from kgen.launcher.device import INTERPRETER_NUM_SMS

GQA = "qwen3_5_gqa256"
MLA = "mla_absorbed_512_64"


def _poison_scratch(module):
    for partial_o, partial_lse in module.LAUNCHER.scratch.values():
        partial_o.fill_(float("nan"))
        partial_lse.fill_(float("nan"))


@pytest.mark.parametrize("group", [4, 8, 16, 6])
@pytest.mark.parametrize("draft", [1, 2, 3, 4])
def test_gqa_groups_and_draft_widths(group, draft):
    case = build(GQA, [37, 70], [draft, draft], group, seed=group * 10 + draft)
    check_parity(case, GQA, "bfloat16")


@pytest.mark.parametrize("draft", [1, 4, 7])
def test_the_sm90_batch_one_row_matches_the_reference(draft):
    """GQA 256 group 16's batch-1 row on sm_90 (four heads a program: 16 rows on mma.sync for a
    short draft), in the interpreter for one request, over one split and over several."""
    config = dict(kgen.load(GQA, "bfloat16").select_config("sm_90", 16, 1))
    assert config["block_h"] == 4
    for split in (config["split"], {"programs_per_sm": 4, "min_tokens_per_split": 16}):
        case = build(GQA, [300], [draft], 16, seed=draft)
        check_parity(case, GQA, "bfloat16", config={**config, "split": split})


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"])
def test_fp8_kv_with_scales(kv):
    case = build(GQA, [45, 90], [4, 2], 8, kv_dtype=kv, k_scale=0.37, v_scale=1.9, seed=3)
    try:
        check_parity(case, GQA, kv)
    except InterpreterError as exc:
        # Triton 3.6's interpreter has no fp8e4b8 (e4m3fnuz) type; the ROCm compiler does.
        if "fp8e4b8" not in str(exc):
            raise
        pytest.skip("Triton's interpreter cannot convert e4m3fnuz (fp8e4b8); runs on ROCm only")


@pytest.mark.parametrize("kv", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_scales_as_device_tensors(kv):
    case = build(GQA, [33], [3], 4, kv_dtype=kv, k_scale=0.5, v_scale=2.0, seed=4)
    case.k_scale, case.v_scale = torch.tensor([0.5]), torch.tensor([2.0])
    check_parity(case, GQA, kv)


@pytest.mark.parametrize("group", [16, 8])
@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_mla_absorbed(group, kv):
    scales = {"k_scale": 0.8, "v_scale": 1.25} if kv != "bfloat16" else {}
    case = build(MLA, [50, 17, 0], [4, 1, 3], group, kv_dtype=kv, seed=group, **scales)
    check_parity(case, MLA, kv)


def test_mla_widths_that_need_padding():
    # L = 3 pads to 4 draft rows; BLOCK_H 16 x 4 rows; group 6 pads heads to 8.
    case = build(MLA, [29], [3], 6, seed=11)
    check_parity(case, MLA, "bfloat16")


def test_fp16_queries():
    case = build("gqa128", [40, 3], [2, 4], 8, q_dtype="float16", seed=5)
    check_parity(case, "gqa128", "bfloat16", q_dtype="float16")


@pytest.mark.parametrize(("layout", "group", "q"), [("gqa128", 8, "float16"), ("gqa64", 4, "bfloat16"),
                                                    (GQA, 16, "float16"), (MLA, 16, "float16")])
def test_fp16_kv(layout, group, q):
    """An fp16 pool (a float16 model's cache, e.g. an AWQ model's), with its own queries and with
    bf16 ones, over several splits."""
    case = build(layout, [70, 0, 33], [4, 2, 3], group, kv_dtype="float16", q_dtype=q, seed=group)
    check_parity(case, layout, "float16", q_dtype=q)
    case.o.fill_(float("nan"))
    check_parity(case, layout, "float16", q_dtype=q, config={**SMALL_SPLITS, "block_h": min(group, 8)})


def test_ragged_prefixes_not_multiples_of_block_n_and_empty_prefix():
    case = build(GQA, [0, 1, 63, 65, 130], [2, 4, 1, 3, 4], 8, seed=6)
    check_parity(case, GQA, "bfloat16", config=SMALL_SPLITS)


@pytest.mark.parametrize(("layout", "kv", "group"), [
    (GQA, "float8_e4m3fn", 8), (MLA, "bfloat16", 16), (MLA, "float8_e4m3fn", 8), ("gqa128", "bfloat16", 4),
])
def test_many_splits_draft_tile_in_the_last_split(layout, kv, group):
    """Several splits per request: the last one also runs the draft tile (and, for FP8, mixes
    descaled prefix with unscaled draft values); the merge combines them."""
    scales = {"k_scale": 0.6, "v_scale": 1.7} if kv != "bfloat16" else {}
    case = build(layout, [70, 0, 33], [4, 2, 3], group, kv_dtype=kv, seed=group + 31, **scales)
    check_parity(case, layout, kv, config=SMALL_SPLITS)


def test_two_kv_heads_and_int64_indices():
    case = build("gqa128", [33, 80], [4, 3], 4, num_kv_heads=2, index_dtype=torch.int64, seed=7)
    check_parity(case, "gqa128", "bfloat16")


def test_unshuffled_and_shuffled_tables_agree():
    a = build("gqa64", [50], [3], 8, shuffle=False, seed=8)
    b = build("gqa64", [50], [3], 8, shuffle=True, seed=8)
    assert not torch.equal(a.kv_indices, b.kv_indices)
    check_parity(a, "gqa64", "bfloat16")
    check_parity(b, "gqa64", "bfloat16")


def test_empty_splits_are_never_read():
    """Short prefixes next to a long one: the grid has splits the short ones never write."""
    module = kgen.load(GQA, "bfloat16")
    case = build(GQA, [200, 5, 0, 17], [4, 4, 2, 1], 4, seed=9)
    module.launch(*case.launch_args(), config=SMALL_SPLITS)  # allocate the scratch for this shape
    _poison_scratch(module)
    case.o.fill_(float("nan"))
    check_parity(case, GQA, "bfloat16", config=SMALL_SPLITS)


@pytest.mark.parametrize("layout", [GQA, MLA])
def test_merge_combines_more_splits_than_one_chunk(layout):
    """A request with 10 splits: the merge loads MERGE_SPLIT_CHUNK (8) of them as one block,
    then the last 2 in a second, partly masked chunk, combined online."""
    module = kgen.load(layout, "bfloat16")
    config = {**SMALL_SPLITS, "split": {"programs_per_sm": 8, "max_splits": 16, "min_tokens_per_split": 16}}
    # Interpreter: 4 SMs x 8 programs / 3 requests = 10 splits; 300 tokens in splits of 32.
    assert module.LAUNCHER.max_splits(config, 3, INTERPRETER_NUM_SMS) == (10, 16)
    assert module.MERGE_SPLIT_CHUNK == 8
    case = build(layout, [300, 5, 0], [4, 2, 3], 8, seed=12)
    module.launch(*case.launch_args(), config=config)  # allocate the scratch for this shape
    _poison_scratch(module)
    case.o.fill_(float("nan"))
    check_parity(case, layout, "bfloat16", config=config)


def _poison_unnamed_slots(case) -> None:
    """NaN in every pool slot the page table does not name, slot 0 among them (a masked
    index load's `other=0` would land there)."""
    nan_slot = torch.full_like(case.k_buffer[:1], float("nan"))
    k_pool = torch.cat([nan_slot, case.k_buffer])
    unnamed = torch.ones(k_pool.shape[0], dtype=torch.bool)
    case.kv_indices = case.kv_indices + 1
    unnamed[case.kv_indices.long()] = False
    k_pool[unnamed] = float("nan")
    if case.v_buffer.data_ptr() == case.k_buffer.data_ptr():  # absorbed MLA: V is K's latent part
        v_pool = k_pool[..., : case.v_buffer.shape[-1]]
    else:
        v_pool = torch.cat([torch.full_like(case.v_buffer[:1], float("nan")), case.v_buffer])
        v_pool[unnamed] = float("nan")
    case.k_buffer, case.v_buffer = k_pool, v_pool


@pytest.mark.parametrize(("layout", "group", "config"), [
    (GQA, 8, None), (GQA, 4, SMALL_SPLITS), (MLA, 16, None), (MLA, 8, SMALL_SPLITS),
])
def test_partial_tiles_read_only_named_slots(layout, group, config):
    """A split's last, partial tile gathers clamped token indices (its last token again), never
    a slot outside the request: NaN there would reach o through P.V (0 x NaN = NaN)."""
    case = build(layout, [37, 1, 70, 0], [4, 3, 1, 2], group, seed=group + 50)
    _poison_unnamed_slots(case)
    check_parity(case, layout, "bfloat16", config=config)
    assert torch.isfinite(case.o.float()).all()


def test_per_head_variant_matches_too():
    case = build(GQA, [40, 21], [4, 2], 4, seed=10)
    check_parity(case, GQA, "bfloat16", variant="per_head")


def test_draft_rows_of_other_requests_are_untouched():
    """o rows of a request are written only by that request (row masks are per request)."""
    case = build("gqa64", [10, 20], [1, 4], 8, seed=12)
    check_parity(case, "gqa64", "bfloat16")
    assert torch.isfinite(case.o.float()).all()


def test_graph_safety_no_host_sync(monkeypatch):
    """The launcher never converts a tensor to Python (that would sync under a CUDA graph)."""
    module = kgen.load("gqa64", "bfloat16")
    case = build("gqa64", [30, 9], [2, 3], 8, seed=13)
    module.verify_shared_kv_fwd(*case.sglang_args())  # warm caches

    def boom(*a, **k):
        raise AssertionError("host sync in the launcher")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    # The interpreter itself converts tensors, so check the host side only: why_not and the
    # config/scratch/grid computation, then restore before the kernels run.
    args = case.sglang_args()
    assert module.why_not(*args) == ""
    arch, sms, is_rocm = module.LAUNCHER.device_info(case.q.device.type, case.q.device.index)
    module.LAUNCHER.launch_setup(arch, sms, 8, 2, case.max_len_extend, None, None)
    module.LAUNCHER.scratch_buffers(case.q.device, case.q.shape[0], case.q.shape[1], 4)


@pytest.mark.parametrize("l_pad", [1, 2, 4, 8, 16])
def test_merge_rows_are_a_power_of_two(l_pad):
    """tl.arange needs a power of two: the interpreter does not check it, the GPU compiler does."""
    module = kgen.load(GQA, "bfloat16")
    heads = module.LAUNCHER.merge_heads(l_pad)
    rows = heads * l_pad
    assert heads >= 1 and rows & (rows - 1) == 0
    assert rows <= max(module.MERGE_ROWS, l_pad)


def test_make_case_rejects_negative_prefix_and_empty_draft():
    # A negative length would hand the kernel bounds that index outside the pool (the GPU
    # reports an illegal address far from the cause), so the case builder refuses it.
    from kernel_cases import SPECS

    from kgen.problems import make_case

    spec = SPECS[GQA]
    with pytest.raises(ValueError, match="prefix lengths must be >= 0"):
        make_case(spec, [5, -3], [1, 1], 4)
    with pytest.raises(ValueError, match="draft lengths >= 1"):
        make_case(spec, [5, 3], [1, 0], 4)


ONE_SPLIT = {"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 1,
             "split": {"programs_per_sm": 1, "max_splits": 1, "min_tokens_per_split": 16}}


def _ramp_keys(case, prefix):
    """Scale each request's prefix keys by 1 -> 5 along the sequence, so a row's running max
    grows by more than 2**8 between tiles (the lazy rescale's threshold) at least once."""
    scale = torch.cat([torch.linspace(1.0, 5.0, n) for n in prefix])
    slots = case.kv_indices.long()
    pool = case.k_buffer.float()
    pool[slots] *= scale[:, None, None]
    case.k_buffer.copy_(pool.to(case.k_buffer.dtype))
    # The claim above, checked on the reference's scores (log2 domain), so the test cannot
    # quietly stop exercising the rescale branch.
    d = case.q.shape[-1]
    sm = case.sm_scale if case.sm_scale is not None else d ** -0.5
    start = 0
    grew = False
    for b, n in enumerate(prefix):
        keys = pool[slots[start:start + n], 0].double() * case.k_scale
        rows = case.q[case.qo_indptr[b]:case.qo_indptr[b + 1]].double()
        scores = torch.einsum("thd,nd->thn", rows, keys) * sm * 1.4426950408889634
        first = scores[..., :16].amax(-1)
        grew |= bool(((scores.amax(-1) - first) > 8).any())
        start += n
    assert grew, "the ramp never moved a running max past the lazy threshold"


@pytest.mark.parametrize(("layout", "kv"), [(GQA, "bfloat16"), (GQA, "float8_e4m3fn"), (MLA, "bfloat16"),
                                            (MLA, "float8_e4m3fn")])
@pytest.mark.parametrize("ramp", [True, False])
@pytest.mark.parametrize("config", [ONE_SPLIT, SMALL_SPLITS], ids=["one_split", "small_splits"])
def test_lazy_rescale_matches_the_reference(layout, kv, ramp, config):
    prefix = [90, 47]
    fp8 = kv != "bfloat16"
    case = build(layout, prefix, [4, 3], 16, kv_dtype=kv, k_scale=0.6 if fp8 else 1.0, v_scale=1.7 if fp8 else 1.0,
                 seed=11)
    if ramp:
        _ramp_keys(case, prefix)
    check_parity(case, layout, kv, config={**config, "lazy_rescale": True})


@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("draft_first_rows", [(), (16, 32, 64)])
def test_gqa_draft_tile_before_and_after_the_loop(monkeypatch, kv, draft_first_rows):
    """Both placements of GQA's draft tile (the launcher picks one by rows), for 64-row
    programs (group 16 at L4) and 16-row ones (group 4 at L3)."""
    module = kgen.load(GQA, kv)
    patch_identity(monkeypatch, module, draft_first_rows=draft_first_rows)
    scales = {"k_scale": 0.37, "v_scale": 1.9} if kv != "bfloat16" else {}
    for group, draft in ((16, 4), (4, 3)):
        case = build(GQA, [70, 0, 33], [draft, 2, draft], group, kv_dtype=kv, seed=group + draft, **scales)
        check_parity(case, GQA, kv, config={**SMALL_SPLITS, "block_h": group})


@pytest.mark.parametrize("placement", ["first", "after"])
def test_a_configs_draft_tile_overrides_the_row_rule(monkeypatch, placement):
    """BlockConfig.draft_tile picks the placement whatever the rows: the row rule is set to
    the opposite for every row count, and the launch still takes the config's."""
    module = kgen.load(GQA, "bfloat16")
    patch_identity(monkeypatch, module, draft_first_rows=() if placement == "first" else (16, 32, 64))
    config = {**SMALL_SPLITS, "block_h": 8, "draft_tile": placement}
    assert module.LAUNCHER.draft_first(config, 32) is (placement == "first")
    assert module.LAUNCHER.draft_first({**config, "draft_tile": None}, 32) is (placement != "first")
    seen = []
    real = module.LAUNCHER.kernels.prefix

    class Spy:  # records the DRAFT_FIRST each launch compiles with
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["DRAFT_FIRST"])
                return real[grid](*args, **kwargs)
            return launch

    patch_kernels(monkeypatch, module, prefix=Spy())
    case = build(GQA, [70, 0, 33], [4, 2, 4], 8, seed=41)
    check_parity(case, GQA, "bfloat16", config=config)
    assert seen and set(seen) == {placement == "first"}
