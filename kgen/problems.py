"""Random verify problems in SGLang's layout, for the tuner's check, the benchmark and the tests.

``make_case`` is the one builder of verify inputs: the tests, the tuner and ``kgen bench``
(whose input sets are slices of one case) all call it. A ``VerifyCase`` holds every tensor
``verify_shared_kv_fwd`` takes. Pools are filled with random data (never zeros: zeros hide
unwritten outputs), in chunks so a pool of many GiB needs no fp32 copy of itself, and the
page table is a random permutation of slots unless ``shuffle=False``.

Trees (EAGLE topk > 1): ``eagle_tree`` draws one request's [L, L] draft mask and ``sglang_mask``
lays masks out as SGLang passes them; ``chain_mask`` is the causal chain as a mask. The reference
applies a case's mask as it is. What only the tests make of a case (trees set on it, batches of
cases, poisoned pools, paged caches) is in ``tests/case_tools.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kgen.reference import reference_verify
from kgen.spec import FP8_DTYPES, LayoutSpec


@dataclass
class VerifyCase:
    q: torch.Tensor
    k_extend: torch.Tensor
    v_extend: torch.Tensor
    o: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_len_extend: int
    k_scale: float = 1.0
    v_scale: float = 1.0
    sm_scale: float | None = None
    extra: dict = field(default_factory=dict)
    # A tree: each request's [L, L] draft mask (tests/case_tools.py's ``set_draft_masks``) and
    # the same bits in SGLang's layout; None: the causal chain.
    draft_masks: list[torch.Tensor] | None = None
    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    is_causal: bool = True

    def sglang_args(self) -> tuple:
        """Positional arguments of ``verify_shared_kv_fwd`` (the case's mask, if it has one)."""
        return (self.q, self.k_extend, self.v_extend, self.o, self.k_buffer, self.v_buffer,
                self.qo_indptr, self.kv_indptr, self.kv_indices, self.custom_mask, self.is_causal,
                self.mask_indptr, self.max_len_extend, self.k_scale, self.v_scale, self.sm_scale)

    def mask_kwargs(self) -> dict:
        """The mask keywords of a module's ``launch`` (empty for a chain)."""
        if self.custom_mask is None:
            return {}
        return {"custom_mask": self.custom_mask, "mask_indptr": self.mask_indptr}

    def launch_args(self) -> tuple:
        """Positional arguments of a generated module's ``launch``."""
        return (self.q, self.k_extend, self.v_extend, self.o, self.k_buffer, self.v_buffer,
                self.qo_indptr, self.kv_indptr, self.kv_indices, self.max_len_extend,
                self.k_scale, self.v_scale, self.sm_scale)

    def reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return reference_verify(self.q, self.k_extend, self.v_extend, self.k_buffer, self.v_buffer,
                                self.qo_indptr, self.kv_indptr, self.kv_indices, self.k_scale,
                                self.v_scale, self.sm_scale, dtype=dtype, custom_mask=self.custom_mask,
                                mask_indptr=self.mask_indptr, is_causal=self.is_causal)

    def prefix_lens(self) -> list[int]:
        bounds = self.kv_indptr.tolist()
        return [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]

    def draft_lens(self) -> list[int]:
        bounds = self.qo_indptr.tolist()
        return [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]


def indptr_of(lengths: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Offsets of consecutive runs of ``lengths``: [0, l0, l0 + l1, ...] (int32)."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


POOL_CHUNK_ELEMS = 64 << 20  # random pool values are drawn this many at a time (bounded fp32 temporaries)


def random_pool(slots: int, heads: int, dim: int, dtype: torch.dtype, scale: float, gen: torch.Generator,
                device: torch.device) -> torch.Tensor:
    """N(0, 1) values stored as ``x / scale`` in ``dtype`` (what an engine's FP8 quantizer
    stores; the kernel multiplies the scale back), drawn in chunks of POOL_CHUNK_ELEMS."""
    out = torch.empty(slots, heads, dim, dtype=dtype, device=device)
    rows = max(1, POOL_CHUNK_ELEMS // max(1, heads * dim))
    for start in range(0, slots, rows):
        n = min(rows, slots - start)
        x = torch.randn(n, heads, dim, generator=gen, device=device)
        if scale != 1.0:
            x.div_(scale)
        out[start : start + n] = x.to(dtype)
    return out


def make_case(
    spec: LayoutSpec,
    prefix_lens: Sequence[int],
    draft_lens: Sequence[int],
    group: int,
    num_kv_heads: int = 1,
    kv_dtype: str = "bfloat16",
    q_dtype: str = "bfloat16",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    device: torch.device | str = "cpu",
    shuffle: bool = True,
    spare_slots: int = 7,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
    draft_affinity: float = 0.0,
) -> VerifyCase:
    """A random problem: request b has ``prefix_lens[b]`` prefix and ``draft_lens[b]`` drafts.

    ``draft_affinity`` > 0 adds one random direction per request, times it, to the request's
    draft queries and keys: their scores then stand above the prefix keys', so the draft
    block carries a visible share of the softmax mass and a wrong causal mask on the draft
    tail shows in the output instead of drowning in a long prefix (see ``draft_affinity_for``)."""
    if len(prefix_lens) != len(draft_lens):
        raise ValueError("prefix_lens and draft_lens must have one entry per request")
    if any(n < 0 for n in prefix_lens) or any(n < 1 for n in draft_lens):
        raise ValueError(f"prefix lengths must be >= 0 and draft lengths >= 1, got prefix {list(prefix_lens)} "
                         f"and draft {list(draft_lens)}")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape = spec.attention
    qdt = getattr(torch, q_dtype)
    kvdt = getattr(torch, kv_dtype)
    num_q_heads = group * num_kv_heads
    num_tokens = int(sum(draft_lens))
    total_prefix = int(sum(prefix_lens))
    slots = total_prefix + spare_slots  # unused slots hold data the kernel must not read

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=dev)

    fp8 = kv_dtype in FP8_DTYPES
    k_pool = random_pool(slots, num_kv_heads, shape.qk_dim, kvdt, k_scale if fp8 else 1.0, gen, dev)
    v_pool = None
    if shape.v_source != "k_latent":
        v_pool = random_pool(slots, num_kv_heads, shape.v_head_dim, kvdt, v_scale if fp8 else 1.0, gen, dev)
    order = torch.randperm(slots, generator=gen, device=dev) if shuffle else torch.arange(slots, device=dev)
    kv_indices = order[:total_prefix].to(index_dtype)
    del order
    q = randn(num_tokens, num_q_heads, shape.qk_dim)
    k_ext = randn(num_tokens, num_kv_heads, shape.qk_dim)
    v_ext = None
    if shape.v_source != "k_latent":
        v_ext = randn(num_tokens, num_kv_heads, shape.v_head_dim).to(qdt)
    if draft_affinity:
        shared = randn(len(draft_lens), 1, shape.qk_dim) * draft_affinity
        shared = shared.repeat_interleave(torch.tensor(list(draft_lens), device=dev), dim=0)
        q.add_(shared)
        k_ext.add_(shared)
    q, k_ext = q.to(qdt), k_ext.to(qdt)
    o = torch.full((num_tokens, num_q_heads, shape.v_head_dim), float("nan"), dtype=qdt, device=dev)
    if shape.v_source == "k_latent":
        # Absorbed MLA: V is a view of K's latent columns, in the pool and in the draft.
        v_pool, v_ext = k_pool[..., : shape.v_head_dim], k_ext[..., : shape.v_head_dim]
    return VerifyCase(
        q=q, k_extend=k_ext, v_extend=v_ext, o=o, k_buffer=k_pool, v_buffer=v_pool,
        qo_indptr=indptr_of(draft_lens, dev), kv_indptr=indptr_of(prefix_lens, dev),
        kv_indices=kv_indices, max_len_extend=max(draft_lens) if draft_lens else 0,
        k_scale=k_scale, v_scale=v_scale,
    )


def chain_mask(num_draft: int) -> torch.Tensor:
    """The causal chain as an [L, L] draft mask: draft token i sees 0..i (EAGLE topk = 1)."""
    return torch.ones(num_draft, num_draft, dtype=torch.bool).tril()


def eagle_tree(num_draft: int, topk: int = 4, seed: int = 0) -> torch.Tensor:
    """A random EAGLE-like draft tree as an [L, L] mask: token 0 is the root, each level gives
    every token of the level before 1..topk children (tokens in depth order, parents first),
    and a token sees itself and its ancestors."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1]
    level = [0]
    while len(parents) < num_draft:
        children = []
        for parent in level:
            for _ in range(int(torch.randint(1, topk + 1, (1,), generator=gen))):
                if len(parents) < num_draft:
                    parents.append(parent)
                    children.append(len(parents) - 1)
        level = children
    mask = torch.zeros(num_draft, num_draft, dtype=torch.bool)
    for token in range(num_draft):
        node = token
        while node >= 0:
            mask[token, node] = True
            node = parents[node]
    return mask


def sglang_mask(draft_masks: Sequence[torch.Tensor], prefix_lens: Sequence[int], gap: int = 0,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(custom_mask, mask_indptr) in SGLang's layout: request b's row-major [L, P + L] block of
    bools from mask_indptr[b] (int64). The P prefix columns are written 0: with
    skip_prefix_custom_mask every draft token sees the whole prefix, so a kernel that read them
    would hide it. ``gap`` bytes of 1 between blocks: a kernel reading past its block shows."""
    pieces, starts, at = [], [], 0
    for draft, prefix in zip(draft_masks, prefix_lens, strict=True):
        block = torch.zeros(draft.shape[0], prefix + draft.shape[1], dtype=torch.bool)
        block[:, prefix:] = draft
        starts.append(at)
        pieces += [block.reshape(-1), torch.ones(gap, dtype=torch.bool)]
        at += block.numel() + gap
    starts.append(at)
    flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool)
    return flat.to(device), torch.tensor(starts, dtype=torch.int64, device=device)


def draft_affinity_for(prefix: int, qk_dim: int) -> float:
    """The ``draft_affinity`` that puts a draft score at about ln(prefix) + 2 over prefix
    scores of about N(0, 1 + beta^2)."""
    return math.sqrt((math.log(max(prefix, 2)) + 2.0) / math.sqrt(qk_dim))
