"""Random verify problems in SGLang's layout, for tests, the tuner's check and the benchmark.

A ``VerifyCase`` holds every tensor ``verify_shared_kv_fwd`` takes. Pools are filled with
random data (never zeros: zeros hide unwritten outputs) and the page table is a random
permutation of slots unless ``shuffle=False``. ``poison_unnamed_slots`` puts NaN in every slot
a case does not name and ``to_paged`` copies a case's prefixes into a vLLM-style paged cache
(NaN wherever no prefix token lies), so that a kernel reading outside a request shows up.
"""

from __future__ import annotations

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

    def sglang_args(self) -> tuple:
        """Positional arguments of ``verify_shared_kv_fwd`` (topk = 1, causal)."""
        return (self.q, self.k_extend, self.v_extend, self.o, self.k_buffer, self.v_buffer,
                self.qo_indptr, self.kv_indptr, self.kv_indices, None, True, None,
                self.max_len_extend, self.k_scale, self.v_scale, self.sm_scale)

    def launch_args(self) -> tuple:
        """Positional arguments of a generated module's ``launch``."""
        return (self.q, self.k_extend, self.v_extend, self.o, self.k_buffer, self.v_buffer,
                self.qo_indptr, self.kv_indptr, self.kv_indices, self.max_len_extend,
                self.k_scale, self.v_scale, self.sm_scale)

    def reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return reference_verify(self.q, self.k_extend, self.v_extend, self.k_buffer, self.v_buffer,
                                self.qo_indptr, self.kv_indptr, self.kv_indices, self.k_scale,
                                self.v_scale, self.sm_scale, dtype=dtype)


def _indptr(lengths: Sequence[int], device: torch.device | str) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32, device=device)


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
) -> VerifyCase:
    """A random problem: request b has ``prefix_lens[b]`` prefix and ``draft_lens[b]`` drafts."""
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

    k_pool = randn(slots, num_kv_heads, shape.qk_dim)
    if kv_dtype in FP8_DTYPES:
        # Quantize as an engine would: store x / scale, the kernel multiplies back.
        k_pool = (k_pool / k_scale).to(kvdt)
    else:
        k_pool = k_pool.to(kvdt)
    v_pool = None
    if shape.v_source != "k_latent":
        v_pool = randn(slots, num_kv_heads, shape.v_head_dim)
        v_pool = (v_pool / v_scale).to(kvdt) if kv_dtype in FP8_DTYPES else v_pool.to(kvdt)
    order = torch.randperm(slots, generator=gen, device=dev) if shuffle else torch.arange(slots, device=dev)
    kv_indices = order[:total_prefix].to(index_dtype)
    q = randn(num_tokens, num_q_heads, shape.qk_dim).to(qdt)
    k_ext = randn(num_tokens, num_kv_heads, shape.qk_dim).to(qdt)
    v_ext = None
    if shape.v_source != "k_latent":
        v_ext = randn(num_tokens, num_kv_heads, shape.v_head_dim).to(qdt)
    o = torch.full((num_tokens, num_q_heads, shape.v_head_dim), float("nan"), dtype=qdt, device=dev)
    if shape.v_source == "k_latent":
        # Absorbed MLA: V is a view of K's latent columns, in the pool and in the draft.
        v_pool, v_ext = k_pool[..., : shape.v_head_dim], k_ext[..., : shape.v_head_dim]
    return VerifyCase(
        q=q, k_extend=k_ext, v_extend=v_ext, o=o, k_buffer=k_pool, v_buffer=v_pool,
        qo_indptr=_indptr(draft_lens, dev), kv_indptr=_indptr(prefix_lens, dev),
        kv_indices=kv_indices, max_len_extend=max(draft_lens) if draft_lens else 0,
        k_scale=k_scale, v_scale=v_scale,
    )


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
        """Positional arguments of ``verify_paged_fwd`` (and ``why_not_paged``) for ``case``."""
        return (case.q, case.k_extend, case.v_extend, case.o, self.k_cache, self.v_cache,
                self.block_table.to(index_dtype), self.prefix_lens, case.qo_indptr, case.max_len_extend,
                case.k_scale, case.v_scale, case.sm_scale)


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


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
