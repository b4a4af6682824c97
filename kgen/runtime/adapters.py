"""Engine-shaped entry points over the chain: SGLang's flat slots, vLLM's block tables.

Build one adapter per attention backend at start-up (``sglang_verify_for`` /
``vllm_verify_for``): that is when the gate runs, the device is queried and the modules
are imported. A call then only checks tensor metadata and launches.

- ``SGLangVerify`` takes exactly what ``TritonAttnBackend.forward_extend`` passes to its
  verify function at target verify, and returns a bool like SGLang's verify kernels do.
  With ``defer_general=True`` it returns False when no kernel accepts, so the engine keeps
  running its own ``extend_attention_fwd``; otherwise kgen's general path runs.
- ``VLLMVerify`` takes vLLM's names (``seq_lens`` counts the new tokens too,
  ``query_start_loc`` is ``qo_indptr``, ``tree_attn_bias`` the tree backend's one tree for
  the batch) and converts them on the device, without syncs. Its descale tensors mean what
  they mean to vLLM's Triton backend (``vllm_cache_scale``: unread on a 16-bit cache). It
  returns None, ``output`` untouched, for a call no kgen path serves (an FP8 query with its
  ``q_descale``, a ``[batch, H_kv]`` descale of separate values): vLLM's own kernel then runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from kgen.runtime.call import Features, PagedCall, Scale, VerifyCall, sglang_signature
from kgen.runtime.chain import Loader, VerifyChain
from kgen.runtime.gate import DETECT, GateDecision, GateQuery, Inventory, PathName, gate_from_env


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"``; strings pass through (aliases are
    resolved by the gate and ``kgen.load``)."""
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


@functools.lru_cache(maxsize=64)
def get_chain(layout: str | None, kv_dtype: str, q_dtype: str, start: PathName = "grouped") -> VerifyChain:
    """A chain with the default loader, built once per specialization and process."""
    return VerifyChain(layout, kv_dtype, q_dtype, start=start)


class SGLangVerify:
    """SGLang's target-verify call shape over a ``VerifyChain``."""

    def __init__(
        self, chain: VerifyChain, *, defer_general: bool = False, decision: GateDecision | None = None
    ) -> None:
        self.chain = chain
        self.defer_general = defer_general
        self.decision = decision

    @sglang_signature
    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        """Write ``o_extend``; True when written (always, unless ``defer_general``).

        SGLang's arguments (``VerifyCall``'s fields, positional or by name):
        ``q_extend``/``o_extend`` are ``[T, H_q, D]`` views (``q.view(-1, tp_q_head_num,
        qk_head_dim)``); ``k_scale``/``v_scale`` are SGLang's descales (None when not fp8).
        """
        call = VerifyCall.from_sglang(*args, **kwargs)
        if self.defer_general:
            return self.chain.try_call(call) is not None
        self.chain.run(call)
        return True


def vllm_window(sliding_window: int | tuple[int, int] | None) -> int:
    """vLLM's window to SGLang's ``sliding_window_size`` (keys allowed behind the query).

    vLLM configs give ``sliding_window = W`` keys including the query's own, and backends
    pass ``(W - 1, 0)``; both mean "key position >= query position - (W - 1)".
    """
    if sliding_window is None:
        return -1
    if isinstance(sliding_window, tuple):
        left, right = sliding_window
        if right not in (0, -1):
            raise ValueError(f"a verify window cannot look ahead: got right = {right}; use (left, 0)")
        return left if left >= 0 else -1
    return sliding_window - 1 if sliding_window > 0 else -1


