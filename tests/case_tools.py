"""What tests make of a ``kgen.problems`` case: trees set on it, batches of cases, pools poisoned
where a case names no slot, and vLLM-style paged caches.

``set_draft_masks`` gives a case one draft mask per request in SGLang's layout (the paged entry's
rows come from ``paged_mask``). ``poison_unnamed_slots`` puts NaN in every slot a case does not
name and ``to_paged`` copies a case's prefixes into a paged cache (NaN wherever no prefix token
lies), so that a kernel reading outside a request shows up. ``batch_of`` puts single-request
cases into one batch (the same request among other neighbours, for the tests of batch
invariance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kgen.problems import VerifyCase, indptr_of, sglang_mask


def paged_mask(draft_masks: Sequence[torch.Tensor], width: int | None = None,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(custom_mask, mask_indptr) of the paged entry: a [rows, W] uint8 mask whose row
    mask_indptr[b] + i holds draft token i of request b (columns past a request's draft 1, so a
    kernel reading them shows), and the row offsets (int32)."""
    rows = sum(m.shape[0] for m in draft_masks)
    width = width or max((m.shape[1] for m in draft_masks), default=1)
    mask = torch.ones(rows, width, dtype=torch.uint8)
    starts, at = [], 0
    for draft in draft_masks:
        mask[at : at + draft.shape[0], : draft.shape[1]] = draft.to(torch.uint8)
        starts.append(at)
        at += draft.shape[0]
    starts.append(at)
    return mask.to(device), torch.tensor(starts, dtype=torch.int32, device=device)


def set_draft_masks(case: VerifyCase, draft_masks: Sequence[torch.Tensor], gap: int = 0,
                    is_causal: bool = True) -> VerifyCase:
    """Give ``case`` a tree: request b's draft tokens see each other as ``draft_masks[b]`` says
    ([L_b, L_b] bools), in SGLang's layout (``sglang_mask``). ``is_causal`` is what the call
    passes with it (SGLang: True; the mask governs either way)."""
    lens = case.draft_lens()
    shapes = [tuple(m.shape) for m in draft_masks]
    if shapes != [(n, n) for n in lens]:
        raise ValueError(f"draft masks must be [L, L] per request ({lens}), got {shapes}")
    case.draft_masks = [m.bool() for m in draft_masks]
    case.custom_mask, case.mask_indptr = sglang_mask(case.draft_masks, case.prefix_lens(), gap, case.q.device)
    case.is_causal = is_causal
    return case


def batch_of(cases: Sequence[VerifyCase], seed: int = 0, spare_indices: int = 0,
             mask_gap: int = 0) -> tuple[VerifyCase, list[slice]]:
    """One batch holding the requests of ``cases`` in order, each with its own data (the tests of
    batch invariance put the same request among different neighbours), and each case's rows of
    q and o in it. The pools are concatenated, then their slots shuffled (seeded), and the page
    table follows; ``spare_indices`` more entries after kv_indptr[-1] make kv_indices longer
    than the batch needs, as an engine's preallocated (CUDA-graph) index buffer is. Every case
    must have the same KV heads, dtypes, index dtype and scales. Trees (``set_draft_masks``):
    every case has one or none does, and the batch gets theirs in SGLang's layout, its mask
    blocks ``mask_gap`` bytes apart (the neighbours then change where a request's block lies)."""
    first = cases[0]
    if any(c.kv_indptr.numel() != 2 for c in cases):
        raise ValueError("batch_of takes single-request cases")
    trees = [c.draft_masks is not None for c in cases]
    if any(trees) and not all(trees):
        raise ValueError("batch_of needs every case to have a draft mask (set_draft_masks) or none")
    if any((c.k_scale, c.v_scale, c.kv_indices.dtype) != (first.k_scale, first.v_scale, first.kv_indices.dtype)
           for c in cases):
        raise ValueError("batch_of needs cases with the same scales and kv_indices dtype")
    latent = first.v_buffer.data_ptr() == first.k_buffer.data_ptr()  # absorbed MLA: V is K's latent columns
    v_dim = first.v_buffer.shape[-1]
    rows, start = [], 0
    for c in cases:
        rows.append(slice(start, start + c.q.shape[0]))
        start += c.q.shape[0]
    offsets = [0]
    for c in cases:
        offsets.append(offsets[-1] + c.k_buffer.shape[0])
    order = torch.randperm(offsets[-1], generator=torch.Generator().manual_seed(seed)).to(first.k_buffer.device)

    def pool(buffers: list[torch.Tensor]) -> torch.Tensor:
        joined = torch.cat(buffers)
        out = torch.empty_like(joined)
        _bits(out)[order] = _bits(joined)  # slot j of the joined pools moves to slot order[j]
        return out

    k_pool = pool([c.k_buffer for c in cases])
    v_pool = k_pool[..., :v_dim] if latent else pool([c.v_buffer for c in cases])
    indices = torch.cat([order[c.kv_indices.long() + off] for c, off in zip(cases, offsets[:-1], strict=True)])
    if spare_indices:
        indices = torch.cat([indices, order[:1].repeat(spare_indices)])
    k_ext = torch.cat([c.k_extend for c in cases])
    v_ext = k_ext[..., :v_dim] if latent else torch.cat([c.v_extend for c in cases])
    draft_lens = [c.q.shape[0] for c in cases]
    prefix_lens = [int(c.kv_indptr[-1]) for c in cases]
    q = torch.cat([c.q for c in cases])
    batch = VerifyCase(
        q=q, k_extend=k_ext, v_extend=v_ext, o=torch.full_like(torch.cat([c.o for c in cases]), float("nan")),
        k_buffer=k_pool, v_buffer=v_pool, qo_indptr=indptr_of(draft_lens, q.device),
        kv_indptr=indptr_of(prefix_lens, q.device), kv_indices=indices.to(first.kv_indices.dtype),
        max_len_extend=max(draft_lens), k_scale=first.k_scale, v_scale=first.v_scale, sm_scale=first.sm_scale,
    )
    if all(trees):
        set_draft_masks(batch, [m for c in cases for m in c.draft_masks], mask_gap, first.is_causal)
    return batch, rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t``'s elements: torch has no masked fill or index put for float8, and
    copies through the bits are exact for every dtype."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _nan_bits(dtype: torch.dtype) -> int:
    """The bit pattern of NaN in ``dtype`` (float8 included), as an integer of its width."""
    return int(_bits(torch.full((1,), float("nan")).to(dtype))[0])


