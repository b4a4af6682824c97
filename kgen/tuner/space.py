"""The search space of ``kgen tune``: axes per arch, read from data; pruning by the launch rules.

``spaces.toml`` holds the choices of every axis per arch family (CUDA, ROCm) and per-arch
overrides. This module turns it into a ``SearchSpace`` for one study (arch, layout, dtypes,
group size, draft lengths), which suggests configs to Optuna and turns away, before anything
is compiled, every config whose program the launcher would change: it runs the launch rules
the generated modules carry (``kgen/launcher/rules.py``, ``fit``) against the arch's row of
``kgen/tables/targets.json`` (shared memory per block, warp size, matrix instruction), so the
tuner and the launcher cannot disagree about what fits.

Where the layout's module has a Gluon prefix stage (``select_lowering.offered_lowering``) and
the study is on its arch under its Triton version, the space has a second branch: a
``lowering`` axis (triton | gluon) and the Gluon stage's own axes (``[gluon_prefix]`` in
``spaces.toml``), pruned by the rules its launcher runs (``rules.gluon_rows``,
``rules.gluon_shared_bytes``). A Gluon trial's config is the default's Triton fields with
the trial's ``gluon`` section; ``results.finalize`` gives a Gluon winner the Triton config
the study chose as its Triton fields, the fallback wherever the Gluon kernel does not apply.
Elsewhere the study's default loses the gluon section the built-in one may carry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kgen.blockconfig import (
    TARGETS_FILE,
    BlockConfig,
    GluonConfig,
    SplitPolicy,
    installed_triton_version,
    major_minor,
    read_defaults,
)
from kgen.errors import TableError, read_validated
from kgen.launcher import rules
from kgen.launcher.rules import next_pow2, row_blocking
from kgen.passes.fit import plan_kernel_shape
from kgen.passes.legalize import legalize
from kgen.passes.select_lowering import offered_lowering
from kgen.passes.specialize import GQA_DRAFT_FIRST_ROWS, draft_tile_either, specialize
from kgen.plan import Lowering, new_plan
from kgen.spec import FP8_DTYPES, LayoutSpec
from kgen.targets import read_targets, target_dicts
from kgen.tuner.errors import TuneError

if TYPE_CHECKING:
    import optuna

SPACES_FILE = Path(__file__).parent / "spaces.toml"

CORE_AXES = ("block_h", "block_n", "num_warps", "num_stages")
SPLIT_AXES = ("programs_per_sm", "max_splits", "min_tokens_per_split")
# Where the splits merge (SplitPolicy.merge: the merge launch, or a thread-block cluster's own,
# its loads pipelined or not: merge_pipelined), searched where the target has clusters. Like the
# split axes it never changes what fits.
MERGE_AXES = ("merge",)
Merge = Literal["launch", "cluster", "cluster_pipelined"]
ROCM_AXES = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# Kernel switches (0 = off, 1 = on); an axis a family leaves empty is not searched.
KERNEL_AXES = ("lazy_rescale",)
# Where the draft tile runs (BlockConfig.draft_tile: "first" / "after" the prefix loop),
# searched only for layouts whose module emits both placements (grouped GQA, not MLA).
PLACEMENT_AXES = ("draft_tile",)
Placement = Literal["first", "after"]
# The launch rules' constants: they change what fits, so the study name hashes them.
RULE_CONSTANTS = ("MIN_DOT", "MAX_ROWS", "ACC_REGISTERS_PER_THREAD", "SHARED_MARGIN_BYTES", "WGMMA_MIN_ROWS")
# Which kernel serves the prefix stage: a categorical parameter of studies that search the
# Gluon prefix stage; its axes are parameters named GLUON_PARAM + the GluonConfig field.
LOWERING_AXIS = "lowering"
LOWERINGS = ("triton", "gluon")
GLUON_PARAM = "gluon."
GLUON_KERNEL_AXES = ("block_n", "num_stages", "lazy_rescale")
GLUON_RULE_CONSTANTS = ("GLUON_ROWS", "GLUON_GQA_ROWS", "GLUON_MAX_ROW_BLOCK", "SHARED_MARGIN_BYTES")
# BlockConfig fields no axis searches: a written row keeps those of the config the bucket runs
# today where the study's launches do not depend on them (SearchSpace.keep_unsearched).
UNSEARCHED_FIELDS = ("widen_from_rows", "invariant_block_h")


# --------------------------------------------------------------------------- the data file


def _sorted_unique(values: tuple) -> tuple:
    return tuple(sorted(set(values)))


class Axes(BaseModel):
    """Choices of every axis. The ROCm knobs are empty for a CUDA family."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_h: tuple[int, ...] = Field(min_length=1)
    block_n: tuple[int, ...] = Field(min_length=1)
    num_warps: tuple[int, ...] = Field(min_length=1)
    num_stages: tuple[int, ...] = Field(min_length=1)
    programs_per_sm: tuple[int, ...] = Field(min_length=1)
    max_splits: tuple[int, ...] = Field(min_length=1)
    min_tokens_per_split: tuple[int, ...] = Field(min_length=1)
    waves_per_eu: tuple[int, ...] = ()
    matrix_instr_nonkdim: tuple[Literal[16, 32], ...] = ()
    kpack: tuple[Literal[1, 2], ...] = ()
    lazy_rescale: tuple[Literal[0, 1], ...] = ()
    draft_tile: tuple[Placement, ...] = ()
    merge: tuple[Merge, ...] = ()

    @field_validator("*")
    @classmethod
    def _sorted(cls, values: tuple) -> tuple:
        return _sorted_unique(values)


