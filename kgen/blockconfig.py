"""Block configs and the per-arch tables that hold them.

A ``BlockConfig`` is every launch choice of the verify kernel that does not change what it
computes: heads per program, prefix tile, warps, pipeline depth, the split-KV policy and
(on ROCm only) the AMD compiler knobs. Tables live in ``kgen/tables/<arch>.json``; their
schema is ``kgen/tables/SCHEMA.md`` and ``TableFile`` below. ``kgen tune`` writes them,
the select-config pass reads them.

Lookup order for one arch: the file named by ``$KGEN_TABLE`` > ``$KGEN_TABLES_DIR/<arch>.json``
(where ``kgen tune --out DIR`` writes) > the shipped table for the arch > the built-in default
(``kgen/tables/defaults.json``). ``kgen.load`` applies a table from either variable to the
module it imports (``kgen/retable.py``): no rebuild.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kgen.errors import TableError, describe_validation
from kgen.locations import TABLES_DIR_ENV
from kgen.spec import FP8_DTYPES

TABLE_DIR = Path(__file__).parent / "tables"
DEFAULTS_FILE = TABLE_DIR / "defaults.json"
TARGETS_FILE = TABLE_DIR / "targets.json"  # per-target limits (kgen/targets.py), not a block-config table
TABLE_SCHEMA = "kgen.block-config-table/1"
ROCM_ARCH_PREFIX = "gfx"
# A bucket's batch_max that means "and every larger batch" (SCHEMA.md: 2^30, open-ended).
OPEN_BATCH_MAX = 1 << 30


def batch_span(batch_min: int, batch_max: int) -> str:
    """A bucket's batches as people write them: '9-32', '97+' (open-ended), '4'."""
    if batch_max >= OPEN_BATCH_MAX:
        return f"{batch_min}+"
    return str(batch_min) if batch_min == batch_max else f"{batch_min}-{batch_max}"


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


