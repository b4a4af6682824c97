"""``kgen check``: prove without a GPU that every kernel variant a module can launch fits its target.

Triton's interpreter has no shared-memory or register limits, so a module can accept inputs
whose kernels then fail on the GPU (``OutOfResources: shared memory``). This check walks the
whole accepted domain of every generated module (groups, draft lengths, batch sizes at every
table-row boundary, both entry points and every page size, int32 and int64 index tensors),
asks the module which kernels it would launch there (``launch_params``, the function its
launcher calls), dedupes those launches into distinct compile variants, compiles each once
for the real target with Triton's offline compiler (ptxas and the AMD backend ship in the
wheel), and checks shared memory / LDS, registers and spills against the target's limits.

Compiles run in worker processes started without ``TRITON_INTERPRET`` (``@triton.jit`` reads
it at import) and are cached on disk, keyed by the Triton version, the target, the kernel's
source hash, its constexprs, signature and compile options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from kgen.errors import KgenError

# Bumped when what a cached result holds changes, so old cache entries are not reused.
CACHE_FORMAT = 1
# Largest batch the domain walks: table rows end at 2**30, but past the last row boundary
# the launch no longer changes with the batch.
BATCH_CAP = 512
# ptxas spill bytes a thread above which an NVIDIA variant fails (below it is only reported).
NVIDIA_SPILL_LIMIT = 2048


@dataclasses.dataclass(frozen=True)
class Arch:
    """One compile target and the limits a launch on it must respect."""

    name: str
    backend: str  # "cuda" | "hip"
    target_arch: int | str  # GPUTarget's arch: 90 or "gfx950"
    warp_size: int
    num_sms: int  # a realistic multiprocessor / compute-unit count: it decides the split grid
    shared_limit: int  # bytes of shared memory (LDS on AMD) one block may use
    kv_dtypes: tuple[str, ...]  # KV dtypes this arch stores natively


_KV16 = ("bfloat16", "float16")
ARCHS: dict[str, Arch] = {
    "sm_80": Arch("sm_80", "cuda", 80, 32, 108, 166912, _KV16),
    "sm_89": Arch("sm_89", "cuda", 89, 32, 128, 101376, (*_KV16, "float8_e4m3fn")),
    "sm_90": Arch("sm_90", "cuda", 90, 32, 132, 232448, (*_KV16, "float8_e4m3fn")),
    "sm_100": Arch("sm_100", "cuda", 100, 32, 148, 232448, (*_KV16, "float8_e4m3fn")),
    "gfx942": Arch("gfx942", "hip", "gfx942", 64, 304, 65536, (*_KV16, "float8_e4m3fnuz")),
    "gfx950": Arch("gfx950", "hip", "gfx950", 64, 256, 163840, (*_KV16, "float8_e4m3fn")),
}
_KV_REFUSAL = {
    "float8_e4m3fn": "no e4m3 on this arch (Ampere has no FP8; CDNA3 stores float8_e4m3fnuz)",
    "float8_e4m3fnuz": "float8_e4m3fnuz is a ROCm CDNA3 format (NVIDIA and gfx950 store OCP float8_e4m3fn)",
}

# Triton type names of torch dtypes as they appear in a kernel signature.
_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8e4nv",
                 "float8_e4m3fnuz": "fp8e4b8", "int32": "i32", "int64": "i64"}
INDEX_DTYPES = ("int32", "int64")
COLLAPSIBLE_AXES = ("group", "page_size", "index_dtype")

# Kernel parameter names and the Triton type they take. Query-side tensors are in the module's
# query dtype, the KV pools in its KV dtype; index tensors take the domain's index dtype.
_Q_POINTERS = frozenset({"Q", "K_Extend", "V_Extend", "O"})
_KV_POINTERS = frozenset({"K_Buffer", "V_Buffer"})
_INDEX_POINTER = re.compile(r"^[A-Z]\w*_(Indptr|Indices|Bounds|Table|Lens|Counters)$")
_FP32_POINTER = re.compile(r"^Partial_\w+$")
_FP32_SCALARS = frozenset({"qk_scale", "sm_scale"})
_SCALE_ARGS = frozenset({"k_scale", "v_scale"})
_I64_SCALAR = re.compile(r"(^|_)(offset|offsets|elem_offset|base)$")
_I32_SCALAR = re.compile(r"^(stride_\w+|max_splits|num_\w+|\w+_len|\w+_size)$")


class CheckError(KgenError):
    """The check could not be set up (bad arguments, a kernel parameter it cannot type)."""


# ---------------------------------------------------------------------------------------
# Modules and what they launch
# ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _compile_environment() -> Iterator[None]:
    """Import generated modules as a GPU process would: no interpreter, PDL at its default.

    The module reads TRITON_INTERPRET (its dot dtype) and KGEN_NO_PDL at import and
    @triton.jit picks the interpreter from TRITON_INTERPRET at decoration time.
    """
    saved = {name: os.environ.pop(name) for name in ("TRITON_INTERPRET", "KGEN_NO_PDL") if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def load_module_file(path: Path) -> ModuleType:
    """A private copy of a generated module, imported with the compile environment."""
    path = Path(path).resolve()
    name = "kgen_check_" + hashlib.sha1(str(path).encode()).hexdigest()[:12] + "_" + path.stem
    cached = sys.modules.get(name)
    if cached is not None:
        return cached
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CheckError(f"cannot import generated module {path}")
    module = importlib.util.module_from_spec(spec)
    with _compile_environment():
        spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _torch_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    path: Path
    uri: str
    layout: str
    variant: str
    kv_dtype: str
    q_dtype: str


def find_modules(generated: Path | None = None, layouts: Iterable[str] = (), kv_dtypes: Iterable[str] = (),
                 q_dtypes: Iterable[str] = (), variants: Iterable[str] = ()) -> list[ModuleInfo]:
    """The generated modules (``generated/verify*.py``), optionally only some layouts / dtypes / variants."""
    from kgen.loader import generated_dir
    from kgen.spec import KV_DTYPES, Q_DTYPES, canonical_dtype

    directory = Path(generated) if generated else generated_dir()
    wanted_layouts = set(layouts)
    wanted_kv = {canonical_dtype(d, KV_DTYPES, "KV") for d in kv_dtypes}
    wanted_q = {canonical_dtype(d, Q_DTYPES, "query") for d in q_dtypes}
    wanted_variants = set(variants)
    found = []
    for path in sorted(directory.glob("verify*.py")):
        module = load_module_file(path)
        info = ModuleInfo(path, module.URI, module.LAYOUT, module.VARIANT, _torch_name(module.KV_DTYPE),
                          _torch_name(module.Q_DTYPE))
        if ((not wanted_layouts or info.layout in wanted_layouts) and (not wanted_kv or info.kv_dtype in wanted_kv)
                and (not wanted_q or info.q_dtype in wanted_q)
                and (not wanted_variants or info.variant in wanted_variants)):
            found.append(info)
    if wanted_layouts - {m.layout for m in found}:
        raise CheckError(f"no generated module for layout(s) {sorted(wanted_layouts - {m.layout for m in found})} "
                         f"in {directory} (see `kgen list`; run `kgen build`)")
    if not found:
        raise CheckError(f"no generated modules match in {directory}: run `kgen build`")
    return found


def _launch_params_shim(module: ModuleType) -> Callable[..., list[tuple[str, dict, dict]]]:
    """``launch_params`` for modules generated before they carried it: the same decisions as
    their ``_run``, from ``select_config`` / ``_rows`` / ``_max_splits``, for one KV head."""

    def launch_params(arch: str, num_sms: int, group: int, batch: int, max_len: int,
                      page_size: int | None = None, config: dict | None = None) -> list[tuple[str, dict, dict]]:
        config = config if config is not None else module.select_config(arch, group, batch)
        block_h, l_pad = module._rows(config["block_h"], group, max_len, config.get("min_rows"))
        head_programs = module._cdiv(group, block_h)
        max_splits, min_tokens = module._max_splits(config, head_programs * batch, num_sms)
        is_rocm = arch.startswith("gfx")
        knobs = module._backend_knobs(config, is_rocm)
        use_pdl = bool(module._launch_options(arch, is_rocm))
        paged = page_size is not None
        prefix = {"GROUP": group, "BLOCK_H": block_h, "L_PAD": l_pad, "DRAFT_N": max(module.MIN_DOT_ROWS, l_pad),
                  "BLOCK_N": config["block_n"], "MIN_TOKENS_PER_SPLIT": min_tokens, "PAGE_SIZE": page_size or 1,
                  "BLOCK_TABLE": paged, "SCALES_ON_DEVICE": False, "DOT_DTYPE": module._TL_PREFIX_DOT_DTYPE,
                  "LAZY_RESCALE": bool(config.get("lazy_rescale")), "USE_PDL": use_pdl}
        if hasattr(module, "_draft_first"):
            prefix["DRAFT_FIRST"] = module._draft_first(config, block_h * l_pad)
        names = module._verify_prefix_stage.arg_names
        launches = [("_verify_prefix_stage", {k: v for k, v in prefix.items() if k in names},
                     {"num_warps": config["num_warps"], "num_stages": config["num_stages"], **knobs})]
        if max_splits > 1:
            merge = {"MERGE_HEADS": module._merge_heads(group, l_pad), "L_PAD": l_pad,
                     "SPLIT_CHUNK": min(module._next_pow2(max_splits), module.MERGE_SPLIT_CHUNK),
                     "BLOCK_N": config["block_n"], "MIN_TOKENS_PER_SPLIT": min_tokens, "BLOCK_TABLE": paged,
                     "USE_PDL": use_pdl}
            launches.append(("_verify_merge_stage", merge, {"num_warps": 4, "num_stages": 2, **knobs}))
        return launches

    return launch_params


def module_launch_params(module: ModuleType) -> Callable[..., list[tuple[str, dict, dict]]]:
    fn = getattr(module, "launch_params", None)
    return fn if fn is not None else _launch_params_shim(module)


def module_checked_archs(module: ModuleType) -> tuple[str, ...]:
    return tuple(getattr(module, "CHECKED_ARCHS", ARCHS))


# ---------------------------------------------------------------------------------------
# The domain
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Point:
    """One input the module accepts, as far as the kernels it launches can tell."""

    group: int
    draft: int
    batch: int
    page_size: int | None  # None: the token-slot entry (verify_shared_kv_fwd)
    index_dtype: str
    from_table: bool  # the launch uses a shipped table row, not the default config


def unlisted_group(module: ModuleType, arch: str) -> int:
    """A group the layout does not list, chosen to land on a row blocking the listed groups don't."""
    listed = set(module.GROUP_SIZES)
    top = max(listed)

    def blockings(group: int) -> set[tuple[int, int]]:
        config = module.select_config(arch, group, 1)
        return {module._rows(config["block_h"], group, draft, config.get("min_rows"))
                for draft in range(1, module.MAX_DRAFT_TOKENS + 1)}

    seen = set().union(*(blockings(g) for g in listed))
    candidates = [c for c in (2 * top, 12, 2, 32, 6, 24, 1) if c not in listed]
    for candidate in candidates:
        if blockings(candidate) - seen:
            return candidate
    return candidates[0]


