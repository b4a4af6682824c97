"""Checks of verify calls: what no path could take raises ValueError naming the fix.

``validate_flat`` / ``validate_paged`` check tensor metadata only (shapes, dtypes,
devices): no host sync, safe in the hot path and under CUDA-graph capture; the chain runs
them on every call. ``check_flat_indices`` / ``check_paged_indices`` check index *values*
(custom-mask sizes included), which syncs the host: they run only with
``check_indices=True`` or ``KGEN_CHECK_INDICES=1``. ``unserved_reason`` names valid calls that no
kgen path computes correctly (an FP8 query, a scale tensor of separate values, ``kv_len_adjust``
with a custom mask): the chain and the adapters refuse those, leaving ``o_extend`` untouched, so
the engine runs its own kernel.
"""

from __future__ import annotations

import math

import torch

from kgen.runtime.call import Features, PagedCall, Scale, VerifyCall

_INDEX_DTYPES = (torch.int32, torch.int64)
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64)
# Tensors that must share q_extend's device; scales and window offsets are moved to it.
_FLAT_SAME_DEVICE = (
    "q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
    "kv_indices", "custom_mask", "mask_indptr", "sinks",
)  # fmt: skip
_PAGED_SAME_DEVICE = (
    "q_extend", "k_extend", "v_extend", "o_extend", "k_cache", "v_cache", "block_table", "prefix_lens", "qo_indptr",
)  # fmt: skip


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
    """A float, None or a non-empty float tensor. A tensor of several values is valid input (vLLM
    passes ``[batch, H_kv]`` descales); ``unserved_reason`` refuses it unless it is one value
    broadcast (``single_scale``)."""
    if isinstance(s, torch.Tensor):
        if s.numel() == 0 or not s.dtype.is_floating_point:
            _fail(f"{name} must be a float or a non-empty float tensor, got {s.dtype} of shape {tuple(s.shape)}")
    elif s is not None and (isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s)):
        _fail(f"{name} must be a finite float, a float tensor or None, got {s!r}")


def single_scale(s: Scale) -> Scale:
    """``s`` as one value without a host sync: a tensor whose elements all alias one memory
    location (every dimension of size > 1 has stride 0: vLLM's ``layer._k_scale.expand(batch,
    H_kv)``) becomes a 1-element view of it; anything else is returned as it is."""
    if not isinstance(s, torch.Tensor) or s.numel() <= 1:
        return s
    if all(stride == 0 for size, stride in zip(s.shape, s.stride(), strict=True) if size > 1):
        return s[(0,) * s.dim()].reshape(1)
    return s


def _check_kv_len_adjust(adjust: object) -> None:
    if isinstance(adjust, bool) or not isinstance(adjust, int):
        _fail(f"kv_len_adjust must be a Python int <= 0 (SGLang's), got {type(adjust).__name__}")
    if adjust > 0:
        _fail(
            f"kv_len_adjust = {adjust} > 0 would read kv_indices past kv_indptr[b + 1] (another request's "
            "slots); pass 0, or a negative int to trim each request's last slots"
        )


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


def _check_features(f: Features, bs: int, h_q: int, paged: bool = False) -> None:
    if f.custom_mask is not None:
        m = _need_tensor("custom_mask", f.custom_mask)
        if m.dtype not in _MASK_DTYPES:
            _fail(f"custom_mask must be bool or an integer 0/1 tensor, got {m.dtype}")
        if paged and m.dim() != 2:
            _fail(f"a paged call's custom_mask is 2-D [rows, W] (draft token i of request b reads row "
                  f"mask_indptr[b] + i), got shape {tuple(m.shape)}")
        if paged and not f.skip_prefix_custom_mask:
            _fail("a paged call's custom_mask holds draft columns only: skip_prefix_custom_mask must be True")
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


def _is_one(s: Scale) -> bool:
    """True for None or the number 1; a tensor is never known to be 1 without a host sync."""
    return s is None or (not isinstance(s, torch.Tensor) and float(s) == 1.0)


