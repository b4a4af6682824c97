"""The general verify path: plain torch, every valid input, the prefix streamed in chunks.

It is the last level of the chain, so it must accept everything the fast kernels refuse:
masks on the prefix (``skip_prefix_custom_mask=False``), sliding windows, tanh logit caps,
attention sinks, non-causal drafts without a mask, xai temperature, any dtype, any group
size, tree masks (SGLang's ``custom_mask`` / ``mask_indptr`` layout, or the paged rows) with
any of those, and vLLM-style block tables as well as SGLang's flat token-slot indices. Validation lives in
``kgen.runtime.call_checks``; this module is the attention math.

It is written independently of ``kgen.reference`` (which stays the tests' oracle): all
requests are processed together, chunk by chunk over the prefix, with an online softmax,
so memory is bounded by ``token_budget`` gathered tokens whatever the pool or prefix size
— the pool is never materialized. It does a couple of host syncs per call (the longest
prefix and draft), which is fine for a fallback and is why the chain tries kernels first.

Semantics follow SGLang's ``extend_attention_fwd`` (two-stage kernel), per request ``b``
with prefix length ``P`` and draft length ``L``, draft row ``i`` (0-based), column ``j``:

- score = (q . k) * sm_scale, times ``k_scale`` on prefix columns; then the logit cap
  ``cap * tanh(s / cap)`` when ``logit_cap > 0``; then the xai temperature factor
  ``log2(P + i) / log2(xai_temperature_len)`` when ``P + i > xai_temperature_len > 0``;
- visible: prefix column ``j < P`` (and the custom mask bit when
  ``skip_prefix_custom_mask`` is False); draft column ``j`` by the custom mask if given,
  else ``j <= i`` when causal, else every draft column; a sliding window ``W > 0`` keeps
  only columns within ``W`` positions (``P + i <= j + W`` on the prefix, ``i <= j + W`` on
  the draft);
- custom mask bit of (i, column c) sits at ``mask_indptr[b] + i * (P + L + off) + off + c``
  where ``off = window_kv_offsets[b]`` when a sliding window is on, else 0; a paged call's
  mask holds draft columns only: the bit of (i, draft column j) is
  ``custom_mask[mask_indptr[b] + i, j]``;
- sinks: one logit per query head added to the softmax denominator only;
- P.V of prefix columns times ``v_scale``; a row that sees nothing writes zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kgen.runtime.call import Features, PagedCall, Scale, VerifyCall, sglang_signature
from kgen.runtime.call_checks import check_flat_indices, unserved_reason, validate_flat

# ----------------------------------------------------------------------------- prefix sources


def _take(pool: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``pool[index]``; one-byte float (fp8) pools are gathered as bytes, because advanced
    indexing is not implemented for every fp8 dtype on every backend."""
    if pool.element_size() == 1 and pool.dtype.is_floating_point:
        return pool.view(torch.uint8)[index].view(pool.dtype)
    return pool[index]