# Every model below is strict (SCHEMA.md): a wrong type is an error, never converted ("64" is
# not 64, 1 is not true); float fields alone also take integers (a hand-written 41 for 41.0).
class SplitPolicy(BaseModel):
    """How the prefix is split across programs (split-KV).

    The launcher sizes the grid from shapes only (graph-safe):
    ``max_splits = clamp((programs_per_sm * num_sms) // programs_per_split, 1, max_splits)``
    (rounded down: a grid just past a whole wave leaves most SMs idle for the last one).
    Inside the kernel each request uses ``clamp(cdiv(prefix_len, min_tokens_per_split), 1,
    max_splits)`` splits of its own, so a short prefix is not cut into slivers.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    programs_per_sm: int = Field(default=2, ge=1, le=64)
    max_splits: int = Field(default=64, ge=1, le=1024)
    min_tokens_per_split: int = Field(default=256, ge=16, le=1 << 20)
    # Where a call's splits merge: unset, in the merge stage's launch; "cluster", in the prefix
    # stage where the launcher can (the splits of a head block one thread-block cluster:
    # VerifyLauncher.cluster_splits), else in the merge stage's launch.
    merge: Literal["cluster"] | None = None
    # The merge in a cluster loads its partials by cp.async through shared memory (true) or into
    # registers (absent): which wins depends on the program (docs/perf-notes.md, "The merge stage").
    merge_pipelined: bool | None = None

    @model_validator(mode="after")
    def _pipelined_needs_cluster(self) -> SplitPolicy:
        if self.merge_pipelined and self.merge != "cluster":
            raise ValueError('split.merge_pipelined pipelines the merge in a cluster: set split.merge to "cluster" '
                             "or drop merge_pipelined")
        return self

    def compact(self) -> str:
        """'programs_per_sm/max_splits/min_tokens_per_split', as ``BlockConfig.compact`` writes it
        ('/cluster' after it where the splits merge in a thread-block cluster, '/cluster+cp.async'
        where that merge is pipelined)."""
        merge = f"/{self.merge}" if self.merge else ""
        staged = "+cp.async" if self.merge_pipelined else ""
        return f"{self.programs_per_sm}/{self.max_splits}/{self.min_tokens_per_split}{merge}{staged}"


class GluonConfig(BaseModel):
    """The Gluon prefix stage's launch choices (kgen/templates/gluon/, gluon_gqa/): its own axes,
    since a program's rows and warpgroups are fixed by its layout. Present in a table row when
    the tuner measured that kernel faster than the Triton one on the row's bucket. 128-token
    tiles fit shared memory for GQA's narrower heads only (rules.gluon_shared_bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    block_n: Literal[32, 64, 128]
    num_stages: int = Field(ge=2, le=4)
    lazy_rescale: bool = False
    split: SplitPolicy = SplitPolicy(programs_per_sm=1)
    # The Gluon stage launches where a KV head's rows (group x L) reach this; below it the
    # row's Triton fields serve (a GQA program of 64 rows or fewer keeps one consumer busy).
    # Set by hand from a measurement; 0: at every draft length.
    from_rows: int = Field(default=0, ge=0, le=4096)
    # FP8 GQA: converter warpgroups (None: the launcher's rule, two where consumer 1 has no rows,
    # else one). 2: also beside two consumers, as a fourth warpgroup (head dims to 128); 1: never
    # two (rules.gluon_converters).
    converters: Literal[1, 2] | None = None
    # FP8 GQA: tiles in the converter's landing ring (None: none, the converters hold their tiles
    # in registers). The rows land with cp.async that many tiles minus one ahead, and one
    # converter turns them into the fp16 stages (rules.gluon_landing_refusal).
    landing_stages: int | None = Field(default=None, ge=2, le=4)

    def short(self) -> str:
        from_rows = f" from_rows={self.from_rows}" if self.from_rows else ""
        converters = f" converters={self.converters}" if self.converters else ""
        landing = f" landing={self.landing_stages}" if self.landing_stages else ""
        return (f"gluon(BLOCK_N={self.block_n} stages={self.num_stages}{' lazy_rescale' if self.lazy_rescale else ''} "
                f"split(ppsm={self.split.programs_per_sm}, max={self.split.max_splits}, "
                f"min_tok={self.split.min_tokens_per_split}){from_rows}{converters}{landing})")

    def compact(self, splits: bool = True) -> str:
        """The section in ``BlockConfig.compact``'s notation: 'gluon(N64 s2 1/64/256)'."""
        lazy = " lazy_rescale" if self.lazy_rescale else ""
        split = f" {self.split.compact()}" if splits else ""
        from_rows = f" from {self.from_rows} rows" if self.from_rows else ""
        converters = f" {self.converters} converters" if self.converters else ""
        landing = f" landing {self.landing_stages}" if self.landing_stages else ""
        return f"gluon(N{self.block_n} s{self.num_stages}{lazy}{split}{from_rows}{converters}{landing})"


