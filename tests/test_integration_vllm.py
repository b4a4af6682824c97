"""``kgen.integrations.vllm`` against vLLM 0.33.0's real code, in Triton's interpreter.

The pure routing functions are tested without vLLM. The rest drives vLLM's real classes:
``TritonAttentionImpl.forward`` (its Triton ``unified_attention``) and ``TritonMLAImpl.forward_mqa``
(its Triton ``decode_attention_fwd``), each against kgen's subclass of it, on metadata built by
vLLM's own ``TritonAttentionMetadataBuilder.build`` (Triton attention) or as
``MLACommonMetadataBuilder.build`` fills ``MLACommonMetadata`` for an all-decode batch
(vllm/model_executor/layers/attention/mla_attention.py, 0.33.0: that builder needs the model's
real ``MLAAttention`` layers), under a real ``VllmConfig`` whose ``ModelConfig`` reads a
``config.json`` the test writes. vLLM's backend registry and its plugin loader are real too.

No import is stubbed: vLLM's modules import on CPU with the packages of
``.ci/engines/vllm.txt`` (vLLM logs that ``vllm._C`` is missing and goes on). What a CPU machine
lacks is set up instead, and only that:

- ``CUDA_VISIBLE_DEVICES=""`` while vLLM is imported (when no GPU is there, and unset again
  after): ``vllm.triton_utils`` turns Triton off when it finds no active GPU driver, except with
  empty visible devices (its Ray case); the interpreter needs no driver.
- ``current_platform.num_compute_units`` (the GPU's SM count; vLLM's ``UnspecifiedPlatform`` has
  none and raises) returns 4 while the test builds ``TritonMLAImpl``, whose constructor reads it.
- The KV cache is written by the test, as ``triton_reshape_and_cache_flash`` writes it (the
  slot's K/V, divided by the layer's scale on an FP8 cache): that kernel asks
  ``torch.cuda.get_device_capability``.
- ``kv_b_proj=None`` for ``TritonMLAImpl``: only the layer's prefill path reads it.
- The attention layer is a ``torch.nn.Module`` holding the ``_q_scale``/``_k_scale``/``_v_scale``
  tensors vLLM's ``Attention`` gives every layer; vLLM's impls read nothing else from it here.

Queries are float16: the interpreter's ``tl.dot`` multiplies bfloat16 operands wrongly
(/work/shared/notes/testing-without-a-gpu.md), and vLLM's kernels cast K and V to the query's
dtype (a bfloat16 or FP8 cache) before their dots, so fp16 queries keep vLLM's own kernel exact.
The draft tokens' K/V are given exactly representable in the cache's dtype, so what kgen reads
from ``key``/``value`` is what vLLM's kernel reads back from the cache.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from engines import import_vllm

from kgen.integrations import vllm as kv
from kgen.reference import relative_error
from kgen.runtime.gate import GateDecision

GROUPED = GateDecision("grouped", "gqa128", "layout 'gqa128' ...")
GENERAL = GateDecision("general", None, "no layout lists model architecture 'X'")
H, HKV, D, PAGE = 8, 1, 128, 16
RANK, ROPE = 512, 64
PREFIX, DRAFT = (19, 37), 4


# --------------------------------------------------------------------------- pure routing


def facts(**kw) -> kv.LayerFacts:
    return kv.LayerFacts(**{"backend": "TRITON_ATTN", "gate": GROUPED, "max_verify_len": 4, **kw})


def test_a_plain_layer_with_spec_decode_routes_to_kgen_and_names_the_gate():
    route = kv.layer_route(facts())
    assert route.use_kgen and "grouped" in route.reason and GROUPED.reason in route.reason


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"sinks": True}, "attention sinks"),
        ({"sliding_window": True}, "sliding window"),
        ({"logits_soft_cap": 30.0}, "soft cap 30.0"),
        ({"alibi": True}, "ALiBi"),
        ({"chunk_lookback": 2}, "chunked attention"),
        ({"attn_type": "encoder_only"}, "decoder self-attention only"),
        ({"kv_sharing": True}, "KV sharing"),
        ({"context_parallel": 2}, "context parallelism"),
        ({"gate": GENERAL}, "no layout lists"),
        ({"kv_dtype": None, "gate": GateDecision("general", None, "kv_cache_dtype 'fp8_e5m2': none")}, "fp8_e5m2"),
        ({"max_verify_len": 1}, "speculative decoding is off"),
    ],
)
def test_a_layer_with_what_kgen_lacks_stays_on_vllm_with_the_reason(kw, why):
    route = kv.layer_route(facts(**kw))
    assert not route.use_kgen and why in route.reason


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"max_query_len": 1}, "decode step"),
        ({"max_query_len": 5}, "query length 5 > verify length 4"),
        ({"causal": False}, "non-causal"),
        ({"has_key_value": False}, "no key/value"),
        ({"quantized_output": True}, "fused-quantized output"),
        ({"mm_prefix": True}, "multimodal"),
        ({"rswa": True}, "R-SWA"),
        ({"uniform": False}, "whole number"),
    ],
)
def test_a_call_that_is_not_a_causal_verify_step_stays_on_vllm(kw, why):
    layer = kv.layer_route(facts())
    route = kv.step_route(layer, kv.StepFacts(**{"max_query_len": 4, **kw}), 4)
    assert not route.use_kgen and why in route.reason


def test_a_verify_step_goes_to_kgen_and_a_refused_layer_keeps_its_reason():
    assert kv.step_route(kv.layer_route(facts()), kv.StepFacts(max_query_len=3), 4).use_kgen
    off = kv.layer_route(facts(sinks=True))
    assert kv.step_route(off, kv.StepFacts(max_query_len=3), 4) == off


def test_vllm_cache_dtypes_map_to_kgens_or_to_none():
    assert kv.kv_dtype_for("auto", "float16") == "float16"
    assert kv.kv_dtype_for("bfloat16", "float16") == "bfloat16"
    assert kv.kv_dtype_for("fp8", "bfloat16", "float8_e4m3fnuz") == "float8_e4m3fnuz"
    assert kv.kv_dtype_for("fp8_e4m3", "bfloat16") == "float8_e4m3fn"
    for other in ("fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "nvfp4_ds_mla", "turboquant_k8v4"):
        assert kv.kv_dtype_for(other, "bfloat16") is None


def test_the_adapter_built_for_vllm_runs_kernels_only():
    """``VLLMVerify(defer_general=True)``: a call no kernel takes (a window; a group the grouped
    kernel lacks) returns None with the output unwritten, where the plain adapter would run kgen's
    general path (which syncs the host: no place under vLLM's CUDA graphs)."""
    from test_runtime_support import FakeModule, fake_loader, runtime_case, to_pages

    from kgen.runtime.adapters import VLLMVerify
    from kgen.runtime.chain import VerifyChain

    chain = VerifyChain("fake", "float32", "float32", loader=fake_loader({"grouped": FakeModule("g", groups=(4,))}))
    for group, kw, kernel in ((4, {}, "grouped"), (4, {"sliding_window": 8}, None), (2, {}, None)):
        case = runtime_case([40, 3], [2, 3], group=group)
        pages = to_pages(case, 16)
        seq_lens = pages["prefix_lens"] + (case.qo_indptr[1:] - case.qo_indptr[:-1])
        args = (case.q, case.k, case.v, None, pages["k_cache"], pages["v_cache"], pages["block_table"], seq_lens,
                case.qo_indptr, case.max_len)  # fmt: skip
        deferred, plain = case.out(), case.out()
        assert VLLMVerify(chain, defer_general=True)(*args[:3], deferred, *args[4:], **kw) == kernel
        assert deferred.isnan().all() != (kernel is not None)
        assert VLLMVerify(chain)(*args[:3], plain, *args[4:], **kw) == (kernel or "general")


# --------------------------------------------------------------------------- vLLM set-up


@pytest.fixture(scope="module")
def vllm() -> ModuleType:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these run vLLM's and kgen's kernels on CPU tensors in Triton's interpreter")
    module = import_vllm("vllm.v1.attention.backends.triton_attn", "vllm.v1.attention.backends.mla.triton_mla")
    assert module.__version__ == kv.VLLM_VERSION, f"the pinned vLLM is {kv.VLLM_VERSION}, got {module.__version__}"
    return module


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H * D, "head_dim": D,
         "num_attention_heads": H, "num_key_value_heads": HKV, "intermediate_size": 256, "num_hidden_layers": 1,
         "vocab_size": 64, "max_position_embeddings": 1024, "torch_dtype": "float16"}  # fmt: skip
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
            "num_attention_heads": H, "num_key_value_heads": H, "kv_lora_rank": RANK, "q_lora_rank": None,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": ROPE, "v_head_dim": 128, "intermediate_size": 256,
            "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1,
            "first_k_dense_replace": 1, "vocab_size": 64, "max_position_embeddings": 1024,
            "torch_dtype": "float16"}  # fmt: skip