class PrefixSource(Protocol):
    """Where a request's prefix tokens live; gathers one chunk of every request at once."""

    def lengths(self) -> torch.Tensor: ...

    def gather(self, pos: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class FlatPrefix:
    """SGLang: ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` are request b's pool slots, less the
    last ``-kv_len_adjust`` of them (SGLang's decode through the verify entry: -1)."""

    def __init__(
        self,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_adjust: int = 0,
    ):
        self.k, self.v = k_buffer, v_buffer
        self.start = kv_indptr[:-1].to(torch.int64)
        # A slice shorter than the trim (caught by check_flat_indices) reads nothing, never a
        # negative count of slots.
        self.lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64).add(kv_len_adjust).clamp(min=0)
        self.indices = kv_indices

    def lengths(self) -> torch.Tensor:
        return self.lens

    def gather(self, pos: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = torch.where(valid, self.start[:, None] + pos[None, :], 0)
        slots = torch.where(valid, self.indices[flat].to(torch.int64), 0)
        return _take(self.k, slots), _take(self.v, slots)  # [bs, C, H_kv, D]


class PagedPrefix:
    """vLLM: token t of request b is ``cache[block_table[b, t // page], t % page]``."""

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        bs: int,
    ):
        self.k, self.v = k_cache, v_cache
        self.table = block_table[:bs].to(torch.int64)
        self.lens = prefix_lens[:bs].to(torch.int64)
        self.page = k_cache.shape[1]

    def lengths(self) -> torch.Tensor:
        return self.lens

    def gather(self, pos: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        col = (pos // self.page).clamp(max=self.table.shape[1] - 1)
        blocks = self.table[:, col]  # [bs, C]
        blocks = torch.where(valid, blocks, 0)
        within = (pos % self.page)[None, :].expand_as(blocks)
        return _take(self.k, blocks, within), _take(self.v, blocks, within)


# ----------------------------------------------------------------------------- the computation


def _scalar(s: Scale, dtype: torch.dtype, device: torch.device) -> torch.Tensor | float:
    """A scale usable in arithmetic without a host sync (tensors stay on the device)."""
    if isinstance(s, torch.Tensor):
        return s.reshape(-1)[:1].to(device=device, dtype=dtype).reshape(())
    return 1.0 if s is None else float(s)


@dataclass
class _Batch:
    """Per-request numbers every chunk needs (device tensors, shapes [bs] or [bs, L])."""

    bs: int
    max_draft: int
    qlens: torch.Tensor
    plens: torch.Tensor
    rows: torch.Tensor  # [bs, L] token row of (request, draft position)
    row_valid: torch.Tensor  # [bs, L]
    mask_base: torch.Tensor | None  # [bs, L] custom-mask offset of column 0 of each row
    mask_draft_col: torch.Tensor | None  # [bs] the mask column of draft column 0 (P; 0 for paged rows)


class _Softmax:
    """Online softmax state over [bs, H_kv, G, L] rows."""

    def __init__(self, shape: tuple[int, ...], d_v: int, dtype: torch.dtype, device: torch.device):
        self.m = torch.full(shape, float("-inf"), dtype=dtype, device=device)
        self.den = torch.zeros(shape, dtype=dtype, device=device)
        self.acc = torch.zeros((*shape, d_v), dtype=dtype, device=device)

    def update(self, scores: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor | float) -> None:
        """Fold in one block: ``scores [bs,H,G,L,C]`` (-inf = hidden), ``v [bs,C,H,Dv]``."""
        m_new = torch.maximum(self.m, scores.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(self.m - m_safe)
        p = torch.exp(scores - m_safe[..., None])
        self.den = self.den * alpha + p.sum(dim=-1)
        pv = torch.einsum("bhglc,bchd->bhgld", p, v)
        self.acc = self.acc * alpha[..., None] + pv * v_scale
        self.m = m_new

    def finish(self, sinks: torch.Tensor | None) -> torch.Tensor:
        m_safe = torch.where(torch.isinf(self.m), torch.zeros_like(self.m), self.m)
        den = self.den
        if sinks is not None:
            h_kv, g = self.m.shape[1], self.m.shape[2]
            s = sinks.to(self.m.dtype).reshape(1, h_kv, g, 1)
            den = den + torch.exp(s - m_safe)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        return torch.where((den > 0)[..., None], self.acc / safe[..., None], torch.zeros_like(self.acc))


def _postprocess(scores: torch.Tensor, f: Features, temp: torch.Tensor | None) -> torch.Tensor:
    """Logit cap, then xai temperature (SGLang's order)."""
    if f.logit_cap and f.logit_cap > 0:
        scores = f.logit_cap * torch.tanh(scores / f.logit_cap)
    if temp is not None:
        scores = scores * temp[:, None, None, :, None]
    return scores


def _xai_temperature(f: Features, batch: _Batch, dtype: torch.dtype) -> torch.Tensor | None:
    if f.xai_temperature_len <= 0:
        return None
    pos = (batch.plens[:, None] + torch.arange(batch.max_draft, device=batch.plens.device)[None, :]).to(dtype)
    scale = torch.log2(pos.clamp(min=1.0)) / math.log2(f.xai_temperature_len)
    return torch.where(pos > f.xai_temperature_len, scale, torch.ones_like(scale))


def _custom_bits(f: Features, batch: _Batch, cols: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Custom-mask bits [bs, L, C] for sequence columns ``cols`` ([bs, C] or [C])."""
    cols = cols if cols.dim() == 2 else cols[None, :].expand(batch.bs, -1)
    idx = batch.mask_base[:, :, None] + cols[:, None, :]  # type: ignore[index]
    ok = valid & batch.row_valid[:, :, None]
    idx = torch.where(ok, idx, 0)
    flat = f.custom_mask.reshape(-1)  # type: ignore[union-attr]
    return (flat[idx] != 0) & ok


def _make_batch(qo_indptr: torch.Tensor, plens: torch.Tensor, f: Features, paged: bool) -> tuple[_Batch, int]:
    bs = qo_indptr.numel() - 1
    start = qo_indptr[:-1].to(torch.int64)
    qlens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    maxima = torch.stack([qlens.max(), plens.max()]).tolist() if bs else [0, 0]  # one host sync
    max_draft, max_prefix = int(maxima[0]), int(maxima[1])
    lpos = torch.arange(max_draft, device=qo_indptr.device)
    row_valid = lpos[None, :] < qlens[:, None]
    rows = torch.where(row_valid, start[:, None] + lpos[None, :], 0)
    mask_base = mask_draft_col = None
    if f.custom_mask is not None and paged:  # row mask_indptr[b] + i of a [rows, W] mask, draft columns only
        width = f.custom_mask.shape[1]
        mask_base = (f.mask_indptr[:bs].to(torch.int64)[:, None] + lpos[None, :]) * width  # type: ignore[index]
        mask_draft_col = torch.zeros_like(plens)
    elif f.custom_mask is not None:
        off = f.window_offsets(bs, qo_indptr.device)
        seq = plens + qlens + off
        mask_base = f.mask_indptr[:bs].to(torch.int64)[:, None] + lpos[None, :] * seq[:, None] + off[:, None]  # type: ignore[index]
        mask_draft_col = plens
    return _Batch(bs, max_draft, qlens, plens, rows, row_valid, mask_base, mask_draft_col), max_prefix


def _prefix_visible(f: Features, batch: _Batch, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[bs, L, C]: which prefix columns each draft row sees."""
    vis = valid[:, None, :] & batch.row_valid[:, :, None]
    if f.custom_mask is not None and not f.skip_prefix_custom_mask:
        vis = vis & _custom_bits(f, batch, pos, valid[:, None, :])
    if f.sliding_window_size > 0:
        lpos = torch.arange(batch.max_draft, device=pos.device)
        qpos = batch.plens[:, None] + lpos[None, :]  # [bs, L]
        vis = vis & (qpos[:, :, None] <= pos[None, None, :] + f.sliding_window_size)
    return vis


def _draft_visible(f: Features, batch: _Batch) -> torch.Tensor:
    """[bs, L, L]: which draft columns each draft row sees."""
    lpos = torch.arange(batch.max_draft, device=batch.qlens.device)
    col_ok = (lpos[None, :] < batch.qlens[:, None])[:, None, :]  # [bs, 1, L]
    vis = batch.row_valid[:, :, None] & col_ok
    if f.custom_mask is not None:
        cols = batch.mask_draft_col[:, None] + lpos[None, :]  # type: ignore[index]
        vis = vis & _custom_bits(f, batch, cols, col_ok)
    elif f.is_causal:
        vis = vis & (lpos[None, :, None] >= lpos[None, None, :])
    if f.sliding_window_size > 0:
        vis = vis & (lpos[None, :, None] <= lpos[None, None, :] + f.sliding_window_size)
    return vis


def _scores(q: torch.Tensor, k: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """q [bs, L, H_kv, G, D] . k [bs, C, H_kv, D] -> [bs, H_kv, G, L, C]."""
    return torch.einsum("blhgd,bchd->bhglc", q, k) * scale


def _hide(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(~visible[:, None, None, :, :], float("-inf"))


def attend(
    call: VerifyCall | PagedCall,
    prefix: PrefixSource,
    *,
    compute_dtype: torch.dtype = torch.float32,
    chunk_tokens: int = 4096,
    token_budget: int = 1 << 16,
) -> None:
    """Write ``call.o_extend`` for every request, the prefix read from ``prefix``; the call is
    assumed valid (see ``kgen.runtime.call_checks``).

    The prefix is visited in chunks of ``min(chunk_tokens, token_budget // bs)`` tokens per
    request (at least 16), all requests at once, so the gathered K/V never exceed about
    ``token_budget`` tokens.
    """
    q_extend, k_extend, v_extend, o_extend, qo_indptr = (
        call.q_extend, call.k_extend, call.v_extend, call.o_extend, call.qo_indptr
    )  # fmt: skip
    dev, cd, f = q_extend.device, compute_dtype, call.features
    _, h_q, d_qk = q_extend.shape
    h_kv, d_v = k_extend.shape[1], v_extend.shape[2]
    group = h_q // h_kv
    if q_extend.shape[0] == 0 or qo_indptr.numel() < 2:
        return
    sm = 1.0 / math.sqrt(d_qk) if call.sm_scale is None else float(call.sm_scale)
    ks, vs = _scalar(call.k_scale, cd, dev), _scalar(call.v_scale, cd, dev)
    batch, max_prefix = _make_batch(qo_indptr, prefix.lengths(), f, isinstance(call, PagedCall))
    if batch.max_draft == 0:
        return
    q = q_extend[batch.rows].to(cd).reshape(batch.bs, batch.max_draft, h_kv, group, d_qk)
    temp = _xai_temperature(f, batch, cd)
    state = _Softmax((batch.bs, h_kv, group, batch.max_draft), d_v, cd, dev)
    chunk = max(16, min(chunk_tokens, token_budget // max(batch.bs, 1)))
    for c0 in range(0, max_prefix, chunk):
        pos = torch.arange(c0, min(c0 + chunk, max_prefix), device=dev)
        valid = pos[None, :] < batch.plens[:, None]
        k_pre, v_pre = prefix.gather(pos, valid)
        s = _postprocess(_scores(q, k_pre.to(cd), sm * ks), f, temp)
        # Past a request's prefix the gather reads some cache position (a page's unused tail):
        # its V may hold NaN, and 0 x NaN is NaN in P.V, so those rows are zeroed.
        v_pre = v_pre.to(cd).masked_fill(~valid[:, :, None, None], 0.0)
        state.update(_hide(s, _prefix_visible(f, batch, pos, valid)), v_pre, vs)
    k_d = k_extend[batch.rows].to(cd)
    v_d = v_extend[batch.rows].to(cd)
    s = _postprocess(_scores(q, k_d, sm), f, temp)
    state.update(_hide(s, _draft_visible(f, batch)), v_d, 1.0)
    out = state.finish(f.sinks).permute(0, 3, 1, 2, 4).reshape(batch.bs, batch.max_draft, h_q, d_v)
    o_extend[batch.rows[batch.row_valid]] = out[batch.row_valid].to(o_extend.dtype)


@dataclass(frozen=True)
class GeneralPath:
    """The chain's last level as an object, so chunk sizes are set once per engine."""

    compute_dtype: torch.dtype = torch.float32
    chunk_tokens: int = 4096
    token_budget: int = 1 << 16

    def run(self, call: VerifyCall | PagedCall) -> None:
        """Write ``call.o_extend``; the call is already validated (``validate_flat`` / ``validate_paged``)."""
        if isinstance(call, PagedCall):
            prefix: PrefixSource = PagedPrefix(
                call.k_cache, call.v_cache, call.block_table, call.prefix_lens, call.qo_indptr.numel() - 1
            )
        else:
            prefix = FlatPrefix(call.k_buffer, call.v_buffer, call.kv_indptr, call.kv_indices, call.kv_len_adjust)
        attend(
            call,
            prefix,
            compute_dtype=self.compute_dtype,
            chunk_tokens=self.chunk_tokens,
            token_budget=self.token_budget,
        )


@sglang_signature
def general_verify(*args: Any, check_indices: bool = False, path: GeneralPath | None = None, **kwargs: Any) -> None:
    """The general path alone, with SGLang's call shape (``VerifyCall``'s arguments):
    validate, optionally check index values, then write ``o_extend``. A call it cannot compute
    correctly (``unserved_reason``: an FP8 query) raises ValueError, ``o_extend`` untouched."""
    call = VerifyCall.from_sglang(*args, **kwargs)
    validate_flat(call)
    if check_indices:
        check_flat_indices(call)
    reason = unserved_reason(call)
    if reason:
        raise ValueError(reason)
    (path or GeneralPath()).run(call)