def domain_batches(module: ModuleType, arch: str) -> list[int]:
    """Batch sizes at every table row's boundaries for this arch (capped), and the default's."""
    batches = {1, BATCH_CAP}
    for _group, batch_min, batch_max, _config in module._BLOCK_CONFIGS.get(arch, ()):
        for b in (batch_min - 1, batch_min, batch_max, batch_max + 1):
            if 1 <= b <= BATCH_CAP:
                batches.add(b)
    return sorted(batches)


def domain(module: ModuleType, arch: str) -> Iterator[Point]:
    groups = [*module.GROUP_SIZES, unlisted_group(module, arch)]
    entries: list[int | None] = [None, *module.SUPPORTED_PAGE_SIZES]
    for group, batch in itertools.product(groups, domain_batches(module, arch)):
        from_table = module.select_config(arch, group, batch) is not module._DEFAULT_CONFIG
        for draft, page_size, index_dtype in itertools.product(range(1, module.MAX_DRAFT_TOKENS + 1), entries,
                                                               INDEX_DTYPES):  # index dtype innermost
            yield Point(group, draft, batch, page_size, index_dtype, from_table)


def kernel_signature(module: ModuleType, kernel_name: str, constexprs: dict[str, Any],
                     index_dtype: str) -> dict[str, str]:
    """Triton types of a kernel's parameters, from their names (constexprs from the launch)."""
    kernel = getattr(module, kernel_name)
    q_type = "*" + _TRITON_TYPES[_torch_name(module.Q_DTYPE)]
    kv_type = "*" + _TRITON_TYPES[_torch_name(module.KV_DTYPE)]
    scales_on_device = any(v is True for k, v in constexprs.items() if "SCALES_ON_DEVICE" in k)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _Q_POINTERS:
            signature[name] = q_type
        elif name in _KV_POINTERS:
            signature[name] = kv_type
        elif _INDEX_POINTER.match(name):
            signature[name] = "*" + _TRITON_TYPES[index_dtype]
        elif _FP32_POINTER.match(name):
            signature[name] = "*fp32"
        elif name in _FP32_SCALARS:
            signature[name] = "fp32"
        elif name in _SCALE_ARGS:
            signature[name] = "*fp32" if scales_on_device else "fp32"
        elif _I64_SCALAR.search(name):
            signature[name] = "i64"
        elif _I32_SCALAR.match(name):
            signature[name] = "i32"
        else:
            raise CheckError(f"{module.URI}.{kernel_name}: parameter {name!r} has no known type; teach "
                             "kgen/check.py (kernel_signature) what it is before checking this module")
    missing = set(constexprs) - set(kernel.arg_names)
    if missing:
        raise CheckError(f"{module.URI}: launch_params names constexprs {sorted(missing)} that "
                         f"{kernel_name} does not take")
    return signature