class AxesOverride(BaseModel):
    """Per-arch replacement of some axes (an axis given here replaces the family's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_h: tuple[int, ...] | None = None
    block_n: tuple[int, ...] | None = None
    num_warps: tuple[int, ...] | None = None
    num_stages: tuple[int, ...] | None = None
    programs_per_sm: tuple[int, ...] | None = None
    max_splits: tuple[int, ...] | None = None
    min_tokens_per_split: tuple[int, ...] | None = None
    waves_per_eu: tuple[int, ...] | None = None
    matrix_instr_nonkdim: tuple[Literal[16, 32], ...] | None = None
    kpack: tuple[Literal[1, 2], ...] | None = None
    lazy_rescale: tuple[Literal[0, 1], ...] | None = None
    draft_tile: tuple[Placement, ...] | None = None
    merge: tuple[Merge, ...] | None = None


class Family(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_dtypes: tuple[str, ...] = Field(min_length=1)
    # An MFMA constraint, not a resource: block_n and the rows must be multiples of the
    # instruction's non-K size (matrix_instr_nonkdim).
    dot_multiple_of_nonkdim: bool = False
    axes: Axes
    baseline_knobs: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _knobs(self) -> Family:
        unknown = set(self.baseline_knobs) - set(ROCM_AXES)
        if unknown:
            raise ValueError(f"baseline_knobs may name only {ROCM_AXES}, got {sorted(unknown)}")
        return self


class ArchEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: str = ""
    kv_dtypes: tuple[str, ...] | None = None
    axes: AxesOverride | None = None


class GluonSpace(BaseModel):
    """Choices of the Gluon prefix stage's axes (BlockConfig.gluon). Every choice must be a
    value GluonConfig takes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_n: tuple[int, ...] = Field(min_length=1)
    num_stages: tuple[int, ...] = Field(min_length=1)
    lazy_rescale: tuple[Literal[0, 1], ...] = Field(min_length=1)
    programs_per_sm: tuple[int, ...] = Field(min_length=1)
    max_splits: tuple[int, ...] = Field(min_length=1)
    min_tokens_per_split: tuple[int, ...] = Field(min_length=1)
    # FP8 GQA's landing ring (GluonConfig.landing_stages; 0: none). An axis only in the studies
    # whose programs may have one (rules.gluon_landing_refusal).
    landing_stages: tuple[int, ...] = (0,)

    @field_validator("block_n", "num_stages", "lazy_rescale", "landing_stages", *SPLIT_AXES)
    @classmethod
    def _sorted(cls, values: tuple) -> tuple:
        return _sorted_unique(values)

    @model_validator(mode="after")
    def _choices_are_configs(self) -> GluonSpace:
        # GluonConfig and SplitPolicy say what is legal: one fact, checked here per choice.
        for block_n, stages in itertools.product(self.block_n, self.num_stages):
            GluonConfig(block_n=block_n, num_stages=stages)
        for name in SPLIT_AXES:
            for value in getattr(self, name):
                SplitPolicy(**{name: value})
        for landing in self.landing_stages:
            if landing:
                GluonConfig(block_n=self.block_n[0], num_stages=self.num_stages[0], landing_stages=landing)
        return self

    def axes(self, kernel_shape: dict) -> dict[str, tuple[int, ...]]:
        """The Optuna parameters of the Gluon branch and their choices for a module of this
        kernel shape: landing_stages where its programs may land their rows and the file
        offers more than one choice."""
        names = (*GLUON_KERNEL_AXES, *SPLIT_AXES)
        if len(self.landing_stages) > 1 and rules.gluon_landing_refusal(kernel_shape, 2, None) is None:
            names += ("landing_stages",)
        return {GLUON_PARAM + n: tuple(getattr(self, n)) for n in names}


class SpacesFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["kgen.tune-space/1"] = Field(alias="schema")
    arch_families: dict[str, str] = Field(min_length=1)
    family: dict[str, Family] = Field(min_length=1)
    arch: dict[str, ArchEntry] = Field(default_factory=dict)
    gluon_prefix: GluonSpace | None = None

    @model_validator(mode="after")
    def _families_exist(self) -> SpacesFile:
        missing = sorted(set(self.arch_families.values()) - set(self.family))
        if missing:
            raise ValueError(f"arch_families names families with no [family.<name>] table: {missing}")
        return self