class BlockConfig(BaseModel):
    """One launch configuration. ROCm knobs stay ``None`` on CUDA and are never passed there."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    block_h: int = Field(ge=1, le=128)
    block_n: int = Field(ge=16, le=512)
    num_warps: int
    num_stages: int = Field(ge=1, le=8)
    split: SplitPolicy = SplitPolicy()
    waves_per_eu: int | None = Field(default=None, ge=0, le=8)
    matrix_instr_nonkdim: Literal[16, 32] | None = None
    kpack: Literal[1, 2] | None = None
    # Kernel switch: move a row's running max only when it grows past 2**8, skipping most
    # accumulator rescales. Wins for 64-row BF16 programs, loses for FP8 (docs/perf-notes.md).
    lazy_rescale: bool | None = None
    # Where a request's last split runs its causal draft tile: "first" (before the prefix
    # loop) or "after" it. Only modules that emit both placements (grouped GQA) take it; None
    # is their row rule (before the loop in 32-row programs: docs/perf-notes.md, "Draft tile placement").
    draft_tile: Literal["first", "after"] | None = None
    # The Gluon prefix stage serves this row where it applies (its module has one, the GPU is
    # its arch, the Triton version its own; both entries); the fields above are the
    # Triton kernel's, for everything else.
    gluon: GluonConfig | None = None
    # The head block of the batch-invariant mode's programs, where it must be smaller than
    # block_h: that mode walks the draft columns in a loop, which carries the accumulator,
    # and a program that fits the default's straight-line draft tile can spill in the loop.
    invariant_block_h: int | None = Field(default=None, ge=1, le=128)
    # Rows from which a wgmma program with 16-bit KV takes twice the warps (up to
    # rules.WIDE_MAX_WARPS), though its accumulator would still fit: a row tuned at short drafts
    # keeps its warps there, while its longer drafts' programs, at the register budget's edge,
    # would spill in the prefix loop (GQA 256 group 4 at L 16: docs/perf-notes.md, "Rows at the
    # register budget"). None: only past the budget (rules.widened_warps).
    widen_from_rows: int | None = Field(default=None, ge=16, le=128)

    @field_validator("matrix_instr_nonkdim", "kpack", mode="before")
    @classmethod
    def _integer_choice(cls, v: object) -> object:
        # Literal choices compare by value, so true would pass as 1 and 16.0 as 16.
        if v is not None and type(v) is not int:
            raise ValueError(f"must be an integer, got {v!r} ({type(v).__name__})")
        return v

    @field_validator("block_h", "block_n", "invariant_block_h", "widen_from_rows")
    @classmethod
    def _power_of_two(cls, v: int | None) -> int | None:
        if v is not None and not _pow2(v):
            raise ValueError(f"must be a power of two (tl.arange extents are), got {v}")
        return v

    @field_validator("num_warps")
    @classmethod
    def _warps(cls, v: int) -> int:
        if v not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {v}")
        return v

    @property
    def has_rocm_knobs(self) -> bool:
        return any(k is not None for k in (self.waves_per_eu, self.matrix_instr_nonkdim, self.kpack))

    def for_arch(self, arch: str) -> BlockConfig:
        """The config with the AMD knobs dropped unless ``arch`` is a ROCm arch."""
        if arch.startswith(ROCM_ARCH_PREFIX) or not self.has_rocm_knobs:
            return self
        return self.model_copy(update={"waves_per_eu": None, "matrix_instr_nonkdim": None, "kpack": None})

    def short(self) -> str:
        s = (
            f"BLOCK_H={self.block_h} BLOCK_N={self.block_n} warps={self.num_warps} "
            f"stages={self.num_stages} split(ppsm={self.split.programs_per_sm}, "
            f"max={self.split.max_splits}, min_tok={self.split.min_tokens_per_split})"
        )
        if self.lazy_rescale:
            s += " lazy_rescale"
        if self.draft_tile:
            s += f" draft_tile={self.draft_tile}"
        if self.gluon is not None:
            s += " " + self.gluon.short()
        if self.invariant_block_h is not None:
            s += f" invariant_block_h={self.invariant_block_h}"
        if self.widen_from_rows is not None:
            s += f" widen_from_rows={self.widen_from_rows}"
        if self.has_rocm_knobs:
            s += f" waves_per_eu={self.waves_per_eu} nonkdim={self.matrix_instr_nonkdim} kpack={self.kpack}"
        return s

    def compact(self, splits: bool = True) -> str:
        """The config in ``compact_notation``, short enough for one line of ``kgen explain`` beside
        its reason: 'H16 N64 w4 s3 2/64/128' (``short`` spells the same fields out). Without
        ``splits``, the split policies are left out: the batch-invariant mode does not use them."""
        s = f"H{self.block_h} N{self.block_n} w{self.num_warps} s{self.num_stages}"
        if splits:
            s += f" {self.split.compact()}"
        if self.lazy_rescale:
            s += " lazy_rescale"
        if self.draft_tile:
            s += f" draft_tile={self.draft_tile}"
        if self.gluon is not None:
            s += " " + self.gluon.compact(splits)
        if self.invariant_block_h is not None:
            s += f" invariant H{self.invariant_block_h}"
        if self.widen_from_rows is not None:
            s += f" wide from {self.widen_from_rows} rows"
        if self.has_rocm_knobs:
            s += f" waves_per_eu={self.waves_per_eu} nonkdim={self.matrix_instr_nonkdim} kpack={self.kpack}"
        return s


def compact_notation(splits: bool = True) -> str:
    """What ``BlockConfig.compact``'s letters stand for (``kgen explain`` prints it under its configs)."""
    return "H BLOCK_H, N BLOCK_N, w warps, s stages" + (", ppsm/max/min_tok" if splits else "")


