"""Layout specs: what one model's attention looks like to the verify kernel.

A layout spec is one TOML file in ``kgen/layouts/`` (or any directory given to
``load_layouts``). It names the model architectures that use it, the query/key/value head
widths, the group sizes (query heads per KV head, one per tensor-parallel degree) and
the dtypes the generated kernels accept. Parsing is strict: an unknown key, an unknown
dtype, an impossible width or a name that is not a safe identifier is refused with a
message naming the file, the field and the reason.
"""

from __future__ import annotations

import keyword
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kgen.errors import SpecError, UsageError, describe_validation

SHIPPED_LAYOUT_DIR = Path(__file__).parent / "layouts"
# What every field of a layout spec means; unknown-key errors point here (repository-relative).
LAYOUT_README = SHIPPED_LAYOUT_DIR / "README.md"
LAYOUT_README_NAME = LAYOUT_README.relative_to(Path(__file__).parent.parent).as_posix()

# Canonical dtype names (torch attribute names) and the short tags used in module names.
KV_DTYPES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float8_e4m3fn": "fp8_e4m3fn",
    "float8_e4m3fnuz": "fp8_e4m3fnuz",
    "float8_e5m2": "fp8_e5m2",
}
Q_DTYPES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16"}
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2"})
# Friendly spellings accepted on the command line and in spec files.
DTYPE_ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "e4m3fn": "float8_e4m3fn",
    "fp8_e4m3fnuz": "float8_e4m3fnuz",
    "e4m3fnuz": "float8_e4m3fnuz",
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
}

_SAFE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_ARCH_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Widest head the kernel family is written for (MLA 512 + 64 is 576).
MAX_HEAD_DIM = 1024


def canonical_dtype(name: str, allowed: Iterable[str], what: str) -> str:
    """Map ``name`` (``bf16``, ``bfloat16``, ``fp8`` ...) to its canonical torch name.

    An unknown name raises ``UsageError`` (a ``ValueError``) listing the valid names and short forms.
    """
    allowed = tuple(allowed)
    canon = DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    if canon not in allowed:
        short = [alias for alias, full in DTYPE_ALIASES.items() if full in allowed]
        raise UsageError(
            f"unknown {what} dtype {name!r}; expected one of {', '.join(allowed)} (short forms: {', '.join(short)})"
        )
    return canon