def load_spaces(path: Path | None = None) -> SpacesFile:
    """Read and validate the spaces file; errors name the file and the field."""
    return read_validated(path or SPACES_FILE, SpacesFile, TuneError, "search-space file", tomllib.loads, "TOML")


# --------------------------------------------------------------------------- one arch


@dataclass(frozen=True)
class ArchProfile:
    """Everything the space needs about one arch: the family's axes with the arch's
    overrides, and the arch's target (its row of kgen/tables/targets.json, a plain dict as
    the launch rules take it)."""

    arch: str
    family: str
    target_name: str
    target: dict
    kv_dtypes: tuple[str, ...]
    dot_multiple_of_nonkdim: bool
    axes: Axes
    baseline_knobs: dict[str, int] = field(default_factory=dict)
    gpus: str = ""
    gluon: GluonSpace | None = None  # spaces.toml's [gluon_prefix]: searched where a study may launch it

    @property
    def warp_size(self) -> int:
        return int(self.target["warp_size"])

    @property
    def is_rocm(self) -> bool:
        return bool(self.axes.matrix_instr_nonkdim)


def arch_family(arch: str, spaces: SpacesFile) -> str:
    """``sm_90`` / ``sm_100`` -> ``cuda``, ``gfx942`` / ``gfx950`` -> ``rocm`` (longest prefix)."""
    matches = [p for p in spaces.arch_families if arch.startswith(p)]
    if not matches or not re.fullmatch(r"[A-Za-z0-9_]+", arch):
        known = ", ".join(f"{p}* -> {f}" for p, f in spaces.arch_families.items())
        raise TuneError(f"unknown arch {arch!r}: expected a name like sm_90 or gfx942 ({known})")
    return spaces.arch_families[max(matches, key=len)]


def _base_arch(arch: str) -> str:
    return re.sub(r"^(sm_\d+)[a-z]$", r"\1", arch)  # sm_90a -> sm_90


def arch_target(arch: str, targets_file: Path = TARGETS_FILE) -> tuple[str, dict]:
    """(row name, row) of ``arch`` in kgen/tables/targets.json; an arch with no row is an
    error: the generated modules refuse it, so there is nothing to tune."""
    try:
        targets = target_dicts(read_targets(targets_file))
    except TableError as exc:
        raise TuneError(str(exc)) from None
    for name in (arch, _base_arch(arch)):
        if name in targets:
            return name, targets[name]
    raise TuneError(
        f"{arch} has no row in {targets_file} (it lists {', '.join(targets)}): the generated modules "
        f"refuse it and the tuner reads its shared memory, warp size and matrix instruction there; "
        f"add a row for it (and run `kgen build`) to tune it"
    )


def arch_profile(arch: str, spaces: SpacesFile, targets_file: Path = TARGETS_FILE) -> ArchProfile:
    """The family's space for ``arch``, with the arch's overrides applied, and its target.
    KV dtypes the target has no tensor-core format for are left out (its module refuses them)."""
    fam_name = arch_family(arch, spaces)
    fam = spaces.family[fam_name]
    target_name, target = arch_target(arch, targets_file)
    entry = spaces.arch.get(arch) or spaces.arch.get(_base_arch(arch))
    axes, kv = fam.axes, fam.kv_dtypes
    if entry is not None:
        if entry.axes is not None:
            update = entry.axes.model_dump(exclude_none=True)
            axes = Axes.model_validate({**axes.model_dump(), **update})
        kv = entry.kv_dtypes or kv
    return ArchProfile(
        arch=arch,
        family=fam_name,
        target_name=target_name,
        target=target,
        kv_dtypes=tuple(d for d in kv if d not in FP8_DTYPES or d in target["fp8"]),
        dot_multiple_of_nonkdim=fam.dot_multiple_of_nonkdim,
        axes=axes,
        baseline_knobs=dict(fam.baseline_knobs),
        gpus=entry.gpus if entry else "",
        gluon=spaces.gluon_prefix,
    )


# --------------------------------------------------------------------------- the launch rules


