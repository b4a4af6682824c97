"""The parity tests at real sizes on a GPU, plus CUDA-graph capture and replay with new data.

Run on a GPU machine: KGEN_TEST_ON_GPU=1 pytest -m gpu
"""


import pytest
import torch
from kernel_cases import SPECS, check_parity, tolerance

import kgen
from kgen.problems import make_case
from kgen.reference import relative_error

pytestmark = pytest.mark.gpu

CASES = [
    # layout, kv, group, batch, prefix, L
    ("qwen3_5_gqa256", "bfloat16", 16, 64, 16384, 4),
    ("qwen3_5_gqa256", "bfloat16", 8, 16, 32768, 3),
    ("qwen3_5_gqa256", "bfloat16", 4, 1, 4096, 1),
    ("qwen3_5_gqa256", "float8_e4m3fn", 16, 32, 8192, 2),
    ("mla_absorbed_512_64", "bfloat16", 16, 64, 4096, 4),
    ("mla_absorbed_512_64", "float8_e4m3fn", 16, 8, 32768, 4),
    ("gqa128", "bfloat16", 8, 64, 4096, 4),
    ("gqa128", "float8_e4m3fn", 16, 4, 16384, 2),
    ("gqa64", "bfloat16", 8, 16, 8192, 4),
    # Cases on sm_90 rows with configs of their own: FP8 group 8 at batch 33-96 (2 warps, 1 stage, 4
    # programs per SM), MLA at batch 9-32, group 16 at batch 1-8.
    ("qwen3_5_gqa256", "float8_e4m3fn", 8, 64, 4096, 4),
    ("mla_absorbed_512_64", "bfloat16", 16, 16, 8192, 3),
    ("qwen3_5_gqa256", "bfloat16", 16, 4, 16384, 4),
    # Programs widened by widen_from_rows: group 4's 64 rows at L 16 (the batch 33-96 row) and
    # the head dim 128 default's 128 rows, both at 8 warps.
    ("qwen3_5_gqa256", "bfloat16", 4, 40, 8192, 16),
    ("gqa128", "bfloat16", 8, 24, 4096, 16),
    # 256 rows in one 8-warp program (rules.WIDE_MAX_ROWS): GQA 128 group 16 at L 16, group 8 at L 32
    # (fp16 KV, whose dots are fp16).
    ("gqa128", "bfloat16", 16, 24, 8192, 16),
    ("gqa128", "float16", 8, 24, 4096, 32),
    # The GQA 64 rows of batch 33-96 (4430f47): BF16 group 8 in head blocks of 4 on 2 warps, the
    # draft tile first; FP8 group 4 with 128-token tiles in 1 stage; FP8 group 8, the draft tile after.
    ("gqa64", "bfloat16", 8, 40, 8192, 16),
    ("gqa64", "float8_e4m3fn", 4, 48, 4096, 8),
    ("gqa64", "float8_e4m3fn", 8, 36, 8192, 4),
    # e5m2 KV (SGLang's fp8_e5m2 pool): the default configs, GQA and MLA on the Triton kernel.
    ("qwen3_5_gqa256", "float8_e5m2", 16, 32, 8192, 4),
    ("mla_absorbed_512_64", "float8_e5m2", 16, 8, 16384, 3),
    ("gqa128", "float8_e5m2", 8, 24, 4096, 16),
]
# fp16 pools (a float16 model's cache) with fp16 queries: the default configs, on the Triton kernel.
FP16_CASES = [
    ("qwen3_5_gqa256", 16, 32, 8192, 4),
    ("mla_absorbed_512_64", 16, 8, 16384, 3),
    ("gqa128", 8, 24, 4096, 16),
]


@pytest.mark.parametrize(("layout", "kv", "group", "batch", "prefix", "draft"), CASES)
def test_parity_real_sizes(layout, kv, group, batch, prefix, draft):
    fp8 = kv != "bfloat16"
    gen = torch.Generator().manual_seed(batch * prefix)
    # Ragged: prefix lengths spread below the nominal one, not multiples of BLOCK_N, one empty.
    prefixes = [int(prefix * (0.5 + 0.5 * torch.rand(1, generator=gen).item())) | 1 for _ in range(batch)]
    prefixes[-1] = 0 if batch > 1 else prefixes[-1]
    drafts = [max(1, draft - (b % 2)) for b in range(batch)]
    case = make_case(SPECS[layout], prefixes, drafts, group, kv_dtype=kv, device="cuda",
                     k_scale=0.6 if fp8 else 1.0, v_scale=1.7 if fp8 else 1.0, seed=prefix + batch)
    check_parity(case, layout, kv)
    per_head = make_case(SPECS[layout], prefixes[:2], drafts[:2], group, kv_dtype=kv, device="cuda",
                         k_scale=case.k_scale, v_scale=case.v_scale, seed=1)
    check_parity(per_head, layout, kv, variant="per_head")