class Measured(BaseModel):
    """Times measured by the tuner for one bucket (median microseconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    tuned_us: float = Field(gt=0)
    default_us: float = Field(gt=0)
    noise_pct: float = Field(default=0.0, ge=0)
    workloads: list[dict[str, int]] = Field(default_factory=list)
    # Rows whose config has a gluon section: the median of their Triton fields (the Triton
    # config the study chose) in the same re-measurement the Gluon kernel won.
    triton_us: float | None = Field(default=None, gt=0)
    # The GPU the bucket was measured on. The table's metadata names the last run's, and one
    # arch's table may merge runs on several of its GPUs (an H100's and an H200's rows).
    gpu_name: str | None = None


class TableEntry(BaseModel):
    """The config for one layout, KV dtype, group size and batch bucket.

    The bucket is a batch range only: the launcher must choose a config from shapes and
    Python scalars (CUDA-graph safety), and the prefix length lives on the device. The
    tuner times each bucket over several prefix lengths (``measured.workloads``); the
    split policy adapts to the actual prefix length inside the kernel.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    layout: str
    kv_dtype: str
    group_size: int = Field(ge=1, le=256)
    batch_min: int = Field(default=1, ge=1)
    batch_max: int = Field(default=OPEN_BATCH_MAX, ge=1)
    config: BlockConfig
    measured: Measured | None = None

    @model_validator(mode="after")
    def _range(self) -> TableEntry:
        if self.batch_max < self.batch_min:
            raise ValueError(f"batch_max {self.batch_max} < batch_min {self.batch_min}")
        return self

    def covers(self, group_size: int, batch: int) -> bool:
        return self.group_size == group_size and self.batch_min <= batch <= self.batch_max


# A KV dtype with no rows of its own in a table takes its twin's: the same bytes a token and the
# same MMA work (fp16 and bf16 tiles feed the same tensor-core instructions at the same rate;
# e5m2 and e4m3fn each convert to fp16 in one cvt a pair), so a config measured for one is the
# best known for the other. Rows of its own, once tuned, win.
TWIN_KV = {"float16": "bfloat16", "float8_e5m2": "float8_e4m3fn"}


class TableMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    gpu_name: str = "unknown"
    arch: str
    torch_version: str | None = None
    triton_version: str | None = None
    date: str | None = None
    trials: int = Field(default=0, ge=0)
    tuned: bool = False
    note: str = ""


class TableFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    schema_: Literal["kgen.block-config-table/1"] = Field(alias="schema")
    arch: str
    metadata: TableMetadata
    entries: list[TableEntry]

    @model_validator(mode="after")
    def _arch_matches(self) -> TableFile:
        if self.metadata.arch != self.arch:
            raise ValueError(f"metadata.arch {self.metadata.arch!r} differs from arch {self.arch!r}")
        return self

    def lookup(self, layout: str, kv_dtype: str, group_size: int, batch: int) -> TableEntry | None:
        """The row a call of this layout, KV dtype, group and batch runs (its twin's, see rows_for)."""
        rows, _ = self.rows_for(layout, kv_dtype)
        return next((entry for entry in rows if entry.covers(group_size, batch)), None)

    def rows_for(self, layout: str, kv_dtype: str) -> tuple[list[TableEntry], str]:
        """The rows a module of this layout and KV dtype runs, and the KV dtype they are keyed by:
        its own, or where it has none its twin's (TWIN_KV)."""
        for keyed_by in (kv_dtype, TWIN_KV.get(kv_dtype)):
            rows = [e for e in self.entries if e.layout == layout and e.kv_dtype == keyed_by]
            if rows:
                return rows, keyed_by
        return [], kv_dtype