def vllm_config(path, hf_config: dict, dtype: str = "float16", spec_tokens: int | None = 3, cache_dtype: str = "auto"):
    """A real VllmConfig: the model read from a config.json, ngram speculation (no draft model)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    model = ModelConfig(model=str(path), skip_tokenizer_init=True, dtype=dtype)
    spec = None
    if spec_tokens:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens, prompt_lookup_max=3,
                                 prompt_lookup_min=1, target_model_config=model,
                                 target_parallel_config=ParallelConfig())  # fmt: skip
    return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"), speculative_config=spec,
                      cache_config=CacheConfig(cache_dtype=cache_dtype))  # fmt: skip


class Layer(torch.nn.Module):
    """The scales vLLM's ``Attention`` layer holds (``_init_kv_cache_quant``): one-element float32."""

    def __init__(self, k_scale: float = 1.0, q_scale: float = 1.0) -> None:
        super().__init__()
        self._q_scale = torch.tensor(q_scale)
        self._k_scale = torch.tensor(k_scale)
        self._v_scale = torch.tensor(k_scale)


@contextmanager
def gpu_count_for_mla(vllm: ModuleType) -> Iterator[None]:
    """``current_platform.num_compute_units`` for ``TritonMLAImpl.__init__`` (see the docstring)."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    saved = platform.__dict__.get("num_compute_units")
    platform.num_compute_units = classmethod(lambda cls, device_id=0: 4)
    try:
        yield
    finally:
        if saved is None:
            del platform.num_compute_units
        else:
            platform.num_compute_units = saved


# --------------------------------------------------------------------------- a verify batch


class Batch:
    """Two requests (prefixes 19 and 37) verifying 4 draft tokens each over shuffled pages."""

    def __init__(self, cache_dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = torch.tensor([p + DRAFT for p in PREFIX], dtype=torch.int32)
        self.query_start_loc = torch.arange(0, 2 * DRAFT + 1, DRAFT, dtype=torch.int32)
        self.block_table = torch.randperm(8, generator=g)[:8].view(2, 4).to(torch.int32)
        self.num_blocks, self.scale, self.cache_dtype = 8, scale, cache_dtype
        self.tokens = 2 * DRAFT
        self.slots = torch.cat([self._slots(b, p, p + DRAFT) for b, p in enumerate(PREFIX)])
        self.g = g

    def _slots(self, b: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return self.block_table[b, pos // PAGE].long() * PAGE + pos % PAGE

    def representable(self, *shape: int) -> torch.Tensor:
        """fp16 values the cache's dtype holds exactly once divided by the scale."""
        x = torch.randn(*shape, generator=self.g)
        return (x.to(self.cache_dtype).float() * self.scale).half()

    def store(self, flat_cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """What vLLM's reshape-and-cache stores at ``slots`` (``values / scale`` in the cache dtype)."""
        flat_cache[slots] = (values.float() / self.scale).to(flat_cache.dtype)

    def positions(self, b: int) -> torch.Tensor:
        return self._slots(b, 0, int(self.seq_lens[b]))


def reference(batch: Batch, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, sm_scale: float):
    """Float64 causal verify attention over the cache (every token's K/V read back from it)."""
    group = q.shape[1] // k_flat.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v_flat.shape[-1], dtype=torch.float64)
    for b, prefix in enumerate(PREFIX):
        slots = batch.positions(b)
        keys = k_flat[slots].double().repeat_interleave(group, 1) * batch.scale
        vals = v_flat[slots].double().repeat_interleave(group, 1) * batch.scale
        for t in range(DRAFT):
            row, seen = b * DRAFT + t, prefix + t + 1
            scores = torch.einsum("hd,nhd->hn", q[row].double(), keys[:seen]) * sm_scale
            out[row] = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vals[:seen])
    return out