def vllm_tree_mask(tree_attn_bias: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(custom_mask, mask_indptr) of the paged entry for vLLM's tree: ``tree_attn_bias`` is the
    tree backend's ``[T, T]`` float bias (0 where query token i sees draft token j, -inf
    elsewhere), one tree for every request, which its ``unified_attention`` applies on top of
    causality. Every request reads the same rows (``mask_indptr`` all zeros): no copy per
    request, on the device, graph-safe."""
    if tree_attn_bias.dim() != 2 or tree_attn_bias.shape[0] != tree_attn_bias.shape[1]:
        raise ValueError(f"tree_attn_bias must be a square [T, T] bias, got shape {tuple(tree_attn_bias.shape)}")
    mask = torch.tril(tree_attn_bias == 0)
    return mask, torch.zeros(batch + 1, dtype=torch.int32, device=tree_attn_bias.device)


def vllm_cache_scale(scale: Scale, cache: torch.Tensor) -> Scale:
    """vLLM's descale for ``cache`` as vLLM's Triton attention applies it: a tensor on a 16-bit
    cache is never read, so it is dropped (1.0); on an FP8 cache, and floats anywhere (kgen's
    own meaning: the pool is scaled), it is kept.

    vLLM passes ``layer._k_scale.expand(batch, H_kv)`` whatever the cache dtype
    (vllm-project/vllm vllm/v1/attention/backends/triton_attn.py, ``TritonAttentionImpl.forward``),
    and its kernel reads that descale only in FP8 modes: ``_cast_kv_tile`` in
    vllm/v1/attention/ops/triton_unified_attention.py at 001394336840495fb529a33f71767ecbfdc88372
    plainly casts the tile for ``KVQuantMode.NONE`` and does ``tl.load(tensor_scale)`` only for
    FP8 per-tensor (and at 001ceb3e98e7a19ebe33f542a368fa73bf6c76ad, vllm/attention/ops/, only
    when ``K_load.dtype.is_fp8()``)."""
    if isinstance(scale, torch.Tensor) and cache.element_size() >= 2:
        return 1.0
    return scale


class VLLMVerify:
    """vLLM's call shape (block tables) over a ``VerifyChain``.

    ``key_cache``/``value_cache`` are ``[num_blocks, block_size, H_kv, D]`` (FlashAttention's
    ``kv_cache.unbind(0)``); the draft tokens' K/V come from ``key``/``value``, so they need
    not be written into the cache before the call. ``tree_attn_bias`` (vLLM's tree attention
    backend, ``TreeAttentionMetadata.tree_attn_bias``) turns tree verification on. A call no
    kgen path serves returns None with ``output`` untouched, and ``last_refusal`` says why.
    With ``defer_general=True`` only the kernel levels run: a call no kernel accepts returns None
    too, ``output`` untouched, so vLLM's own kernel runs it (kgen's general path syncs the host,
    which CUDA-graph capture forbids).
    """

    def __init__(
        self, chain: VerifyChain, *, decision: GateDecision | None = None, defer_general: bool = False
    ) -> None:
        self.chain = chain
        self.decision = decision
        self.defer_general = defer_general

    @property
    def last_refusal(self) -> str:
        """Why the latest refused call was refused ('' before any was)."""
        return self.chain.last_refusal

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        softmax_scale: float | None = None,
        logits_soft_cap: float | None = None,
        sliding_window: int | tuple[int, int] | None = None,
        sinks: torch.Tensor | None = None,
        tree_attn_bias: torch.Tensor | None = None,
        q_descale: Scale = None,
    ) -> PathName | None:
        """Write ``output`` and return the path that ran, or return None with ``output``
        untouched when no kgen path serves the call (an FP8 query: kgen applies no
        ``q_descale``; an FP8 cache's ``[batch, H_kv]`` descale of separate values), so vLLM runs
        its own kernel. ``k_scale``/``v_scale`` have vLLM's meaning (``vllm_cache_scale``):
        tensors are dropped on a 16-bit cache, as vLLM's kernel never reads them there.
        ``seq_lens`` counts each request's committed prefix plus its draft tokens (vLLM's
        meaning); ``tree_attn_bias`` is the tree backend's [T, T] bias (``vllm_tree_mask``), None for a chain."""
        if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1:
            raise ValueError("query_start_loc must be a 1-D tensor of batch_size + 1 offsets")
        bs = query_start_loc.numel() - 1
        if not isinstance(seq_lens, torch.Tensor) or seq_lens.numel() < bs:
            raise ValueError(f"seq_lens must be a tensor with one length per request ({bs})")
        draft = query_start_loc[1:] - query_start_loc[:-1]
        # Clamped at 0 on the device: vLLM's padding requests, and the metadata it captures CUDA
        # graphs with (seq_lens filled with 1 whatever the query length), have seq_lens < draft.
        prefix_lens = (seq_lens[:bs] - draft).clamp_min(0).to(torch.int32)
        custom_mask, mask_indptr = vllm_tree_mask(tree_attn_bias, bs) if tree_attn_bias is not None else (None, None)
        features = Features(
            custom_mask=custom_mask,
            mask_indptr=mask_indptr,
            sliding_window_size=vllm_window(sliding_window),
            sinks=sinks,
            logit_cap=float(logits_soft_cap or 0.0),
        )
        call = PagedCall(
            query, key, value, output, key_cache, value_cache, block_table[:bs], prefix_lens,
            query_start_loc, max_query_len, vllm_cache_scale(k_scale, key_cache),
            vllm_cache_scale(v_scale, value_cache), softmax_scale, features=features, q_descale=q_descale,
        )  # fmt: skip
        return self.chain.try_paged_kernels(call) if self.defer_general else self.chain.try_paged(call)