@dataclass(frozen=True)
class ProblemShape:
    """What the launch rules need to know about the problem of one study: the kernel shape
    the generated module carries (``rules.kernel_shape``: bytes a program stages per prefix
    token and per row, the accumulator's width), the group and the draft lengths."""

    kernel: dict
    group_size: int
    drafts: tuple[int, ...]
    # The module emits both draft-tile placements; unset, it drafts first at these rows.
    draft_tile_either: bool = False
    draft_first_rows: tuple[int, ...] = ()
    # The module's lowering (select_lowering.offered_lowering): whether it has a Gluon prefix stage.
    lowering: Lowering = Lowering("triton")
    # The built-in default (default_config, with its gluon section if it has one).
    default: BlockConfig | None = None

    @classmethod
    def of(
        cls,
        layout: LayoutSpec,
        kv_dtype: str,
        q_dtype: str,
        group: int,
        drafts: tuple[int, ...],
    ) -> ProblemShape:
        """The grouped module's shape and lowering, from the same passes that generate it."""
        plan = legalize(specialize(new_plan(layout, kv_dtype, q_dtype, "grouped")))
        either = draft_tile_either(layout.attention)
        lowering, _ = offered_lowering(plan)
        return cls(
            kernel=plan_kernel_shape(plan),
            group_size=group,
            drafts=tuple(sorted(set(drafts))),
            draft_tile_either=either,
            draft_first_rows=GQA_DRAFT_FIRST_ROWS if either else (),
            lowering=lowering,
            default=default_config(layout, group, kv_dtype),
        )


def launch_rows(block_h: int, shape: ProblemShape, draft: int) -> tuple[int, int]:
    """(BLOCK_H, L_PAD) of the launcher's row rule (kgen/launcher/rules.py, ``row_blocking``)."""
    return row_blocking(block_h, shape.group_size, draft)


def row_rule_placement(cfg: BlockConfig, shape: ProblemShape, draft: int) -> str:
    """Where the module's row rule puts the draft tile for ``cfg`` at one draft length."""
    bh, l_pad = launch_rows(cfg.block_h, shape, draft)
    return "first" if bh * l_pad in shape.draft_first_rows else "after"


def row_rule_placements(cfg: BlockConfig, shape: ProblemShape) -> set[str]:
    """Where the row rule puts the draft tile for ``cfg``, over the study's drafts."""
    return {row_rule_placement(cfg, shape, d) for d in shape.drafts}


def why_not(cfg: BlockConfig, shape: ProblemShape, profile: ArchProfile) -> str | None:
    """Why ``cfg`` is not a config of its own on this arch for this problem, or None.

    The launcher runs ``rules.fit_program`` on every call: a config it would change (a smaller head
    block for the accumulator's registers, fewer stages, narrower tiles or fewer heads for
    shared memory) at some draft length of the study runs there as another config's
    program, so timing it would time a duplicate and a table row holding it would name a
    program that never runs; one with no program that fits is refused outright.
    """
    cap = next_pow2(shape.group_size)
    if cfg.block_h > cap:
        return f"block_h {cfg.block_h} > next_pow2(group size {shape.group_size}) = {cap}"
    launch = cfg.model_dump(exclude_none=True)
    programs = {}
    for draft in shape.drafts:
        fitted = rules.fit_program(profile.target, shape.kernel, launch, shape.group_size, draft)
        if fitted is None:
            return (
                f"no program fits {profile.target_name} at L={draft}: even one head, {rules.MIN_DOT}-token "
                f"tiles and 1 stage exceed {profile.target['shared_bytes']} B of shared memory"
            )
        programs[draft] = fitted
    for draft, fitted in programs.items():
        if fitted.reasons:
            return (
                f"duplicate: at L={draft} the launcher runs it on {profile.target_name} as BLOCK_H {fitted.block_h} x "
                f"L_PAD {fitted.l_pad}, BLOCK_N {fitted.block_n}, {fitted.num_stages} stages, {fitted.num_warps} "
                f"warps ({'; '.join(fitted.reasons)})"
            )
    rows_per_draft = {d: launch_rows(cfg.block_h, shape, d) for d in shape.drafts}
    if all(bh != cfg.block_h for bh, _ in rows_per_draft.values()):
        ran = sorted({bh for bh, _ in rows_per_draft.values()})
        return f"duplicate: the launcher halves block_h {cfg.block_h} to {ran} (rows <= {rules.MAX_ROWS})"
    nonk = cfg.matrix_instr_nonkdim
    if profile.dot_multiple_of_nonkdim and nonk is not None:
        for draft, fitted in programs.items():
            block_h, l_pad, block_n = fitted.block_h, fitted.l_pad, fitted.block_n
            if block_n % nonk or (block_h * l_pad) % nonk:
                return (
                    f"block_n {block_n} and rows {block_h * l_pad} (L={draft}) must be multiples of "
                    f"matrix_instr_nonkdim {nonk}"
                )
    return None