class DefaultRule(BaseModel):
    """A built-in default for every layout whose K width is at most ``max_qk_dim``; with
    ``kv_storage`` ("fp8" or "16bit") only for KV caches stored that way."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_qk_dim: int = Field(gt=0)
    kv_storage: Literal["fp8", "16bit"] | None = None
    config: BlockConfig
    why: str

    def applies_to(self, qk_dim: int, kv_dtype: str) -> bool:
        storage = "fp8" if kv_dtype in FP8_DTYPES else "16bit"
        return qk_dim <= self.max_qk_dim and self.kv_storage in (None, storage)


class DefaultsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    schema_: Literal["kgen.block-config-defaults/1"] = Field(alias="schema")
    rules: list[DefaultRule] = Field(min_length=1)

    def rule_for(self, qk_dim: int, kv_dtype: str = "bfloat16") -> DefaultRule:
        """The narrowest rule covering this K width; at one width, a KV-storage rule wins."""
        for rule in sorted(self.rules, key=lambda r: (r.max_qk_dim, r.kv_storage is None)):
            if rule.applies_to(qk_dim, kv_dtype):
                return rule
        return max(self.rules, key=lambda r: (r.max_qk_dim, r.kv_storage is None))


# Keys that say which row of a list an error is in (TableEntry, DefaultRule).
_ROW_KEYS = ("layout", "kv_dtype", "group_size", "batch_min", "batch_max", "max_qk_dim", "kv_storage")


def _row(raw: object, loc: tuple) -> str:
    """' (row N: layout ..., group_size ...)' for an error inside ``entries[N]`` / ``rules[N]``."""
    if len(loc) < 2 or loc[0] not in ("entries", "rules") or not isinstance(loc[1], int):
        return ""
    rows = raw.get(loc[0]) if isinstance(raw, dict) else None
    row = rows[loc[1]] if isinstance(rows, list) and loc[1] < len(rows) else None
    keys = [f"{k} {row[k]!r}" for k in _ROW_KEYS if isinstance(row, dict) and k in row]
    return f" (row {loc[1]}{': ' + ', '.join(keys) if keys else ''})"


def _read_json(path: Path) -> object:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TableError(f"{path}: no such table file") from None
    except json.JSONDecodeError as exc:
        raise TableError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def read_table(path: Path) -> TableFile:
    """Read and validate one table; a corrupt file is an error naming the file and field."""
    raw = _read_json(path)
    try:
        return TableFile.model_validate(raw)
    except ValidationError as exc:
        raise TableError(describe_validation(Path(path), exc, lambda loc: _row(raw, loc))) from None


def read_defaults(path: Path = DEFAULTS_FILE) -> DefaultsFile:
    raw = _read_json(path)
    try:
        return DefaultsFile.model_validate(raw)
    except ValidationError as exc:
        raise TableError(describe_validation(Path(path), exc, lambda loc: _row(raw, loc))) from None


def table_to_json(table: TableFile) -> str:
    return json.dumps(table.model_dump(by_alias=True, exclude_none=True), indent=2) + "\n"


def write_text_atomic(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` through a temporary file and a rename; skip if unchanged.

    Returns True when the file changed. A crash leaves either the old or the new file.
    """
    path = Path(path)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def write_table(path: Path, table: TableFile) -> bool:
    """Validate then atomically write ``table``; returns True when the file changed."""
    TableFile.model_validate(table.model_dump(by_alias=True))
    return write_text_atomic(Path(path), table_to_json(table))


