"""The float32 (or float64) reference for target verification, written from the semantics.

It is deliberately simple and slow: a loop over requests, gathered prefix, one softmax per
request over [prefix ; draft] columns. It is the oracle for tests, the tuner's correctness
check and the benchmark's check, never a serving path; ``relative_error`` is how they compare
a kernel's output with it.

Semantics (L draft tokens per request, a chain or a tree):
- request b's prefix is ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (token slots of the
  pool), its draft tokens are rows ``qo_indptr[b]:qo_indptr[b+1]`` of q/k/v_extend;
- query head h reads KV head ``h // (H_q // H_kv)``;
- score = q . k x sm_scale, with the pool (prefix) part also multiplied by ``k_scale``;
  the prefix's P.V is multiplied by ``v_scale``; the draft part is unscaled;
- with a custom mask (SGLang's layout: request b's row-major [L, P + L] block of bits from
  ``mask_indptr[b]``), draft token i sees column c where its bit is set, read literally:
  draft columns always, prefix columns unless ``skip_prefix_custom_mask`` (then the whole
  prefix), whatever ``is_causal`` says;
- without one, draft token i sees the whole prefix and draft tokens 0..i (``is_causal``)
  or every draft token;
- a draft token that sees nothing gets zeros.
"""

from __future__ import annotations

import math
from typing import Literal

import torch


def _scale_value(scale: float | torch.Tensor | None) -> float | torch.Tensor:
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return scale.detach().to(torch.float64).reshape(-1)[0].item()
    return float(scale)


def reference_verify(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    k_scale: float | torch.Tensor | None = 1.0,
    v_scale: float | torch.Tensor | None = 1.0,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    is_causal: bool = True,
    skip_prefix_custom_mask: bool = True,
) -> torch.Tensor:
    """Return o [T, H_q, D_v] in ``dtype`` (float32 by default)."""
    num_tokens, num_q_heads, qk_dim = q_extend.shape
    num_kv_heads = k_buffer.shape[1]
    v_dim = v_buffer.shape[-1]
    group = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(qk_dim) if sm_scale is None else sm_scale
    ks, vs = _scale_value(k_scale), _scale_value(v_scale)
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    bits = custom_mask.reshape(-1).cpu() != 0 if custom_mask is not None else None
    mask_starts = mask_indptr.tolist() if custom_mask is not None else None
    out = torch.zeros(num_tokens, num_q_heads, v_dim, dtype=dtype, device=q_extend.device)
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        if q1 == q0:
            continue
        slots = kv_indices[kvp[b] : kvp[b + 1]].long()
        k_pre = k_buffer[slots].to(dtype) * ks  # [P, H_kv, D_qk]
        v_pre = v_buffer[slots].to(dtype) * vs  # [P, H_kv, D_v]
        k_all = torch.cat([k_pre, k_extend[q0:q1].to(dtype)], dim=0)
        v_all = torch.cat([v_pre, v_extend[q0:q1].to(dtype)], dim=0)
        num_draft, prefix = q1 - q0, slots.numel()
        col = torch.arange(prefix + num_draft, device=q_extend.device)
        row = torch.arange(num_draft, device=q_extend.device)
        if bits is not None:  # the mask's bits, as they are
            start = mask_starts[b]
            visible = bits[start : start + num_draft * (prefix + num_draft)].reshape(num_draft, prefix + num_draft)
            visible = visible.to(q_extend.device).clone()
            if skip_prefix_custom_mask:
                visible[:, :prefix] = True
        elif is_causal:  # draft token i sees the prefix and draft tokens 0..i
            visible = col[None, :] <= (prefix + row)[:, None]
        else:
            visible = torch.ones(num_draft, prefix + num_draft, dtype=torch.bool, device=q_extend.device)
        # Query head h reads KV head h // group: the group is its own axis, so K and V are
        # never copied per query head (a float64 copy of a long prefix at group 16 is gigabytes).
        q = q_extend[q0:q1].to(dtype).reshape(num_draft, num_kv_heads, group, qk_dim)  # [L, H_kv, G, D]
        scores = torch.einsum("lkgd,nkd->kgln", q, k_all).reshape(num_q_heads, num_draft, -1) * sm_scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        # A row that sees nothing gets zeros (softmax over all -inf would be NaN).
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(visible.any(dim=-1)[None, :, None], probs, 0.0)
        probs = probs.reshape(num_kv_heads, group, num_draft, -1)
        out[q0:q1] = torch.einsum("kgln,nkd->lkgd", probs, v_all).reshape(num_draft, num_q_heads, v_dim)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor, norm: Literal["l2", "max"] = "l2") -> float:
    """||out - ref|| / ||ref|| in float64, in the L2 norm (the whole output) or the max norm
    (the worst element against the largest |ref|, so one wrong row is not averaged away over
    many right ones). NaN or inf anywhere in ``out`` gives inf: an unwritten output is
    NaN-filled, so a kernel that skips rows cannot pass."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    if norm == "max":
        return ((out64 - ref64).abs().max() / ref64.abs().max().clamp_min(1e-30)).item()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