def gluon_why_not(gluon: GluonConfig, shape: ProblemShape, profile: ArchProfile) -> str | None:
    """Why a Gluon config would not run as the Gluon kernel in this study, or None: the
    launcher (``_gluon_prefix``) runs the Triton kernel where the program overflows shared
    memory or a draft length of the study does not fit its tile or rows, so timing it would
    time the Triton kernel under a Gluon name."""
    need = rules.gluon_shared_bytes(shape.kernel, gluon.block_n, gluon.num_stages)
    limit = profile.target["shared_bytes"]
    if need > limit:
        return (
            f"the Gluon program (BLOCK_N {gluon.block_n}, {gluon.num_stages} stages) needs {need} B of shared "
            f"memory, {profile.target_name} has {limit} B (rules.gluon_shared_bytes): the launcher runs the Triton "
            f"kernel"
        )
    for draft in shape.drafts:
        if shape.group_size * draft < gluon.from_rows:
            return (
                f"at L={draft} the launcher runs the Triton kernel: {shape.group_size * draft} rows a KV head, under "
                f"the section's from_rows {gluon.from_rows}"
            )
        if rules.gluon_rows(shape.kernel, draft, gluon.block_n) is None:
            return (
                f"at L={draft} the launcher runs the Triton kernel: the draft does not fit one {gluon.block_n}-token "
                f"tile or a program's {rules.gluon_program_rows(shape.kernel)} rows (rules.gluon_rows)"
            )
    return _landing_why_not(gluon, shape, limit)


def _landing_why_not(gluon: GluonConfig, shape: ProblemShape, limit: int) -> str | None:
    """Why a section's landing ring would change no launch of this study, or None: where it
    fits none of the study's programs the launcher leaves it out of them all
    (rules.gluon_landing_stages), and the trial would time the section without it."""
    if not gluon.landing_stages:
        return None
    for draft in shape.drafts:
        _, l_pad = rules.gluon_rows(shape.kernel, draft, gluon.block_n)
        consumers = rules.gluon_consumers(shape.group_size, l_pad)
        if rules.gluon_landing_stages(shape.kernel, gluon.block_n, gluon.num_stages, gluon.landing_stages,
                                      consumers, limit):
            return None
    return (f"its {gluon.landing_stages}-tile landing ring fits no program of the study (rules.gluon_landing_stages): "
            f"the trial would time the section without it")


def gluon_searched(profile: ArchProfile, shape: ProblemShape, triton_version: str | None) -> tuple[bool, str]:
    """Whether a study searches the Gluon prefix stage, and why (or why not): the module must
    have one, and the study run on its arch under its Triton version, where the launcher
    launches it. An empty reason for layouts without one (nothing to say)."""
    lowering = shape.lowering
    if lowering.gluon_prefix is None:
        return False, ""
    stage = f"the Gluon prefix stage ({lowering.gluon_prefix}: {lowering.gluon_arch}, Triton {lowering.gluon_triton}.x)"
    if _base_arch(profile.arch) != lowering.gluon_arch:
        return False, f"not searched: {stage} runs on {lowering.gluon_arch} only, this study is {profile.arch}"
    if triton_version is None or major_minor(triton_version) != major_minor(lowering.gluon_triton):
        return False, f"not searched: {stage} runs under its Triton only, this is Triton {triton_version}"
    if profile.gluon is None:
        return False, f"not searched: the spaces file has no [gluon_prefix] table for {stage}"
    return True, (
        f"searched: the {LOWERING_AXIS} axis picks the Triton kernel or {stage}; a Gluon trial keeps the "
        f"default's Triton fields, and a Gluon winner gets the Triton config the study chose as its fallback"
    )


# --------------------------------------------------------------------------- the space


def default_config(layout: LayoutSpec, group_size: int, kv_dtype: str = "bfloat16") -> BlockConfig:
    """The built-in default (``kgen/tables/defaults.json``) made legal for the group size:
    block_h is cut to next_pow2(group), since a program never owns more heads than exist."""
    cfg = read_defaults().rule_for(layout.attention.qk_dim, kv_dtype).config
    return cfg.model_copy(update={"block_h": min(cfg.block_h, next_pow2(group_size))})


