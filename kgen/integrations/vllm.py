"""kgen in vLLM 0.33.0: speculative-decoding target verification on kgen's kernels, the rest on
vLLM's own.

**The switch.** ``KGEN_VLLM=1`` in the environment of the vLLM processes, with kgen installed
in vLLM's environment. kgen declares the entry point ``kgen = "kgen.integrations.vllm:register"``
in vLLM's general-plugin group ``vllm.general_plugins``, which vLLM loads in every process it
starts (``vllm/plugins/__init__.py``, ``load_general_plugins``; ``VLLM_PLUGINS`` filters it by the
name ``kgen``). With the switch on, ``register`` overrides two names of vLLM's attention-backend
registry (``register_backend`` in ``vllm/v1/attention/backends/registry.py``); off, it changes
nothing. ``enable()`` does the same in-process, without the environment variable.

- ``TRITON_ATTN`` -> ``KgenTritonAttentionBackend``, a subclass of vLLM's
  ``TritonAttentionBackend`` (``vllm/v1/attention/backends/triton_attn.py``) whose impl's
  ``forward`` sends verify calls to kgen's paged kernel and every other call, unchanged, to
  vLLM's ``TritonAttentionImpl.forward`` (its Triton ``unified_attention``);
- ``TRITON_MLA`` -> ``KgenTritonMLABackend``, a subclass of ``TritonMLABackend``
  (``vllm/v1/attention/backends/mla/triton_mla.py``) whose impl's ``forward_mqa`` does the same
  around vLLM's ``decode_attention_fwd``.

vLLM still chooses the backend (``--attention-backend TRITON_ATTN`` / ``TRITON_MLA``, or its own
priority list); the overrides only replace the classes those names resolve to. vLLM 0.33.0 has
no tree-attention backend (vllm-project/vllm#42121 removed ``TreeAttentionBackend``), so there
is no tree to route: every call is a chain. For a vLLM that still has it, the adapter call is
``VLLMVerify(..., tree_attn_bias=attn_metadata.tree_attn_bias)`` (docs/runtime.md, "Tree
verification"); this module does not patch it.

**Which calls.** ``layer_route`` (once per layer, at construction) and ``step_route`` (per call)
are pure: plain facts in, a ``Route`` (kgen or not, and why) out. kgen takes a call when the
model's layout, dtypes and GPU pass kgen's gate (``kgen.runtime.gate``), the layer has none of
what kgen's paged kernels lack (sinks, sliding windows, soft caps, ALiBi, chunked attention,
per-token-head quantized caches, KV sharing, context parallelism), speculative decoding is on,
and the call is a causal verify step: ``1 < max_query_len <= 1 + num_speculative_tokens``.
Anything else, and any call kgen's kernels refuse (an FP8 query with its ``q_descale``, a
fused-quantized output, ...), runs vLLM's own kernel with ``output`` untouched by kgen.

**CUDA graphs and torch.compile.** Both impls run inside vLLM's own registered custom op
(``vllm::unified_attention_with_output``, ``vllm/model_executor/layers/attention/attention.py``),
which torch.compile does not trace into, so no op of kgen's needs registering. The kgen path
does no host sync: routing reads host ints vLLM's metadata already holds, the prefix lengths
and (MLA) the draft rows' K are computed on the device, and the adapter runs kernels only
(``VLLMVerify(defer_general=True)``: kgen's general path, which syncs, never runs here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kgen.launcher.switches import env_flag
from kgen.runtime.adapters import VLLMVerify, dtype_name, get_chain
from kgen.runtime.gate import GateDecision, GateQuery, gate_from_env

ENABLE_ENV = "KGEN_VLLM"
VLLM_VERSION = "0.33.0"
# vLLM's ``AttentionType.DECODER``; the others (encoder, cross-attention) never verify drafts.
DECODER = "decoder"
# A child of vLLM's "vllm" logger, so the messages land in vLLM's log with its level and handlers.
_logger = logging.getLogger("vllm.kgen")
_logged: set[str] = set()


@dataclass(frozen=True)
class Route:
    """Whether kgen computes a layer's (or a call's) attention, and why."""

    use_kgen: bool
    reason: str


@dataclass(frozen=True)
class LayerFacts:
    """What a vLLM attention impl knows at construction, as plain values.

    ``kv_dtype`` is kgen's name of the cache dtype (``kv_dtype_for``; None: kgen has none);
    ``max_verify_len`` vLLM's ``max_decode_query_len`` (1 + num_speculative_tokens; 1 without
    speculative decoding); ``gate`` kgen's gate decision for the model on this GPU.
    """

    backend: str
    gate: GateDecision
    kv_cache_dtype: str = "auto"
    kv_dtype: str | None = "bfloat16"
    attn_type: str = DECODER
    alibi: bool = False
    sinks: bool = False
    sliding_window: bool = False
    logits_soft_cap: float = 0.0
    chunk_lookback: int = -1
    kv_sharing: bool = False
    context_parallel: int = 1
    max_verify_len: int = 1


@dataclass(frozen=True)
class StepFacts:
    """One forward call, from host values vLLM's metadata holds (no device read).

    ``causal``: ``attn_metadata.causal is True`` (a per-request tensor counts as not causal);
    ``uniform``: every request has ``max_query_len`` query tokens (MLA's decode rows).
    """

    max_query_len: int
    causal: bool = True
    has_key_value: bool = True
    quantized_output: bool = False
    mm_prefix: bool = False
    rswa: bool = False
    uniform: bool = True


# Why vLLM's fp8_e5m2 stays on vLLM although kgen has e5m2 modules (SGLang's fp8_e5m2 pool is e5m2).
E5M2_STORED_AS = (
    "vLLM 0.33.0's Triton attention writes and reads that cache as the platform's e4m3 (triton_attn.py "
    "views it as current_platform.fp8_dtype()), and its Triton MLA does not take it; the name does not say "
    "the bytes' format, so vLLM's own kernel keeps it"
)


def kv_dtype_for(kv_cache_dtype: str, model_dtype: str, fp8_dtype: str = "float8_e4m3fn") -> str | None:
    """kgen's KV dtype name for vLLM's ``kv_cache_dtype`` (None when kgen has no module for it).

    ``auto`` is the model's dtype; ``fp8`` / ``fp8_e4m3`` are the platform's FP8 format
    (``current_platform.fp8_dtype()``: e4m3fn, or e4m3fnuz on MI300). ``fp8_e5m2`` is not
    e5m2 in the backends kgen serves (``E5M2_STORED_AS``); every other vLLM format
    (per-token-head, nvfp4, turboquant, ...) has no kgen module."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("bfloat16", "float16"):
        return kv_cache_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return fp8_dtype
    return None


def _layer_lacks(f: LayerFacts) -> str:
    """What the layer has that kgen's paged kernels lack ('' when nothing)."""
    if f.attn_type != DECODER:
        return f"attention type {f.attn_type!r}: kgen verifies decoder self-attention only"
    if f.kv_sharing:
        return "the layer reads another layer's KV cache (KV sharing): its key/value are not what the cache holds"
    features = (
        ("ALiBi slopes", f.alibi),
        ("attention sinks", f.sinks),
        ("a sliding window", f.sliding_window),
        (f"logits soft cap {f.logits_soft_cap}", bool(f.logits_soft_cap)),
        (f"chunked attention (chunk_lookback {f.chunk_lookback})", f.chunk_lookback >= 0),
    )
    for name, present in features:
        if present:
            return f"{name}: kgen's paged kernels have none"
    if f.context_parallel > 1:
        return f"context parallelism over {f.context_parallel} ranks: kgen returns no LSE to combine"
    return ""


def layer_route(f: LayerFacts) -> Route:
    """Pure: whether kgen may take this layer's verify calls at all, and why."""
    lacks = _layer_lacks(f)
    if lacks:
        return Route(False, lacks)
    if f.gate.path == "general" or f.kv_dtype is None:
        return Route(False, f"kgen's gate: {f.gate.reason}")
    if f.max_verify_len <= 1:
        return Route(False, "speculative decoding is off (max decode query length 1): nothing to verify")
    return Route(True, f"{f.backend} verify calls on kgen's {f.gate.path} kernel: {f.gate.reason}")


def step_route(layer: Route, step: StepFacts, max_verify_len: int) -> Route:
    """Pure: whether kgen computes this call (``layer`` is the layer's ``layer_route``)."""
    if not layer.use_kgen:
        return layer
    checks = (
        (step.max_query_len <= 1, "a decode step (query length 1), not a verification"),
        (step.max_query_len > max_verify_len,
         f"query length {step.max_query_len} > verify length {max_verify_len}: a prefill or mixed batch"),
        (not step.causal, "a non-causal batch (attn_metadata.causal is not True)"),
        (not step.has_key_value, "no key/value given (the model wrote the cache itself)"),
        (step.quantized_output, "a fused-quantized output (output_scale): kgen writes 16-bit outputs"),
        (step.mm_prefix, "multimodal bidirectional prefix ranges"),
        (step.rswa, "R-SWA prefix lengths (a window over generated tokens)"),
        (not step.uniform, "decode rows that are not a whole number per request"),
    )  # fmt: skip
    for failed, why in checks:
        if failed:
            return Route(False, why)
    return Route(True, f"verify step of {step.max_query_len} tokens a request")


def _log_once(reason: str, level: int = logging.INFO) -> None:
    if reason not in _logged:
        _logged.add(reason)
        _logger.log(level, "kgen: %s", reason)


def _vllm_config() -> Any:
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def _fp8_name() -> str:
    from vllm.platforms import current_platform

    return dtype_name(current_platform.fp8_dtype())


class KgenLayer:
    """One vLLM attention layer's route and, when kgen may serve it, its ``VLLMVerify``.

    ``last_route`` is the latest call's route (why kgen ran or not); ``verify.last_refusal``
    why kgen's kernels refused a call they were given."""

    def __init__(self, facts: LayerFacts, q_dtype: str) -> None:
        self.facts = facts
        self.route = layer_route(facts)
        self.last_route = self.route
        self.verify: VLLMVerify | None = None
        if self.route.use_kgen:
            gate, kv = facts.gate, facts.kv_dtype
            chain = get_chain(gate.layout, kv, q_dtype, gate.path)  # type: ignore[arg-type]
            self.verify = VLLMVerify(chain, decision=gate, defer_general=True)
        _log_once(f"{facts.backend} layer: {'kgen' if self.route.use_kgen else 'vLLM'} ({self.route.reason})")

    @classmethod
    def from_impl(cls, impl: Any, backend: str, widths: tuple[int, int, int, int, int], **facts: Any) -> KgenLayer:
        """Facts of a vLLM impl under the current vLLM config; ``widths`` are (query heads, KV heads,
        qk, pe, v) as the gate takes them."""
        config = _vllm_config()
        model = getattr(config, "model_config", None)
        kv_cache_dtype = str(impl.kv_cache_dtype)
        if model is None:
            gate = GateDecision("general", None, "no vLLM model config when the layer was built")
            return cls(LayerFacts(backend, gate, kv_cache_dtype, **facts), "bfloat16")
        from vllm.v1.attention.backend import max_decode_query_len

        q_dtype = dtype_name(model.dtype)
        kv = kv_dtype_for(kv_cache_dtype, q_dtype, _fp8_name())
        cp = max(int(getattr(impl, "dcp_world_size", 1)), int(getattr(impl, "pcp_world_size", 1)))
        gate = _gate(model.architectures[0], widths, kv_cache_dtype, kv, q_dtype)
        layer_facts = LayerFacts(
            backend, gate, kv_cache_dtype, kv, context_parallel=cp, max_verify_len=max_decode_query_len(config), **facts
        )
        return cls(layer_facts, q_dtype)

    def step(self, step: StepFacts) -> bool:
        """Route one call; True when kgen should compute it."""
        self.last_route = step_route(self.route, step, self.facts.max_verify_len)
        if not self.last_route.use_kgen:
            _log_once(f"vLLM's kernel for {self.last_route.reason}", logging.DEBUG)
        return self.last_route.use_kgen

    def run(self, *args: Any, **kwargs: Any) -> bool:
        """``VLLMVerify`` on vLLM's arguments; False (``output`` untouched) when kgen refuses."""
        assert self.verify is not None
        try:
            ran = self.verify(*args, **kwargs)
        except ValueError as exc:  # kgen's validation: input outside its contract, nothing written
            self.last_route = Route(False, f"kgen refused the call: {exc}")
            _log_once(self.last_route.reason, logging.WARNING)
            return False
        if ran is None:
            self.last_route = Route(False, f"kgen's kernels refused the call: {self.verify.last_refusal or 'why_not'}")
            _log_once(self.last_route.reason, logging.DEBUG)
        return ran is not None


def _gate(model_arch: str, widths: tuple[int, int, int, int, int], kv_cache_dtype: str, kv: str | None,
          q: str) -> GateDecision:  # fmt: skip
    """kgen's gate (``gate_from_env``: the GPU, the switches, the generated modules) for one layer."""
    heads, kv_heads, qk, pe, v = widths
    if kv_cache_dtype == "fp8_e5m2":
        return GateDecision("general", None, f"kv_cache_dtype 'fp8_e5m2': {E5M2_STORED_AS}")
    if kv is None:
        return GateDecision("general", None, f"kv_cache_dtype {kv_cache_dtype!r}: kgen has no module for that format")
    if kv_heads < 1 or heads % kv_heads:
        return GateDecision("general", None, f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    query = GateQuery(
        model_arch=model_arch, topk=1, qk_dim=qk, pe_dim=pe, v_dim=v, group_size=heads // kv_heads,
        num_local_kv_heads=kv_heads, kv_dtype=kv, q_dtype=q,
    )  # fmt: skip
    return gate_from_env(query)


# --------------------------------------------------------------------------- Triton attention


def triton_attn_layer(impl: Any) -> KgenLayer:
    """The ``KgenLayer`` of a ``TritonAttentionImpl`` (vllm/v1/attention/backends/triton_attn.py,
    0.33.0: ``sliding_window`` is ``(-1, -1)`` when off, ``logits_soft_cap`` 0 when off)."""
    widths = (impl.num_heads, impl.num_kv_heads, impl.head_size, 0, impl.head_size)
    return KgenLayer.from_impl(
        impl, "TRITON_ATTN", widths, attn_type=str(getattr(impl.attn_type, "value", impl.attn_type)),
        alibi=impl.alibi_slopes is not None, sinks=impl.sinks is not None,
        sliding_window=tuple(impl.sliding_window) != (-1, -1), logits_soft_cap=float(impl.logits_soft_cap or 0.0),
        chunk_lookback=int(impl.chunk_lookback), kv_sharing=impl.kv_sharing_target_layer_name is not None,
    )  # fmt: skip


def triton_attn_forward(
    kgen: KgenLayer, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor | None,
    value: torch.Tensor | None, kv_cache: torch.Tensor, md: Any, output: torch.Tensor,
    quantized_output: bool,
) -> bool:  # fmt: skip
    """kgen's kernel on one ``TritonAttentionImpl.forward`` call; False, ``output`` untouched, when
    vLLM's kernel must run it. The cache views are the ones vLLM's forward takes: the logical
    ``[blocks, H_kv, page, 2 * D]`` cache transposed and split into K and V
    ``[blocks, page, H_kv, D]``; the descales are the layer's one-element ``_k_scale`` /
    ``_v_scale`` (read on an FP8 cache only, as vLLM's kernel does)."""
    step = StepFacts(
        max_query_len=int(md.max_query_len), causal=md.causal is True,
        has_key_value=key is not None and value is not None, quantized_output=quantized_output,
        mm_prefix=md.mm_prefix_range_tensor is not None, rswa=md.rswa_prefix_lens is not None,
    )  # fmt: skip
    if not kgen.step(step):
        return False
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    kv_dtype = _torch_dtype(kgen.facts.kv_dtype)
    if kv_dtype.itemsize == 1 and key_cache.dtype != kv_dtype:  # an FP8 cache allocated as bytes
        key_cache, value_cache = key_cache.view(kv_dtype), value_cache.view(kv_dtype)
    n = md.num_actual_tokens
    q_descale = layer._q_scale if query.element_size() == 1 else None
    return kgen.run(
        query[:n], key[:n], value[:n], output[:n], key_cache, value_cache, md.block_table, md.seq_lens,  # type: ignore[index]
        md.query_start_loc, step.max_query_len, layer._k_scale, layer._v_scale, impl.scale, q_descale=q_descale,
    )  # fmt: skip


def _torch_dtype(name: str | None) -> torch.dtype:
    return getattr(torch, name) if name else torch.bfloat16


# --------------------------------------------------------------------------- Triton MLA


def triton_mla_layer(impl: Any) -> KgenLayer:
    """The ``KgenLayer`` of a ``TritonMLAImpl`` (vllm/v1/attention/backends/mla/triton_mla.py,
    0.33.0): one latent KV head of ``kv_lora_rank + qk_rope_head_dim`` (V the latent part)."""
    rank, rope = impl.kv_lora_rank, impl.qk_rope_head_dim
    widths = (impl.num_heads, 1, rank + rope, rope, rank)
    return KgenLayer.from_impl(impl, "TRITON_MLA", widths)


def mla_draft_latents(
    cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, length: int,
    dtype: torch.dtype, scale: torch.Tensor | float,
) -> torch.Tensor:  # fmt: skip
    """The draft rows' ``[rows, 1, 576]`` latent + RoPE K, read from vLLM's MLA cache
    ``[blocks, page, 576]`` on the device: request b's draft token t sits at position
    ``seq_lens[b] - length + t`` (vLLM wrote it before ``forward_mqa``). An FP8 cache is
    dequantized as vLLM's ``decode_attention_fwd`` does (fp32 times the layer's scale, then the
    query dtype). Positions below 0 (padding requests, graph-capture metadata) read position 0."""
    page = cache.shape[1]
    offsets = torch.arange(length - 1, -1, -1, device=seq_lens.device, dtype=seq_lens.dtype)
    pos = (seq_lens[:, None] - 1 - offsets[None, :]).clamp_min(0).to(torch.int64)
    blocks = torch.gather(block_table.to(torch.int64), 1, pos // page)
    rows = cache[blocks.flatten(), (pos % page).flatten()]
    if cache.element_size() == 1:
        rows = rows.to(torch.float32) * scale
    return rows.to(dtype).unsqueeze(1)


def triton_mla_forward_mqa(kgen: KgenLayer, impl: Any, q: Any, kv_cache: torch.Tensor, md: Any, layer: Any) -> Any:
    """kgen's kernel on one ``TritonMLAImpl.forward_mqa`` call: ``(o, None)`` with ``o`` the
    ``[rows, H, kv_lora_rank]`` latent output, or None when vLLM's kernel must run it. ``q`` is
    vLLM's ``(ql_nope, q_pe)`` or their concatenation; the LSE is None (context parallelism,
    its one reader, is refused by the layer route)."""
    decode = md.decode
    num_decodes = 0 if decode is None else int(decode.seq_lens.shape[0])
    rows = q[0].shape[0] if isinstance(q, tuple) else q.shape[0]
    length, rest = divmod(rows, num_decodes) if num_decodes else (0, 1)
    if not kgen.step(StepFacts(max_query_len=length, causal=md.causal is True, uniform=rest == 0)):
        return None
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    pages = kv_cache.unsqueeze(2)
    draft = mla_draft_latents(kv_cache, decode.block_table, decode.seq_lens, length, q.dtype, layer._k_scale)
    o = torch.empty(rows, q.shape[1], impl.kv_lora_rank, dtype=q.dtype, device=q.device)
    rank = impl.kv_lora_rank
    ran = kgen.run(
        q, draft, draft[..., :rank], o, pages, pages[..., :rank], decode.block_table, decode.seq_lens,
        # Each request's rows are consecutive, ``length`` of them (vLLM's forward_mqa makes the same
        # assumption); made per call, so a captured graph replays the op that fills it.
        torch.arange(0, rows + 1, length, dtype=torch.int32, device=q.device), length, layer._k_scale,
        layer._k_scale, impl.scale,
    )  # fmt: skip
    return (o, None) if ran else None


# --------------------------------------------------------------------------- vLLM's registry


def _triton_attn_classes() -> dict[str, type]:
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

    class KgenTritonAttentionImpl(TritonAttentionImpl):
        """vLLM's ``TritonAttentionImpl`` with verify calls on kgen's kernel."""

        __qualname__ = "KgenTritonAttentionImpl"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kgen = triton_attn_layer(self)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):  # fmt: skip
            quantized = output_scale is not None or output_block_scale is not None
            if attn_metadata is not None and triton_attn_forward(
                self.kgen, self, layer, query, key, value, kv_cache, attn_metadata, output, quantized
            ):
                return output
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)  # fmt: skip

    class KgenTritonAttentionBackend(TritonAttentionBackend):
        """vLLM's ``TritonAttentionBackend`` (name ``TRITON_ATTN``) with kgen's impl."""

        __qualname__ = "KgenTritonAttentionBackend"

        @staticmethod
        def get_impl_cls() -> type[KgenTritonAttentionImpl]:
            return KgenTritonAttentionImpl

    return {cls.__qualname__: cls for cls in (KgenTritonAttentionImpl, KgenTritonAttentionBackend)}


def _triton_mla_classes() -> dict[str, type]:
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

    class KgenTritonMLAImpl(TritonMLAImpl):
        """vLLM's ``TritonMLAImpl`` with verify rows on kgen's kernel."""

        __qualname__ = "KgenTritonMLAImpl"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kgen = triton_mla_layer(self)

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):  # fmt: skip
            out = triton_mla_forward_mqa(self.kgen, self, q, kv_c_and_k_pe_cache, attn_metadata, layer)
            if out is not None:
                return out
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    class KgenTritonMLABackend(TritonMLABackend):
        """vLLM's ``TritonMLABackend`` (name ``TRITON_MLA``) with kgen's impl."""

        __qualname__ = "KgenTritonMLABackend"

        @staticmethod
        def get_impl_cls() -> type[KgenTritonMLAImpl]:
            return KgenTritonMLAImpl

    return {cls.__qualname__: cls for cls in (KgenTritonMLAImpl, KgenTritonMLABackend)}


