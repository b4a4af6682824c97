"""Why a module cannot run a call: each function returns a reason, or '' when the call is ours.

They read shapes, dtypes, strides, devices and Python scalars only, never tensor values, so
``why_not`` costs no host sync and is safe under CUDA-graph capture.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .identity import ModuleIdentity

INDEX_DTYPES = (torch.int32, torch.int64)
# Custom masks the kernels read: one byte a bit (SGLang sends bool).
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8)


def unsupported_features(logit_cap: float | None, sliding_window_size: int | None, sinks: Any,
                         window_kv_offsets: Any, xai_temperature_len: int | None) -> str:
    """SGLang's attention features no module implements (the general path serves them)."""
    if sinks is not None:
        return "attention sinks are not supported"
    if sliding_window_size is not None and sliding_window_size > 0:
        return "sliding-window attention is not supported"
    if window_kv_offsets is not None:
        return "window_kv_offsets (sliding window) is not supported"
    if logit_cap is not None and logit_cap > 0:
        return "logit soft-capping is not supported"
    if xai_temperature_len is not None and xai_temperature_len > 0:
        return "xai temperature scaling is not supported"
    return ""


def kv_len_adjust_reason(kv_len_adjust: Any, max_draft_tokens: int) -> str:
    """SGLang's kv_len_adjust: added to each request's kv_indptr length to give its prefix (-1:
    decode through the verify entry, the token being generated already the last slot)."""
    if isinstance(kv_len_adjust, bool) or not isinstance(kv_len_adjust, int):
        return f"kv_len_adjust must be a Python int (SGLang's), got {type(kv_len_adjust).__name__}"
    if kv_len_adjust > 0:
        return (f"kv_len_adjust={kv_len_adjust} > 0 would read kv_indices past kv_indptr[b + 1], another "
                "request's slots; only values <= 0 (trimming each request's last slots) are meaningful")
    if kv_len_adjust < -max_draft_tokens:
        return (f"kv_len_adjust={kv_len_adjust}: trimming more than MAX_DRAFT_TOKENS = {max_draft_tokens} slots "
                "a request is no verify or decode call this module serves")
    return ""


def tensor_reason(tensors: dict[str, Any], q: torch.Tensor, pool_ndim: int, interpret: bool) -> str:
    """Every tensor argument is a tensor of the right rank, contiguous in its last dim, on q's
    device, and that device is one Triton can launch on."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dim() != (3 if name.endswith("extend") else pool_ndim):
            return f"{name} has {t.dim()} dims"
        if t.stride(-1) != 1:
            return f"{name} is not contiguous in its last dim"
        if t.device != q.device:
            return f"{name} is on {t.device}, q_extend on {q.device}"
    if q.device.type != "cuda" and not interpret:
        # Without the interpreter Triton finds no driver for these tensors and raises.
        return (f"{q.device.type} tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
                "triton is imported, or pass CUDA tensors")
    return ""


def shape_reason(ident: ModuleIdentity, q: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                 o: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> str:
    """Dtypes, head widths and head counts are this module's and agree with each other."""
    if any(t.dtype != ident.q_dtype for t in (q, k_extend, v_extend, o)):
        return f"query-side dtypes must be {ident.q_dtype} (this module's)"
    if k_pool.dtype != ident.kv_dtype or v_pool.dtype != ident.kv_dtype:
        return f"KV dtype {k_pool.dtype} is not this module's {ident.kv_dtype}"
    num_tokens, num_q_heads, qk_dim = q.shape
    num_kv_heads = k_extend.shape[1]
    if qk_dim != ident.qk_dim or k_extend.shape[2] != ident.qk_dim or k_pool.shape[-1] != ident.qk_dim:
        return f"q/k head dim must be {ident.qk_dim}"
    if (v_extend.shape[2], v_pool.shape[-1], o.shape[2]) != (ident.v_head_dim,) * 3:
        return f"v/o head dim must be {ident.v_head_dim}"
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        return f"H_q={num_q_heads} is not a multiple of H_kv={num_kv_heads}"
    if k_pool.shape[-2] != num_kv_heads or v_pool.shape[-2] != num_kv_heads or v_extend.shape[1] != num_kv_heads:
        return "KV head counts of k_extend, v_extend and the pools disagree"
    if o.shape[:2] != q.shape[:2] or k_extend.shape[0] != num_tokens or v_extend.shape[0] != num_tokens:
        return "token or head counts of q, k_extend, v_extend and o disagree"
    return ""


def draft_reason(qo_indptr: Any, max_len_extend: Any, q: torch.Tensor, max_draft_tokens: int) -> str:
    """qo_indptr is an index tensor on q's device and the draft bound a Python int in range."""
    if (not isinstance(qo_indptr, torch.Tensor) or qo_indptr.dim() != 1 or qo_indptr.dtype not in INDEX_DTYPES
            or qo_indptr.device != q.device):
        return "qo_indptr must be a 1-D int32/int64 tensor on q's device"
    if not isinstance(max_len_extend, int) or not 0 <= max_len_extend <= max_draft_tokens:
        return f"max_len_extend must be a Python int in 0..{max_draft_tokens}"
    return ""


