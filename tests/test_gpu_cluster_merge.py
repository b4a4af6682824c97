"""The merge in a thread-block cluster, on a GPU with clusters (sm_90+): the Triton prefix stage
launched as clusters of a head block's splits merges their partials itself, in one launch.

Every case first asserts that its call launches clustered (CLUSTER_SPLITS > 1 and no merge
launch), so a change in the launch rules cannot turn these into tests of the merge launch.

Run on a GPU machine: KGEN_TEST_ON_GPU=1 pytest -m gpu tests/test_gpu_cluster_merge.py
"""

import pytest
import torch
from case_tools import set_draft_masks, to_paged
from kernel_cases import SPECS, tolerance

import kgen
from kgen.launcher.device import device_info
from kgen.launcher.launches import PREFIX_KERNEL
from kgen.problems import eagle_tree, make_case
from kgen.reference import relative_error

pytestmark = pytest.mark.gpu

GQA256, GQA128, GQA64, MLA = "qwen3_5_gqa256", "gqa128", "gqa64", "mla_absorbed_512_64"


def split_config(splits: int, block_h: int = 16, block_n: int = 64, min_tokens: int = 64) -> dict:
    """A Triton-stage config whose grid has exactly ``splits`` splits on any GPU of at least 16
    programs' worth of multiprocessors (max_splits caps it), merged in a cluster."""
    return {"block_h": block_h, "block_n": block_n, "num_warps": 4, "num_stages": 2,
            "split": {"programs_per_sm": 64, "max_splits": splits, "min_tokens_per_split": min_tokens,
                      "merge": "cluster"}}


def clustered_launch(module, case, config, page_size=None) -> int:
    """The call's cluster size, asserting it launches clustered: one launch, no merge stage."""
    arch, num_sms, _ = device_info("cuda", torch.cuda.current_device())
    group = case.q.shape[1] // case.k_extend.shape[1]
    launches = module.launch_params(arch, num_sms, group, len(case.prefix_lens()), case.max_len_extend,
                                    page_size, config, case.k_extend.shape[1], case.custom_mask is not None)
    assert [name for name, _, _ in launches] == [PREFIX_KERNEL], launches
    cluster = launches[0][1]["CLUSTER_SPLITS"]
    assert cluster > 1, launches
    return cluster


def assert_parity(case, what: str) -> None:
    err, tol = relative_error(case.o, case.reference(torch.float64)), tolerance(case)
    assert err <= tol, f"{what}: relative error {err:.2e} > tolerance {tol:.2e}"


def ragged(batch: int, prefix: int, seed: int) -> list[int]:
    """Prefix lengths below ``prefix``, one empty and one shorter than a split where the batch
    allows: requests of one call write 1 split, fewer splits than the cluster, or all."""
    gen = torch.Generator().manual_seed(seed)
    lens = [int(prefix * (0.3 + 0.7 * torch.rand(1, generator=gen).item())) | 1 for _ in range(batch)]
    if batch > 2:
        lens[-1], lens[-2] = 0, 40
    return lens


@pytest.mark.parametrize("splits", [2, 4, 8, 16])
@pytest.mark.parametrize(("layout", "kv", "group", "kv_heads", "draft"), [
    (GQA256, "bfloat16", 16, 2, 4),
    (GQA128, "float8_e4m3fn", 8, 2, 16),  # a draft of more rows than a program's (ROW_BLOCKS > 1)
    (GQA64, "bfloat16", 8, 2, 3),
    (MLA, "float16", 16, 1, 2),  # MLA on the Triton stage (a config with no gluon section), fp16 KV
])
def test_cluster_merge_parity(layout, kv, group, kv_heads, draft, splits):
    batch = 3
    q_dtype = "float16" if kv == "float16" else "bfloat16"
    case = make_case(SPECS[layout], ragged(batch, 2048, splits), [draft, max(1, draft - 1), draft], group,
                     num_kv_heads=kv_heads, kv_dtype=kv, q_dtype=q_dtype, device="cuda", seed=splits,
                     k_scale=0.7 if kv.startswith("float8") else 1.0, index_dtype=torch.int64)
    module = kgen.load(layout, kv, q_dtype)
    config = split_config(splits, block_h=min(16, group))
    assert clustered_launch(module, case, config) == splits
    case.o.fill_(float("nan"))
    module.launch(*case.launch_args(), config=config)
    assert_parity(case, f"{splits} splits")