@contextmanager
def runs_kgen(layer: kv.KgenLayer) -> Iterator[None]:
    """The block runs kgen's grouped kernel exactly once (the chains are shared per process)."""
    before = layer.verify.chain.counts["grouped"]
    yield
    assert layer.last_route.use_kgen, layer.last_route.reason
    assert layer.verify.chain.counts["grouped"] == before + 1


def assert_both_close(kgen_out: torch.Tensor, vllm_out: torch.Tensor, exact: torch.Tensor) -> None:
    """Each within 3x the rounding of the exact answer to its own output dtype (tests/kernel_cases.py's
    tolerance), so the two within the sum of theirs."""
    tol = {out.dtype: 3 * relative_error(exact.to(out.dtype), exact) for out in (kgen_out, vllm_out)}
    assert relative_error(vllm_out, exact) <= tol[vllm_out.dtype], "vLLM's own kernel is off: the set-up is wrong"
    assert relative_error(kgen_out, exact) <= tol[kgen_out.dtype]
    assert relative_error(kgen_out, vllm_out) <= tol[kgen_out.dtype] + tol[vllm_out.dtype]


# --------------------------------------------------------------------------- Triton attention


def triton_impl(config, kv_cache_dtype: str, kgen: bool = True, **impl_kw):
    """kgen's ``TritonAttentionImpl`` subclass (or vLLM's own), built under ``config`` as vLLM's
    ``Attention`` layer builds it."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    cls = kv.KgenTritonAttentionImpl if kgen else TritonAttentionImpl
    with set_current_vllm_config(config):
        return cls(H, D, D**-0.5, HKV, None, None, kv_cache_dtype, **impl_kw)


@dataclass
class TritonCall:
    """One verify step's ``forward`` arguments (and the cache's flat K/V views for the reference)."""

    q: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    md: object
    k_flat: torch.Tensor
    v_flat: torch.Tensor

    def as_fp16(self) -> TritonCall:
        """The same values in float16 (exact: they are bfloat16 values), the same metadata."""
        kv_cache = self.kv_cache.half()  # keeps the NHD strides
        k_flat, v_flat = flat_kv(kv_cache)
        return TritonCall(self.q.half(), self.key.half(), self.value.half(), kv_cache, self.md, k_flat, v_flat)


def flat_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[slots, H_kv, D]`` views of K and V in vLLM's cache (as ``forward`` splits it)."""
    k_cache, v_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    return k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)


