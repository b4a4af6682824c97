"""The search space of ``kgen tune``: axes and resource limits per arch, read from data.

``spaces.toml`` holds the choices of every axis per arch family (CUDA, ROCm), the
per-arch shared-memory / LDS and register budgets, and per-arch overrides. This module
turns it into a ``SearchSpace`` for one study (arch, layout, dtypes, group size, draft
lengths), which suggests configs to Optuna and rejects, before anything is compiled, the
ones that cannot fit: compiling and launching a config that spills or exceeds shared
memory costs seconds, estimating costs microseconds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kgen.blockconfig import BlockConfig, SplitPolicy, read_defaults
from kgen.passes.specialize import GQA_DRAFT_FIRST_ROWS, draft_tile_either
from kgen.rules import next_pow2, row_blocking
from kgen.spec import FP8_DTYPES, LayoutSpec
from kgen.tuner.errors import TuneError, describe_validation

if TYPE_CHECKING:
    import optuna

SPACES_FILE = Path(__file__).parent / "spaces.toml"

CORE_AXES = ("block_h", "block_n", "num_warps", "num_stages")
SPLIT_AXES = ("programs_per_sm", "max_splits", "min_tokens_per_split")
ROCM_AXES = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# Kernel switches (0 = off, 1 = on); an axis a family leaves empty is not searched.
KERNEL_AXES = ("lazy_rescale",)
# Where the draft tile runs (BlockConfig.draft_tile: "first" / "after" the prefix loop),
# searched only for layouts whose module emits both placements (grouped GQA, not MLA).
PLACEMENT_AXES = ("draft_tile",)
Placement = Literal["first", "after"]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a canonical dtype name (``bfloat16``, ``float8_e4m3fn`` ...)."""
    return 1 if dtype in FP8_DTYPES else 2


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


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    smem_per_block: int = Field(gt=0)
    smem_per_sm: int = Field(gt=0)
    max_fp32_regs_per_thread: int = Field(gt=0)