def unserved_reason(call: VerifyCall | PagedCall) -> str:
    """Why no kgen path computes this valid call correctly ('' when one does).

    Every path computes with the query-side tensors as they are: an FP8 query (vLLM's FP8
    attention path, ``q`` in e4m3 with a ``q_descale``) would need its descale in the dot
    product, which no path applies, and an FP8 ``o_extend`` a quantization scale nobody
    passes. A tensor ``q_descale`` with a 16-bit query is refused too: its value is not
    known without a host sync. So are scale tensors of separate values (a ``[batch, H_kv]``
    descale that is not one value broadcast: kgen applies one scale per cache) and
    ``kv_len_adjust`` with a custom mask (no defined meaning)."""
    for name in ("q_extend", "k_extend", "v_extend", "o_extend"):
        t = getattr(call, name)
        if t.element_size() == 1:
            return (
                f"{name} is {t.dtype}: kgen computes with 16- or 32-bit queries, draft K/V and outputs and "
                "applies no q_descale (the FP8 query path), so it refuses; run the engine's own kernel for "
                "FP8 queries"
            )
    q_descale = getattr(call, "q_descale", None)
    if not _is_one(q_descale):
        return (
            f"q_descale is given with a {call.q_extend.dtype} query: kgen applies no query descale; pass "
            "q_descale=None for a 16-bit query, or run the engine's own kernel"
        )
    for name in ("k_scale", "v_scale"):
        s = single_scale(getattr(call, name))
        if isinstance(s, torch.Tensor) and s.numel() > 1:
            return (
                f"{name} is a {list(s.shape)} tensor of separate values (a descale per request and KV head?): "
                "kgen applies one scale to the whole cache; pass the layer's single scale (vLLM's "
                "layer._k_scale / _v_scale, or its expand), or run the engine's own kernel"
            )
    if isinstance(call, VerifyCall) and call.kv_len_adjust and call.custom_mask is not None:
        return (
            f"kv_len_adjust = {call.kv_len_adjust} with a custom_mask: decoding through the verify entry is "
            "a chain, and which prefix a mask's [L, P + L] rows would count is not defined, so kgen refuses; "
            "run the engine's own kernel"
        )
    return ""


def _check_devices(tensors: dict[str, torch.Tensor | None]) -> None:
    devices = {n: t.device for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    first = next(iter(devices.values()))
    bad = [f"{n} on {d}" for n, d in devices.items() if d != first]
    if bad:
        _fail(f"all tensors must be on {first}; move " + ", ".join(bad))


def validate_flat(call: VerifyCall) -> None:
    """Raise ValueError naming the problem if no path could take this SGLang-style call.

    Metadata only (shapes, dtypes, devices): no host sync, safe in the hot path and
    under CUDA-graph capture. Index *values* are checked by ``check_flat_indices``.
    """
    h_q, h_kv, d_qk, d_v = _check_draft(call.q_extend, call.k_extend, call.v_extend, call.o_extend, call.qo_indptr)
    for name, t, width in (("k_buffer", call.k_buffer, d_qk), ("v_buffer", call.v_buffer, d_v)):
        _need_tensor(name, t, 3)
        _need_float(name, t)
        if t.shape[1] != h_kv or t.shape[2] != width:
            _fail(f"{name} must be [slots, {h_kv}, {width}] (KV heads, width), got {tuple(t.shape)}")
    _need_index("kv_indptr", call.kv_indptr)
    _need_index("kv_indices", call.kv_indices)
    if call.kv_indptr.numel() != call.qo_indptr.numel():
        _fail(
            f"kv_indptr ({call.kv_indptr.numel()}) and qo_indptr ({call.qo_indptr.numel()}) must both hold "
            "batch_size + 1 offsets"
        )
    _check_scale("k_scale", call.k_scale)
    _check_scale("v_scale", call.v_scale)
    _check_kv_len_adjust(call.kv_len_adjust)
    _check_features(call.features, call.qo_indptr.numel() - 1, h_q)
    _check_devices({name: getattr(call, name) for name in _FLAT_SAME_DEVICE})


def validate_paged(call: PagedCall) -> None:
    """``validate_flat`` for vLLM-style pages: ``k_cache [blocks, page, H_kv, D]``."""
    h_q, h_kv, d_qk, d_v = _check_draft(call.q_extend, call.k_extend, call.v_extend, call.o_extend, call.qo_indptr)
    k_cache, v_cache = call.k_cache, call.v_cache
    for name, t, width in (("k_cache", k_cache, d_qk), ("v_cache", v_cache, d_v)):
        _need_tensor(name, t, 4)
        _need_float(name, t)
        if t.shape[2] != h_kv or t.shape[3] != width:
            _fail(f"{name} must be [num_blocks, page_size, {h_kv}, {width}], got {tuple(t.shape)}")
    if k_cache.shape[:2] != v_cache.shape[:2]:
        _fail(f"k_cache and v_cache disagree on [num_blocks, page_size]: {k_cache.shape[:2]} vs {v_cache.shape[:2]}")
    bs = call.qo_indptr.numel() - 1
    _need_index("block_table", call.block_table, 2)
    _need_index("prefix_lens", call.prefix_lens)
    if call.block_table.shape[0] < bs or call.prefix_lens.numel() < bs:
        _fail(
            f"block_table ({call.block_table.shape[0]} rows) and prefix_lens ({call.prefix_lens.numel()}) "
            f"need one entry per request ({bs})"
        )
    _check_scale("k_scale", call.k_scale)
    _check_scale("v_scale", call.v_scale)
    _check_scale("q_descale", call.q_descale)
    _check_features(call.features, bs, h_q, paged=True)
    _check_devices({**{name: getattr(call, name) for name in _PAGED_SAME_DEVICE}, "sinks": call.features.sinks,
                    "custom_mask": call.features.custom_mask, "mask_indptr": call.features.mask_indptr})


def _check_indptr(name: str, ptr: torch.Tensor, limit: int, limit_name: str) -> None:
    p = ptr.to(torch.int64).cpu()
    if p[0] != 0:
        _fail(f"{name}[0] must be 0, got {int(p[0])}")
    if bool((p[1:] < p[:-1]).any()):
        _fail(f"{name} must be non-decreasing, got {p.tolist()[:16]}...")
    if int(p[-1]) > limit:
        _fail(f"{name}[-1] = {int(p[-1])} exceeds {limit_name} = {limit}")


def _check_draft_indices(
    q_extend: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_len_extend: int | None,
    f: Features,
    plens: torch.Tensor,
    paged: bool = False,
) -> None:
    _check_indptr("qo_indptr", qo_indptr, q_extend.shape[0], "the number of tokens")
    qlens = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64).cpu()
    if max_len_extend is not None and qlens.numel() and int(qlens.max()) > max_len_extend:
        _fail(f"max_len_extend = {max_len_extend} but a request has {int(qlens.max())} draft tokens")
    if f.custom_mask is not None and paged:
        rows, width = f.custom_mask.shape
        starts = f.mask_indptr[: qlens.numel()].to(torch.int64).cpu()  # type: ignore[union-attr]
        used = qlens > 0
        if bool((starts[used] < 0).any()) or bool((starts + qlens)[used].gt(rows).any()):
            _fail(f"custom_mask has {rows} rows but mask_indptr/draft lengths need rows up to "
                  f"{int((starts + qlens)[used].max())} (draft token i of request b reads row mask_indptr[b] + i)")
        if qlens.numel() and int(qlens.max()) > width:
            _fail(f"custom_mask rows hold {width} draft columns but a request has {int(qlens.max())} draft tokens")
    elif f.custom_mask is not None:
        mi = f.mask_indptr.to(torch.int64).cpu()  # type: ignore[union-attr]
        bs = qlens.numel()
        off = f.window_offsets(bs, torch.device("cpu"))
        need = mi[:bs] + qlens * (plens.cpu() + qlens + off)
        if bs and int(need.max()) > f.custom_mask.numel():
            _fail(
                f"custom_mask has {f.custom_mask.numel()} entries but mask_indptr/lengths need "
                f"{int(need.max())} (each request needs L x (prefix + L) bits)"
            )