def triton_call(config, batch: Batch, q_dtype: torch.dtype, max_query_len: int = DRAFT) -> TritonCall:
    """A verify step: the cache written, the metadata from vLLM's ``TritonAttentionMetadataBuilder``."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    # vLLM's logical [blocks, H_kv, page, 2 * D] cache, stored [blocks, page, H_kv, 2 * D] (NHD).
    stored = batch.representable(batch.num_blocks, PAGE, HKV, 2 * D).float().div(batch.scale)
    kv_cache = stored.to(batch.cache_dtype).transpose(1, 2)
    q = (torch.randn(batch.tokens, H, D, generator=batch.g) * 0.5).to(batch.cache_dtype).to(q_dtype)
    key, value = (batch.representable(batch.tokens, HKV, D).to(q_dtype) for _ in range(2))
    k_flat, v_flat = flat_kv(kv_cache)
    batch.store(k_flat, key, batch.slots)
    batch.store(v_flat, value, batch.slots)
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=D, dtype=batch.cache_dtype)
    builder = TritonAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu"))
    common = CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc, query_start_loc_cpu=batch.query_start_loc, seq_lens=batch.seq_lens,
        num_reqs=2, num_actual_tokens=batch.tokens, max_query_len=max_query_len,
        max_seq_len=int(batch.seq_lens.max()), block_table_tensor=batch.block_table, slot_mapping=batch.slots,
    )  # fmt: skip
    return TritonCall(q, key, value, kv_cache, builder.build(0, common), k_flat, v_flat)


def forward(impl, layer: Layer, call: TritonCall, query: torch.Tensor | None = None) -> torch.Tensor:
    """``impl.forward`` into a NaN-filled output (so a row nobody writes cannot pass)."""
    query = call.q if query is None else query
    out = torch.full((query.shape[0], H, D), float("nan"), dtype=call.key.dtype)
    impl.forward(layer, query, call.key, call.value, call.kv_cache, call.md, out)
    return out


def test_triton_attention_bf16_verify_runs_kgen_and_matches_vllms_unified_attention(vllm, tmp_path):
    """A bfloat16 model and cache on kgen's impl; vLLM's impl runs the same values in float16 (its
    kernel's bfloat16 dots are wrong in the interpreter, the float16 ones exact)."""
    kgen_impl = triton_impl(vllm_config(tmp_path / "bf16", LLAMA, "bfloat16"), "auto")
    vllm_impl = triton_impl(vllm_config(tmp_path / "fp16", LLAMA, "float16"), "auto", kgen=False)
    assert kgen_impl.kgen.route.use_kgen, kgen_impl.kgen.route.reason
    batch = Batch(torch.bfloat16)
    call = triton_call(vllm_config(tmp_path / "bf16", LLAMA, "bfloat16"), batch, torch.bfloat16)
    with runs_kgen(kgen_impl.kgen):
        kgen_out = forward(kgen_impl, Layer(), call)
    vllm_out = forward(vllm_impl, Layer(), call.as_fp16())
    assert_both_close(kgen_out, vllm_out, reference(batch, call.q, call.k_flat, call.v_flat, D**-0.5))


def test_triton_attention_fp8_cache_verify_runs_kgen_and_matches_vllms_unified_attention(vllm, tmp_path):
    """An FP8 (e4m3fn) cache with its layer scale, float16 queries, one config for both impls."""
    config = vllm_config(tmp_path, LLAMA, "float16", cache_dtype="fp8")
    kgen_impl, vllm_impl = triton_impl(config, "fp8"), triton_impl(config, "fp8", kgen=False)
    assert kgen_impl.kgen.route.use_kgen, kgen_impl.kgen.route.reason
    batch = Batch(torch.float8_e4m3fn, 0.5)
    call = triton_call(config, batch, torch.float16)
    with runs_kgen(kgen_impl.kgen):
        kgen_out = forward(kgen_impl, Layer(0.5), call)
    vllm_out = forward(vllm_impl, Layer(0.5), call)
    assert_both_close(kgen_out, vllm_out, reference(batch, call.q, call.k_flat, call.v_flat, D**-0.5))


@pytest.mark.parametrize("model_dtype", ["float16", "bfloat16"])
def test_triton_attention_fp16_cache_verify_runs_kgen_and_matches_vllms_unified_attention(vllm, tmp_path,
                                                                                        model_dtype):
    """A float16 cache (``auto`` on a float16 model, or ``float16`` beside a bfloat16 one) on kgen's
    impl; vLLM's impl runs float16 queries on the same cache (its kernel's float16 dots are exact
    in the interpreter)."""
    cache = "auto" if model_dtype == "float16" else "float16"
    config = vllm_config(tmp_path, LLAMA, model_dtype)
    kgen_impl = triton_impl(config, cache)
    vllm_impl = triton_impl(vllm_config(tmp_path / "fp16", LLAMA, "float16"), "auto", kgen=False)
    assert kgen_impl.kgen.route.use_kgen, kgen_impl.kgen.route.reason
    batch = Batch(torch.float16)
    call = triton_call(config, batch, getattr(torch, model_dtype))
    with runs_kgen(kgen_impl.kgen):
        kgen_out = forward(kgen_impl, Layer(), call)
    vllm_out = forward(vllm_impl, Layer(), call.as_fp16())
    assert_both_close(kgen_out, vllm_out, reference(batch, call.q, call.k_flat, call.v_flat, D**-0.5))


def test_calls_kgen_refuses_run_vllms_kernel_bit_for_bit(vllm, tmp_path):
    """A layer with sinks, and an FP8 query with its q_descale: vLLM's kernel writes ``output``
    (the same bits as vLLM's own impl), kgen's never ran."""
    config = vllm_config(tmp_path, LLAMA, "float16", cache_dtype="fp8")
    call = triton_call(config, Batch(torch.float8_e4m3fn, 0.5), torch.float16)
    layer = Layer(0.5, q_scale=0.25)
    sinks = {"sinks": torch.linspace(-1.0, 1.0, H)}
    fp8_query = (call.q.float() / 0.25).to(torch.float8_e4m3fn)
    for why, impl_kw, query in (("attention sinks", sinks, call.q), ("float8_e4m3fn", {}, fp8_query)):
        kgen_impl, vllm_impl = triton_impl(config, "fp8", **impl_kw), triton_impl(config, "fp8", False, **impl_kw)
        ran = dict(kgen_impl.kgen.verify.chain.counts) if kgen_impl.kgen.verify else None
        kgen_out, vllm_out = forward(kgen_impl, layer, call, query), forward(vllm_impl, layer, call, query)
        assert torch.equal(kgen_out.view(torch.int16), vllm_out.view(torch.int16)), why
        assert not kgen_impl.kgen.last_route.use_kgen and why in kgen_impl.kgen.last_route.reason
        assert kgen_impl.kgen.verify is None or kgen_impl.kgen.verify.chain.counts == ran


def test_a_decode_step_stays_on_vllm(vllm, tmp_path):
    config = vllm_config(tmp_path, LLAMA, "float16", cache_dtype="fp8")
    batch = Batch(torch.float8_e4m3fn, 0.5)
    batch.query_start_loc = torch.arange(3, dtype=torch.int32)
    batch.tokens, batch.slots = 2, batch.slots[DRAFT - 1 :: DRAFT]  # each request's newest token
    call = triton_call(config, batch, torch.float16, max_query_len=1)
    kgen_impl, vllm_impl = triton_impl(config, "fp8"), triton_impl(config, "fp8", kgen=False)
    kgen_out, vllm_out = forward(kgen_impl, Layer(0.5), call), forward(vllm_impl, Layer(0.5), call)
    assert torch.equal(kgen_out.view(torch.int16), vllm_out.view(torch.int16))
    assert "decode step" in kgen_impl.kgen.last_route.reason


@pytest.mark.parametrize(
    ("impl_kw", "cache", "spec", "why"),
    [
        ({"logits_soft_cap": 30.0}, "auto", 3, "soft cap"),
        ({}, "auto", 3, "sliding window"),
        ({}, "fp8_e5m2", 3, "fp8_e5m2"),
        ({}, "int8_per_token_head", 3, "int8_per_token_head"),
        ({}, "auto", None, "speculative decoding is off"),
    ],
)
def test_triton_layers_kgen_cannot_serve_are_left_to_vllm(vllm, tmp_path, impl_kw, cache, spec, why):
    from vllm.config import set_current_vllm_config

    config = vllm_config(tmp_path, LLAMA, "bfloat16", spec_tokens=spec)
    window = 64 if why == "sliding window" else None
    with set_current_vllm_config(config):
        impl = kv.KgenTritonAttentionImpl(H, D, D**-0.5, HKV, None, window, cache, **impl_kw)
    assert not impl.kgen.route.use_kgen and why in impl.kgen.route.reason
    assert impl.kgen.verify is None


# --------------------------------------------------------------------------- Triton MLA


def mla_impls(vllm, config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    args = (H, RANK + ROPE, 0.1, 1, None, None, "fp8", None, "decoder", None)
    mla = {"q_lora_rank": None, "kv_lora_rank": RANK, "qk_nope_head_dim": 128, "qk_rope_head_dim": ROPE,
           "qk_head_dim": 128 + ROPE, "v_head_dim": 128, "kv_b_proj": None}  # fmt: skip
    with set_current_vllm_config(config), gpu_count_for_mla(vllm):
        return kv.KgenTritonMLAImpl(*args, **mla), TritonMLAImpl(*args, **mla)


def mla_metadata(vllm, batch: Batch):
    """``MLACommonMetadata`` of an all-decode batch as ``MLACommonMetadataBuilder.build`` fills it."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata, MLACommonMetadata

    decode = MLACommonDecodeMetadata(block_table=batch.block_table, seq_lens=batch.seq_lens, dcp_tot_seq_lens=None)
    return MLACommonMetadata(
        num_reqs=2, max_query_len=DRAFT, max_seq_len=int(batch.seq_lens.max()), num_actual_tokens=batch.tokens,
        query_start_loc=batch.query_start_loc, slot_mapping=batch.slots, head_dim=RANK + ROPE, num_decodes=2,
        num_decode_tokens=batch.tokens, num_prefills=0, causal=True, decode=decode,
    )  # fmt: skip


def test_triton_mla_verify_runs_kgen_and_matches_vllms_decode_attention(vllm, tmp_path):
    """DeepSeek-V3's absorbed MLA on an FP8 cache (TritonMLAImpl keeps 16-bit queries there)."""
    config = vllm_config(tmp_path, DEEPSEEK, "float16", cache_dtype="fp8")
    kgen_impl, vllm_impl = mla_impls(vllm, config)
    assert kgen_impl.kgen.route.use_kgen, kgen_impl.kgen.route.reason
    batch = Batch(torch.float8_e4m3fn, 0.5)
    cache = batch.representable(batch.num_blocks, PAGE, RANK + ROPE).float().div(0.5).to(torch.float8_e4m3fn)
    q_nope = (torch.randn(batch.tokens, H, RANK, generator=batch.g) * 0.05).half()
    q_pe = (torch.randn(batch.tokens, H, ROPE, generator=batch.g) * 0.05).half()
    md, layer = mla_metadata(vllm, batch), Layer(0.5)
    with runs_kgen(kgen_impl.kgen):
        kgen_out, kgen_lse = kgen_impl.forward_mqa((q_nope, q_pe), cache, md, layer)
    vllm_out, _ = vllm_impl.forward_mqa((q_nope, q_pe), cache, md, layer)
    assert kgen_lse is None
    flat = cache.view(-1, 1, RANK + ROPE)
    exact = reference(batch, torch.cat([q_nope, q_pe], -1), flat, flat[..., :RANK], 0.1)
    assert_both_close(kgen_out, vllm_out, exact)


def test_mla_draft_rows_are_read_from_the_cache_where_vllm_wrote_them():
    batch = Batch(torch.bfloat16)
    cache = torch.randn(batch.num_blocks, PAGE, RANK + ROPE).to(torch.bfloat16)
    rows = kv.mla_draft_latents(cache, batch.block_table, batch.seq_lens, DRAFT, torch.float16, 1.0)
    assert torch.equal(rows[:, 0], cache.view(-1, RANK + ROPE)[batch.slots].half())
    fp8 = cache.to(torch.float8_e4m3fn)
    rows = kv.mla_draft_latents(fp8, batch.block_table, batch.seq_lens, DRAFT, torch.float16, torch.tensor(0.5))
    assert torch.equal(rows[:, 0], (fp8.view(-1, RANK + ROPE)[batch.slots].float() * 0.5).half())


# --------------------------------------------------------------------------- the switch


def test_the_plugin_switches_vllms_triton_backends_to_kgens_only_when_on(vllm, monkeypatch):
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv("VLLM_PLUGINS", "kgen")
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins == {"kgen": kv.register}, "kgen's vllm.general_plugins entry point is not installed"
    names = ("TRITON_ATTN", "TRITON_MLA")
    try:
        monkeypatch.delenv(kv.ENABLE_ENV, raising=False)
        plugins["kgen"]()
        assert not any(AttentionBackendEnum[n].is_overridden() for n in names)
        monkeypatch.setenv(kv.ENABLE_ENV, "1")
        plugins["kgen"]()
        attn, mla = (AttentionBackendEnum[n].get_class() for n in names)
        assert attn is kv.KgenTritonAttentionBackend and attn.get_impl_cls() is kv.KgenTritonAttentionImpl
        assert mla is kv.KgenTritonMLABackend and mla.get_impl_cls() is kv.KgenTritonMLAImpl
        assert (attn.get_name(), mla.get_name()) == names
    finally:
        for n in names:
            AttentionBackendEnum[n].clear_override()
