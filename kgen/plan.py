"""The Plan: the generator's IR. Every choice the passes make lives here with its reason.

A plan starts from one layout spec plus the dtypes and variant to generate for. Each pass
is a pure function ``Plan -> Plan`` that fills in fields and appends ``Decision`` records;
``kgen explain`` prints the plan after each pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from kgen.blockconfig import BlockConfig
from kgen.spec import KV_DTYPES, Q_DTYPES, LayoutSpec

Variant = Literal["grouped", "per_head"]
VARIANTS: tuple[Variant, ...] = ("grouped", "per_head")


def module_uri(layout: str, kv_dtype: str, q_dtype: str, variant: Variant = "grouped") -> str:
    """The one name of a specialization: file name, ``kgen.load`` key, cache and table key."""
    prefix = "verify" if variant == "grouped" else "verify_perhead"
    return f"{prefix}_{layout}__kv_{KV_DTYPES[kv_dtype]}__q_{Q_DTYPES[q_dtype]}"


@dataclass(frozen=True)
class Decision:
    """One choice: which pass made it, what was decided, the value, and why."""

    pass_name: str
    what: str
    value: Any
    why: str


@dataclass(frozen=True)
class ConfigEntry:
    """One row of the block-config table baked into a module."""

    group_size: int
    batch_min: int
    batch_max: int
    config: BlockConfig


@dataclass(frozen=True)
class Plan:
    spec: LayoutSpec
    kv_dtype: str
    q_dtype: str
    variant: Variant = "grouped"
    decisions: tuple[Decision, ...] = ()
    # specialize
    has_pe: bool | None = None
    fp8_kv: bool | None = None
    v_from_k_tile: bool | None = None
    draft_tile_first: bool | None = None
    draft_tile_either: bool = False
    draft_first_rows: tuple[int, ...] = ()
    unmasked_full_tiles: bool | None = None
    prefix_dot_dtype: str | None = None
    # legalize
    block_d: int | None = None
    block_dpe: int | None = None
    block_dv: int | None = None
    merge_block_dv: int | None = None
    merge_rows: int | None = None
    merge_split_chunk: int | None = None
    min_dot_rows: int | None = None
    max_draft_tokens: int | None = None
    mask_d: bool | None = None
    mask_dv: bool | None = None
    page_sizes: tuple[int, ...] = ()
    # select_config
    default_config: BlockConfig | None = None
    arch_configs: dict[str, tuple[ConfigEntry, ...]] = field(default_factory=dict)
    table_sources: dict[str, str] = field(default_factory=dict)
    # fit
    targets: dict[str, dict] = field(default_factory=dict)
    kernel_shape: dict[str, Any] = field(default_factory=dict)
    # render / check / emit
    source: str | None = None
    checked: bool = False
    output_path: str | None = None
    written: bool | None = None

    @property
    def uri(self) -> str:
        return module_uri(self.spec.name, self.kv_dtype, self.q_dtype, self.variant)

    def with_(self, decisions: list[Decision] | tuple[Decision, ...] = (), **changes: Any) -> Plan:
        """A copy with ``changes`` applied and ``decisions`` appended (plans are immutable)."""
        return dataclasses.replace(self, decisions=self.decisions + tuple(decisions), **changes)

    def decisions_of(self, pass_name: str) -> list[Decision]:
        return [d for d in self.decisions if d.pass_name == pass_name]


def new_plan(spec: LayoutSpec, kv_dtype: str, q_dtype: str, variant: Variant = "grouped") -> Plan:
    return Plan(spec=spec, kv_dtype=kv_dtype, q_dtype=q_dtype, variant=variant)