@dataclass(frozen=True)
class SearchSpace:
    """The choices of one study, and the rules that prune configs before compiling.

    ``axes`` are the Triton kernel's; ``gluon_axes`` the Gluon prefix stage's (parameters
    named ``gluon.<field>``), empty where the study does not search it (``gluon_note`` says
    why, for layouts that have one). With Gluon axes every trial first picks its
    ``lowering``, then the axes of that branch only (a conditional space)."""

    profile: ArchProfile
    shape: ProblemShape
    axes: dict[str, tuple[int, ...]]
    gluon_axes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    gluon_note: str = ""

    @classmethod
    def build(cls, profile: ArchProfile, shape: ProblemShape, triton_version: str | None = None) -> SearchSpace:
        """The study's space; ``triton_version`` (default: the installed one) decides, with the
        arch, whether the Gluon prefix stage is searched."""
        cap = next_pow2(shape.group_size)
        kernel = tuple(n for n in KERNEL_AXES if getattr(profile.axes, n))
        if shape.draft_tile_either:  # MLA and per-head modules have one fixed placement
            kernel += tuple(n for n in PLACEMENT_AXES if getattr(profile.axes, n))
        merge = MERGE_AXES if profile.axes.merge and profile.target.get("clusters", 1) > 1 else ()
        names = CORE_AXES + SPLIT_AXES + merge + kernel + (ROCM_AXES if profile.is_rocm else ())
        axes = {n: tuple(getattr(profile.axes, n)) for n in names}
        axes["block_h"] = tuple(b for b in axes["block_h"] if b <= cap)
        empty = [n for n, v in axes.items() if not v]
        if empty:
            raise TuneError(
                f"search space for {profile.arch}, group {shape.group_size} has no choice for "
                f"{empty}: widen these axes in spaces.toml"
            )
        version = installed_triton_version() if triton_version is None else triton_version
        searched, note = gluon_searched(profile, shape, version)
        gluon_axes = profile.gluon.axes(shape.kernel) if searched and profile.gluon is not None else {}
        return cls(profile=profile, shape=shape, axes=axes, gluon_axes=gluon_axes, gluon_note=note)

    @property
    def default(self) -> BlockConfig:
        """The study's default: the built-in one (``ProblemShape.default``), without its gluon
        section where the study does not search the Gluon stage (the launcher does not run it
        there, and a row written from it must not carry it)."""
        if self.shape.default is None:
            raise TuneError("the study has no default config (ProblemShape.of sets it)")
        return self.shape.default if self.gluon_axes else self.shape.default.model_copy(update={"gluon": None})

    @property
    def conditional(self) -> bool:
        """Whether trials pick a lowering first (the sampler then groups each branch's axes)."""
        return bool(self.gluon_axes)

    def config(self, params: dict[str, int | str]) -> BlockConfig:
        """The BlockConfig named by one set of Optuna parameters."""
        if params.get(LOWERING_AXIS) == "gluon":
            return self._gluon_config(params)
        split = SplitPolicy(**{n: params[n] for n in SPLIT_AXES}, **merge_fields(params.get("merge", "launch")))
        knobs = {n: params[n] for n in ROCM_AXES if n in self.axes}
        switches = {n: bool(params[n]) or None for n in KERNEL_AXES if n in self.axes}  # off is the default
        cfg = BlockConfig(**{n: params[n] for n in CORE_AXES}, split=split, **knobs, **switches)
        if "draft_tile" in self.axes and row_rule_placements(cfg, self.shape) != {params["draft_tile"]}:
            # Only a placement the row rule would not pick is spelled out, so equal kernels key equal.
            cfg = cfg.model_copy(update={"draft_tile": params["draft_tile"]})
        return cfg

    def _gluon_config(self, params: dict[str, int | str]) -> BlockConfig:
        """A Gluon trial: the default's Triton fields with the trial's gluon section."""
        own = {n.removeprefix(GLUON_PARAM): v for n, v in params.items() if n.startswith(GLUON_PARAM)}
        gluon = GluonConfig(
            block_n=own["block_n"],
            num_stages=own["num_stages"],
            lazy_rescale=bool(own["lazy_rescale"]),
            split=SplitPolicy(**{n: own[n] for n in SPLIT_AXES}),
            landing_stages=own.get("landing_stages") or None,
        )
        return self.default.model_copy(update={"gluon": gluon})

    def keep_unsearched(self, chosen: BlockConfig, source: BlockConfig | None) -> tuple[BlockConfig, list[str]]:
        """``chosen`` with the fields of ``source`` (the config the bucket runs today) that no axis
        searches (UNSEARCHED_FIELDS), where the study's launches do not depend on them: its
        trials ran without them, so a field is kept only where that changed nothing the study
        timed. Returns the config and a note per field, kept or dropped, and why."""
        if source is None:
            return chosen, []
        kept, notes = chosen, []
        for name in UNSEARCHED_FIELDS:
            value = getattr(source, name)
            if value is None or getattr(chosen, name) is not None:
                continue
            if name == "invariant_block_h" and value >= chosen.block_h:
                notes.append(f"{name} {value} dropped: not below the tuned block_h {chosen.block_h}")
                continue
            candidate = kept.model_copy(update={name: value})
            if name == "widen_from_rows" and self._launches_differ(kept, candidate):
                notes.append(f"{name} {value} dropped: it changes a launch the study timed without it")
                continue
            kept = candidate
            notes.append(f"{name} {value} kept from the config in use: no axis searches it, and the study's "
                         f"launches do not depend on it")
        return self._keep_gluon_above_the_study(kept, source, notes)

    def _keep_gluon_above_the_study(self, chosen: BlockConfig, source: BlockConfig,
                                    notes: list[str]) -> tuple[BlockConfig, list[str]]:
        """A Triton winner keeps the gluon section of the config in use where that section's
        from_rows (set by hand) kept it off every draft the study timed: the study judged the
        Triton launches alone, and the Gluon ones it never ran stay as measured by hand."""
        gluon = source.gluon
        if gluon is None or not gluon.from_rows or chosen.gluon is not None:
            return chosen, notes
        if any(self.shape.group_size * draft >= gluon.from_rows for draft in self.shape.drafts):
            return chosen, [*notes, f"gluon section (from_rows {gluon.from_rows}) dropped: it launched at a draft "
                                    f"the study timed, and the Triton winner beat it there"]
        return chosen.model_copy(update={"gluon": gluon}), [
            *notes, f"gluon section kept from the config in use: its from_rows {gluon.from_rows} keeps it off "
                    f"every draft the study timed (L {', '.join(map(str, self.shape.drafts))})"]

    def _launches_differ(self, a: BlockConfig, b: BlockConfig) -> bool:
        """Whether the launcher fits ``a`` and ``b`` to different programs at a draft of the study."""
        def fitted(cfg: BlockConfig, draft: int) -> rules.FittedProgram | None:
            return rules.fit_program(self.profile.target, self.shape.kernel, cfg.model_dump(exclude_none=True),
                                     self.shape.group_size, draft)

        return any(fitted(a, d) != fitted(b, d) for d in self.shape.drafts)

    def why_not(self, cfg: BlockConfig) -> str | None:
        if cfg.gluon is not None:
            if not self.gluon_axes:
                return f"the Gluon prefix stage is not searched here: {self.gluon_note or 'the module has none'}"
            return gluon_why_not(cfg.gluon, self.shape, self.profile)
        return why_not(cfg, self.shape, self.profile)

    def suggest(self, trial: optuna.Trial) -> BlockConfig:
        """Ask the trial for every axis (of its lowering's branch); prune (before compiling) a
        config that cannot fit."""
        import optuna

        params: dict[str, int | str] = {}
        branch = self.axes
        if self.gluon_axes:
            params[LOWERING_AXIS] = trial.suggest_categorical(LOWERING_AXIS, list(LOWERINGS))
            branch = self.gluon_axes if params[LOWERING_AXIS] == "gluon" else self.axes
        params.update({n: trial.suggest_categorical(n, list(c)) for n, c in branch.items()})
        cfg = self.config(params)
        reason = self.why_not(cfg)
        if reason is not None:
            trial.set_user_attr("pruned_reason", f"does not fit: {reason}")
            raise optuna.TrialPruned(f"does not fit: {reason}")
        return cfg

    def params_of(self, cfg: BlockConfig) -> tuple[dict[str, int | str], list[str]]:
        """The nearest point of the space to ``cfg`` (for enqueueing a default) and notes on
        every value that had to move. Missing ROCm knobs take the family's baseline. A gluon
        section maps to the Gluon branch where the study searches it and is left out elsewhere."""
        notes: list[str] = []
        if cfg.gluon is not None and self.gluon_axes:
            gluon = cfg.gluon
            values = {**gluon.model_dump(exclude={"split"}), **gluon.split.model_dump()}
            params: dict[str, int | str] = {LOWERING_AXIS: "gluon"}
            for name, choices in self.gluon_axes.items():
                own = name.removeprefix(GLUON_PARAM)
                params[name] = _nearest(name, choices, int(values[own] or 0), notes)  # no landing ring: 0
            return params, notes
        if cfg.gluon is not None:
            notes.append(f"gluon section left out: {self.gluon_note or 'the module has no Gluon prefix stage'}")
        values = {**cfg.model_dump(exclude={"split", "gluon"}), **cfg.split.model_dump()}
        params = {LOWERING_AXIS: "triton"} if self.gluon_axes else {}
        for name, choices in self.axes.items():
            want = values.get(name)
            if name in PLACEMENT_AXES:
                params[name] = self._placement_param(cfg, choices, notes)
                continue
            if name in MERGE_AXES:
                params[name] = _merge_param(cfg, choices, notes)
                continue
            if want is None:
                want = self.profile.baseline_knobs.get(name, choices[0])
            params[name] = _nearest(name, choices, want, notes)
        return params, notes

    def _placement_param(self, cfg: BlockConfig, choices: tuple[str, ...], notes: list[str]) -> str:
        """The draft_tile choice of ``cfg``: its own, or where the row rule puts it (at the
        study's longest draft when the drafts disagree)."""
        want = cfg.draft_tile
        if want is None:
            want = row_rule_placement(cfg, self.shape, max(self.shape.drafts))
            if len(row_rule_placements(cfg, self.shape)) > 1:
                notes.append(f"draft_tile: the row rule differs between drafts; {want} (longest draft) enqueued")
        if want not in choices:
            notes.append(f"draft_tile {want} -> {choices[0]} (not a choice)")
            return choices[0]
        return want

    def size(self) -> int:
        triton = math.prod(len(v) for v in self.axes.values())
        return triton + (math.prod(len(v) for v in self.gluon_axes.values()) if self.gluon_axes else 0)

    def feasible_configs(self) -> list[BlockConfig]:
        """Every config that passes the estimates, split policy fixed at its first choice
        (the split axes never change what fits), the Triton ones first."""
        out = []
        branches: list[tuple[dict[str, tuple[int, ...]], dict[str, str]]] = [(self.axes, {})]
        if self.gluon_axes:
            branches.append((self.gluon_axes, {LOWERING_AXIS: "gluon"}))
        for branch, base in branches:
            splits = {n for n in branch if n.removeprefix(GLUON_PARAM) in (*SPLIT_AXES, *MERGE_AXES)}
            names = [n for n in branch if n not in splits]
            fixed = {n: branch[n][0] for n in splits}
            for combo in itertools.product(*(branch[n] for n in names)):
                cfg = self.config({**base, **dict(zip(names, combo, strict=True)), **fixed})
                if self.why_not(cfg) is None:
                    out.append(cfg)
        return out

    def feasible_count(self) -> int:
        feasible = self.feasible_configs()
        triton = sum(1 for c in feasible if c.gluon is None)
        splits = math.prod(len(self.axes[n]) for n in (*SPLIT_AXES, *MERGE_AXES) if n in self.axes)
        gluon_splits = math.prod(len(self.gluon_axes[GLUON_PARAM + n]) for n in SPLIT_AXES) if self.gluon_axes else 0
        return triton * splits + (len(feasible) - triton) * gluon_splits

    def digest(self, extra: object = None) -> str:
        """A short hash of the choices, the target, the launch rules' constants, the kernel
        shape and ``extra`` (the workloads): the study name carries it, so a changed space
        never resumes an old, mismatched study. The Gluon branch enters it only where it is
        searched, so the other studies keep their names."""
        constants = {n: getattr(rules, n) for n in RULE_CONSTANTS}
        content: dict[str, object] = {"axes": self.axes, "target": self.profile.target, "rules": constants,
                                      "kernel": self.shape.kernel, "extra": extra}
        if self.gluon_axes:
            content["gluon"] = {"axes": self.gluon_axes, "rules": {n: getattr(rules, n) for n in GLUON_RULE_CONSTANTS},
                                "lowering": dataclasses.asdict(self.shape.lowering)}
        blob = json.dumps(content, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:8]

    def describe(self) -> str:
        p, s, k = self.profile, self.shape, self.shape.kernel
        t = p.target
        lines = [
            f"arch {p.arch} (family {p.family}{', ' + p.gpus if p.gpus else ''}); target {p.target_name} "
            f"(kgen/tables/targets.json): shared memory {t['shared_bytes']} B per block, warp size {t['warp_size']}, "
            f"{t['mma']}",
            f"problem: {k['kv_row_bytes']} B of K/V per prefix token, {k['q_row_bytes']} B of q per row, "
            f"accumulator width {k['acc_width']}, "
            f"group {s.group_size}, draft lengths {list(s.drafts)}",
        ]
        width = max([22, *(len(n) + 1 for n in self.gluon_axes)])
        lines += [f"  {n:<{width}} {list(v)}" for n, v in self.axes.items()]
        if self.gluon_note:
            lines.append(f"  gluon prefix stage: {self.gluon_note}")
        if self.gluon_axes:
            lines.append(f"  {LOWERING_AXIS:<{width}} {list(LOWERINGS)}")
            lines += [f"  {n:<{width}} {list(v)}" for n, v in self.gluon_axes.items()]
        lines.append(f"  {self.size()} configs, {self.feasible_count()} run as written (kgen/launcher/rules.py fit"
                     + (", gluon_rows, gluon_shared_bytes)" if self.gluon_axes else ")"))
        return "\n".join(lines)