def check_flat_indices(call: VerifyCall) -> None:
    """Check index *values* (host sync): offsets ordered, slots inside the pool.

    Off by default (it syncs); turn on with ``check_indices=True`` or
    ``KGEN_CHECK_INDICES=1`` when an out-of-range slot is suspected.
    """
    kv_indptr, kv_indices, pool_slots = call.kv_indptr, call.kv_indices, call.k_buffer.shape[0]
    _check_indptr("kv_indptr", kv_indptr, kv_indices.numel(), "len(kv_indices)")
    if call.kv_len_adjust:
        slices = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64).cpu()
        short = (slices < -call.kv_len_adjust).nonzero()
        if short.numel():
            b = int(short[0, 0])
            _fail(
                f"request {b}'s kv_indptr slice holds {int(slices[b])} slots, fewer than kv_len_adjust = "
                f"{call.kv_len_adjust} trims: its prefix would be negative"
            )
    used = kv_indices[: int(kv_indptr[-1])]
    if used.numel():
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= pool_slots:
            _fail(f"kv_indices hold slots {lo}..{hi}, outside the pool's 0..{pool_slots - 1}")
    _check_draft_indices(
        call.q_extend, call.qo_indptr, call.max_len_extend, call.features, call.prefix_lens().to(torch.int64)
    )


def check_paged_indices(call: PagedCall) -> None:
    """``check_flat_indices`` for block tables: lengths fit the table, pages exist."""
    bs = call.qo_indptr.numel() - 1
    plens = call.prefix_lens[:bs].to(torch.int64).cpu()
    blocks, page = call.k_cache.shape[0], call.k_cache.shape[1]
    capacity = call.block_table.shape[1] * page
    if bs and (int(plens.min()) < 0 or int(plens.max()) > capacity):
        _fail(
            f"prefix_lens must lie in 0..{capacity} (block_table width x page size), got "
            f"{int(plens.min())}..{int(plens.max())}"
        )
    table = call.block_table[:bs].to(torch.int64).cpu()
    pages_used = (plens + page - 1) // page
    used = torch.arange(table.shape[1])[None, :] < pages_used[:, None]
    vals = table[used]
    if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= blocks):
        _fail(f"block_table points at blocks {int(vals.min())}..{int(vals.max())}, outside 0..{blocks - 1}")
    _check_draft_indices(call.q_extend, call.qo_indptr, call.max_len_extend, call.features, plens, paged=True)

