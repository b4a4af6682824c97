"""What a generated module is: the one declaration its launcher reads (``ModuleIdentity``),
and the kernels it offers (``Kernels``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Invariance:
    """The batch-invariant variant's fixed split plan: split k of a request covers prefix
    tokens [k, k + 1) x tokens_per_split; past max_splits splits the split grows to a whole
    multiple of it. Programs are fitted for drafts of draft_rows tokens."""

    tokens_per_split: int
    max_splits: int
    draft_rows: int


@dataclass(frozen=True, kw_only=True)
class ModuleIdentity:
    """Everything the launcher needs to know about one generated module, decided at build time
    (the plan's sections; ``kgen explain`` prints the reasons)."""

    uri: str
    layout: str
    variant: str  # "grouped" or "per_head"
    kv_dtype: torch.dtype
    q_dtype: torch.dtype
    qk_dim: int
    v_head_dim: int
    max_draft_tokens: int
    page_sizes: tuple[int, ...]
    # Targets this module was compiled and checked for (`kgen check`, kgen/tables/targets.json).
    targets: Mapping[str, Mapping[str, Any]]
    # What one program stages per prefix token and per row (rules.kernel_shape).
    kernel_shape: Mapping[str, int]
    # The prefix stage's tl.dot operand dtype on the GPU (the interpreter's dot takes fp32).
    prefix_dot_dtype: Any
    # V comes from K's latent columns (absorbed MLA): no V pointer, v_buffer must be that view.
    v_from_k_tile: bool
    # Row counts whose programs run the draft tile before the prefix loop, unless the block
    # config says (draft_tile); None where the kernel has no such choice.
    draft_first_rows: tuple[int, ...] | None = None
    # The default mode's split policy (a table row's `split` overrides its fields).
    split_defaults: Mapping[str, int] | None = None
    merge_rows: int
    merge_split_chunk: int
    merge_block_dv: int
    # The arch whose table rows may launch the Gluon prefix stage; None when the module has none.
    gluon_arch: str | None = None
    invariance: Invariance | None = None

    @property
    def grouped(self) -> bool:
        return self.variant == "grouped"

    @property
    def fp8_kv(self) -> bool:
        return self.kv_dtype.itemsize == 1

    @property
    def kv_dtype_name(self) -> str:
        """The KV dtype as targets.json's `fp8` lists name it (float8_e4m3fn, ...)."""
        return str(self.kv_dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Kernels:
    """The module's launchable kernels. gluon_prefix is None where the module has no Gluon stage
    or this Triton cannot run it (the Triton prefix stage serves every call then)."""

    prefix: Any
    merge: Any
    gluon_prefix: Any = None
    gluon_num_warps: int | None = None  # its default partition's warps (the consumers)