_CLASS_BUILDERS = {
    "KgenTritonAttentionImpl": _triton_attn_classes,
    "KgenTritonAttentionBackend": _triton_attn_classes,
    "KgenTritonMLAImpl": _triton_mla_classes,
    "KgenTritonMLABackend": _triton_mla_classes,
}
# vLLM's registry names and the classes kgen puts behind them.
OVERRIDES = {"TRITON_ATTN": "KgenTritonAttentionBackend", "TRITON_MLA": "KgenTritonMLABackend"}


def __getattr__(name: str) -> type:
    """The backend classes subclass vLLM's, so they are built on first access (vLLM's registry
    resolves ``kgen.integrations.vllm.KgenTritonAttentionBackend`` by name): importing this
    module needs no vLLM."""
    build = _CLASS_BUILDERS.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    classes = build()
    globals().update(classes)
    return classes[name]


def enable() -> None:
    """Point vLLM's ``TRITON_ATTN`` and ``TRITON_MLA`` at kgen's subclasses (this process only;
    idempotent). vLLM's ``AttentionBackendEnum.X.clear_override()`` undoes it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, cls in OVERRIDES.items():
        register_backend(AttentionBackendEnum[name], f"{__name__}.{cls}")
    _log_once(f"TRITON_ATTN and TRITON_MLA resolve to kgen's backends (built for vLLM {VLLM_VERSION})")


def register() -> None:
    """vLLM's general-plugin entry point: ``enable()`` when ``KGEN_VLLM`` is on, else nothing."""
    if env_flag(ENABLE_ENV):
        enable()
