"""Random verify problems in SGLang's layout, for tests, the tuner's check and the benchmark.

A ``VerifyCase`` holds every tensor ``verify_shared_kv_fwd`` takes. Pools are filled with
random data (never zeros: zeros hide unwritten outputs) and the page table is a random
permutation of slots unless ``shuffle=False``.
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


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