class Family(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    warp_size: Literal[32, 64]
    kv_dtypes: tuple[str, ...] = Field(min_length=1)
    dot_multiple_of_nonkdim: bool = False
    stage_buffers_offset: int = Field(default=0, ge=-1, le=0)
    axes: Axes
    limits: Limits
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
    limits: Limits | None = None


class KernelRules(BaseModel):
    """Launcher rules of the generated kernels that change what a config means; they must
    match the module's MIN_DOT_ROWS and MAX_ROWS (the GPU backend checks)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_dot: int = Field(default=16, ge=1)
    max_rows: int = Field(default=128, ge=1)


class SpacesFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["kgen.tune-space/1"] = Field(alias="schema")
    kernel: KernelRules = KernelRules()
    arch_families: dict[str, str] = Field(min_length=1)
    family: dict[str, Family] = Field(min_length=1)
    arch: dict[str, ArchEntry] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _families_exist(self) -> SpacesFile:
        missing = sorted(set(self.arch_families.values()) - set(self.family))
        if missing:
            raise ValueError(f"arch_families names families with no [family.<name>] table: {missing}")
        return self


def load_spaces(path: Path | None = None) -> SpacesFile:
    """Read and validate the spaces file; errors name the file and the field."""
    path = Path(path or SPACES_FILE)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TuneError(f"{path}: no such search-space file") from None
    except tomllib.TOMLDecodeError as exc:
        raise TuneError(f"{path}: not valid TOML: {exc}") from None
    try:
        return SpacesFile.model_validate(raw)
    except ValidationError as exc:
        raise TuneError(describe_validation(path, exc)) from None


# --------------------------------------------------------------------------- one arch


@dataclass(frozen=True)
class ArchProfile:
    """Everything the space needs about one arch, after family defaults and overrides."""

    arch: str
    family: str
    warp_size: int
    kv_dtypes: tuple[str, ...]
    dot_multiple_of_nonkdim: bool
    stage_buffers_offset: int
    axes: Axes
    limits: Limits
    limits_from: str
    baseline_knobs: dict[str, int] = field(default_factory=dict)
    gpus: str = ""

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


def _arch_entry(arch: str, spaces: SpacesFile) -> tuple[str, ArchEntry | None]:
    if arch in spaces.arch:
        return arch, spaces.arch[arch]
    base = re.sub(r"^(sm_\d+)[a-z]$", r"\1", arch)  # sm_90a -> sm_90
    return base, spaces.arch.get(base)


def arch_profile(arch: str, spaces: SpacesFile) -> ArchProfile:
    """The family's space and limits for ``arch``, with the arch's overrides applied."""
    fam_name = arch_family(arch, spaces)
    fam = spaces.family[fam_name]
    key, entry = _arch_entry(arch, spaces)
    axes, limits, kv = fam.axes, fam.limits, fam.kv_dtypes
    limits_from = f"family {fam_name} fallback (no [arch.{arch}] in spaces.toml)"
    if entry is not None:
        if entry.axes is not None:
            update = entry.axes.model_dump(exclude_none=True)
            axes = Axes.model_validate({**axes.model_dump(), **update})
        if entry.limits is not None:
            limits, limits_from = entry.limits, f"arch {key}"
        kv = entry.kv_dtypes or kv
    return ArchProfile(
        arch=arch,
        family=fam_name,
        warp_size=fam.warp_size,
        kv_dtypes=kv,
        dot_multiple_of_nonkdim=fam.dot_multiple_of_nonkdim,
        stage_buffers_offset=fam.stage_buffers_offset,
        axes=axes,
        limits=limits,
        limits_from=limits_from,
        baseline_knobs=dict(fam.baseline_knobs),
        gpus=entry.gpus if entry else "",
    )


# --------------------------------------------------------------------------- estimates


@dataclass(frozen=True)
class ProblemShape:
    """What the resource estimates need to know about the problem of one study. Widths are
    the kernel's padded tile widths (a power of two, at least ``min_dot``)."""

    qk_width: int
    v_width: int
    v_shares_k: bool
    kv_bytes: int
    q_bytes: int
    group_size: int
    drafts: tuple[int, ...]
    min_dot: int = 16
    max_rows: int = 128
    # The module emits both draft-tile placements; unset, it drafts first at these rows.
    draft_tile_either: bool = False
    draft_first_rows: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        layout: LayoutSpec,
        kv_dtype: str,
        q_dtype: str,
        group: int,
        drafts: tuple[int, ...],
        kernel: KernelRules | None = None,
    ) -> ProblemShape:
        att, rules = layout.attention, kernel or KernelRules()

        def width(x: int) -> int:
            return max(rules.min_dot, next_pow2(x))

        return cls(
            qk_width=width(att.nope_dim) + (width(att.pe_dim) if att.pe_dim else 0),
            v_width=width(att.v_head_dim),
            v_shares_k=att.v_source == "k_latent",
            kv_bytes=dtype_bytes(kv_dtype),
            q_bytes=dtype_bytes(q_dtype),
            group_size=group,
            drafts=tuple(sorted(set(drafts))),
            min_dot=rules.min_dot,
            max_rows=rules.max_rows,
            draft_tile_either=draft_tile_either(att),
            draft_first_rows=GQA_DRAFT_FIRST_ROWS if draft_tile_either(att) else (),
        )


def launch_rows(block_h: int, shape: ProblemShape, draft: int) -> tuple[int, int]:
    """(BLOCK_H, L_PAD) of the launcher's row rule (kgen/rules.py, ``row_blocking``)."""
    return row_blocking(block_h, shape.group_size, draft, shape.max_rows)


def row_rule_placement(cfg: BlockConfig, shape: ProblemShape, draft: int) -> str:
    """Where the module's row rule puts the draft tile for ``cfg`` at one draft length."""
    bh, l_pad = launch_rows(cfg.block_h, shape, draft)
    return "first" if bh * l_pad in shape.draft_first_rows else "after"


def row_rule_placements(cfg: BlockConfig, shape: ProblemShape) -> set[str]:
    """Where the row rule puts the draft tile for ``cfg``, over the study's drafts."""
    return {row_rule_placement(cfg, shape, d) for d in shape.drafts}


def smem_bytes(cfg: BlockConfig, shape: ProblemShape, rows: int, stage_buffers_offset: int = 0) -> int:
    """Shared memory / LDS of one program: the K and V tiles of every pipeline buffer
    (``max(1, num_stages + stage_buffers_offset)`` of them) plus the Q tile of ``rows``
    rows. Absorbed MLA reuses the K tile as V."""
    v_width = 0 if shape.v_shares_k else shape.v_width
    buffers = max(1, cfg.num_stages + stage_buffers_offset)
    kv_tiles = cfg.block_n * (shape.qk_width + v_width) * shape.kv_bytes * buffers
    return kv_tiles + rows * shape.qk_width * shape.q_bytes


