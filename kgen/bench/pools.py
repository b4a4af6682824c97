"""The case's KV as an engine's cache holds it, for the peers that read a pool of their own
(FlashInfer, vLLM's Triton kernels), built in set-up, untimed.

kgen's kernels take the draft tokens apart (``k_extend``); an engine writes them into its pool
before the verify step, so these peers get the case's pool with every input set's draft K/V
appended (``token_pool``). An FP8 pool stores them as an engine's quantizer does (``x / scale``
in e4m3), so a peer's check reads the draft values as stored (``pool_reference``). A pool of
16-token pages is a copy of the same rows in a shuffled page order (``paged_copy``); pages of one
token are the token-slot pool itself (``page1``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kgen.bench.cases import Case
from kgen.bench.inputs import CaseInputs, case_seed, gather_rows, reference_subset


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 rows move as bytes (indexing and cat kernels for FP8 types are not on every torch build)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _stored(rows: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Draft rows as the pool stores them: BF16 as they are, FP8 as ``x / scale`` (what an
    engine's KV writer stores; the kernel multiplies the scale back)."""
    if rows.dtype == dtype:
        return rows
    return (rows.float() / scale).to(dtype)


def _cat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([as_bytes(a), as_bytes(b)]).view(a.dtype)


@dataclass
class TokenPool:
    """The case's pool with every input set's draft rows appended after its slots."""

    k: torch.Tensor  # [slots + drafts, H_kv, D_qk] in the KV dtype
    v: torch.Tensor | None  # [slots + drafts, H_kv, D_v]; None for MLA (V is K's latent)
    k_draft: torch.Tensor  # [n_sets * bs * L, H_kv, D_qk]: the draft rows as stored
    v_draft: torch.Tensor | None
    tokens: list[torch.Tensor]  # per set: [bs, P + L] int64, the slot of each token in order


def token_pool(inputs: CaseInputs) -> TokenPool:
    """Set s, request b: its P slots from the case's page table, then its L draft rows at
    ``slots + (s * bs + b) * L`` onwards."""
    case = inputs.case
    dtype = inputs.k_buffer.dtype
    k_draft = _stored(torch.cat([s.k_extend for s in inputs.sets]), dtype, inputs.k_scale)
    v_draft = None
    if case.separate_v:
        v_draft = _stored(torch.cat([s.v_extend for s in inputs.sets]), dtype, inputs.v_scale)
    slots = inputs.k_buffer.shape[0]
    bs, P, L = case.batch, case.prefix, case.draft
    device = inputs.k_buffer.device
    tokens = []
    for i, s in enumerate(inputs.sets):
        draft = slots + i * bs * L + torch.arange(bs * L, device=device).view(bs, L)
        tokens.append(torch.cat([s.kv_indices.long().view(bs, P), draft], dim=1))
    return TokenPool(
        k=_cat_rows(inputs.k_buffer, k_draft),
        v=_cat_rows(inputs.v_buffer, v_draft) if v_draft is not None else None,
        k_draft=k_draft,
        v_draft=v_draft,
        tokens=tokens,
    )


@dataclass
class PagedKV:
    """One page size's view of the pool and each input set's int32 plan metadata."""

    page_size: int
    k: torch.Tensor  # prefill: [pages, page_size, H_kv, D_qk]; MLA: [pages, page_size, D_qk]
    v: torch.Tensor | None  # prefill: [pages, page_size, H_kv, D_v]; MLA: None
    pages: list[torch.Tensor]  # per set: [bs, pages per request] int64 page ids
    qo_indptr: torch.Tensor  # int32 [bs + 1]
    kv_indptr: torch.Tensor  # int32 [bs + 1], in pages
    last_page_len: torch.Tensor  # int32 [bs]
    kv_len: torch.Tensor  # int32 [bs], in tokens (MLA's kv_len_arr)

    def kv_indices(self, i: int) -> torch.Tensor:
        """Set ``i``'s page ids, int32 (FlashInfer's index type; converted once, here)."""
        return self.pages[i].reshape(-1).to(torch.int32)


def _pages_view(rows: torch.Tensor, page_size: int, mla: bool) -> torch.Tensor:
    """[N * page_size, H_kv, D] rows as pages: NHD for batch prefill, [pages, page_size, D] for
    MLA (its one latent head dropped)."""
    shape = (-1, page_size, rows.shape[-1]) if mla else (-1, page_size, *rows.shape[1:])
    return rows.view(shape)


