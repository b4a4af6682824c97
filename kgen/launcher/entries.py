"""The call shapes a generated module offers: SGLang's target-verify call
(``verify_shared_kv_fwd``, its 23 arguments, and its ``why_not`` / ``can_handle``), the
vLLM-shaped paged call (``verify_paged_fwd`` / ``why_not_paged``), and ``launch`` without checks
for the tuner and the bench. ``VerifyLauncher`` inherits them; it supplies ``run``,
``device_info``, ``cached_setup`` and ``check_indices``.
"""

from __future__ import annotations

from typing import Any

import torch

from . import checks
from .index_check import check_index_values


class CallShapes:
    """Entry points, checks first: a call a module cannot run is refused with a reason (why_not)
    and the entry returns False, o_extend untouched, nothing raised."""

    def launch(self, q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
               o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor,
               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, max_len_extend: int, k_scale: Any = 1.0,
               v_scale: Any = 1.0, sm_scale: float | None = None, config: dict[str, Any] | None = None,
               custom_mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None,
               is_causal: bool = True, kv_len_adjust: int = 0) -> None:
        """Run the kernels on SGLang's token-slot pool with no checks (callers: tuner, bench).

        ``config`` is a block-config dict (fields of kgen.blockconfig.BlockConfig); None uses
        this module's table for the device's arch. ``custom_mask``/``mask_indptr``: SGLang's
        tree mask (the draft block of each request's [L, P + L] rows), as in verify_shared_kv_fwd;
        ``is_causal`` and ``kv_len_adjust`` (<= 0) as there.
        """
        self.run(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                 kv_indices, int(max_len_extend), k_scale, v_scale, sm_scale, config,
                 page_size=None, stride_table=0,
                 k_strides=(k_buffer.stride(0), 0, k_buffer.stride(1)),
                 v_strides=(v_buffer.stride(0), 0, v_buffer.stride(1)),
                 custom_mask=custom_mask, mask_indptr=mask_indptr, is_causal=is_causal,
                 prefix_trim_len=-int(kv_len_adjust))

    def common_reason(self, q: Any, k_extend: Any, v_extend: Any, o: Any, k_pool: Any, v_pool: Any,
                      qo_indptr: Any, max_len_extend: Any, k_scale: Any, v_scale: Any, pool_ndim: int = 3,
                      sm_scale: Any = None) -> str:
        """Reasons shared by both entry points; '' when the shapes and dtypes are ours."""
        ident = self.identity
        tensors = {"q_extend": q, "k_extend": k_extend, "v_extend": v_extend, "o_extend": o,
                   "k_buffer": k_pool, "v_buffer": v_pool}
        if not isinstance(q, torch.Tensor):
            return "q_extend is not a tensor"
        return (checks.tensor_reason(tensors, q, pool_ndim, self.interpret)
                or checks.shape_reason(ident, q, k_extend, v_extend, o, k_pool, v_pool)
                or checks.draft_reason(qo_indptr, max_len_extend, q, ident.max_draft_tokens)
                or checks.scale_reason(ident, k_scale, v_scale, q, sm_scale)
                or checks.v_view_reason(ident, k_pool, v_pool)
                or self.target_reason(q, q.shape[1] // k_extend.shape[1], qo_indptr.shape[0] - 1, max_len_extend))

    def target_reason(self, q: torch.Tensor, group: int, batch: int, max_len: int) -> str:
        """Why the device cannot run this module ('' when it can): an arch `kgen check` did not
        prove, an FP8 format its tensor cores lack, or no program that fits."""
        arch, num_sms, _ = self.device_info(q.device.type, q.device.index)
        reason = checks.target_reason(self.identity, arch)
        if reason:
            return reason
        if batch > 0 and self.cached_setup(arch, num_sms, group, batch, max_len, None) is None:
            return f"no program fits {arch}'s shared memory for group {group} at draft length {max_len}"
        return ""

    def why_not(self, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale,
                sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True, sliding_window_size=-1,
                sinks=None, window_kv_offsets=None, xai_temperature_len=-1, max_bs=None, *,
                kv_len_adjust=0) -> str:
        """Why this module cannot run these arguments ('' when it can). SGLang's signature."""
        reason = (checks.unsupported_features(logit_cap, sliding_window_size, sinks, window_kv_offsets,
                                              xai_temperature_len)
                  or checks.kv_len_adjust_reason(kv_len_adjust, self.identity.max_draft_tokens))
        if reason:
            return reason
        # A given custom_mask governs, is_causal True or False (SGLang's extend_attention_fwd); without
        # one, is_causal=False is a whole draft block (block drafters): every draft token sees every other.
        if kv_len_adjust and custom_mask is not None:
            return ("kv_len_adjust with a custom_mask: decode through the verify entry is a chain, and which prefix "
                    "the mask's [L, P + L] rows would count is not defined; the general path takes it")
        if custom_mask is not None and not skip_prefix_custom_mask:
            return ("skip_prefix_custom_mask=False: the kernels read only the mask's draft block (every draft token "
                    "sees the whole prefix); honouring its prefix columns would need a host read of them")
        reason = self.common_reason(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                                    max_len_extend, k_scale, v_scale, sm_scale=sm_scale)
        if not reason and custom_mask is not None:
            reason = checks.mask_reason(custom_mask, mask_indptr, q_extend, qo_indptr.shape[0] - 1, max_len_extend,
                                        False)
        if reason:
            return reason
        reason = checks.index_tensor_reason(q_extend, kv_indptr=kv_indptr, kv_indices=kv_indices)
        if not reason and kv_indptr.shape[0] != qo_indptr.shape[0]:
            return "kv_indptr and qo_indptr have different batch sizes"
        return reason

    def can_handle(self, *args: Any, **kwargs: Any) -> bool:
        """True when verify_shared_kv_fwd would run these arguments (same signature)."""
        return self.why_not(*args, **kwargs) == ""

    def verify_shared_kv_fwd(self, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                             kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend,
                             k_scale, v_scale, sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True,
                             sliding_window_size=-1, sinks=None, window_kv_offsets=None,
                             xai_temperature_len=-1, max_bs=None, *, kv_len_adjust=0,
                             check_indices=False) -> bool:
        """SGLang's target-verify call. Writes o_extend and returns True, or returns False
        (o_extend untouched, nothing raised) when this module does not handle the input.

        Index values are not checked: an out-of-range kv_indices entry reads outside the pool.
        With check_indices=True (or KGEN_CHECK_INDICES=1 when the module was imported), an
        accepted call first checks them on the device and raises ValueError naming the tensor,
        the request and the value (qo_indptr/kv_indptr start at 0 and never decrease, qo_indptr
        ends at the token count, kv_indices used lie in the pool, drafts <= max_len_extend).
        That check syncs the host, so it is for debugging and not for CUDA-graph capture.

        custom_mask (a tree, EAGLE topk > 1): SGLang's layout, a flat bool/uint8 tensor holding
        request b's row-major [L, P + L] block from mask_indptr[b]; the kernels read its draft
        columns on the device and it governs whatever is_causal says. Without it the draft is the
        causal chain (is_causal=True) or a block whose tokens all see each other (is_causal=False).

        k_scale / v_scale multiply the prefix's (the pool's) scores and P.V, never the draft's.
        kv_len_adjust (SGLang's, an int <= 0): request b's prefix is its kv_indptr slice less its
        last -kv_len_adjust slots (-1: decode through this entry, the new token already in the
        pool). A slice shorter than that is not checked unless check_indices is on."""
        if self.why_not(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                        custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale, logit_cap,
                        skip_prefix_custom_mask, sliding_window_size, sinks, window_kv_offsets, xai_temperature_len,
                        max_bs, kv_len_adjust=kv_len_adjust):
            return False
        if check_indices or self.check_indices:
            check_index_values(q_extend.shape[0], qo_indptr, max_len_extend, kv_indptr=kv_indptr,
                               kv_indices=kv_indices, pool_slots=k_buffer.shape[0], custom_mask=custom_mask,
                               mask_indptr=mask_indptr, prefix_trim_len=-kv_len_adjust)
        self.launch(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                    kv_indices, max_len_extend, k_scale, v_scale, sm_scale, custom_mask=custom_mask,
                    mask_indptr=mask_indptr, is_causal=is_causal, kv_len_adjust=kv_len_adjust)
        return True

    def why_not_paged(self, q_extend, k_extend, v_extend, o_extend, k_cache, v_cache, block_table,
                      prefix_lens, qo_indptr, max_len_extend, k_scale=1.0, v_scale=1.0, sm_scale=None,
                      custom_mask=None, mask_indptr=None, is_causal=True) -> str:
        """Why verify_paged_fwd cannot run these arguments ('' when it can)."""
        reason = (self.common_reason(q_extend, k_extend, v_extend, o_extend, k_cache, v_cache, qo_indptr,
                                     max_len_extend, k_scale, v_scale, pool_ndim=4, sm_scale=sm_scale)
                  or checks.paged_reason(self.identity, q_extend, k_cache, v_cache, block_table, prefix_lens,
                                         qo_indptr, is_causal))
        if not reason and custom_mask is not None:
            reason = checks.mask_reason(custom_mask, mask_indptr, q_extend, block_table.shape[0], max_len_extend, True)
        return reason

    def verify_paged_fwd(self, q_extend, k_extend, v_extend, o_extend, k_cache, v_cache, block_table,
                         prefix_lens, qo_indptr, max_len_extend, k_scale=1.0, v_scale=1.0, sm_scale=None,
                         custom_mask=None, mask_indptr=None, is_causal=True, config=None, *,
                         check_indices=False) -> bool:
        """vLLM-style paged cache ([blocks, page, H_kv, D] + block table): the kernel walks the
        pages itself. Returns False (o untouched) when this module does not handle the input.

        custom_mask (a tree): a 2-D bool/uint8 [rows, W] mask; draft token i of request b sees
        draft token j when custom_mask[mask_indptr[b] + i, j] is set (every draft token sees the
        whole prefix). Requests may share rows: vLLM's one tree for the batch is its
        tree_attn_bias == 0 with mask_indptr all zeros. Without it the draft is the causal chain,
        or with is_causal=False a block whose tokens all see each other.

        check_indices=True (or KGEN_CHECK_INDICES=1 when the module was imported) checks index
        values first, as in verify_shared_kv_fwd: prefix_lens in 0..block_table width x page
        size, the block_table entries they use inside the cache, qo_indptr and the mask rows as
        there. It raises ValueError on bad values and syncs the host (debugging only, not under
        graph capture)."""
        if self.why_not_paged(q_extend, k_extend, v_extend, o_extend, k_cache, v_cache, block_table, prefix_lens,
                              qo_indptr, max_len_extend, k_scale, v_scale, sm_scale, custom_mask, mask_indptr,
                              is_causal):
            return False
        if check_indices or self.check_indices:
            check_index_values(q_extend.shape[0], qo_indptr, max_len_extend, block_table=block_table,
                               prefix_lens=prefix_lens, page_size=k_cache.shape[1], num_blocks=k_cache.shape[0],
                               custom_mask=custom_mask, mask_indptr=mask_indptr)
        self.run(q_extend, k_extend, v_extend, o_extend, k_cache, v_cache, qo_indptr, prefix_lens,
                 block_table, int(max_len_extend), k_scale, v_scale, sm_scale, config,
                 page_size=k_cache.shape[1], stride_table=block_table.stride(0),
                 k_strides=(k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
                 v_strides=(v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
                 custom_mask=custom_mask, mask_indptr=mask_indptr, is_causal=is_causal)
        return True