def fp32_regs_per_thread(cfg: BlockConfig, shape: ProblemShape, rows: int, warp_size: int) -> float:
    """fp32 registers per thread held by the accumulator (rows x D_v) and the score tile
    (rows x block_n), both live across the prefix loop, spread over num_warps x warp_size."""
    return rows * (shape.v_width + cfg.block_n) / (cfg.num_warps * warp_size)


def _resources(cfg: BlockConfig, shape: ProblemShape, profile: ArchProfile, rows: int, draft: int) -> str | None:
    lim = profile.limits
    smem = smem_bytes(cfg, shape, rows, profile.stage_buffers_offset)
    if smem > lim.smem_per_block:
        return (
            f"shared memory ~{smem} B > {lim.smem_per_block} B per block on {profile.arch} "
            f"(L={draft}, {rows} rows); fewer stages or a smaller block_n fit"
        )
    regs = fp32_regs_per_thread(cfg, shape, rows, profile.warp_size)
    if regs > lim.max_fp32_regs_per_thread:
        return (
            f"~{regs:.0f} fp32 registers per thread > {lim.max_fp32_regs_per_thread} "
            f"(L={draft}, {rows} rows); more warps or a smaller block_h fit"
        )
    nonk = cfg.matrix_instr_nonkdim
    if profile.dot_multiple_of_nonkdim and nonk is not None and (cfg.block_n % nonk or rows % nonk):
        return f"block_n {cfg.block_n} and rows {rows} must be multiples of matrix_instr_nonkdim {nonk}"
    return None


def why_not(cfg: BlockConfig, shape: ProblemShape, profile: ArchProfile) -> str | None:
    """Why ``cfg`` cannot run well on this arch for this problem, or None when it fits.

    Also refuses configs the launcher would silently run as another block_h (a duplicate
    trial would only re-time a kernel already timed).
    """
    cap = next_pow2(shape.group_size)
    if cfg.block_h > cap:
        return f"block_h {cfg.block_h} > next_pow2(group size {shape.group_size}) = {cap}"
    rows_per_draft = {d: launch_rows(cfg.block_h, shape, d) for d in shape.drafts}
    if all(bh != cfg.block_h for bh, _ in rows_per_draft.values()):
        ran = sorted({bh for bh, _ in rows_per_draft.values()})
        return f"duplicate: the launcher halves block_h {cfg.block_h} to {ran} (rows <= {shape.max_rows})"
    for draft, (bh, l_pad) in rows_per_draft.items():
        reason = _resources(cfg, shape, profile, bh * l_pad, draft)
        if reason:
            return reason
    return None


# --------------------------------------------------------------------------- the space


def default_config(layout: LayoutSpec, group_size: int, kv_dtype: str = "bfloat16") -> BlockConfig:
    """The built-in default (``kgen/tables/defaults.json``) made legal for the group size:
    block_h is cut to next_pow2(group), since a program never owns more heads than exist."""
    cfg = read_defaults().rule_for(layout.attention.qk_dim, kv_dtype).config
    return cfg.model_copy(update={"block_h": min(cfg.block_h, next_pow2(group_size))})