def divisible_args(signature: dict[str, str]) -> list[str]:
    """Arguments the JIT would mark 16-divisible for real engine tensors: pointers and the
    strides of contiguous tensors (a block table's row stride is the engine's max pages per
    request, arbitrary, so it is left unmarked)."""
    return [n for n, t in signature.items()
            if t.startswith("*") or (n.startswith("stride_") and n != "stride_table")]


def _encode(value: Any) -> Any:
    """Constexpr values as JSON: tl.dtype objects become {"dtype": "bf16"}."""
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"dtype": str(value)}
    return value


def _decode(value: Any) -> Any:
    import triton.language as tl

    if isinstance(value, dict) and set(value) == {"dtype"}:
        return tl.dtype(value["dtype"])
    return value


@dataclasses.dataclass
class Variant:
    """One distinct compile: a kernel with its constexprs, signature and options on one target."""

    key: str
    module: str  # uri
    module_path: str
    kernel: str
    arch: str
    constexprs: dict[str, Any]  # JSON-encoded values
    options: dict[str, Any]
    signature: dict[str, str]
    divisible: list[str]
    points: list[Point] = dataclasses.field(default_factory=list)
    represented: int = 0  # domain points folded in by --collapse (compiled through a representative)
    modules: set[str] = dataclasses.field(default_factory=set)  # every module launching this exact compile

    @property
    def from_table(self) -> bool:
        return any(p.from_table for p in self.points)


@dataclasses.dataclass
class Refusal:
    module: str
    arch: str
    reason: str