class AttentionShape(BaseModel):
    """Head widths. GQA: ``nope_dim`` is the whole rotated head, ``pe_dim`` is 0.
    Absorbed MLA: ``nope_dim`` is the latent width, ``pe_dim`` the RoPE part, and V is
    the first ``v_head_dim`` latent columns of the K buffer (``v_source = "k_latent"``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["gqa", "mla"]
    nope_dim: int = Field(gt=0, le=MAX_HEAD_DIM)
    pe_dim: int = Field(ge=0, le=MAX_HEAD_DIM)
    v_head_dim: int = Field(gt=0, le=MAX_HEAD_DIM)
    v_source: Literal["v_buffer", "k_latent"] = "v_buffer"
    group_sizes: tuple[int, ...] = Field(min_length=1)

    @field_validator("group_sizes")
    @classmethod
    def _positive_groups(cls, groups: tuple[int, ...]) -> tuple[int, ...]:
        bad = [g for g in groups if g <= 0 or g > 256]
        if bad:
            raise ValueError(f"group sizes must lie in 1..256, got {bad}")
        if len(set(groups)) != len(groups):
            raise ValueError(f"group sizes repeat: {list(groups)}")
        return tuple(sorted(groups))

    @model_validator(mode="after")
    def _consistent(self) -> AttentionShape:
        if self.nope_dim + self.pe_dim > MAX_HEAD_DIM:
            raise ValueError(f"nope_dim + pe_dim = {self.nope_dim + self.pe_dim} > {MAX_HEAD_DIM}")
        if self.v_head_dim > self.nope_dim + self.pe_dim:
            raise ValueError(
                f"v_head_dim {self.v_head_dim} is larger than the K width "
                f"{self.nope_dim + self.pe_dim} (nope_dim + pe_dim)"
            )
        if self.v_source == "k_latent" and self.v_head_dim > self.nope_dim:
            raise ValueError(
                f"v_source 'k_latent' takes V from the latent (nope) columns, but v_head_dim "
                f"{self.v_head_dim} > nope_dim {self.nope_dim}"
            )
        if self.kind == "gqa" and self.pe_dim != 0:
            raise ValueError("a 'gqa' layout has its RoPE already applied: pe_dim must be 0")
        if self.kind == "gqa" and self.v_source != "v_buffer":
            raise ValueError("a 'gqa' layout reads V from its own buffer: v_source = 'v_buffer'")
        if self.kind == "mla" and self.v_source != "k_latent":
            raise ValueError("an absorbed 'mla' layout takes V from the latent: v_source = 'k_latent'")
        return self

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.pe_dim


class Dtypes(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kv: tuple[str, ...] = Field(min_length=1)
    q: tuple[str, ...] = Field(min_length=1)

    @field_validator("kv")
    @classmethod
    def _kv(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(canonical_dtype(n, KV_DTYPES, "KV") for n in names))

    @field_validator("q")
    @classmethod
    def _q(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(canonical_dtype(n, Q_DTYPES, "query") for n in names))


class LayoutSpec(BaseModel):
    """One layout file, validated. ``source`` is the file it came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    architectures: tuple[str, ...] = ()
    attention: AttentionShape
    dtypes: Dtypes
    source: str = Field(default="<memory>", exclude=True)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        # The name becomes a file and module name: no path characters, no keywords.
        if not _SAFE_NAME.match(name) or keyword.iskeyword(name):
            raise ValueError(
                f"{name!r} is not a safe identifier: use lower-case letters, digits and '_', "
                "starting with a letter, at most 64 characters"
            )
        return name

    @field_validator("architectures")
    @classmethod
    def _arch_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        bad = [n for n in names if not _ARCH_NAME.match(n)]
        if bad:
            raise ValueError(f"architecture names must be Python identifiers, got {bad}")
        return names


def parse_layout(text: str, source: Path | str = "<memory>") -> LayoutSpec:
    """Parse and validate one layout spec from TOML text."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    try:
        spec = LayoutSpec.model_validate({**raw, "source": str(source)})
    except ValidationError as exc:
        raise SpecError(describe_validation(source, exc, fields_doc=LAYOUT_README_NAME)) from None
    stem = Path(str(source)).stem
    if str(source) != "<memory>" and stem != spec.name:
        raise SpecError(f"{source}: field 'name': {spec.name!r} must match the file name {stem!r}")
    return spec


def load_layout_file(path: Path) -> LayoutSpec:
    return parse_layout(path.read_text(encoding="utf-8"), path)


def load_layouts(directory: Path | None = None) -> dict[str, LayoutSpec]:
    """Every ``*.toml`` spec in ``directory`` (the shipped ones by default), by name.

    All files are validated before anything is returned: one bad file fails the whole
    load, with every problem listed, so a build never writes half a set of kernels.
    """
    directory = directory or SHIPPED_LAYOUT_DIR
    specs: dict[str, LayoutSpec] = {}
    problems: list[str] = []
    for path in sorted(Path(directory).glob("*.toml")):
        try:
            spec = load_layout_file(path)
        except SpecError as exc:
            problems.append(str(exc))
            continue
        specs[spec.name] = spec
    if problems:
        raise SpecError("\n".join(problems))
    if not specs:
        raise SpecError(f"{directory}: no layout specs (*.toml) found")
    return specs


def layouts_for_architecture(arch_name: str, specs: dict[str, LayoutSpec]) -> list[LayoutSpec]:
    """The layouts whose spec lists ``arch_name`` (a HuggingFace architecture name)."""
    return [s for s in specs.values() if arch_name in s.architectures]