@dataclass(frozen=True)
class SearchSpace:
    """The choices of one study, and the rules that prune configs before compiling."""

    profile: ArchProfile
    shape: ProblemShape
    axes: dict[str, tuple[int, ...]]

    @classmethod
    def build(cls, profile: ArchProfile, shape: ProblemShape) -> SearchSpace:
        cap = next_pow2(shape.group_size)
        kernel = tuple(n for n in KERNEL_AXES if getattr(profile.axes, n))
        if shape.draft_tile_either:  # MLA and per-head modules have one fixed placement
            kernel += tuple(n for n in PLACEMENT_AXES if getattr(profile.axes, n))
        names = CORE_AXES + SPLIT_AXES + kernel + (ROCM_AXES if profile.is_rocm else ())
        axes = {n: tuple(getattr(profile.axes, n)) for n in names}
        axes["block_h"] = tuple(b for b in axes["block_h"] if b <= cap)
        empty = [n for n, v in axes.items() if not v]
        if empty:
            raise TuneError(
                f"search space for {profile.arch}, group {shape.group_size} has no choice for "
                f"{empty}: widen these axes in spaces.toml"
            )
        return cls(profile=profile, shape=shape, axes=axes)

    def config(self, params: dict[str, int]) -> BlockConfig:
        """The BlockConfig named by one set of Optuna parameters."""
        split = SplitPolicy(**{n: params[n] for n in SPLIT_AXES})
        knobs = {n: params[n] for n in ROCM_AXES if n in self.axes}
        switches = {n: bool(params[n]) or None for n in KERNEL_AXES if n in self.axes}  # off is the default
        cfg = BlockConfig(**{n: params[n] for n in CORE_AXES}, split=split, **knobs, **switches)
        if "draft_tile" in self.axes and row_rule_placements(cfg, self.shape) != {params["draft_tile"]}:
            # Only a placement the row rule would not pick is spelled out, so equal kernels key equal.
            cfg = cfg.model_copy(update={"draft_tile": params["draft_tile"]})
        return cfg

    def why_not(self, cfg: BlockConfig) -> str | None:
        return why_not(cfg, self.shape, self.profile)

    def suggest(self, trial: optuna.Trial) -> BlockConfig:
        """Ask the trial for every axis; prune (before compiling) a config that cannot fit."""
        import optuna

        params = {n: trial.suggest_categorical(n, list(c)) for n, c in self.axes.items()}
        cfg = self.config(params)
        reason = self.why_not(cfg)
        if reason is not None:
            trial.set_user_attr("pruned_reason", f"does not fit: {reason}")
            raise optuna.TrialPruned(f"does not fit: {reason}")
        return cfg

    def params_of(self, cfg: BlockConfig) -> tuple[dict[str, int], list[str]]:
        """The nearest point of the space to ``cfg`` (for enqueueing a default) and notes on
        every value that had to move. Missing ROCm knobs take the family's baseline."""
        values = {**cfg.model_dump(exclude={"split"}), **cfg.split.model_dump()}
        params, notes = {}, []
        for name, choices in self.axes.items():
            want = values.get(name)
            if name in PLACEMENT_AXES:
                params[name] = self._placement_param(cfg, choices, notes)
                continue
            if want is None:
                want = self.profile.baseline_knobs.get(name, choices[0])
            got = min(choices, key=lambda c: (abs(math.log2(c + 1) - math.log2(want + 1)), c))
            if got != want:
                notes.append(f"{name} {want} -> {got} (nearest choice)")
            params[name] = got
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
        return math.prod(len(v) for v in self.axes.values())

    def feasible_configs(self) -> list[BlockConfig]:
        """Every config that passes the estimates, split policy fixed at its first choice
        (the split axes never change what fits)."""
        names = [n for n in self.axes if n not in SPLIT_AXES]
        fixed = {n: self.axes[n][0] for n in SPLIT_AXES}
        out = []
        for combo in itertools.product(*(self.axes[n] for n in names)):
            cfg = self.config({**dict(zip(names, combo, strict=True)), **fixed})
            if self.why_not(cfg) is None:
                out.append(cfg)
        return out

    def feasible_count(self) -> int:
        splits = math.prod(len(self.axes[n]) for n in SPLIT_AXES)
        return len(self.feasible_configs()) * splits

    def digest(self, extra: object = None) -> str:
        """A short hash of the choices, limits and ``extra`` (the workloads): the study
        name carries it, so a changed space never resumes an old, mismatched study."""
        blob = json.dumps(
            {"axes": self.axes, "limits": self.profile.limits.model_dump(), "extra": extra},
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:8]

    def describe(self) -> str:
        p, s = self.profile, self.shape
        v_note = " (V = K latent)" if s.v_shares_k else ""
        lines = [
            f"arch {p.arch} (family {p.family}{', ' + p.gpus if p.gpus else ''}); "
            f"limits from {p.limits_from}: smem/block {p.limits.smem_per_block} B, "
            f"smem/SM {p.limits.smem_per_sm} B, fp32 regs/thread {p.limits.max_fp32_regs_per_thread}, "
            f"warp size {p.warp_size}",
            f"problem: K tile width {s.qk_width}, V tile width {s.v_width}{v_note}, KV {s.kv_bytes} B/elt, "
            f"Q {s.q_bytes} B/elt, group {s.group_size}, draft lengths {list(s.drafts)}",
        ]
        lines += [f"  {n:<22} {list(v)}" for n, v in self.axes.items()]
        lines.append(f"  {self.size()} configs, {self.feasible_count()} fit")
        return "\n".join(lines)