def scale_reason(ident: ModuleIdentity, k_scale: Any, v_scale: Any, q: torch.Tensor, sm_scale: Any = None) -> str:
    """FP8 modules read scales from 1-element fp32 device tensors (a float becomes one); a 16-bit
    pool's scales are float kernel arguments. The score scale (sm_scale x k_scale, as floats)
    must be positive: the Gluon prefix stage takes a row's max of the unscaled scores and scales it."""
    if sm_scale is not None and not (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)
                                     and math.isfinite(sm_scale) and sm_scale > 0):
        return f"sm_scale must be None or a finite float > 0, got {sm_scale!r}"
    if isinstance(k_scale, (int, float)) and math.isfinite(k_scale) and k_scale <= 0:
        return f"k_scale must be > 0 (it scales every score), got {k_scale!r}"
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if ident.fp8_kv:
            if isinstance(scale, torch.Tensor) and (scale.numel() != 1 or scale.device != q.device
                                                    or scale.dtype != torch.float32):
                # float32: the dtype of the device-scale programs kgen check compiles.
                return f"{name} must be a float or a 1-element float32 tensor on q's device"
        elif isinstance(scale, torch.Tensor):
            return (f"{name} is a tensor: a 16-bit pool's scales are float kernel arguments here (reading a "
                    "device scalar would be a second compiled program); pass a Python float")
        elif scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
            return f"{name} must be None or a finite float, got {scale!r}"
    return ""


def v_view_reason(ident: ModuleIdentity, k_pool: torch.Tensor, v_pool: torch.Tensor) -> str:
    """A module that takes V from the K tile it already loaded needs v to be K's latent columns."""
    if not ident.v_from_k_tile:
        return ""
    if v_pool.data_ptr() != k_pool.data_ptr() or v_pool.stride()[:-1] != k_pool.stride()[:-1]:
        return (f"v_buffer is not a view of k_buffer's first {ident.v_head_dim} columns: this absorbed-MLA module "
                "takes V from the K tile it already loaded and has no V pointer, V load or shared memory for a "
                "V tile; a separate v_buffer needs other programs. Pass v_buffer = k_buffer[..., :"
                f"{ident.v_head_dim}] when it holds the same values, else the general path serves it")
    return ""


def target_reason(ident: ModuleIdentity, arch: str) -> str:
    """An arch `kgen check` did not prove, or an FP8 format its tensor cores lack ('' when the
    arch is one of the module's targets, or the interpreter)."""
    if arch == "interpreter":
        return ""
    if arch not in ident.targets:
        return (f"{arch} is not a target this module was checked for ({', '.join(ident.targets)}); add it to "
                f"kgen/tables/targets.json, run `kgen check --arch {arch}` and `kgen build`")
    if ident.fp8_kv and ident.kv_dtype_name not in ident.targets[arch]["fp8"]:
        takes = ", ".join(ident.targets[arch]["fp8"]) or "none"
        return f"{arch} has no {ident.kv_dtype_name} tensor-core format (it takes: {takes})"
    return ""


def mask_reason(custom_mask: Any, mask_indptr: Any, q: torch.Tensor, batch: int, max_len: int, paged: bool) -> str:
    """Why the kernels cannot read this custom mask ('' when they can). They read it on the
    device, one byte a bit, with no host sync: only its metadata is checked here."""
    if not isinstance(custom_mask, torch.Tensor) or custom_mask.device != q.device:
        return "custom_mask must be a tensor on q's device"
    if custom_mask.dtype not in MASK_DTYPES:
        return (f"custom_mask is {custom_mask.dtype}: the kernels read one byte a bit; pass it as bool or uint8 "
                "(SGLang's is bool)")
    if paged:
        if custom_mask.dim() != 2 or custom_mask.stride(1) != 1:
            return "the paged entry's custom_mask must be 2-D [rows, W] with contiguous rows"
        if custom_mask.shape[1] < max_len:
            return f"custom_mask rows hold {custom_mask.shape[1]} draft columns, but a draft may be {max_len} long"
    elif not custom_mask.is_contiguous():
        return "custom_mask must be contiguous (SGLang's flat layout)"
    if (not isinstance(mask_indptr, torch.Tensor) or mask_indptr.dim() != 1 or mask_indptr.dtype not in INDEX_DTYPES
            or mask_indptr.device != q.device):
        return "mask_indptr must be a 1-D int32/int64 tensor on q's device"
    if mask_indptr.shape[0] < batch:
        return f"mask_indptr has {mask_indptr.shape[0]} offsets for {batch} requests"
    return ""


def index_tensor_reason(q: torch.Tensor, **tensors: Any) -> str:
    """Each named index tensor is 1-D int32/int64 on q's device."""
    for name, t in tensors.items():
        if (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INDEX_DTYPES
                or t.device != q.device):
            return f"{name} must be a 1-D int32/int64 tensor on q's device"
    return ""


def paged_reason(ident: ModuleIdentity, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: Any, prefix_lens: Any, qo_indptr: torch.Tensor, is_causal: Any) -> str:
    """The paged entry's cache, block table and prefix lengths agree with each other."""
    if k_cache.shape[:2] != v_cache.shape[:2]:
        return "k_cache and v_cache have different block counts or page sizes"
    if k_cache.shape[1] not in ident.page_sizes:
        return f"page size {k_cache.shape[1]} is not one of {ident.page_sizes}"
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype not in INDEX_DTYPES:
        return "block_table must be a 2-D int32/int64 tensor [batch, max_blocks]"
    if block_table.stride(1) != 1 or block_table.device != q.device:
        return "block_table must be row-contiguous and on q's device"
    if not isinstance(prefix_lens, torch.Tensor) or prefix_lens.dim() != 1 or prefix_lens.dtype not in INDEX_DTYPES:
        return "prefix_lens must be a 1-D int32/int64 tensor"
    if prefix_lens.device != q.device:
        return f"prefix_lens is on {prefix_lens.device}, q_extend on {q.device}"
    if prefix_lens.shape[0] != block_table.shape[0] or qo_indptr.shape[0] != block_table.shape[0] + 1:
        return "block_table, prefix_lens and qo_indptr disagree on the batch size"
    if not isinstance(is_causal, bool):
        return f"is_causal must be a bool, got {type(is_causal).__name__}"
    return ""