def _chain_for(decision: GateDecision, kv: str, q: str, loader: Loader | None) -> VerifyChain:
    if loader is None:
        return get_chain(decision.layout, kv, q, decision.path)
    return VerifyChain(decision.layout, kv, q, start=decision.path, loader=loader)


def verify_chain_for(
    *,
    model_arch: str,
    num_q_heads: int,
    num_kv_heads: int,
    qk_dim: int,
    v_dim: int,
    pe_dim: int = 0,
    topk: int = 1,
    kv_dtype: torch.dtype | str = "bfloat16",
    q_dtype: torch.dtype | str = "bfloat16",
    loader: Loader | None = None,
    device_arch: str | None | object = DETECT,
    env: Mapping[str, str] | None = None,
    inventory: Inventory | None = None,
) -> tuple[VerifyChain, GateDecision]:
    """Gate + chain for one model on this rank (call once at start-up); the adapters wrap the chain.

    Head counts are TP-local (``tp_q_head_num``, ``tp_k_head_num``); ``model_arch`` is
    ``hf_config.architectures[0]``; ``qk_dim`` is the full K width (MLA: 576, pe 64).
    ``device_arch``, ``env`` and ``inventory`` replace the detected GPU, ``os.environ`` and
    the scanned modules/tables (tests).
    """
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads per rank ({num_q_heads}) must be a multiple of KV heads per rank ({num_kv_heads})"
        )
    kv, q = dtype_name(kv_dtype), dtype_name(q_dtype)
    query = GateQuery(
        model_arch=model_arch, topk=topk, qk_dim=qk_dim, pe_dim=pe_dim, v_dim=v_dim,
        group_size=num_q_heads // num_kv_heads, num_local_kv_heads=num_kv_heads, kv_dtype=kv, q_dtype=q,
    )  # fmt: skip
    decision = gate_from_env(query, device_arch=device_arch, env=env, inventory=inventory)
    return _chain_for(decision, kv, q, loader), decision


def sglang_verify_for(*, defer_general: bool = False, **model: Any) -> SGLangVerify:
    """Gate + chain + SGLang adapter: ``verify_chain_for``'s keywords, plus ``defer_general``
    (True: return False when no kernel accepts, so SGLang runs its own ``extend_attention_fwd``)."""
    chain, decision = verify_chain_for(**model)
    return SGLangVerify(chain, defer_general=defer_general, decision=decision)


def vllm_verify_for(*, defer_general: bool = False, **model: Any) -> VLLMVerify:
    """Gate + chain + vLLM adapter: ``verify_chain_for``'s keywords, plus ``defer_general``
    (True: return None when no kernel accepts, so vLLM runs its own kernel)."""
    chain, decision = verify_chain_for(**model)
    return VLLMVerify(chain, decision=decision, defer_general=defer_general)