def shipped_tables(directory: Path = TABLE_DIR) -> dict[str, Path]:
    """Shipped table files by arch name (``sm_90.json`` -> ``sm_90``)."""
    return {p.stem: p for p in sorted(Path(directory).glob("*.json"))
            if p.name not in (DEFAULTS_FILE.name, TARGETS_FILE.name)}


class TableSource(BaseModel):
    """Where one arch's table came from, for ``kgen explain``."""

    arch: str
    path: str | None
    origin: Literal["KGEN_TABLE", "KGEN_TABLES_DIR", "shipped", "none"]
    table: TableFile | None = None


def user_tables(directory: Path) -> dict[str, Path]:
    """The table files of a ``$KGEN_TABLES_DIR`` by arch; each file is named for the arch its
    table holds (``kgen tune --out DIR`` writes ``DIR/<arch>.json``)."""
    if not directory.is_dir():
        raise TableError(f"{TABLES_DIR_ENV}={directory} is not a directory: point it at the folder "
                         "`kgen tune --out DIR` wrote (it holds <arch>.json files), or unset it")
    return shipped_tables(directory)


def tables_overridden(env: dict[str, str] | None = None) -> bool:
    """Whether ``$KGEN_TABLE`` or ``$KGEN_TABLES_DIR`` puts a table before the shipped ones."""
    env = os.environ if env is None else env
    return bool(env.get("KGEN_TABLE") or env.get(TABLES_DIR_ENV))


def resolve_tables(directory: Path = TABLE_DIR, env: dict[str, str] | None = None) -> dict[str, TableSource]:
    """Every arch's table following the lookup order: ``$KGEN_TABLE`` > ``$KGEN_TABLES_DIR`` > shipped."""
    env = os.environ if env is None else env
    sources = {
        arch: TableSource(arch=arch, path=str(path), origin="shipped", table=read_table(path))
        for arch, path in shipped_tables(directory).items()
    }
    if env.get(TABLES_DIR_ENV):
        for arch, path in user_tables(Path(env[TABLES_DIR_ENV])).items():
            table = read_table(path)
            if table.arch != arch:
                raise TableError(f"{path}: holds the table of {table.arch}, but a {TABLES_DIR_ENV} file is named "
                                 f"for its arch: rename it {table.arch}.json")
            sources[arch] = TableSource(arch=arch, path=str(path), origin="KGEN_TABLES_DIR", table=table)
    override = env.get("KGEN_TABLE")
    if override:
        table = read_table(Path(override))
        sources[table.arch] = TableSource(arch=table.arch, path=override, origin="KGEN_TABLE", table=table)
    return sources


TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton-rocm", "pytorch-triton")


def installed_triton_version() -> str | None:
    """The installed Triton's version from package metadata (no import), or None."""
    for name in TRITON_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def major_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("3.6.0" -> (3, 6)); None when it names none."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_triton_version(
    table: TableFile, installed: str | None = None, source: str | Path | None = None
) -> str | None:
    """A warning when ``table`` was tuned with another Triton major.minor than the one
    installed, else None. The table is still used: its configs stay correct, only perhaps
    no longer the fastest, since code generation changes between Triton releases.

    ``installed`` defaults to the installed Triton; tables that record no Triton version
    (untuned ones) and machines without Triton give None.
    """
    made = table.metadata.triton_version
    installed = installed if installed is not None else installed_triton_version()
    if not made or not installed:
        return None
    made_mm, inst_mm = major_minor(made), major_minor(installed)
    if made_mm is None or inst_mm is None or made_mm == inst_mm:
        return None
    where = source or f"the {table.arch} table"
    return (
        f"{where}: tuned with Triton {made} but Triton {installed} is installed; its configs "
        f"are still used but may no longer be the fastest: re-run `kgen tune --arch "
        f"{table.arch}` (it was tuned on {table.metadata.gpu_name}) to re-tune"
    )
