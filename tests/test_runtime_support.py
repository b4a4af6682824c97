"""Shared helpers for the runtime tests (no tests here): cases, a brute-force oracle, fakes.

``brute_force`` is written row by row from SGLang's extend-attention semantics, apart
from both ``kgen.reference`` (causal only) and ``kgen.runtime.attend`` (chunked, batched),
so the general path is checked against something that shares none of its code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# tests/conftest.py chooses Triton's interpreter (CPU runs) before anything imports triton.


@dataclass
class Case:
    """A verify problem in SGLang's flat-slot layout (tensors on one device)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_len: int
    extra: dict = field(default_factory=dict)

    def out(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        t, h = self.q.shape[:2]
        return torch.full((t, h, self.v.shape[2]), float("nan"), dtype=dtype or self.q.dtype, device=self.q.device)

    def flat_args(self, o: torch.Tensor) -> tuple:
        return (
            self.q,
            self.k,
            self.v,
            o,
            self.k_buffer,
            self.v_buffer,
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
        )

    @property
    def prefix_lens(self) -> list[int]:
        p = self.kv_indptr.tolist()
        return [p[i + 1] - p[i] for i in range(len(p) - 1)]

    @property
    def draft_lens(self) -> list[int]:
        p = self.qo_indptr.tolist()
        return [p[i + 1] - p[i] for i in range(len(p) - 1)]


def _indptr(lengths: list[int], device: str) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def runtime_case(
    prefix: list[int],
    draft: list[int],
    *,
    h_kv: int = 1,
    group: int = 4,
    d_qk: int = 32,
    d_v: int = 32,
    q_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = torch.float32,
    mla: bool = False,
    spare: int = 9,
    seed: int = 0,
    device: str = "cpu",
    index_dtype: torch.dtype = torch.int32,
) -> Case:
    """Random case; ``mla=True`` makes V the first ``d_v`` columns of K (absorbed MLA)."""
    g = torch.Generator().manual_seed(seed)
    slots = sum(prefix) + spare
    kb = torch.randn(slots, h_kv, d_qk, generator=g)
    vb = kb[..., :d_v] if mla else torch.randn(slots, h_kv, d_v, generator=g)
    t = sum(draft)
    q = torch.randn(t, h_kv * group, d_qk, generator=g)
    k = torch.randn(t, h_kv, d_qk, generator=g)
    v = k[..., :d_v] if mla else torch.randn(t, h_kv, d_v, generator=g)
    kvi = torch.randperm(slots, generator=g)[: sum(prefix)].to(index_dtype)
    kb_t = kb.to(kv_dtype).to(device)
    vb_t = kb_t[..., :d_v] if mla else vb.to(kv_dtype).to(device)
    k_t = k.to(q_dtype).to(device)
    v_t = k_t[..., :d_v] if mla else v.to(q_dtype).to(device)
    return Case(
        q=q.to(q_dtype).to(device), k=k_t, v=v_t, k_buffer=kb_t, v_buffer=vb_t,
        qo_indptr=_indptr(draft, device), kv_indptr=_indptr(prefix, device),
        kv_indices=kvi.to(device), max_len=max(draft) if draft else 0,
    )  # fmt: skip


def to_pages(case: Case, page: int, seed: int = 1, spare_blocks: int = 2) -> dict:
    """The same prefixes as a vLLM cache: random blocks, a block table, prefix lengths."""
    g = torch.Generator().manual_seed(seed)
    plens = case.prefix_lens
    nblocks = [-(-p // page) for p in plens]
    total = sum(nblocks) + spare_blocks
    _, h, dq = case.k_buffer.shape
    dv = case.v_buffer.shape[2]
    dev = case.k_buffer.device
    k_cache = torch.randn(total, page, h, dq, generator=g).to(case.k_buffer.dtype).to(dev)
    v_cache = torch.randn(total, page, h, dv, generator=g).to(case.v_buffer.dtype).to(dev)
    order = torch.randperm(total, generator=g).tolist()
    width = max(max(nblocks, default=0), 1) + 1
    table = torch.full((len(plens), width), 0, dtype=torch.int32)
    starts = case.kv_indptr.tolist()
    for b, p in enumerate(plens):
        slots = case.kv_indices[starts[b] : starts[b] + p].long()
        for j in range(nblocks[b]):
            blk = order.pop()
            table[b, j] = blk
            n = min(page, p - j * page)
            k_cache[blk, :n] = case.k_buffer[slots[j * page : j * page + n]]
            v_cache[blk, :n] = case.v_buffer[slots[j * page : j * page + n]]
    return {
        "k_cache": k_cache, "v_cache": v_cache, "block_table": table.to(dev),
        "prefix_lens": torch.tensor(plens, dtype=torch.int32, device=dev),
    }  # fmt: skip


def tree_mask(case: Case, seed: int = 0, prefix_bits: bool = False, offsets: list[int] | None = None) -> tuple:
    """A random tree mask in SGLang's layout: per request L x (off + P + L) bits, row-major.

    Draft token i always sees itself; other draft bits are random (a tree need not be a
    chain). Prefix bits are all ones unless ``prefix_bits``.
    """
    g = torch.Generator().manual_seed(seed)
    chunks, ptr = [], [0]
    for b, (p, n) in enumerate(zip(case.prefix_lens, case.draft_lens, strict=True)):
        off = offsets[b] if offsets else 0
        m = torch.ones(n, off + p + n, dtype=torch.bool)
        m[:, :off] = torch.rand(n, off, generator=g) < 0.5
        if prefix_bits:
            m[:, off : off + p] = torch.rand(n, p, generator=g) < 0.7
        m[:, off + p :] = (torch.rand(n, n, generator=g) < 0.5) | torch.eye(n, dtype=torch.bool)
        chunks.append(m.reshape(-1))
        ptr.append(ptr[-1] + m.numel())
    dev = case.q.device
    mask = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.bool)
    return mask.to(dev), torch.tensor(ptr, dtype=torch.int32, device=dev)


def chain_mask(case: Case) -> tuple:
    """SGLang's topk = 1 mask: the whole prefix, then a lower triangle."""
    chunks, ptr = [], [0]
    for p, n in zip(case.prefix_lens, case.draft_lens, strict=True):
        m = torch.ones(n, p + n, dtype=torch.bool)
        m[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
        chunks.append(m.reshape(-1))
        ptr.append(ptr[-1] + m.numel())
    dev = case.q.device
    return torch.cat(chunks).to(dev), torch.tensor(ptr, dtype=torch.int32, device=dev)


def _scale(s: object) -> float:
    if isinstance(s, torch.Tensor):
        return float(s.reshape(-1)[0])
    return 1.0 if s is None else float(s)


def brute_force(
    case: Case,
    *,
    k_scale: object = 1.0,
    v_scale: object = 1.0,
    sm_scale: float | None = None,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    is_causal: bool = True,
    skip_prefix_custom_mask: bool = True,
    sliding_window_size: int = -1,
    sinks: torch.Tensor | None = None,
    window_kv_offsets: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    xai_temperature_len: int = -1,
) -> torch.Tensor:
    """Float64, one row at a time: build the visibility row, the scores, a softmax with
    the sink as an extra column, then the weighted sum of V."""
    h_q, d_qk = case.q.shape[1:]
    h_kv = case.k.shape[1]
    grp = h_q // h_kv
    sm = 1.0 / math.sqrt(d_qk) if sm_scale is None else sm_scale
    ks, vs = _scale(k_scale), _scale(v_scale)
    out = torch.zeros(case.q.shape[0], h_q, case.v.shape[2], dtype=torch.float64)
    qo, kvp = case.qo_indptr.tolist(), case.kv_indptr.tolist()
    bits = custom_mask.reshape(-1).cpu().bool() if custom_mask is not None else None
    for b in range(len(qo) - 1):
        p, n = kvp[b + 1] - kvp[b], qo[b + 1] - qo[b]
        slots = case.kv_indices[kvp[b] : kvp[b + 1]].long().cpu()
        keys = torch.cat([case.k_buffer.cpu()[slots].double() * ks, case.k.cpu()[qo[b] : qo[b + 1]].double()])
        vals = torch.cat([case.v_buffer.cpu()[slots].double() * vs, case.v.cpu()[qo[b] : qo[b + 1]].double()])
        off = 0
        if bits is not None and sliding_window_size > 0:
            off = int(window_kv_offsets[b])
        for i in range(n):
            visible = []
            for j in range(p + n):
                bit = True
                if bits is not None:
                    bit = bool(bits[int(mask_indptr[b]) + i * (p + n + off) + off + j])
                if j < p:
                    ok = bit if (bits is not None and not skip_prefix_custom_mask) else True
                    if sliding_window_size > 0:
                        ok = ok and p + i <= j + sliding_window_size
                else:
                    jd = j - p
                    ok = bit if bits is not None else (jd <= i if is_causal else True)
                    if sliding_window_size > 0:
                        ok = ok and i <= jd + sliding_window_size
                visible.append(ok)
            vis = torch.tensor(visible, dtype=torch.bool)
            for h in range(h_q):
                kv = h // grp
                qv = case.q.cpu()[qo[b] + i, h].double()
                s = keys[:, kv] @ qv * sm
                if logit_cap > 0:
                    s = logit_cap * torch.tanh(s / logit_cap)
                if xai_temperature_len > 0 and p + i > xai_temperature_len:
                    s = s * (math.log2(p + i) / math.log2(xai_temperature_len))
                s = s[vis]
                if sinks is not None:
                    s = torch.cat([s, sinks.cpu()[h : h + 1].double()])
                if s.numel() == 0 or (sinks is None and not vis.any()):
                    continue
                w = torch.softmax(s, 0)[: int(vis.sum())]
                out[qo[b] + i, h] = w @ vals[vis, kv]
    return out


class FakeModule:
    """A stand-in for a generated module that follows the contract in docs/design.md.

    It accepts causal chains and custom masks (which govern, as in a generated module; not
    their prefix columns) with ``dtype`` tensors and ``group`` in ``groups``, computes with
    ``kgen.reference`` (the general path for pages), and counts calls. It refuses a non-zero
    ``kv_len_adjust``; its paged entry takes ``is_causal`` (and records the latest).
    ``compute=False`` makes it accept without touching any tensor value (for the no-host-sync test).
    """

    def __init__(
        self, uri: str, *, groups: tuple[int, ...] = (4,), dtype: torch.dtype = torch.float32, compute: bool = True
    ):
        self.URI, self.groups, self.dtype, self.compute = uri, groups, dtype, compute
        self.calls = 0
        self.accepted = 0
        self.last_paged_is_causal: bool | None = None

    def why_not(self, q, k, v, o, kb, vb, qo, kvp, kvi, custom_mask, is_causal, mask_indptr, max_len,
                k_scale, v_scale, sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True,
                sliding_window_size=-1, sinks=None, window_kv_offsets=None, xai_temperature_len=-1,
                max_bs=None, *, kv_len_adjust=0) -> str:  # fmt: skip
        if kv_len_adjust:
            return "kv_len_adjust"
        if sinks is not None:
            return "sinks"
        if sliding_window_size > 0:
            return "sliding window"
        if logit_cap > 0:
            return "logit cap"
        if xai_temperature_len > 0:
            return "xai"
        if custom_mask is None and not is_causal:
            return "non-causal without a mask"
        if custom_mask is not None and not skip_prefix_custom_mask:
            return "mask on the prefix"
        if q.dtype != self.dtype or kb.dtype != self.dtype:
            return "dtype"
        if q.shape[1] // k.shape[1] not in self.groups:
            return "group"
        return ""

    def can_handle(self, *args, **kwargs) -> bool:
        return self.why_not(*args, **kwargs) == ""

    def verify_shared_kv_fwd(self, *args, **kwargs) -> bool:
        self.calls += 1
        if self.why_not(*args, **kwargs):
            return False
        self.accepted += 1
        if self.compute:
            from kgen.reference import reference_verify
            from kgen.runtime.call import VerifyCall

            c = VerifyCall.from_sglang(*args, **kwargs)
            o = reference_verify(*c.tensors[:3], *c.tensors[4:], c.k_scale, c.v_scale, c.sm_scale,
                                 custom_mask=c.custom_mask, mask_indptr=c.mask_indptr, is_causal=c.is_causal)
            c.o_extend.copy_(o.to(c.o_extend.dtype))
        return True

    def verify_paged_fwd(self, q, k, v, o, k_cache, v_cache, block_table, prefix_lens, qo, max_len,
                         k_scale=1.0, v_scale=1.0, sm_scale=None, custom_mask=None, mask_indptr=None,
                         is_causal=True, config=None) -> bool:  # fmt: skip
        self.calls += 1
        self.last_paged_is_causal = is_causal
        if q.dtype != self.dtype or q.shape[1] // k.shape[1] not in self.groups:
            return False
        self.accepted += 1
        if self.compute:
            from kgen.runtime.attend import GeneralPath
            from kgen.runtime.call import Features, PagedCall

            GeneralPath().run(
                PagedCall(
                    q, k, v, o, k_cache, v_cache, block_table, prefix_lens, qo, max_len, k_scale, v_scale, sm_scale,
                    features=Features(custom_mask=custom_mask, mask_indptr=mask_indptr, is_causal=is_causal),
                )
            )
        return True


def fake_loader(modules: dict[str, FakeModule], counter: dict | None = None):
    """A ``kgen.load`` stand-in serving ``modules`` by variant; counts lookups."""

    def load(layout: str, kv: str, q: str, variant: str) -> FakeModule:
        if counter is not None:
            counter[variant] = counter.get(variant, 0) + 1
        if variant not in modules:
            raise FileNotFoundError(f"no fake {variant} module")
        return modules[variant]

    return load


def real_module_reason() -> str:
    """'' when the generated modules load, else why the tests that need them skip."""
    try:
        import kgen

        kgen.load("gqa64", "bfloat16", "bfloat16", variant="grouped")
        kgen.load("gqa64", "bfloat16", "bfloat16", variant="per_head")
    except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
        return f"generated modules unavailable ({type(exc).__name__}: {exc}); run `kgen build`"
    return ""


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