@dataclasses.dataclass
class Enumeration:
    variants: list[Variant]
    refused: list[Refusal]
    points: Counter  # (module, arch) -> domain points walked
    launches: Counter  # arch -> kernel launches before dedupe
    axis_multipliers: dict[str, dict[str, float]]  # arch -> axis -> variants / variants without that axis


def _variant_key(arch: str, kernel_hash: str, constexprs: dict, signature: dict, options: dict,
                 divisible: list[str]) -> str:
    import triton

    blob = json.dumps({"format": CACHE_FORMAT, "triton": triton.__version__, "arch": arch, "kernel": kernel_hash,
                       "constexprs": constexprs, "signature": signature, "options": options, "divisible": divisible},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _collapse_class(constexprs: dict, signature: dict, axes: set[str]) -> tuple:
    """The variant with the collapsed axes taken out (its representative stands for all)."""
    c = {k: v for k, v in constexprs.items()
         if not ((k == "GROUP" and "group" in axes) or (k == "PAGE_SIZE" and "page_size" in axes))}
    s = {k: ("*idx" if "index_dtype" in axes and k in signature and _INDEX_POINTER.match(k) else v)
         for k, v in signature.items()}
    return json.dumps(c, sort_keys=True), json.dumps(s, sort_keys=True)


def _rep_rank(constexprs: dict, signature: dict) -> tuple:
    """Representative of a collapsed class: the largest group, page size and index dtype."""
    wide = sum(t == "*i64" for t in signature.values())
    return constexprs.get("GROUP", 0), constexprs.get("PAGE_SIZE", 0), wide


def _distinct_launch(info: ModuleInfo, module: ModuleType, arch_name: str, kernel_name: str, constexprs: dict,
                 options: dict, index_dtype: str, kernel_hashes: dict[str, str], by_key: dict[str, Variant],
                 proj: dict[str, set], reps: dict[tuple, str], axes: set[str]) -> Variant:
    """The Variant of one distinct launch (shared with other modules' identical compiles)."""
    if kernel_name not in kernel_hashes:
        kernel_hashes[kernel_name] = getattr(module, kernel_name).cache_key
    signature = kernel_signature(module, kernel_name, constexprs, index_dtype)
    encoded = {k: _encode(v) for k, v in constexprs.items()}
    divisible = divisible_args(signature)
    key = _variant_key(arch_name, kernel_hashes[kernel_name], encoded, signature, options, divisible)
    base = (info.layout, info.variant, info.kv_dtype, kernel_name, json.dumps(options, sort_keys=True))
    cx, sg = json.dumps(encoded, sort_keys=True), json.dumps(signature, sort_keys=True)
    proj["all"].add((*base, info.q_dtype, cx, sg))
    for axis in COLLAPSIBLE_AXES:
        proj[axis].add((*base, info.q_dtype, *_collapse_class(encoded, signature, {axis})))
    proj["q_dtype"].add((*base, cx, sg.replace(f'"*{_TRITON_TYPES[info.q_dtype]}"', '"*q"')))
    variant = by_key.get(key)
    if variant is None:
        variant = by_key[key] = Variant(key, info.uri, str(info.path), kernel_name, arch_name, encoded,
                                        dict(options), signature, divisible)
    variant.modules.add(info.uri)
    if axes:
        cls = (info.uri, arch_name, kernel_name, json.dumps(options, sort_keys=True),
               *_collapse_class(encoded, signature, axes))
        best = reps.get(cls)
        if best is None or _rep_rank(encoded, signature) > _rep_rank(by_key[best].constexprs, by_key[best].signature):
            reps[cls] = key
    return variant


def enumerate_variants(modules: list[ModuleInfo], archs: list[str], collapse: Iterable[str] = (),
                       launch_params_for: Callable[[ModuleType], Callable] | None = None) -> Enumeration:
    """Walk every module's domain on every arch it accepts and dedupe what it launches."""
    axes = set(collapse)
    unknown = axes - set(COLLAPSIBLE_AXES)
    if unknown:
        raise CheckError(f"--collapse {sorted(unknown)}: collapsible axes are {', '.join(COLLAPSIBLE_AXES)}")
    by_key: dict[str, Variant] = {}
    refused: list[Refusal] = []
    points: Counter = Counter()
    launches: Counter = Counter()
    reps: dict[tuple, str] = {}
    # For the multipliers: distinct variants with each axis removed, per arch.
    projections: dict[str, dict[str, set]] = {}
    for info in modules:
        module = load_module_file(info.path)
        params = (launch_params_for or module_launch_params)(module)
        accepted = module_checked_archs(module)
        kernel_hashes: dict[str, str] = {}
        for arch_name in archs:
            arch = ARCHS[arch_name]
            if arch_name not in accepted:
                refused.append(Refusal(info.uri, arch_name, f"the module's CHECKED_ARCHS {list(accepted)} "
                                       "do not include it"))
                continue
            if info.kv_dtype not in arch.kv_dtypes:
                refused.append(Refusal(info.uri, arch_name, _KV_REFUSAL.get(info.kv_dtype, "KV dtype not stored")))
                continue
            proj = projections.setdefault(arch_name, {a: set() for a in ("all", *COLLAPSIBLE_AXES, "q_dtype")})
            # Launches repeat across the domain: the full typing and hashing runs once per distinct one.
            seen: dict[tuple, Variant] = {}
            for point in domain(module, arch_name):
                points[(info.uri, arch_name)] += 1
                if point.index_dtype == INDEX_DTYPES[0]:  # launch_params does not see tensors' dtypes
                    planned = params(arch_name, arch.num_sms, point.group, point.batch, point.draft, point.page_size)
                for kernel_name, constexprs, options in planned:
                    launches[arch_name] += 1
                    fast = (kernel_name, point.index_dtype, tuple((k, str(v)) for k, v in constexprs.items()),
                            tuple(options.items()))
                    variant = seen.get(fast)
                    if variant is None:
                        variant = seen[fast] = _distinct_launch(info, module, arch_name, kernel_name, constexprs,
                                                                options, point.index_dtype, kernel_hashes, by_key,
                                                                proj, reps, axes)
                    variant.points.append(point)

    variants = list(by_key.values())
    if axes:
        variants = _fold_collapsed(by_key, reps, axes)
    multipliers = {arch: {axis: len(sets["all"]) / max(1, len(sets[axis])) for axis in sets if axis != "all"}
                   for arch, sets in projections.items()}
    return Enumeration(variants, refused, points, launches, multipliers)


def _fold_collapsed(by_key: dict[str, Variant], reps: dict[tuple, str], axes: set[str]) -> list[Variant]:
    kept = {key: dataclasses.replace(by_key[key], points=list(by_key[key].points)) for key in reps.values()}
    for variant in by_key.values():
        cls = (variant.module, variant.arch, variant.kernel, json.dumps(variant.options, sort_keys=True),
               *_collapse_class(variant.constexprs, variant.signature, axes))
        rep = kept[reps[cls]]
        if variant.key != rep.key:
            rep.points.extend(variant.points)
            rep.modules |= variant.modules
            rep.represented += len(variant.points)
    return list(kept.values())


# ---------------------------------------------------------------------------------------
# Compiling and reading resources
# ---------------------------------------------------------------------------------------

_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_AMDGCN_FIELD = re.compile(r"^\s*-?\s*\.(vgpr_count|sgpr_count|agpr_count|vgpr_spill_count|sgpr_spill_count"
                           r"|group_segment_fixed_size|private_segment_fixed_size):\s+(\d+)", re.M)
_MFMA = re.compile(r"\b(v_mfma_\w+|v_smfmac_\w+)")
_NVIDIA_MMA = re.compile(r"\b(HGMMA|QGMMA|HMMA|IMMA|UTC\w*MMA)\b")


def parse_ptxas_log(text: str) -> dict[str, int]:
    """Registers, spill stores/loads and stack bytes a thread from ``ptxas -v`` (worst function)."""
    out = {"registers": 0, "stack_bytes": 0, "spill_stores": 0, "spill_loads": 0}
    for m in _PTXAS_SPILL.finditer(text):
        out["stack_bytes"] = max(out["stack_bytes"], int(m.group(1)))
        out["spill_stores"] = max(out["spill_stores"], int(m.group(2)))
        out["spill_loads"] = max(out["spill_loads"], int(m.group(3)))
    regs = [int(m.group(1)) for m in _PTXAS_REGS.finditer(text)]
    if not regs:
        raise ValueError("no 'Used N registers' line in the ptxas log")
    out["registers"] = max(regs)
    return out


def parse_amdgcn(text: str) -> dict[str, Any]:
    """VGPR/SGPR/AGPR counts and spills from the amdgcn metadata, and the MFMA instructions used."""
    fields: dict[str, int] = {}
    for m in _AMDGCN_FIELD.finditer(text):
        fields[m.group(1)] = max(fields.get(m.group(1), 0), int(m.group(2)))
    if "vgpr_count" not in fields:
        raise ValueError("no .vgpr_count in the amdgcn metadata")
    return {"vgprs": fields["vgpr_count"], "sgprs": fields.get("sgpr_count", 0), "agprs": fields.get("agpr_count", 0),
            "vgpr_spills": fields.get("vgpr_spill_count", 0), "sgpr_spills": fields.get("sgpr_spill_count", 0),
            "scratch_bytes": fields.get("private_segment_fixed_size", 0),
            "mma": dict(sorted(Counter(_MFMA.findall(text)).items()))}


def count_nvidia_mma(sass: str) -> dict[str, int]:
    """Tensor-core instructions in SASS (HGMMA/QGMMA on Hopper, HMMA, tcgen05's UTC*MMA)."""
    return dict(sorted(Counter(_NVIDIA_MMA.findall(sass)).items()))


_WORKER_MODULES: dict[str, ModuleType] = {}


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("KGEN_NO_PDL", None)


def compile_variant(job: dict[str, Any]) -> dict[str, Any]:
    """Compile one variant for its target and read its resources (runs in a worker process)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    started = time.perf_counter()
    arch = ARCHS[job["arch"]]
    try:
        module = _WORKER_MODULES.get(job["module_path"])
        if module is None:
            module = _WORKER_MODULES[job["module_path"]] = load_module_file(Path(job["module_path"]))
        kernel = getattr(module, job["kernel"])
        names = kernel.arg_names
        constexprs = {(names.index(k),): _decode(v) for k, v in job["constexprs"].items()}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in job["divisible"]}
        source = ASTSource(fn=kernel, signature=dict(job["signature"]), constexprs=constexprs, attrs=attrs)
        target = GPUTarget(arch.backend, arch.target_arch, arch.warp_size)
        log = io.StringIO()
        with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope():
            triton.knobs.compilation.always_compile = True  # our cache decides; Triton's would hide the ptxas log
            triton.knobs.nvidia.dump_ptxas_log = True  # the -v log of Triton's own ptxas run, printed to stdout
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(source, target=target, options=dict(job["options"]))
        result: dict[str, Any] = {"shared": int(compiled.metadata.shared)}
        if arch.backend == "cuda":
            result.update(parse_ptxas_log(log.getvalue()))
            result["mma"] = count_nvidia_mma(_nvdisasm(compiled.asm["cubin"]))
        else:
            result.update(parse_amdgcn(compiled.asm["amdgcn"]))
        result["error"] = None
    except Exception as exc:  # a compile error is a finding, reported with the variant
        result = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    result["compile_s"] = round(time.perf_counter() - started, 3)
    return result


def _nvdisasm(cubin: bytes) -> str:
    import triton

    nvdisasm = triton.knobs.nvidia.nvdisasm.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout


def _job(variant: Variant) -> dict[str, Any]:
    return {"arch": variant.arch, "module_path": variant.module_path, "kernel": variant.kernel,
            "constexprs": variant.constexprs, "options": variant.options, "signature": variant.signature,
            "divisible": variant.divisible}


def cache_dir() -> Path:
    env = os.environ.get("KGEN_CHECK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kgen" / "check"


class ResultCache:
    """Compile results on disk, one JSON file per variant key."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def get(self, key: str) -> dict | None:
        if self.root is None:
            return None
        path = self.root / key[:2] / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, result: dict) -> None:
        if self.root is None or result.get("error"):
            return  # errors are recompiled: they may come from the environment
        path = self.root / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result, sort_keys=True))
        tmp.replace(path)