def nan_tensor(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of NaN in any float dtype, float8 included."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    _bits(out).fill_(_nan_bits(dtype))
    return out


def poison_unnamed_slots(case: VerifyCase) -> None:
    """Put NaN in every pool slot ``case.kv_indices`` does not name, a new slot 0 among them
    (``kv_indices`` moves up by one): a masked index load's ``other=0`` lands there. A kernel
    that reads outside its request then writes NaN (0 x NaN = NaN in P.V)."""
    k_old = case.k_buffer
    k_pool = nan_tensor((k_old.shape[0] + 1, *k_old.shape[1:]), k_old.dtype, k_old.device)
    case.kv_indices = case.kv_indices + 1
    named = case.kv_indices.long()
    _bits(k_pool)[named] = _bits(k_old)[named - 1]
    if case.v_buffer.data_ptr() == k_old.data_ptr():  # absorbed MLA: V is K's latent columns
        v_pool = k_pool[..., : case.v_buffer.shape[-1]]
    else:
        v_old = case.v_buffer
        v_pool = nan_tensor((v_old.shape[0] + 1, *v_old.shape[1:]), v_old.dtype, v_old.device)
        _bits(v_pool)[named] = _bits(v_old)[named - 1]
    case.k_buffer, case.v_buffer = k_pool, v_pool


@dataclass
class PagedCache:
    """A case's prefixes as a vLLM-style paged cache: ``[blocks, page, H_kv, D]`` pools, a block
    table ``[batch, max_blocks]`` and the prefix lengths."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    prefix_lens: torch.Tensor

    def paged_args(self, case: VerifyCase, index_dtype: torch.dtype = torch.int32) -> tuple:
        """Positional arguments of ``verify_paged_fwd`` (and ``why_not_paged``) for ``case``; a
        tree's masks as the paged entry's rows (``paged_mask``)."""
        args = (case.q, case.k_extend, case.v_extend, case.o, self.k_cache, self.v_cache,
                self.block_table.to(index_dtype), self.prefix_lens, case.qo_indptr, case.max_len_extend,
                case.k_scale, case.v_scale, case.sm_scale)
        if case.draft_masks is None:
            return args
        return (*args, *paged_mask(case.draft_masks, device=case.q.device))


def to_paged(case: VerifyCase, page_size: int, spare_blocks: int = 2, seed: int = 0) -> PagedCache:
    """The case's prefixes copied into pages of ``page_size`` tokens.

    Blocks are a seeded random permutation of the cache (spare blocks among them); every
    position no prefix token occupies holds NaN (a last page's tail, the spare blocks), and
    the table's entries past a request's last block name a spare block.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if spare_blocks < 1:
        raise ValueError(f"spare_blocks must be >= 1 (table padding names one), got {spare_blocks}")
    device = case.k_buffer.device
    bounds = case.kv_indptr.tolist()
    prefix_lens = [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]
    num_blocks = [-(-p // page_size) for p in prefix_lens]
    total = sum(num_blocks) + spare_blocks
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(num_blocks, default=0) + 1
    rows, destination = [], []  # destination: flat position (block x page + offset) of each prefix token
    for b, p in enumerate(prefix_lens):
        blocks, order = order[: num_blocks[b]], order[num_blocks[b] :]
        rows.append(blocks + [order[-1]] * (width - len(blocks)))  # padding names a spare block
        destination += [blocks[t // page_size] * page_size + t % page_size for t in range(p)]
    table = torch.tensor(rows, dtype=torch.int32).reshape(len(prefix_lens), width)
    destination = torch.tensor(destination, dtype=torch.long, device=device)
    slots = case.kv_indices.long()

    def paged(pool: torch.Tensor) -> torch.Tensor:
        cache = nan_tensor((total, page_size, *pool.shape[1:]), pool.dtype, device)
        _bits(cache).view(total * page_size, *pool.shape[1:])[destination] = _bits(pool)[slots]
        return cache

    k_cache = paged(case.k_buffer)
    if case.v_buffer.data_ptr() == case.k_buffer.data_ptr():  # absorbed MLA: V is K's latent columns
        v_cache = k_cache[..., : case.v_buffer.shape[-1]]
    else:
        v_cache = paged(case.v_buffer)
    return PagedCache(k_cache=k_cache, v_cache=v_cache, block_table=table.to(device),
                      prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device))


def patch_kernels(monkeypatch: Any, module: ModuleType, **kernels: Any) -> None:
    """Give a module's launcher other kernels (a spy, a recorder) for one test: prefix=, merge=."""
    launcher = module.LAUNCHER
    monkeypatch.setattr(launcher, "kernels", dataclasses.replace(launcher.kernels, **kernels))


def patch_identity(monkeypatch: Any, module: ModuleType, **fields: Any) -> None:
    """Give a module's launcher another identity field for one test (draft_first_rows=...)."""
    launcher = module.LAUNCHER
    monkeypatch.setattr(launcher, "identity", dataclasses.replace(launcher.identity, **fields))