def test_cluster_merge_trees_and_the_paged_entry():
    """EAGLE trees (the masked program) through both entries, clustered."""
    case = make_case(SPECS[GQA64], [1500, 0, 700, 2047], [7, 3, 12, 1], 8, device="cuda", seed=3)
    set_draft_masks(case, [eagle_tree(n, topk=4, seed=b) for b, n in enumerate(case.draft_lens())], gap=5)
    module = kgen.load(GQA64, "bfloat16")
    config = split_config(8, block_h=8)
    assert clustered_launch(module, case, config) == 8
    case.o.fill_(float("nan"))
    module.launch(*case.launch_args(), config=config, **case.mask_kwargs())
    assert_parity(case, "token slots")
    cache = to_paged(case, 16, seed=16)
    assert clustered_launch(module, case, config, page_size=16) == 8
    case.o.fill_(float("nan"))
    assert module.verify_paged_fwd(*cache.paged_args(case, torch.int64), config=config)
    assert_parity(case, "pages of 16")


def test_cluster_merge_in_graph_replays_with_new_lengths():
    """Captured once, replayed with new lengths: requests of 1 split, fewer than the cluster and
    all of it in one replay, an empty prefix; nothing to reset between replays."""
    spec = SPECS[GQA256]
    batch, draft, group, max_tokens = 4, 4, 16, 4096
    module = kgen.load(GQA256, "bfloat16")
    config = split_config(8)
    case = make_case(spec, [max_tokens] * batch, [draft] * batch, group, device="cuda", seed=5)
    assert clustered_launch(module, case, config) == 8
    slots = case.k_buffer.shape[0]
    static_indices = case.kv_indices.clone()
    args = list(case.launch_args())
    args[8] = static_indices
    module.launch(*args, config=config)  # warm-up: compile, allocate scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.launch(*args, config=config)
    for step, lens in enumerate([[4096, 17, 0, 300], [1, 2048, 4000, 512], [0, 0, 4096, 63]]):
        new = make_case(spec, lens, [draft] * batch, group, device="cuda", seed=100 + step)
        assert new.k_buffer.shape[0] <= slots
        case.k_buffer[: new.k_buffer.shape[0]] = new.k_buffer
        case.v_buffer[: new.v_buffer.shape[0]] = new.v_buffer
        static_indices.zero_()
        static_indices[: new.kv_indices.numel()] = new.kv_indices
        case.kv_indptr.copy_(new.kv_indptr)
        for name in ("q", "k_extend", "v_extend"):
            getattr(case, name).copy_(getattr(new, name))
        case.o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        new.kv_indices = static_indices[: new.kv_indices.numel()]
        new.k_buffer, new.v_buffer = case.k_buffer, case.v_buffer
        new.q, new.k_extend, new.v_extend, new.o = case.q, case.k_extend, case.v_extend, case.o
        assert_parity(new, f"replay {step}")


def test_sixteen_splits_at_a_full_program():
    """The non-portable cluster size at the table's largest programs (64 rows, 3 stages of 64-token
    tiles: one program an SM), so the GPU must co-schedule 16 of them on one GPC."""
    case = make_case(SPECS[GQA256], [8192, 5000], [4, 4], 16, num_kv_heads=2, device="cuda", seed=7,
                     index_dtype=torch.int64)
    module = kgen.load(GQA256, "bfloat16")
    config = {**split_config(16), "num_stages": 3}
    assert clustered_launch(module, case, config) == 16
    case.o.fill_(float("nan"))
    module.launch(*case.launch_args(), config=config)
    assert_parity(case, "16 splits")


def test_clusters_past_what_the_device_holds_run_unclustered():
    """64 requests x 2 KV heads at 16 splits: 128 clusters of 16, far more than any GPU holds at
    once. The launch rules still ask for clusters (shapes alone); the launch finds they do not fit
    and runs the call unclustered, with the merge launch."""
    case = make_case(SPECS[GQA256], ragged(64, 1024, 64), [4] * 64, 16, num_kv_heads=2, device="cuda", seed=9,
                     index_dtype=torch.int64)
    module = kgen.load(GQA256, "bfloat16")
    config = split_config(16)
    assert clustered_launch(module, case, config) == 16
    case.o.fill_(float("nan"))
    module.launch(*case.launch_args(), config=config)
    assert_parity(case, "unclustered fallback")