@pytest.mark.parametrize(("layout", "group", "batch", "prefix", "draft"), FP16_CASES)
def test_parity_fp16_kv(layout, group, batch, prefix, draft):
    prefixes = [prefix // (1 + b % 3) + b for b in range(batch)]
    drafts = [max(1, draft - (b % 2)) for b in range(batch)]
    case = make_case(SPECS[layout], prefixes, drafts, group, kv_dtype="float16", q_dtype="float16", device="cuda",
                     seed=prefix + batch)
    check_parity(case, layout, "float16", q_dtype="float16")


@pytest.mark.parametrize("layout", ["qwen3_5_gqa256", "mla_absorbed_512_64"])
def test_cuda_graph_capture_and_replay_with_new_data(layout):
    module = kgen.load(layout, "bfloat16")
    spec = SPECS[layout]
    batch, draft, group = 8, 4, 16
    max_slots = 8 * 4096 + 100
    case = make_case(spec, [3000] * batch, [draft] * batch, group, device="cuda", seed=5)
    # Under a graph kv_indices is a larger max-size buffer; its length is not the token count.
    static_indices = torch.zeros(max_slots, dtype=torch.int32, device="cuda")
    static_indices[: case.kv_indices.numel()] = case.kv_indices
    pool_k = torch.randn(max_slots, 1, spec.attention.qk_dim, device="cuda").bfloat16()
    pool_k[: case.k_buffer.shape[0]] = case.k_buffer
    pool_v = pool_k[..., :512] if spec.attention.v_source == "k_latent" else \
        torch.randn(max_slots, 1, spec.attention.v_head_dim, device="cuda").bfloat16()
    if spec.attention.v_source != "k_latent":
        pool_v[: case.v_buffer.shape[0]] = case.v_buffer
    args = [case.q, case.k_extend, case.v_extend, case.o, pool_k, pool_v, case.qo_indptr, case.kv_indptr,
            static_indices, None, True, None, draft, 1.0, 1.0]
    assert module.verify_shared_kv_fwd(*args)  # warm-up: compile, allocate scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        module.verify_shared_kv_fwd(*args)

    for step in range(3):
        # New prefix lengths (some shorter, one empty), new queries, new page table, same shapes.
        new = make_case(spec, [4096 - 900 * step, 17, 0, 2048, 4000, 1, 333, 4096][:batch], [draft] * batch,
                        group, device="cuda", seed=100 + step)
        n = new.kv_indices.numel()
        pool_k[: new.k_buffer.shape[0]] = new.k_buffer
        if spec.attention.v_source != "k_latent":
            pool_v[: new.v_buffer.shape[0]] = new.v_buffer
        static_indices[:n] = new.kv_indices
        case.kv_indptr.copy_(new.kv_indptr)
        case.q.copy_(new.q)
        case.k_extend.copy_(new.k_extend)
        if spec.attention.v_source != "k_latent":
            case.v_extend.copy_(new.v_extend)
        case.o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        new.k_buffer, new.v_buffer = pool_k, pool_v
        new.kv_indices = static_indices[:n]
        new.q, new.k_extend, new.v_extend = case.q, case.k_extend, case.v_extend
        ref = new.reference(torch.float64)
        err = relative_error(case.o, ref)
        assert err <= tolerance(new), f"replay {step}: relative error {err:.2e}"


def test_fp8_float_scales_first_seen_in_a_capture_then_eager_then_in_another_graph():
    """An FP8 kernel reads its scales from device tensors, so a float becomes one. A float first
    seen during a capture gets a tensor filled by that graph's replay; the eager call after it
    and a second graph (which takes the cached scalar the eager call made) must each read the
    right scale, not memory only the first graph's replay writes."""
    module = kgen.load("gqa128", "float8_e4m3fn")
    module.LAUNCHER.device_scales.clear()
    case = make_case(SPECS["gqa128"], [3001, 17, 4096, 640], [4, 3, 4, 2], 8, kv_dtype="float8_e4m3fn",
                     device="cuda", k_scale=0.37, v_scale=1.3, seed=11)
    ref = case.reference(torch.float64)
    warm = list(case.sglang_args())
    warm[13], warm[14] = 0.5, 0.5  # compiles and allocates scratch without caching 0.37 / 1.3
    assert module.verify_shared_kv_fwd(*warm)
    torch.cuda.synchronize()
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        module.verify_shared_kv_fwd(*case.sglang_args())
    for run in ("first graph", "eager", "second graph"):
        case.o.fill_(float("nan"))
        if run == "first graph":
            first.replay()
        elif run == "eager":
            assert module.verify_shared_kv_fwd(*case.sglang_args())
        else:
            second = torch.cuda.CUDAGraph()
            with torch.cuda.graph(second):
                module.verify_shared_kv_fwd(*case.sglang_args())
            case.o.fill_(float("nan"))
            second.replay()
        torch.cuda.synchronize()
        err = relative_error(case.o, ref)
        assert err <= tolerance(case), f"{run}: relative error {err:.2e}"


@pytest.mark.parametrize(("layout", "kv", "group", "batch", "prefix", "draft"), [
    ("qwen3_5_gqa256", "bfloat16", 16, 64, 8192, 4),
    ("qwen3_5_gqa256", "float8_e4m3fn", 8, 16, 4096, 3),
    ("mla_absorbed_512_64", "bfloat16", 16, 16, 8192, 4),
])
def test_lazy_rescale_on_the_gpu(layout, kv, group, batch, prefix, draft):
    """The block-config switch lazy_rescale at real sizes, with keys that grow along the
    sequence so running maxima move past the 2**8 threshold mid-split."""
    fp8 = kv != "bfloat16"
    prefixes = [prefix - 53 * b % (prefix // 2) for b in range(batch)]
    case = make_case(SPECS[layout], prefixes, [draft] * batch, group, kv_dtype=kv, device="cuda",
                     k_scale=0.6 if fp8 else 1.0, v_scale=1.7 if fp8 else 1.0, seed=prefix + 7)
    ramp = torch.cat([torch.linspace(1.0, 4.0, n, device="cuda") for n in prefixes])
    slots = case.kv_indices.long()
    pool = case.k_buffer.float()
    pool[slots] *= ramp[:, None, None]
    case.k_buffer.copy_(pool.to(case.k_buffer.dtype))
    module = kgen.load(layout, kv)
    config = {**module.select_config("sm_90", group, batch), "lazy_rescale": True}
    check_parity(case, layout, kv, config=config)


@pytest.mark.parametrize("placement", ["first", "after"])
@pytest.mark.parametrize(("kv", "group", "draft"), [("bfloat16", 16, 4), ("float8_e4m3fn", 8, 4), ("bfloat16", 4, 3)])
def test_draft_tile_placement_on_the_gpu(kv, group, draft, placement):
    """BlockConfig.draft_tile at 64-, 32- and 16-row programs, both placements, many splits a
    request (batch 8: the merge combines more splits than one chunk)."""
    fp8 = kv != "bfloat16"
    case = make_case(SPECS["qwen3_5_gqa256"], [6000 - 331 * b for b in range(8)], [draft] * 8, group, kv_dtype=kv,
                     device="cuda", k_scale=0.6 if fp8 else 1.0, v_scale=1.7 if fp8 else 1.0, seed=group + draft)
    module = kgen.load("qwen3_5_gqa256", kv)
    config = {**module.select_config("sm_90", group, 8), "draft_tile": placement}
    check_parity(case, "qwen3_5_gqa256", kv, config=config)


@pytest.mark.parametrize("layout", ["qwen3_5_gqa256", "mla_absorbed_512_64"])
def test_two_streams_and_two_graphs_at_once_share_no_partials(layout):
    """One module, the same shapes, launched on two streams at once, eagerly and as two graphs
    replayed at once: split partials are per stream and per graph, so each answer is its own."""
    module = kgen.load(layout, "bfloat16")
    cases = [make_case(SPECS[layout], [8192] * 16, [4] * 16, 16, device="cuda", seed=s) for s in (1, 2)]
    streams = [torch.cuda.Stream() for _ in cases]
    for case in cases:  # warm-up on the default stream: compile
        assert module.verify_shared_kv_fwd(*case.sglang_args())
    torch.cuda.synchronize()
    graphs = []
    for case, stream in zip(cases, streams, strict=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            module.verify_shared_kv_fwd(*case.sglang_args())
        graphs.append(graph)
    for run in ("eager", "graphs"):
        for case in cases:
            case.o.fill_(float("nan"))
        torch.cuda.synchronize()
        for _ in range(10):
            for case, stream, graph in zip(cases, streams, graphs, strict=True):
                with torch.cuda.stream(stream):
                    graph.replay() if run == "graphs" else module.verify_shared_kv_fwd(*case.sglang_args())
        torch.cuda.synchronize()
        for i, case in enumerate(cases):
            err = relative_error(case.o, case.reference(torch.float64))
            assert err <= tolerance(case), f"{run}, stream {i}: relative error {err:.2e}"
