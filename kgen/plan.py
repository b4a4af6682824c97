"""The Plan: the generator's IR. Every choice the passes make lives here with its reason.

A plan starts from one layout spec plus the dtypes and variant to generate for. It grows in
sections that follow the passes, each a frozen dataclass one pass fills:

    spec, kv_dtype, q_dtype, variant,   the request (validate checks it)
    batch_invariant
    specialization                      specialize: what the source contains at all
    tiles                               legalize: tile widths and masks Triton's rules need
    config                              select_config: the block configs baked in per arch
    invariance                          fix_invariance: what the batch-invariant mode fixes
    fit                                 fit: the targets and what one program stages
    lowering                            select_lowering: which kernel language renders it
    output                              render, inspect_source, emit: the source and where it went

Every pass is ``(plan, ctx) -> plan``: it adds its section and appends ``Decision`` records
(what was chosen, and why). The plan is also the templates' context: they read
``plan.specialization.has_pe``, ``plan.tiles.block_d`` and so on. ``kgen explain`` prints
the decisions and the section after each pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from kgen.blockconfig import BlockConfig, batch_span
from kgen.errors import BuildError, UsageError
from kgen.launcher import rules
from kgen.spec import KV_DTYPES, Q_DTYPES, LayoutSpec

Variant = Literal["grouped", "per_head"]
VARIANTS: tuple[Variant, ...] = ("grouped", "per_head")


# The name prefix of each module kind: (variant, batch_invariant) -> prefix.
URI_PREFIXES: dict[tuple[Variant, bool], str] = {
    ("grouped", False): "verify",
    ("per_head", False): "verify_perhead",
    ("grouped", True): "verify_batch_invariant",
}


def module_uri(layout: str, kv_dtype: str, q_dtype: str, variant: Variant = "grouped",
               batch_invariant: bool = False) -> str:
    """The one name of a specialization: file name, ``kgen.load`` key, cache and table key."""
    prefix = URI_PREFIXES.get((variant, bool(batch_invariant)))
    if prefix is None:
        raise UsageError(f"the batch-invariant mode is a specialization of the grouped kernel; variant {variant!r} "
                         "has none (use variant='grouped' with batch_invariant=True)")
    return f"{prefix}_{layout}__kv_{KV_DTYPES[kv_dtype]}__q_{Q_DTYPES[q_dtype]}"


def config_value(config: BlockConfig) -> dict[str, Any]:
    """A config as the dict a module holds: unset fields left out, keys in a stable order."""
    return config.model_dump(exclude_none=True)


def config_literal(config: BlockConfig) -> str:
    """A config as a Python dict literal in that order (``config_value``'s repr)."""
    return repr(config_value(config))


# Characters a decision's ``brief`` may take: what is left of a `kgen explain` line (100
# characters) under the value column of the widest row (pass 15, what 17, " = ", "— ").
BRIEF_WIDTH = 60


@dataclass(frozen=True)
class Decision:
    """One choice: which pass made it, what was decided, the value, and why.

    ``why`` is the whole reason: ``kgen explain --verbose`` and ``--pass`` print it, and
    ``kgen build`` prints a ``warning``'s. ``brief`` is the same reason as one whole clause of
    at most BRIEF_WIDTH characters, written by the pass beside ``why``: the decision's one line
    in ``kgen explain`` ends with it. Left out, it is ``why`` itself, for a reason that short.
    A ``detail`` is one cell of a summary decision the same pass makes (the fit pass: one per
    target, its cells per group and draft lengths): the one-line view prints the summary alone.
    """

    pass_name: str
    what: str
    value: Any
    why: str
    brief: str = ""
    warning: bool = False
    detail: bool = False

    def __post_init__(self) -> None:
        if not self.brief:
            object.__setattr__(self, "brief", self.why)


@dataclass(frozen=True)
class Specialization:
    """specialize: what the emitted source contains at all (not just skips at run time)."""

    has_pe: bool  # q_pe/k_pe loads and their dot
    fp8_kv: bool  # FP8 descale: k_scale/v_scale read from device tensors
    v_from_k_tile: bool  # absorbed MLA: V is the K tile's latent columns, no V pointer
    draft_tile_first: bool  # the draft tile runs before the prefix loop, always
    draft_tile_either: bool  # both placements are emitted; the launcher's DRAFT_FIRST picks
    draft_first_rows: tuple[int, ...]  # rows (BLOCK_H x L_PAD) that run it first by default
    draft_first_why: str  # why those rows ("" where both placements are not emitted)
    unmasked_full_tiles: bool  # whole tiles without the -inf select, then the partial one
    prefix_dot_dtype: str  # dot operand dtype of the prefix stage on the GPU
    prefix_dot_why: str

    @property
    def draft_tile_may_run_first(self) -> bool:
        """Whether the module has a draft tile before the prefix loop (FP8 prefix tiles after it
        still hold raw e4m3 V, so that draft tile divides its P.V by v_descale)."""
        return self.draft_tile_first or self.draft_tile_either


@dataclass(frozen=True)
class Tiles:
    """legalize: tile widths (powers of two, >= MIN_DOT) and the limits of a program."""

    block_d: int
    block_dpe: int | None  # None without a PE part: next_power_of_2(0) is never asked
    block_dv: int
    mask_d: bool  # nope_dim is not a power of two: its padded columns are masked
    mask_dv: bool
    merge_block_dv: int
    merge_rows: int
    merge_split_chunk: int
    min_dot_rows: int
    max_draft_tokens: int
    page_sizes: tuple[int, ...]


@dataclass(frozen=True)
class ConfigEntry:
    """One row of the block-config table baked into a module."""

    group_size: int
    batch_min: int
    batch_max: int
    config: BlockConfig

    @property
    def value(self) -> dict[str, Any]:
        return config_value(self.config)

    @property
    def batches(self) -> str:
        """The bucket as people write it: '9-32', '97+'."""
        return batch_span(self.batch_min, self.batch_max)


@dataclass(frozen=True)
class BlockConfigs:
    """select_config: the default block config and each arch's table rows for this layout."""

    default: BlockConfig
    default_why: str
    by_arch: dict[str, tuple[ConfigEntry, ...]] = field(default_factory=dict)
    table_sources: dict[str, str] = field(default_factory=dict)  # arch -> "origin: path"
    split_defaults: dict[str, int] = field(default_factory=dict)  # SplitPolicy's defaults

    @property
    def default_value(self) -> dict[str, Any]:
        return config_value(self.default)

    @property
    def tables_summary(self) -> str:
        return ", ".join(f"{arch} ({src})" for arch, src in sorted(self.table_sources.items())) or "none"


@dataclass(frozen=True)
class Invariance:
    """fix_invariance: what a batch-invariant module fixes so that a request's output bits do
    not depend on the batch, the other requests or the GPU's size (``enabled`` False: the
    default mode, where they do)."""

    enabled: bool
    tokens_per_split: int | None = None  # every split but a request's last holds exactly this many tokens
    max_splits: int | None = None  # splits per request before they grow to whole multiples of tokens_per_split
    draft_rows: int | None = None  # the draft length every program is fitted for (its L_PAD, whatever the batch)
    merge_split_chunk: int | None = None  # splits a merge program combines per unrolled chunk


@dataclass(frozen=True)
class Fit:
    """fit: the targets a module is checked for and what one program stages (rules.kernel_shape)."""

    targets: dict[str, dict]
    k_width: int  # K's padded width (nope + pe)
    acc_width: int  # the accumulator's width (V's padded width)
    kv_bytes: int  # bytes per KV element in the pool
    v_separate: bool  # V is its own buffer (staged beside K)
    refusals: tuple[str, ...] = ()  # (target, config, group, draft length) where no program fits

    @property
    def kernel_shape(self) -> dict[str, Any]:
        return rules.kernel_shape(self.k_width, self.acc_width, self.kv_bytes, self.v_separate)


@dataclass(frozen=True)
class Lowering:
    """select_lowering: the kernel language the plan is rendered into (a templates/ folder),
    and a second lowering of the prefix stage that table rows may pick, if the layout has one."""

    name: str
    gluon_prefix: str | None = None  # template of the Gluon prefix stage, e.g. "gluon/mla_ws_prefix_stage.py.j2"
    gluon_imports: str | None = None  # its guarded imports, at the module's top ("gluon/imports.py.j2")
    gluon_arch: str | None = None  # the one arch it is written for
    gluon_triton: str | None = None  # the Triton minor version it is written for ("3.6")

    @property
    def kernel_template(self) -> str:
        return f"{self.name}/kernel.py.j2"


@dataclass(frozen=True)
class Output:
    """render, inspect_source, emit: the module's source, whether inspect_source passed it, and its file."""

    source: str
    inspected: bool = False
    path: str | None = None
    written: bool | None = None  # written (or, in check mode, stale)

    @property
    def lines(self) -> int:
        return self.source.count("\n")


# Which pass fills which section (``kgen explain`` prints a section after its pass).
SECTION_OF_PASS = {
    "specialize": "specialization", "legalize": "tiles", "select_config": "config",
    "fix_invariance": "invariance", "fit": "fit",
    "select_lowering": "lowering", "render": "output", "inspect_source": "output", "emit": "output",
}


@dataclass(frozen=True)
class Plan:
    spec: LayoutSpec
    kv_dtype: str
    q_dtype: str
    variant: Variant = "grouped"
    batch_invariant: bool = False
    decisions: tuple[Decision, ...] = ()
    specialization: Specialization | None = None
    tiles: Tiles | None = None
    config: BlockConfigs | None = None
    invariance: Invariance | None = None
    fit: Fit | None = None
    lowering: Lowering | None = None
    output: Output | None = None

    @property
    def uri(self) -> str:
        return module_uri(self.spec.name, self.kv_dtype, self.q_dtype, self.variant, self.batch_invariant)

    @property
    def grouped(self) -> bool:
        return self.variant == "grouped"

    @property
    def variant_summary(self) -> str:
        if self.batch_invariant:
            return "grouped-head shared-KV, batch invariant (fixed tokens per split, block config and draft rows)"
        return ("grouped-head shared-KV" if self.grouped
                else "per-head split-KV baseline (one query head per program)")

    @property
    def layout_summary(self) -> str:
        shape = self.spec.attention
        return (f"Layout {self.spec.name}: {shape.kind.upper()}, K width {shape.qk_dim} "
                f"(nope {shape.nope_dim} + pe {shape.pe_dim}), V width {shape.v_head_dim}, "
                f"KV {self.kv_dtype}, queries {self.q_dtype}.")

    @property
    def output_path(self) -> str | None:
        """Where emit wrote (or would write) the module; None before emit."""
        return self.output.path if self.output is not None else None

    @property
    def warnings(self) -> list[Decision]:
        return [d for d in self.decisions if d.warning]

    def with_(self, decisions: list[Decision] | tuple[Decision, ...] = (), **sections: Any) -> Plan:
        """A copy with ``sections`` set and ``decisions`` appended (plans are immutable)."""
        return dataclasses.replace(self, decisions=self.decisions + tuple(decisions), **sections)

    def need(self, section: str, pass_name: str) -> Any:
        """The section ``pass_name`` reads; a BuildError naming the pass that fills it if it is missing."""
        value = getattr(self, section)
        if value is None:
            filler = next(p for p, s in SECTION_OF_PASS.items() if s == section)
            raise BuildError(f"{self.uri}: {pass_name} needs plan.{section}, which {filler} fills: run it first")
        return value

    def decisions_of(self, pass_name: str) -> list[Decision]:
        return [d for d in self.decisions if d.pass_name == pass_name]


def new_plan(spec: LayoutSpec, kv_dtype: str, q_dtype: str, variant: Variant = "grouped",
             batch_invariant: bool = False) -> Plan:
    return Plan(spec=spec, kv_dtype=kv_dtype, q_dtype=q_dtype, variant=variant, batch_invariant=batch_invariant)