def _metadata(case: Case, page_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    tokens = case.prefix + case.draft
    per_request = -(-tokens // page_size)
    ramp = torch.arange(case.batch + 1, dtype=torch.int32, device=device)
    return {
        "qo_indptr": ramp * case.draft,
        "kv_indptr": ramp * per_request,
        "last_page_len": torch.full((case.batch,), tokens - page_size * (per_request - 1), dtype=torch.int32,
                                    device=device),
        "kv_len": torch.full((case.batch,), tokens, dtype=torch.int32, device=device),
    }  # fmt: skip


def page1(case: Case, pool: TokenPool) -> PagedKV:
    """Page size 1: the token-slot pool itself, the token slots as page ids."""
    mla = not case.separate_v
    return PagedKV(
        page_size=1,
        k=_pages_view(pool.k, 1, mla),
        v=_pages_view(pool.v, 1, mla) if pool.v is not None else None,
        pages=pool.tokens,
        **_metadata(case, 1, pool.k.device),
    )


def _page_rows(src: torch.Tensor, tokens: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], total_rows: int,
               gen: torch.Generator) -> torch.Tensor:
    """A [total_rows, ...] copy of ``src`` rows: row ``dst[s]`` gets ``src[tokens[s]]``; the
    padding of the last pages gets other rows of the pool (finite values a kernel must not read)."""
    filler = torch.randint(src.shape[0], (total_rows,), generator=gen).to(src.device)
    out = as_bytes(gather_rows(src, filler))
    raw = as_bytes(src)
    for toks, rows in zip(tokens, dst, strict=True):
        out[rows.reshape(-1)] = raw[toks.reshape(-1)]
    return out.view(src.dtype)


def paged_copy(case: Case, pool: TokenPool, page_size: int, seed: int = 0) -> PagedKV:
    """The same K/V copied into ``page_size``-token pages: every request of every set owns
    ceil((P + L) / page_size) pages, placed by one random permutation of all pages (a
    long-running server's page order), token t of a request in row t % page_size of its page
    t // page_size."""
    device = pool.k.device
    n_sets, bs = len(pool.tokens), case.batch
    tokens = case.prefix + case.draft
    per_request = -(-tokens // page_size)
    total = n_sets * bs * per_request
    gen = torch.Generator().manual_seed(case_seed(case, seed) + page_size)
    order = torch.randperm(total, generator=gen).to(device).view(n_sets, bs, per_request)
    t = torch.arange(tokens, device=device)
    dst = [order[i][:, t // page_size] * page_size + t % page_size for i in range(n_sets)]
    mla = not case.separate_v
    k = _page_rows(pool.k, pool.tokens, dst, total * page_size, gen)
    v = _page_rows(pool.v, pool.tokens, dst, total * page_size, gen) if pool.v is not None else None
    return PagedKV(
        page_size=page_size,
        k=_pages_view(k, page_size, mla),
        v=_pages_view(v, page_size, mla) if v is not None else None,
        pages=[order[i] for i in range(n_sets)],
        **_metadata(case, page_size, device),
    )


def _dequantized(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Stored FP8 draft rows as the kernel reads them, in bf16 (e4m3 x 0.75 or 1.25 is exact there)."""
    return (rows.float() * scale).to(torch.bfloat16)


def pool_reference(inputs: CaseInputs, pool: TokenPool, mask: str) -> torch.Tensor:
    """The reference of the problem a peer reading ``pool`` is given: the case's (shared with the kgen
    kernels) unless the pool is FP8, where the draft K/V are the values the pool stores."""
    case = inputs.case
    if not case.is_fp8:
        return inputs.reference() if mask == case.mask else reference_subset(inputs, mask)
    rows = case.batch * case.draft  # set 0's draft rows come first
    k_ext = _dequantized(pool.k_draft[:rows], inputs.k_scale)
    if pool.v_draft is not None:
        v_ext = _dequantized(pool.v_draft[:rows], inputs.v_scale)
    else:
        v_ext = _dequantized(pool.k_draft[:rows, ..., : case.v_dim], inputs.v_scale)
    s0 = dataclasses.replace(inputs.sets[0], k_extend=k_ext, v_extend=v_ext)
    return reference_subset(dataclasses.replace(inputs, sets=[s0], _reference=None), mask)


def one_latent_scale(inputs: CaseInputs) -> tuple[float, float]:
    """(sm_scale, scale) for an absorbed-MLA kernel that dequantizes the shared latent with one
    scale for the scores and the output alike (FlashInfer's MLA wrapper, vLLM's Triton MLA):
    the case scales K by k_scale and V by v_scale (to catch a swapped scale), and scale =
    v_scale with sm_scale * k_scale / v_scale is the same function exactly (scores sm * k_scale
    * q.k, output V * v_scale)."""
    return inputs.sm_scale * inputs.k_scale / inputs.v_scale, inputs.v_scale


@dataclass
class Launch:
    """A peer's timed launch on its own outputs: ``fn(i)`` runs input set i into ``outs[i]``."""

    fn: Callable[[int], object]
    outs: list[torch.Tensor]