def compile_all(variants: list[Variant], archs: list[str], jobs: int, cache: ResultCache,
                progress: bool = True) -> tuple[dict[str, dict], dict[str, dict]]:
    """Results by variant key, and per arch: distinct variants, compiled, cached, wall seconds."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from tqdm import tqdm

    results: dict[str, dict] = {}
    timing: dict[str, dict] = {}
    todo_by_arch: dict[str, list[Variant]] = {a: [] for a in archs}
    for variant in variants:
        hit = cache.get(variant.key)
        if hit is not None:
            results[variant.key] = {**hit, "cached": True}
        else:
            todo_by_arch[variant.arch].append(variant)
    total = sum(len(v) for v in todo_by_arch.values())
    bar = tqdm(total=total, desc="kgen check", unit="variant", disable=not progress or total == 0)
    pool = None
    try:
        if total:
            with _compile_environment():  # spawned workers inherit the environment at start
                pool = ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_worker_init)
                list(pool.map(_worker_init_probe, range(max(1, jobs))))
        for arch in archs:
            todo = todo_by_arch[arch]
            started = time.perf_counter()
            bar.set_postfix_str(arch)
            # Most expensive first, so the last compiles of an arch do not run alone.
            todo.sort(key=lambda v: -int(v.constexprs.get("BLOCK_N", 0) or 0))
            futures = {pool.submit(compile_variant, _job(v)): v for v in todo} if todo else {}
            for future in as_completed(futures):
                variant = futures[future]
                result = future.result()
                cache.put(variant.key, result)
                results[variant.key] = {**result, "cached": False}
                bar.update(1)
            distinct = sum(1 for v in variants if v.arch == arch)
            timing[arch] = {"variants": distinct, "compiled": len(todo), "cached": distinct - len(todo),
                            "wall_s": round(time.perf_counter() - started, 1)}
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown()
    return results, timing


def _worker_init_probe(_: int) -> int:
    return os.getpid()


# ---------------------------------------------------------------------------------------
# Verdicts and reports
# ---------------------------------------------------------------------------------------

def _ranges(values: Iterable[int]) -> str:
    """1,2,3,5 -> '1-3,5'."""
    out, run = [], []
    for v in sorted(set(values)):
        if run and v == run[-1] + 1:
            run.append(v)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [v]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def describe_points(points: list[Point]) -> dict[str, str]:
    pages = sorted({p.page_size for p in points if p.page_size is not None})
    entries = (["token-slot"] if any(p.page_size is None for p in points) else []) + (
        [f"paged {','.join(map(str, pages))}"] if pages else [])
    return {"groups": _ranges(p.group for p in points), "draft": _ranges(p.draft for p in points),
            "batch": _ranges(p.batch for p in points), "entry": "; ".join(entries),
            "index": ",".join(sorted({p.index_dtype for p in points})),
            "config": "/".join(x for x, on in (("table", any(p.from_table for p in points)),
                                                ("default", any(not p.from_table for p in points))) if on)}


def verdict(variant: Variant, result: dict) -> list[str]:
    """What is wrong with a compiled variant ([] when it fits its target)."""
    arch = ARCHS[variant.arch]
    problems = []
    if result.get("error"):
        return [f"compile error: {result['error']}"]
    if result["shared"] > arch.shared_limit:
        what = "LDS" if arch.backend == "hip" else "shared memory"
        problems.append(f"{what} {result['shared']} B > {arch.shared_limit} B limit "
                        f"(over by {result['shared'] - arch.shared_limit})")
    if arch.backend == "hip":
        spills = result["vgpr_spills"] + result["sgpr_spills"]
        if spills and variant.from_table:
            problems.append(f"a shipped table row spills on {arch.name}: {result['vgpr_spills']} VGPRs, "
                            f"{result['sgpr_spills']} SGPRs")
    elif result["spill_stores"] > NVIDIA_SPILL_LIMIT:
        problems.append(f"spills {result['spill_stores']} B a thread > {NVIDIA_SPILL_LIMIT} B")
    return problems


def spill_note(variant: Variant, result: dict) -> str:
    if result.get("error"):
        return ""
    if ARCHS[variant.arch].backend == "hip":
        v, s = result["vgpr_spills"], result["sgpr_spills"]
        return f"{v} VGPR / {s} SGPR spills" if v or s else ""
    return f"{result['spill_stores']} B spill stores" if result["spill_stores"] else ""


def _config_text(variant: Variant) -> str:
    cx = ", ".join(f"{k}={v['dtype'] if isinstance(v, dict) else v}" for k, v in variant.constexprs.items())
    opts = ", ".join(f"{k}={v}" for k, v in variant.options.items())
    idx = sorted({t for n, t in variant.signature.items() if _INDEX_POINTER.match(n)})
    return f"{cx}; {opts}; index {'/'.join(idx)}"


@dataclasses.dataclass
class CheckReport:
    enumeration: Enumeration
    results: dict[str, dict]
    timing: dict[str, dict]
    archs: list[str]
    collapse: list[str]

    def rows(self) -> list[dict]:
        rows = []
        for v in self.enumeration.variants:
            r = self.results.get(v.key, {"error": "not compiled"})
            rows.append({"module": v.module, "modules": sorted(v.modules), "arch": v.arch, "kernel": v.kernel,
                         "constexprs": v.constexprs,
                         "options": v.options, "signature": v.signature, "key": v.key,
                         "domain": describe_points(v.points), "points": len(v.points),
                         "represented": v.represented, "from_table": v.from_table, "result": r,
                         "problems": verdict(v, r), "spills": spill_note(v, r)})
        return rows

    def failures(self) -> list[dict]:
        return [r for r in self.rows() if r["problems"]]


def summarize(report: CheckReport) -> list[dict]:
    """One line per module x arch with the worst numbers."""
    by: dict[tuple[str, str], list[dict]] = {}
    for row in report.rows():
        by.setdefault((row["module"], row["arch"]), []).append(row)
    out = []
    for (module, arch), rows in sorted(by.items()):
        ok = [r["result"] for r in rows if not r["result"].get("error")]
        hip = ARCHS[arch].backend == "hip"
        out.append({
            "module": module, "arch": arch, "variants": len(rows),
            "shared": max((r["shared"] for r in ok), default=0), "limit": ARCHS[arch].shared_limit,
            "regs": max((r["vgprs" if hip else "registers"] for r in ok), default=0),
            "spills": max((r["vgpr_spills"] + r["sgpr_spills"] if hip else r["spill_stores"] for r in ok), default=0),
            "failing": sum(1 for r in rows if r["problems"]),
        })
    return out


def format_table(report: CheckReport, verbose: bool = False) -> str:
    lines = []
    if verbose:
        head = f"{'module':48s} {'arch':7s} {'kernel':21s} {'shared':>7s} {'regs':>5s} {'spill':>14s}  domain / config"
        lines += [head, "-" * len(head)]
        for r in sorted(report.rows(), key=lambda r: (r["arch"], r["module"], r["kernel"], r["key"])):
            res = r["result"]
            regs = res.get("vgprs", res.get("registers", "-"))
            d = r["domain"]
            status = "  FAIL: " + "; ".join(r["problems"]) if r["problems"] else ""
            lines.append(f"{r['module']:48s} {r['arch']:7s} {r['kernel']:21s} {res.get('shared', '-'):>7} "
                         f"{regs:>5} {r['spills'] or '-':>14s}  group {d['groups']} draft {d['draft']} batch "
                         f"{d['batch']} {d['entry']} [{d['config']}]{status}")
    else:
        head = (f"{'module':48s} {'arch':7s} {'variants':>8s} {'max shared':>10s} {'limit':>7s} "
                f"{'max regs':>8s} {'max spill':>9s}  status")
        lines += [head, "-" * len(head)]
        for s in summarize(report):
            status = f"FAIL ({s['failing']})" if s["failing"] else "ok"
            lines.append(f"{s['module']:48s} {s['arch']:7s} {s['variants']:8d} {s['shared']:10d} {s['limit']:7d} "
                         f"{s['regs']:8d} {s['spills']:9d}  {status}")
    return "\n".join(lines)


def format_failures(report: CheckReport) -> str:
    lines = []
    for r in report.failures():
        d = r["domain"]
        v = next(x for x in report.enumeration.variants if x.key == r["key"])
        lines.append(f"FAIL {r['module']} {r['arch']} {r['kernel']}: {'; '.join(r['problems'])}\n"
                     f"     at group {d['groups']}, draft length {d['draft']}, batch {d['batch']}, {d['entry']}, "
                     f"index {d['index']}, {d['config']} config\n"
                     f"     {_config_text(v)}")
    return "\n".join(lines)


def to_json(report: CheckReport) -> dict:
    e = report.enumeration
    return {
        "archs": report.archs, "collapse": report.collapse, "timing": report.timing,
        "limits": {a: ARCHS[a].shared_limit for a in report.archs},
        "refused": [dataclasses.asdict(r) for r in e.refused],
        "domain_points": sum(e.points.values()), "launches": dict(e.launches),
        "axis_multipliers": e.axis_multipliers,
        "variants": report.rows(),
        "failures": len(report.failures()),
    }


def format_markdown(report: CheckReport) -> str:
    e = report.enumeration
    out = ["# kgen check", ""]
    if report.collapse:
        out += [f"Collapsed axes (each class compiled once, through its largest value): "
                f"{', '.join(report.collapse)}.", ""]
    out += ["| arch | distinct variants | compiled | cached | wall s | launches walked | failing |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fails = Counter(r["arch"] for r in report.failures())
    for arch in report.archs:
        t = report.timing.get(arch, {})
        out.append(f"| {arch} | {t.get('variants', 0)} | {t.get('compiled', 0)} | {t.get('cached', 0)} | "
                   f"{t.get('wall_s', 0)} | {e.launches.get(arch, 0)} | {fails.get(arch, 0)} |")
    out += ["", "## Module x arch (worst numbers)", "",
            "| module | arch | variants | max shared B | limit B | max regs (VGPRs on AMD) | max spill | status |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for s in summarize(report):
        out.append(f"| {s['module']} | {s['arch']} | {s['variants']} | {s['shared']} | {s['limit']} | {s['regs']} "
                   f"| {s['spills']} | {'FAIL' if s['failing'] else 'ok'} |")
    failures = report.failures()
    out += ["", f"## Failures ({len(failures)})", ""]
    out += [f"- `{line}`" for line in format_failures(report).splitlines() if line.startswith("FAIL")] or ["none"]
    spills = [r for r in report.rows() if r["spills"] and not r["problems"]]
    out += ["", f"## Spills within the limits ({len(spills)})", ""]
    for r in spills:
        d = r["domain"]
        out.append(f"- {r['module']} {r['arch']} {r['kernel']}: {r['spills']} (group {d['groups']}, draft "
                   f"{d['draft']}, {d['config']} config)")
    if not spills:
        out.append("none")
    out += ["", "## Refused module x arch", ""]
    out += [f"- {r.module} on {r.arch}: {r.reason}" for r in e.refused] or ["none"]
    return "\n".join(out) + "\n"


def plan_check(archs: list[str], layouts: Iterable[str] = (), kv_dtypes: Iterable[str] = (),
               q_dtypes: Iterable[str] = (), variants: Iterable[str] = (), collapse: Iterable[str] = (),
               generated: Path | None = None,
               launch_params_for: Callable[[ModuleType], Callable] | None = None) -> Enumeration:
    """The distinct variants to compile (nothing is compiled)."""
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise CheckError(f"unknown arch {unknown}: kgen check knows {', '.join(ARCHS)}")
    modules = find_modules(generated, layouts, kv_dtypes, q_dtypes, variants)
    return enumerate_variants(modules, archs, collapse, launch_params_for)


def format_plan(enumeration: Enumeration, archs: list[str]) -> str:
    """Counts per arch and kernel, and how much each domain axis multiplies the variants."""
    counts = Counter((v.arch, v.kernel) for v in enumeration.variants)
    lines = [f"{'arch':7s} {'launches':>9s} {'variants':>8s}  per kernel; x multiplier of each axis"]
    for arch in archs:
        kernels = ", ".join(f"{k.strip('_')} {n}" for (a, k), n in sorted(counts.items()) if a == arch)
        mult = ", ".join(f"{axis} x{m:.2f}" for axis, m in enumeration.axis_multipliers.get(arch, {}).items())
        lines.append(f"{arch:7s} {enumeration.launches.get(arch, 0):9d} "
                     f"{sum(n for (a, _), n in counts.items() if a == arch):8d}  {kernels}; {mult}")
    lines.append(f"total {len(enumeration.variants)} distinct variants from {sum(enumeration.points.values())} "
                 f"domain points; {len(enumeration.refused)} module x arch refused")
    return "\n".join(lines)


def run_check(archs: list[str], layouts: Iterable[str] = (), kv_dtypes: Iterable[str] = (), jobs: int | None = None,
              collapse: Iterable[str] = (), use_cache: bool = True, progress: bool = True,
              generated: Path | None = None, q_dtypes: Iterable[str] = (), variants: Iterable[str] = (),
              launch_params_for: Callable[[ModuleType], Callable] | None = None) -> CheckReport:
    """Enumerate, compile (or read the cache) and judge every distinct variant."""
    enumeration = plan_check(archs, layouts, kv_dtypes, q_dtypes, variants, collapse, generated, launch_params_for)
    cache = ResultCache(cache_dir() if use_cache else None)
    results, timing = compile_all(enumeration.variants, archs, jobs or os.cpu_count() or 1, cache, progress)
    return CheckReport(enumeration, results, timing, list(archs), sorted(set(collapse)))