def merge_choice(split: SplitPolicy) -> Merge:
    """Where and how a split policy merges, as the tuner's merge axis names it: "launch" (the
    merge stage's launch), "cluster", or "cluster_pipelined" (merge_pipelined)."""
    if split.merge != "cluster":
        return "launch"
    return "cluster_pipelined" if split.merge_pipelined else "cluster"


def merge_fields(choice: str) -> dict[str, Any]:
    """The SplitPolicy fields of a merge axis choice (``merge_choice`` read backwards)."""
    return {"merge": "cluster" if choice in ("cluster", "cluster_pipelined") else None,
            "merge_pipelined": True if choice == "cluster_pipelined" else None}


def _merge_param(cfg: BlockConfig, choices: tuple[str, ...], notes: list[str]) -> str:
    """The merge choice of ``cfg`` (``merge_choice``), or the first choice where it is not one."""
    want = merge_choice(cfg.split)
    if want not in choices:
        notes.append(f"merge {want} -> {choices[0]} (not a choice)")
        return choices[0]
    return want


def _nearest(name: str, choices: tuple[int, ...], want: int, notes: list[str]) -> int:
    """The choice nearest ``want`` on a log scale (the smaller on a tie); a note when it moved."""
    got = min(choices, key=lambda c: (abs(math.log2(c + 1) - math.log2(want + 1)), c))
    if got != want:
        notes.append(f"{name} {want} -> {got} (nearest choice)")
    return got
