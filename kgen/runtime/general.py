"""The general verify path: plain torch, every valid input, the prefix streamed in chunks.

It is the last level of the chain, so it must accept everything the fast kernels refuse:
tree masks for ``topk > 1`` (SGLang's ``custom_mask`` / ``mask_indptr`` layout), masks on
the prefix (``skip_prefix_custom_mask=False``), sliding windows, tanh logit caps, attention
sinks, non-causal drafts, xai temperature, any dtype, any group size, and vLLM-style
block tables as well as SGLang's flat token-slot indices.

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
  where ``off = window_kv_offsets[b]`` when a sliding window is on, else 0;
- sinks: one logit per query head added to the softmax denominator only;
- P.V of prefix columns times ``v_scale``; a row that sees nothing writes zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

Scale = float | torch.Tensor | None
_INDEX_DTYPES = (torch.int32, torch.int64)
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64)


@dataclass(frozen=True)
class Features:
    """Everything beyond a plain causal chain; the fast kernels refuse most of it."""

    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    is_causal: bool = True
    skip_prefix_custom_mask: bool = True
    sliding_window_size: int = -1
    sinks: torch.Tensor | None = None
    window_kv_offsets: torch.Tensor | None = None
    logit_cap: float = 0.0
    xai_temperature_len: int = -1

    @property
    def plain(self) -> bool:
        """True for a causal chain with none of the extras (what the paged kernels take)."""
        return (
            self.custom_mask is None
            and self.is_causal
            and self.sliding_window_size <= 0
            and self.sinks is None
            and not self.logit_cap
            and self.xai_temperature_len <= 0
        )

    def describe(self) -> str:
        parts = []
        if self.custom_mask is not None:
            parts.append("custom mask" + ("" if self.skip_prefix_custom_mask else " (prefix too)"))
        if not self.is_causal:
            parts.append("non-causal")
        if self.sliding_window_size > 0:
            parts.append(f"sliding window {self.sliding_window_size}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.logit_cap:
            parts.append(f"logit cap {self.logit_cap}")
        if self.xai_temperature_len > 0:
            parts.append(f"xai temperature {self.xai_temperature_len}")
        return ", ".join(parts) or "plain causal"


PLAIN = Features()

# ----------------------------------------------------------------------------- validation


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _need_tensor(name: str, t: object, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        _fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return t  # type: ignore[return-value]


def _need_index(name: str, t: object, ndim: int = 1) -> torch.Tensor:
    t = _need_tensor(name, t, ndim)
    if t.dtype not in _INDEX_DTYPES:
        _fail(f"{name} must be int32 or int64, got {t.dtype} (convert it with .to(torch.int32))")
    return t


def _need_float(name: str, t: torch.Tensor) -> None:
    if not t.dtype.is_floating_point:
        _fail(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_scale(name: str, s: Scale) -> None:
    if isinstance(s, torch.Tensor):
        if s.numel() != 1:
            _fail(f"{name} must be a float or a 1-element tensor, got shape {tuple(s.shape)}")
    elif s is not None and not isinstance(s, int | float):
        _fail(f"{name} must be a float, a 1-element tensor or None, got {type(s).__name__}")


def _check_draft(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, qo_indptr: torch.Tensor
) -> tuple[int, int, int, int]:
    """Shapes of the draft tensors: returns (H_q, H_kv, D_qk, D_v)."""
    for name, t in (("q_extend", q), ("k_extend", k), ("v_extend", v), ("o_extend", o)):
        _need_tensor(name, t, 3)
        _need_float(name, t)
    tokens, h_q, d_qk = q.shape
    if k.shape[0] != tokens or v.shape[0] != tokens or o.shape[0] != tokens:
        _fail(
            f"q/k/v/o_extend must have the same number of tokens, got {q.shape[0]}, {k.shape[0]}, "
            f"{v.shape[0]}, {o.shape[0]}"
        )
    h_kv, d_v = k.shape[1], v.shape[2]
    if k.shape[2] != d_qk:
        _fail(f"k_extend width {k.shape[2]} differs from q_extend width {d_qk}")
    if v.shape[1] != h_kv:
        _fail(f"v_extend has {v.shape[1]} heads, k_extend {h_kv}")
    if h_kv == 0 or h_q % h_kv:
        _fail(f"query heads {h_q} must be a multiple of KV heads {h_kv}")
    if o.shape[1] != h_q or o.shape[2] != d_v:
        _fail(f"o_extend must be [T, {h_q}, {d_v}] (query heads, V width), got {tuple(o.shape)}")
    _need_index("qo_indptr", qo_indptr)
    if qo_indptr.numel() < 1:
        _fail("qo_indptr must hold batch_size + 1 offsets, got an empty tensor")
    return h_q, h_kv, d_qk, d_v


def _check_features(f: Features, bs: int, h_q: int) -> None:
    if f.custom_mask is not None:
        m = _need_tensor("custom_mask", f.custom_mask)
        if m.dtype not in _MASK_DTYPES:
            _fail(f"custom_mask must be bool or an integer 0/1 tensor, got {m.dtype}")
        mi = _need_index("mask_indptr", f.mask_indptr)
        if mi.numel() < bs + 1:
            _fail(f"mask_indptr needs batch_size + 1 = {bs + 1} offsets, got {mi.numel()}")
        if f.sliding_window_size > 0 and f.window_kv_offsets is None:
            _fail("a custom mask with a sliding window needs window_kv_offsets (one per request)")
    if f.window_kv_offsets is not None and f.sliding_window_size > 0:
        w = _need_index("window_kv_offsets", f.window_kv_offsets)
        if w.numel() < bs:
            _fail(f"window_kv_offsets needs {bs} entries (one per request), got {w.numel()}")
    if f.sinks is not None:
        s = _need_tensor("sinks", f.sinks)
        _need_float("sinks", s)
        if s.numel() != h_q:
            _fail(f"sinks must hold one logit per query head ({h_q}), got {s.numel()}")
    if not isinstance(f.logit_cap, int | float) or f.logit_cap < 0 or math.isnan(f.logit_cap):
        _fail(f"logit_cap must be a float >= 0 (0 turns it off), got {f.logit_cap!r}")
    if f.xai_temperature_len == 1:
        _fail("xai_temperature_len = 1 divides by log2(1) = 0; use -1 (off) or a length > 1")


def _check_devices(tensors: dict[str, torch.Tensor | None]) -> None:
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    bad = [f"{n} on {d}" for n, d in devices.items() if d != first]
    if bad:
        _fail(f"all tensors must be on {first}; move " + ", ".join(bad))


def validate_flat(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    features: Features = PLAIN,
) -> None:
    """Raise ValueError naming the problem if no path could take these SGLang-style inputs.

    Metadata only (shapes, dtypes, devices): no host sync, safe in the hot path and
    under CUDA-graph capture. Index *values* are checked by ``check_flat_indices``.
    """
    h_q, h_kv, d_qk, d_v = _check_draft(q_extend, k_extend, v_extend, o_extend, qo_indptr)
    for name, t, width in (("k_buffer", k_buffer, d_qk), ("v_buffer", v_buffer, d_v)):
        _need_tensor(name, t, 3)
        _need_float(name, t)
        if t.shape[1] != h_kv or t.shape[2] != width:
            _fail(f"{name} must be [slots, {h_kv}, {width}] (KV heads, width), got {tuple(t.shape)}")
    _need_index("kv_indptr", kv_indptr)
    _need_index("kv_indices", kv_indices)
    if kv_indptr.numel() != qo_indptr.numel():
        _fail(
            f"kv_indptr ({kv_indptr.numel()}) and qo_indptr ({qo_indptr.numel()}) must both hold batch_size + 1 offsets"
        )
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    _check_features(features, qo_indptr.numel() - 1, h_q)
    _check_devices(
        {
            "q_extend": q_extend,
            "k_extend": k_extend,
            "v_extend": v_extend,
            "o_extend": o_extend,
            "k_buffer": k_buffer,
            "v_buffer": v_buffer,
            "qo_indptr": qo_indptr,
            "kv_indptr": kv_indptr,
            "kv_indices": kv_indices,
            "custom_mask": features.custom_mask,
            "mask_indptr": features.mask_indptr,
            "sinks": features.sinks,
        }
    )


def validate_paged(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    features: Features = PLAIN,
) -> None:
    """``validate_flat`` for vLLM-style pages: ``k_cache [blocks, page, H_kv, D]``."""
    h_q, h_kv, d_qk, d_v = _check_draft(q_extend, k_extend, v_extend, o_extend, qo_indptr)
    for name, t, width in (("k_cache", k_cache, d_qk), ("v_cache", v_cache, d_v)):
        _need_tensor(name, t, 4)
        _need_float(name, t)
        if t.shape[2] != h_kv or t.shape[3] != width:
            _fail(f"{name} must be [num_blocks, page_size, {h_kv}, {width}], got {tuple(t.shape)}")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        _fail(f"k_cache and v_cache disagree on [num_blocks, page_size]: {k_cache.shape[:2]} vs {v_cache.shape[:2]}")
    bs = qo_indptr.numel() - 1
    _need_index("block_table", block_table, 2)
    _need_index("prefix_lens", prefix_lens)
    if block_table.shape[0] < bs or prefix_lens.numel() < bs:
        _fail(
            f"block_table ({block_table.shape[0]} rows) and prefix_lens ({prefix_lens.numel()}) "
            f"need one entry per request ({bs})"
        )
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    _check_features(features, bs, h_q)
    _check_devices(
        {
            "q_extend": q_extend,
            "k_extend": k_extend,
            "v_extend": v_extend,
            "o_extend": o_extend,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "block_table": block_table,
            "prefix_lens": prefix_lens,
            "qo_indptr": qo_indptr,
            "sinks": features.sinks,
        }
    )


def _check_indptr(name: str, ptr: torch.Tensor, limit: int, limit_name: str) -> None:
    p = ptr.to(torch.int64).cpu()
    if p[0] != 0:
        _fail(f"{name}[0] must be 0, got {int(p[0])}")
    if bool((p[1:] < p[:-1]).any()):
        _fail(f"{name} must be non-decreasing, got {p.tolist()[:16]}...")
    if int(p[-1]) > limit:
        _fail(f"{name}[-1] = {int(p[-1])} exceeds {limit_name} = {limit}")


def _check_draft_indices(
    q_extend: torch.Tensor, qo_indptr: torch.Tensor, max_len_extend: int | None, f: Features, plens: torch.Tensor
) -> None:
    _check_indptr("qo_indptr", qo_indptr, q_extend.shape[0], "the number of tokens")
    qlens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64).cpu()
    if max_len_extend is not None and qlens.numel() and int(qlens.max()) > max_len_extend:
        _fail(f"max_len_extend = {max_len_extend} but a request has {int(qlens.max())} draft tokens")
    if f.custom_mask is not None:
        mi = f.mask_indptr.to(torch.int64).cpu()  # type: ignore[union-attr]
        bs = qlens.numel()
        off = _window_offsets(f, bs, torch.device("cpu"))
        need = mi[:bs] + qlens * (plens.cpu() + qlens + off)
        if bs and int(need.max()) > f.custom_mask.numel():
            _fail(
                f"custom_mask has {f.custom_mask.numel()} entries but mask_indptr/lengths need "
                f"{int(need.max())} (each request needs L x (prefix + L) bits)"
            )


def check_flat_indices(
    q_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_len_extend: int | None = None,
    features: Features = PLAIN,
) -> None:
    """Check index *values* (host sync): offsets ordered, slots inside the pool.

    Off by default (it syncs); turn on with ``check_indices=True`` or
    ``KGEN_CHECK_INDICES=1`` when an out-of-range slot is suspected.
    """
    _check_indptr("kv_indptr", kv_indptr, kv_indices.numel(), "len(kv_indices)")
    used = kv_indices[: int(kv_indptr[-1])]
    if used.numel():
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= k_buffer.shape[0]:
            _fail(f"kv_indices hold slots {lo}..{hi}, outside the pool's 0..{k_buffer.shape[0] - 1}")
    plens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    _check_draft_indices(q_extend, qo_indptr, max_len_extend, features, plens)


def check_paged_indices(
    q_extend: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_len_extend: int | None = None,
    features: Features = PLAIN,
) -> None:
    """``check_flat_indices`` for block tables: lengths fit the table, pages exist."""
    bs = qo_indptr.numel() - 1
    plens = prefix_lens[:bs].to(torch.int64).cpu()
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page
    if bs and (int(plens.min()) < 0 or int(plens.max()) > capacity):
        _fail(
            f"prefix_lens must lie in 0..{capacity} (block_table width x page size), got "
            f"{int(plens.min())}..{int(plens.max())}"
        )
    table = block_table[:bs].to(torch.int64).cpu()
    pages_used = (plens + page - 1) // page
    used = torch.arange(table.shape[1])[None, :] < pages_used[:, None]
    vals = table[used]
    if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= k_cache.shape[0]):
        _fail(f"block_table points at blocks {int(vals.min())}..{int(vals.max())}, outside 0..{k_cache.shape[0] - 1}")
    _check_draft_indices(q_extend, qo_indptr, max_len_extend, features, plens)


def check_chain_mask(qo_indptr: torch.Tensor, prefix_lens: torch.Tensor, f: Features) -> None:
    """Check (host sync) that a custom mask is SGLang's topk = 1 chain mask.

    The kernels do not read the mask (that would need a sync); they compute the causal
    chain, which equals the mask only at topk = 1. Debug aid, run with index checking.
    """
    if f.custom_mask is None:
        return
    flat = f.custom_mask.reshape(-1).cpu() != 0
    starts = f.mask_indptr.to(torch.int64).cpu().tolist()  # type: ignore[union-attr]
    qo = qo_indptr.to(torch.int64).cpu().tolist()
    plens = prefix_lens.to(torch.int64).cpu().tolist()
    offs = _window_offsets(f, len(qo) - 1, torch.device("cpu")).tolist()
    for b in range(len(qo) - 1):
        draft, prefix, off = qo[b + 1] - qo[b], plens[b], offs[b]
        width = prefix + draft + off
        bits = flat[starts[b] : starts[b] + draft * width].reshape(draft, width)[:, off:]
        want = torch.ones(draft, prefix + draft, dtype=torch.bool)
        want[:, prefix:] = torch.ones(draft, draft, dtype=torch.bool).tril()
        cols = slice(prefix, None) if f.skip_prefix_custom_mask else slice(None)
        if not torch.equal(bits[:, cols], want[:, cols]):
            _fail(
                f"request {b}: custom_mask is not a causal chain, but the fast kernels ignore it "
                "(SGLang's topk = 1 convention); build the chain with topk > 1 for tree masks"
            )


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
    """SGLang: ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` are request b's pool slots."""

    def __init__(
        self, k_buffer: torch.Tensor, v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor
    ):
        self.k, self.v = k_buffer, v_buffer
        self.start = kv_indptr[:-1].to(torch.int64)
        self.lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
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


def _window_offsets(f: Features, bs: int, device: torch.device) -> torch.Tensor:
    if f.custom_mask is not None and f.sliding_window_size > 0 and f.window_kv_offsets is not None:
        return f.window_kv_offsets[:bs].to(device=device, dtype=torch.int64)
    return torch.zeros(bs, dtype=torch.int64, device=device)


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


def _make_batch(qo_indptr: torch.Tensor, plens: torch.Tensor, f: Features) -> tuple[_Batch, int]:
    bs = qo_indptr.numel() - 1
    start = qo_indptr[:-1].to(torch.int64)
    qlens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    maxima = torch.stack([qlens.max(), plens.max()]).tolist() if bs else [0, 0]  # one host sync
    max_draft, max_prefix = int(maxima[0]), int(maxima[1])
    lpos = torch.arange(max_draft, device=qo_indptr.device)
    row_valid = lpos[None, :] < qlens[:, None]
    rows = torch.where(row_valid, start[:, None] + lpos[None, :], 0)
    mask_base = None
    if f.custom_mask is not None:
        off = _window_offsets(f, bs, qo_indptr.device)
        seq = plens + qlens + off
        mask_base = f.mask_indptr[:bs].to(torch.int64)[:, None] + lpos[None, :] * seq[:, None] + off[:, None]  # type: ignore[index]
    return _Batch(bs, max_draft, qlens, plens, rows, row_valid, mask_base), max_prefix


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
        cols = batch.plens[:, None] + lpos[None, :]
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
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    qo_indptr: torch.Tensor,
    prefix: PrefixSource,
    *,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sm_scale: float | None = None,
    features: Features = PLAIN,
    compute_dtype: torch.dtype = torch.float32,
    chunk_tokens: int = 4096,
    token_budget: int = 1 << 16,
) -> None:
    """Write o_extend for every request; inputs are assumed valid (see ``validate_*``).

    The prefix is visited in chunks of ``min(chunk_tokens, token_budget // bs)`` tokens per
    request (at least 16), all requests at once, so the gathered K/V never exceed about
    ``token_budget`` tokens.
    """
    dev, cd, f = q_extend.device, compute_dtype, features
    _, h_q, d_qk = q_extend.shape
    h_kv, d_v = k_extend.shape[1], v_extend.shape[2]
    group = h_q // h_kv
    if q_extend.shape[0] == 0 or qo_indptr.numel() < 2:
        return
    sm = 1.0 / math.sqrt(d_qk) if sm_scale is None else float(sm_scale)
    ks, vs = _scalar(k_scale, cd, dev), _scalar(v_scale, cd, dev)
    batch, max_prefix = _make_batch(qo_indptr, prefix.lengths(), f)
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
        state.update(_hide(s, _prefix_visible(f, batch, pos, valid)), v_pre.to(cd), vs)
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

    def _run(self, q, k, v, o, qo_indptr, prefix, k_scale, v_scale, sm_scale, features) -> None:
        attend(
            q,
            k,
            v,
            o,
            qo_indptr,
            prefix,
            k_scale=k_scale,
            v_scale=v_scale,
            sm_scale=sm_scale,
            features=features,
            compute_dtype=self.compute_dtype,
            chunk_tokens=self.chunk_tokens,
            token_budget=self.token_budget,
        )

    def run_flat(
        self,
        q_extend: torch.Tensor,
        k_extend: torch.Tensor,
        v_extend: torch.Tensor,
        o_extend: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        sm_scale: float | None = None,
        features: Features = PLAIN,
    ) -> None:
        """SGLang-style flat slots; inputs already validated by the caller."""
        prefix = FlatPrefix(k_buffer, v_buffer, kv_indptr, kv_indices)
        self._run(q_extend, k_extend, v_extend, o_extend, qo_indptr, prefix, k_scale, v_scale, sm_scale, features)

    def run_paged(
        self,
        q_extend: torch.Tensor,
        k_extend: torch.Tensor,
        v_extend: torch.Tensor,
        o_extend: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        qo_indptr: torch.Tensor,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        sm_scale: float | None = None,
        features: Features = PLAIN,
    ) -> None:
        """vLLM-style block tables; inputs already validated by the caller."""
        prefix = PagedPrefix(k_cache, v_cache, block_table, prefix_lens, qo_indptr.numel() - 1)
        self._run(q_extend, k_extend, v_extend, o_extend, qo_indptr, prefix, k_scale, v_scale, sm_scale, features)


def general_verify(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
    is_causal: bool = True,
    mask_indptr: torch.Tensor | None = None,
    max_len_extend: int | None = None,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    skip_prefix_custom_mask: bool = True,
    sliding_window_size: int = -1,
    sinks: torch.Tensor | None = None,
    window_kv_offsets: torch.Tensor | None = None,
    xai_temperature_len: int = -1,
    *,
    check_indices: bool = False,
    path: GeneralPath = GeneralPath(),
) -> None:
    """The general path alone, with SGLang's call shape: validate, then write ``o_extend``."""
    f = Features(
        custom_mask,
        mask_indptr,
        is_causal,
        skip_prefix_custom_mask,
        sliding_window_size,
        sinks,
        window_kv_offsets,
        logit_cap,
        xai_temperature_len,
    )
    validate_flat(
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        k_scale,
        v_scale,
        f,
    )
    if check_indices:
        check_flat_indices(q_extend, k_buffer, qo_indptr, kv_indptr, kv_indices, max_len_extend, f)
    path.run_flat(
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        k_scale,
        v_scale,
        sm_scale,
        f,
    )
