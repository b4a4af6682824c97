"""``kgen check``: prove without a GPU that every kernel variant a module can launch fits its target.

Triton's interpreter has no shared-memory or register limits, so a module can accept inputs
whose kernels then fail on the GPU (``OutOfResources: shared memory``). This check walks the
whole accepted domain of every generated module (groups, draft lengths, batch sizes at every
table-row boundary, both entry points and every page size, chains and tree masks, int32 and
int64 index tensors),
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
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from kgen.blockconfig import tables_overridden
from kgen.errors import KgenError
from kgen.launcher import rules
from kgen.retable import apply_tables

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
    kv_dtypes: tuple[str, ...]  # KV dtypes this arch's matrix units take


# Multiprocessor (compute unit) counts of a shipping part per arch: A100, L40S, H100/H200,
# B200, MI300X, MI355X. The split grid and so the merge stage depend on them.
NUM_SMS = {"sm_80": 108, "sm_89": 128, "sm_90": 132, "sm_100": 148, "gfx942": 304, "gfx950": 256}


def _archs() -> dict[str, Arch]:
    """kgen/tables/targets.json (the limits the modules were built for) with the SM counts above."""
    from kgen.targets import read_targets

    archs = {}
    for name, t in read_targets().items():
        if name not in NUM_SMS:
            raise CheckError(f"kgen/tables/targets.json lists {name}, which kgen check has no SM count for: add it "
                             "to NUM_SMS in kgen/check.py")
        target_arch: int | str = int(name[3:]) if t.family == "cuda" else name
        archs[name] = Arch(name, t.family, target_arch, t.warp_size, NUM_SMS[name], t.shared_bytes,
                           ("bfloat16", "float16", *t.fp8))
    return archs


ARCHS: dict[str, Arch] = _archs()

# Triton type names of torch dtypes as they appear in a kernel signature.
_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8e4nv",
                 "float8_e4m3fnuz": "fp8e4b8", "float8_e5m2": "fp8e5", "int32": "i32", "int64": "i64"}
INDEX_DTYPES = ("int32", "int64")
# Axes the plan reports how much each multiplies the distinct variants by.
AXES = ("all", "index_dtype", "q_dtype", "runtime int specialization")

# Kernel parameter names and the Triton type they take. Query-side tensors are in the module's
# query dtype, the KV pools in its KV dtype; index tensors take the domain's index dtype.
_Q_POINTERS = frozenset({"Q", "K_Extend", "V_Extend", "Out"})
_KV_POINTERS = frozenset({"K_Buffer", "V_Buffer"})
_MASK_POINTERS = frozenset({"Custom_Mask"})  # read as bytes: the launcher views bool/int8 masks as uint8
_INDEX_POINTER = re.compile(r"^[A-Z]\w*_(Indptr|Indices|Bounds|Table|Lens|Counters)$")
_FP32_POINTER = re.compile(r"^Partial_\w+$")
_FP32_SCALARS = frozenset({"qk_scale", "sm_scale"})
_SCALE_ARGS = frozenset({"k_scale", "v_scale"})
_I64_SCALAR = re.compile(r"(^|_)(offset|offsets|elem_offset|base)$")
_I32_SCALAR = re.compile(r"^(stride_\w+|max_splits|min_tokens_per_split|tokens_per_split|slots_per_request"
                         r"|row_blocks|num_\w+|group|head_blocks|page_shift|block_n|\w+_len|\w+_size)$")


class CheckError(KgenError):
    """The check could not be set up (bad arguments, a kernel parameter it cannot type)."""


# ---------------------------------------------------------------------------------------
# Modules and what they launch
# ---------------------------------------------------------------------------------------

def _import_gluon() -> None:
    """Import Triton's Gluon (where this Triton has it) in the process's own environment.

    Gluon wraps triton.language's standard functions when it is first imported; in a process
    running the interpreter (the tests) those are interpreted functions, which it accepts only
    while TRITON_INTERPRET is set. A module with a Gluon prefix stage imported first in the
    compile environment would fail there."""
    with contextlib.suppress(ImportError):
        import triton.experimental.gluon  # noqa: F401


@contextlib.contextmanager
def _compile_environment() -> Iterator[None]:
    """Import generated modules as a GPU process would: no interpreter, PDL at its default.

    The module reads TRITON_INTERPRET (its dot dtype) and KGEN_NO_PDL at import and
    @triton.jit picks the interpreter from TRITON_INTERPRET at decoration time.
    """
    _import_gluon()
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
    variant: str  # grouped, per_head, or batch_invariant (the grouped kernel's batch-invariant mode)
    kv_dtype: str
    q_dtype: str


def find_modules(generated: Path | None = None, layouts: Iterable[str] = (), kv_dtypes: Iterable[str] = (),
                 q_dtypes: Iterable[str] = (), variants: Iterable[str] = ()) -> list[ModuleInfo]:
    """The generated modules (``generated/verify*.py``), optionally only some layouts / dtypes / variants
    (grouped, per_head, batch_invariant)."""
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
        kind = "batch_invariant" if getattr(module, "BATCH_INVARIANT", False) else module.VARIANT
        info = ModuleInfo(path, module.URI, module.LAYOUT, kind, _torch_name(module.KV_DTYPE),
                          _torch_name(module.Q_DTYPE))
        if tables_overridden():
            # The rows kgen.load would apply are the rows to prove (kgen/retable.py).
            apply_tables(module, info.layout, info.kv_dtype, info.q_dtype, module.VARIANT, kind == "batch_invariant")
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


def module_launch_params(module: ModuleType) -> Callable[..., list[tuple[str, dict, dict]]]:
    fn = getattr(module, "launch_params", None)
    if fn is None:
        raise CheckError(f"{module.URI} has no launch_params: it was generated by an older kgen; run `kgen build`")
    return fn


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
    mask: bool = False  # a call with a custom mask (a tree)


def unlisted_group(module: ModuleType, arch: str) -> int:
    """A group the layout does not list, chosen to launch constexprs (row blockings) the
    listed groups do not, when one of the candidates does."""
    listed = set(module.GROUP_SIZES)
    num_sms = ARCHS[arch].num_sms

    def launched(group: int) -> set[str]:
        return {json.dumps([name, {k: str(v) for k, v in c.items()}, o], sort_keys=True)
                for draft in range(1, module.MAX_DRAFT_TOKENS + 1)
                for name, c, o in module.launch_params(arch, num_sms, group, 1, draft)}

    seen = set().union(*(launched(g) for g in listed))
    candidates = [c for c in (2 * max(listed), 12, 2, 32, 6, 24, 1) if c not in listed]
    for candidate in candidates:
        if launched(candidate) - seen:
            return candidate
    return candidates[0]


def domain_batches(module: ModuleType, arch: str) -> list[int]:
    """Batch sizes at every table row's boundaries for this arch (capped), and the default's."""
    batches = {1, BATCH_CAP}
    for _group, batch_min, batch_max, _config in module.LAUNCHER.block_configs.get(arch, ()):
        for b in (batch_min - 1, batch_min, batch_max, batch_max + 1):
            if 1 <= b <= BATCH_CAP:
                batches.add(b)
    return sorted(batches)


ENTRIES = ("token-slot", "paged")
MASKS = (False, True)  # the causal chain, a tree's custom mask


def domain(module: ModuleType, arch: str, entries: Iterable[str] = ENTRIES,
           index_dtypes: Iterable[str] = INDEX_DTYPES) -> Iterator[Point]:
    """Every input class the module accepts on an arch (narrowed to some entries / index dtypes
    only when asked: a narrowed run proves only that part)."""
    groups = [*module.GROUP_SIZES, unlisted_group(module, arch)]
    entries = set(entries)
    pages: list[int | None] = ([None] if "token-slot" in entries else []) + (
        list(module.SUPPORTED_PAGE_SIZES) if "paged" in entries else [])
    # The first index dtype is where the walk asks launch_params (it does not see dtypes).
    index_order = [d for d in INDEX_DTYPES if d in set(index_dtypes)]
    for group, batch in itertools.product(groups, domain_batches(module, arch)):
        from_table = module.select_config(arch, group, batch) is not module.LAUNCHER.default_config
        for draft, page_size, mask, index_dtype in itertools.product(range(1, module.MAX_DRAFT_TOKENS + 1), pages,
                                                                     MASKS, index_order):  # index dtype innermost
            yield Point(group, draft, batch, page_size, index_dtype, from_table, mask)


def jit_int_class(value: int) -> str:
    """How Triton's JIT specializes an int argument: 1 becomes a constexpr, a multiple of 16
    gets tt.divisibility 16, anything else is a plain i32 (i64 past int32's range)."""
    if value == 1:
        return "one"
    return "div16" if value % 16 == 0 else "plain"


# The int arguments runtime_scalars can give (the default and the batch-invariant modules').
RUNTIME_INTS = ("group", "head_blocks", "max_splits", "page_shift", "block_n", "min_tokens_per_split",
                "tokens_per_split", "row_blocks")


def runtime_scalars(module: ModuleType, arch: str, num_sms: int, point: Point) -> dict[str, int]:
    """Values of the int arguments the launcher computes from shapes (the rest are strides of
    the engine's tensors): the JIT specializes on them, so they are part of the variant."""
    # cached_setup: the launcher's cached set-up, which its launch_params asks for right after.
    setup = module.LAUNCHER.cached_setup(arch, num_sms, point.group, point.batch, point.draft, point.page_size, 1,
                                         point.mask)
    if setup is None:
        return {}
    scalars = {"group": point.group, "head_blocks": setup.head_blocks, "max_splits": setup.max_splits,
               "page_shift": setup.page_shift, "block_n": setup.block_n,
               # partial_lse is [rows, heads, splits], contiguous: its head stride is its split count.
               "stride_pl_head": setup.max_splits}
    if not module.LAUNCHER.invariant:
        scalars["min_tokens_per_split"] = setup.split_tokens
    else:  # a batch-invariant module: its split size and row blocks (all do_not_specialize)
        scalars.update(tokens_per_split=setup.split_tokens, row_blocks=setup.row_blocks)
    return scalars


def complete_launch(module: ModuleType, kernel_name: str, constexprs: dict[str, Any]) -> dict[str, Any]:
    """The constexprs one launch_params entry compiles with: _run adds DOT_DTYPE (the GPU's
    dot operand dtype). Any other constexpr launch_params leaves out is an error. An
    argument the launch passes as None (the chain kernel's mask arguments) is a constexpr of
    the compile too: launch_params lists it with the value None."""
    kernel = getattr(module, kernel_name)
    wanted = [p.name for p in kernel.params if p.is_constexpr]
    missing = [n for n in wanted if n not in constexprs and n != "DOT_DTYPE"]
    if missing:
        raise CheckError(f"{module.URI}.{kernel_name}: launch_params gives no value for constexpr(s) {missing}; "
                         "add them to launch_params (kgen check compiles what it returns)")
    extra = {n for n in set(constexprs) - set(wanted) if n not in kernel.arg_names or constexprs[n] is not None}
    if extra:
        raise CheckError(f"{module.URI}: launch_params names constexprs {sorted(extra)} that {kernel_name} "
                         "does not take")
    base = dict(constexprs)
    if "DOT_DTYPE" in wanted and "DOT_DTYPE" not in base:
        base["DOT_DTYPE"] = module.LAUNCHER.identity.prefix_dot_dtype
    return base


def kernel_signature(module: ModuleType, kernel_name: str, constexprs: dict[str, Any], index_dtype: str,
                     scalars: dict[str, int] | None = None) -> tuple[dict[str, str], dict[str, Any], list[str]]:
    """Triton types of a kernel's parameters from their names, as the JIT would specialize them.

    Returns the signature, the constexprs (plus int arguments the JIT turns into constexpr 1)
    and the arguments marked 16-divisible: pointers, int arguments whose known value is a
    multiple of 16, and the strides of engine tensors (contiguous, 16-element rows; a block
    table's row stride is the engine's max pages per request, arbitrary, so it stays unmarked).
    """
    kernel = getattr(module, kernel_name)
    params = {p.name: p for p in getattr(kernel, "params", ())}
    scalars = scalars or {}
    q_type = "*" + _TRITON_TYPES[_torch_name(module.Q_DTYPE)]
    kv_type = "*" + _TRITON_TYPES[_torch_name(module.KV_DTYPE)]
    # FP8 modules read k_scale / v_scale from 1-element device tensors, 16-bit ones take floats.
    scale_type = "*fp32" if _torch_name(module.KV_DTYPE).startswith("float8") else "fp32"
    signature: dict[str, str] = {}
    constants = dict(constexprs)
    divisible: list[str] = []
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in _Q_POINTERS:
            signature[name] = q_type
        elif name in _KV_POINTERS:
            signature[name] = kv_type
        elif name in _MASK_POINTERS:
            signature[name] = "*u8"
        elif _INDEX_POINTER.match(name):
            signature[name] = "*" + _TRITON_TYPES[index_dtype]
        elif _FP32_POINTER.match(name):
            signature[name] = "*fp32"
        elif name in _FP32_SCALARS:
            signature[name] = "fp32"
        elif name in _SCALE_ARGS:
            signature[name] = scale_type
        elif _I64_SCALAR.search(name):
            signature[name] = "i64"
        elif _I32_SCALAR.match(name):
            signature[name] = "i32"
        else:
            raise CheckError(f"{module.URI}.{kernel_name}: parameter {name!r} has no known type; teach "
                             "kgen/check.py (kernel_signature) what it is before checking this module")
        param = params.get(name)
        if param is not None and param.do_not_specialize:
            continue  # @triton.jit(do_not_specialize=...): the JIT compiles one variant for every value
        aligned_ok = param is None or not param.do_not_specialize_on_alignment
        if name in scalars:
            cls = jit_int_class(scalars[name])
            if cls == "one":
                signature[name], constants[name] = "constexpr", 1
            elif cls == "div16" and aligned_ok:
                divisible.append(name)
        elif aligned_ok and (signature[name].startswith("*")
                             or (name.startswith("stride_") and name != "stride_table")):
            divisible.append(name)
    return signature, constants, divisible


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
    program: str = ""  # program_hash of the kernel: the same for every module whose kernel text is the same
    family: str = ""  # "<kernel> <layout> <KV dtype>": how `kgen check` reports where its time goes
    module_variants: set[tuple] = dataclasses.field(default_factory=set)  # (module, arch, kernel, options, launch)

    @property
    def modules(self) -> set[str]:
        """Every module launching this exact compile."""
        return {module for module, *_ in self.module_variants}

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
    refused_points: Counter  # (module, arch) -> domain points launch_params refuses (returns [])


def program_hash(kernel: Any) -> str:
    """The content of a kernel as a compile sees it: Triton's cache key (the source of the
    kernel and of every JIT function it calls, with the constexpr globals they read), taken
    with every function's starting line set to 0.

    Triton's own key adds the line a function starts on, so the same kernel text at another
    line of another generated module (a merge stage below a longer prefix stage) would be
    compiled again; lines only move debug locations, never the program. Every input that
    changes the program (any source character, a global constexpr's value) still changes the
    hash. Triton's key leaves out the value of a plain (not ``tl.constexpr``) global the code
    reads, which the compile bakes in all the same: this hash adds every such value. Where a
    Triton keeps no ``starting_line_number``, Triton's own key stands for the text.

    The globals are those the kernel reads itself and those its called functions had recorded
    before: Triton's dependency finder takes a callee's globals before computing the callee's key,
    so a global read only inside a called function (V_HEAD_DIM in the prefix stage's
    _merge_in_cluster) is in a second computation and not the first. Every function's recorded
    globals are cleared with its key, so every computation is the first one: the same hash in a
    fresh process and after any other call (the ledger's keys)."""
    functions = [f for f in vars(sys.modules[kernel.fn.__module__]).values()
                 if hasattr(f, "starting_line_number") and hasattr(f, "hash")]
    saved = [(f, f.starting_line_number, f.hash, getattr(f, "used_global_vals", None)) for f in functions]
    try:
        if kernel in functions:
            for f in functions:
                f.starting_line_number, f.hash = 0, None
                if hasattr(f, "used_global_vals"):
                    f.used_global_vals = {}
        text_key = kernel.cache_key
        values = sorted((name, repr(value)) for (name, _), (value, _) in kernel.used_global_vals.items())
    finally:
        for f, line, cached, used in saved:
            f.starting_line_number, f.hash = line, cached
            if used is not None:
                f.used_global_vals = used
    return hashlib.sha256(json.dumps([text_key, values]).encode()).hexdigest()


def _variant_key(arch: str, kernel_hash: str, constexprs: dict, signature: dict, options: dict,
                 divisible: list[str]) -> str:
    import triton

    blob = json.dumps({"format": CACHE_FORMAT, "triton": triton.__version__, "arch": arch, "kernel": kernel_hash,
                       "constexprs": constexprs, "signature": signature, "options": options, "divisible": divisible},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _distinct_launch(info: ModuleInfo, module: ModuleType, arch_name: str, kernel_name: str, constexprs: dict,
                     options: dict, index_dtype: str, scalars: dict[str, int], kernel_hashes: dict[str, str],
                     by_key: dict[str, Variant], proj: dict[str, set]) -> Variant:
    """The Variant of one distinct launch (shared with other modules' identical compiles)."""
    if kernel_name not in kernel_hashes:
        kernel_hashes[kernel_name] = program_hash(getattr(module, kernel_name))
    signature, constants, divisible = kernel_signature(module, kernel_name, constexprs, index_dtype, scalars)
    encoded = {k: _encode(v) for k, v in constants.items()}
    key = _variant_key(arch_name, kernel_hashes[kernel_name], encoded, signature, options, divisible)
    base = (info.layout, info.variant, info.kv_dtype, kernel_name, json.dumps(options, sort_keys=True))
    cx, sg, dv = json.dumps(encoded, sort_keys=True), json.dumps(signature, sort_keys=True), tuple(divisible)
    proj["all"].add((*base, info.q_dtype, cx, sg, dv))
    proj["index_dtype"].add((*base, info.q_dtype, cx, sg.replace('"*i64"', '"*i32"'), dv))
    proj["q_dtype"].add((*base, cx, sg.replace(f'"*{_TRITON_TYPES[info.q_dtype]}"', '"*q"'), dv))
    unspecialized = {k: ("i32" if k in scalars else v) for k, v in signature.items()}
    proj["runtime int specialization"].add((*base, info.q_dtype,
                                            json.dumps({k: v for k, v in encoded.items() if k in constexprs},
                                                       sort_keys=True), json.dumps(unspecialized, sort_keys=True)))
    # One runtime int at a time (max_splits with the stride that equals it), every module's ints
    # for every variant, so that an int only some modules pass does not skew the multipliers.
    for name in RUNTIME_INTS:
        names = {name, "stride_pl_head"} if name == "max_splits" else {name}
        one = {k: ("i32" if k in names else v) for k, v in signature.items()}
        proj.setdefault(f"int {name}", set()).add(
            (*base, info.q_dtype, json.dumps({k: v for k, v in encoded.items() if k not in names}, sort_keys=True),
             json.dumps(one, sort_keys=True), tuple(d for d in dv if d not in names)))
    variant = by_key.get(key)
    if variant is None:
        variant = by_key[key] = Variant(key, info.uri, str(info.path), kernel_name, arch_name, encoded,
                                        dict(options), signature, divisible, program=kernel_hashes[kernel_name],
                                        family=f"{kernel_name.strip('_')} {info.layout} {info.kv_dtype}")
    variant.module_variants.add((info.uri, arch_name, kernel_name, base[-1], cx, sg, dv))
    return variant


def enumerate_variants(modules: list[ModuleInfo], archs: list[str],
                       launch_params_for: Callable[[ModuleType], Callable] | None = None,
                       entries: Iterable[str] = ENTRIES, index_dtypes: Iterable[str] = INDEX_DTYPES) -> Enumeration:
    """Walk every module's domain on every arch it accepts and dedupe what it launches."""
    by_key: dict[str, Variant] = {}
    refused: list[Refusal] = []
    points: Counter = Counter()
    launches: Counter = Counter()
    refused_points: Counter = Counter()
    # For the multipliers: distinct variants with each axis removed, per arch.
    projections: dict[str, dict[str, set]] = {}
    first_index = next(d for d in INDEX_DTYPES if d in set(index_dtypes))
    for info in modules:
        module = load_module_file(info.path)
        params = (launch_params_for or module_launch_params)(module)
        accepted = tuple(module.CHECKED_ARCHS)
        kernel_hashes: dict[str, str] = {}
        for arch_name in archs:
            arch = ARCHS[arch_name]
            if arch_name not in accepted:
                refused.append(Refusal(info.uri, arch_name, f"the module's CHECKED_ARCHS {list(accepted)} "
                                       "do not include it"))
                continue
            if info.kv_dtype not in arch.kv_dtypes:
                refused.append(Refusal(info.uri, arch_name, f"{info.kv_dtype} KV is not an FP8 format of {arch_name} "
                                       f"(kgen/tables/targets.json: {list(arch.kv_dtypes[2:])})"))
                continue
            proj = projections.setdefault(arch_name, {a: set() for a in AXES})
            # Launches repeat across the domain: the full typing and hashing runs once per distinct one,
            # and a launch's completion once per distinct launch_params entry.
            seen: dict[tuple, Variant] = {}
            completed: dict[tuple, dict[str, Any]] = {}
            # The runtime ints each kernel lets the JIT specialize (not do_not_specialize): only
            # their value classes can make another compile.
            specialized = {name: {p.name for p in getattr(module, name).params if not p.do_not_specialize}
                           for name in ("_verify_prefix_stage", "_verify_merge_stage") if hasattr(module, name)}
            for point in domain(module, arch_name, entries, index_dtypes):
                points[(info.uri, arch_name)] += 1
                if point.index_dtype == first_index:  # launch_params does not see tensors' dtypes
                    scalars = runtime_scalars(module, arch_name, arch.num_sms, point)
                    planned = []
                    for kernel_name, constexprs, options in params(arch_name, arch.num_sms, point.group, point.batch,
                                                                   point.draft, point.page_size, has_mask=point.mask):
                        launch = (kernel_name, tuple(constexprs.items()), tuple(options.items()))
                        full = completed.get(launch)
                        if full is None:
                            full = completed[launch] = complete_launch(module, kernel_name, constexprs)
                        jit = specialized.get(kernel_name)
                        classes = tuple(sorted((k, jit_int_class(v)) for k, v in scalars.items()
                                               if jit is None or k in jit))
                        planned.append((launch, classes, kernel_name, full, options))
                if not planned:
                    refused_points[(info.uri, arch_name)] += 1
                for launch, classes, kernel_name, constexprs, options in planned:
                    launches[arch_name] += 1
                    fast = (launch, point.index_dtype, classes)
                    variant = seen.get(fast)
                    if variant is None:
                        variant = seen[fast] = _distinct_launch(info, module, arch_name, kernel_name, constexprs,
                                                                options, point.index_dtype, scalars, kernel_hashes,
                                                                by_key, proj)
                    variant.points.append(point)

    variants = list(by_key.values())
    multipliers = {arch: {axis: len(sets["all"]) / max(1, len(sets[axis])) for axis in sets if axis != "all"}
                   for arch, sets in projections.items()}
    return Enumeration(variants, refused, points, launches, multipliers, refused_points)


# ---------------------------------------------------------------------------------------
# Compiling and reading resources
# ---------------------------------------------------------------------------------------

_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_AMDGCN_FIELD = re.compile(r"^\s*-?\s*\.(vgpr_count|sgpr_count|agpr_count|vgpr_spill_count|sgpr_spill_count"
                           r"|group_segment_fixed_size|private_segment_fixed_size):\s+(\d+)", re.M)
_MFMA = re.compile(r"\b(v_mfma_\w+|v_smfmac_\w+)")
# Tensor-core instructions in PTX: wgmma (Hopper), mma.sync (Ampere/Ada), tcgen05.mma (Blackwell),
# with the operand type that names the kind (bf16, f16, e4m3, ...; tcgen05 spells it kind::f16).
_NVIDIA_MMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?(wgmma\.mma_async|mma\.sync|tcgen05\.mma)[.\w:]*", re.M)
_MMA_KIND = re.compile(r"\.(bf16|f16|tf32|e4m3|e5m2|s8|u8)\b|kind::(\w+)")


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


def count_nvidia_mma(ptx: str) -> dict[str, int]:
    """Tensor-core instructions in PTX by instruction and operand kind ("wgmma.mma_async bf16",
    "mma.sync f16", "tcgen05.mma f8f6f4"). Read from the PTX Triton hands ptxas, which lowers each
    to its SASS form (HGMMA/QGMMA, HMMA, UTC*MMA) one for one."""
    counts: Counter = Counter()
    for m in _NVIDIA_MMA.finditer(ptx):
        kind = _MMA_KIND.search(m.group(0))
        counts[f"{m.group(1)} {next(g for g in kind.groups() if g) if kind else '?'}"] += 1
    return dict(sorted(counts.items()))


_WORKER_MODULES: dict[str, ModuleType] = {}
_COMPILING: list[int] = []  # the pid of the fork compiling now (compile_isolated)


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.pop("KGEN_NO_PDL", None)
    signal.signal(signal.SIGTERM, _stop_worker)


def _stop_worker(signum: int, frame: Any) -> None:
    """A worker stopped (a run over its budget) takes the compile it forked with it."""
    for pid in _COMPILING:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(1)


def _worker_module(path: str) -> ModuleType:
    module = _WORKER_MODULES.get(path)
    if module is None:
        module = _WORKER_MODULES[path] = load_module_file(Path(path))
    return module


def compile_isolated(job: dict[str, Any]) -> dict[str, Any]:
    """compile_variant in a fork of this worker, which itself never compiles: a compile leaves
    state in its process that changes later ones (under Triton 3.6 a gfx942 compile gives a
    gfx950 one compiled after it in the same process 276 VGPRs instead of 224), so every
    compile starts from the same clean process and its result is a function of its key
    (docs/check.md, "The ledger"). The generated module is imported here, once, for every fork."""
    if not hasattr(os, "fork"):
        return compile_variant(job)
    _worker_module(job["module_path"])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: compile, write the result, leave without the worker's exit handlers
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.close(read)
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(compile_variant(job)))
        finally:
            os._exit(0)
    _COMPILING.append(pid)
    os.close(write)
    with os.fdopen(read) as result:
        text = result.read()
    _, status = os.waitpid(pid, 0)
    _COMPILING.remove(pid)
    if not text:
        return {"error": f"the compile process died (wait status {status})", "compile_s": 0.0}
    return json.loads(text)


def ast_source(kernel: Any, signature: Mapping[str, str], constants: Mapping[str, Any],
               divisible: Iterable[str]) -> Any:
    """The source Triton compiles one program from: its signature, its constexpr values by
    argument name and the arguments marked divisible by 16. Gluon kernels (the Hopper lowering
    of a prefix stage) compile from their own AST source."""
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    source_type = GluonASTSource if getattr(kernel, "is_gluon", lambda: False)() else ASTSource
    return source_type(fn=kernel, signature=dict(signature),
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})


def compile_variant(job: dict[str, Any]) -> dict[str, Any]:
    """Compile one variant for its target and read its resources (runs in a worker process)."""
    import triton
    from triton.backends.compiler import GPUTarget

    started = time.perf_counter()
    arch = ARCHS[job["arch"]]
    try:
        kernel = getattr(_worker_module(job["module_path"]), job["kernel"])
        constants = {k: _decode(v) for k, v in job["constexprs"].items()}
        source = ast_source(kernel, job["signature"], constants, job["divisible"])
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
            result["mma"] = count_nvidia_mma(compiled.asm["ptx"])
        else:
            result.update(parse_amdgcn(compiled.asm["amdgcn"]))
        result["error"] = None
    except Exception as exc:  # a compile error is a finding, reported with the variant
        result = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    result["compile_s"] = round(time.perf_counter() - started, 3)
    return result


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


def _expected_cost(variant: Variant) -> tuple:
    """A sort key, most expensive compile first: FP8 KV (its conversions), AMD's backend, then
    the tile (rows x BLOCK_N). One queue for every target, so no compile is left running alone
    at the end of one."""
    cx = {k: _decode(v) for k, v in variant.constexprs.items()}
    fp8 = variant.signature.get("K_Buffer", "").startswith("*fp8")
    tile = _rows_of(variant)[0] * int(cx.get("BLOCK_N", 0) or 0)
    return (not fp8, ARCHS[variant.arch].backend != "hip", -tile)


class Budget:
    """What the compiles of one run may cost (``kgen check --ci``): ``check`` raises
    BudgetExceeded when the programs left would take the run past ``seconds`` of wall time.

    The probe (``queue`` puts it first: the ``probe_programs`` first of the queue by ``rank``,
    a seeded draw) measures the wall seconds a program takes on this machine; once it is done,
    or ``probe_s`` has passed, the programs left are projected at that rate. After that the
    budget is a hard cap."""

    def __init__(self, seconds: float, rank: Callable[[str], Any], probe_programs: int,
                 probe_s: float = 45.0) -> None:
        self.seconds, self.rank, self.probe_programs, self.probe_s = seconds, rank, probe_programs, probe_s
        self.probe: set[str] = set()
        self.per_program: float | None = None  # wall seconds a program, once the probe has measured it
        self.measured_on = 0  # programs the rate was measured on

    def queue(self, todo: list[Variant]) -> list[Variant]:
        """The queue with the probe first (each part keeps its order)."""
        self.probe = {v.key for v in sorted(todo, key=lambda v: self.rank(v.key))[:self.probe_programs]}
        return sorted(todo, key=lambda v: v.key not in self.probe)

    def check(self, done: int, left: int, elapsed: float, probe_left: int) -> None:
        if self.per_program is None and (probe_left == 0 or elapsed >= self.probe_s):
            self.per_program, self.measured_on = elapsed / max(1, done), done
            projected = elapsed + left * self.per_program
            if projected > self.seconds:
                raise BudgetExceeded(self, done, left, projected, passed=False)
        elif self.per_program is not None and elapsed > self.seconds:
            raise BudgetExceeded(self, done, left, elapsed, passed=True)


class BudgetExceeded(KgenError):
    """The run's compiles would take (``passed`` False: projected) or took longer than its Budget."""

    def __init__(self, budget: Budget, done: int, left: int, seconds: float, passed: bool) -> None:
        self.budget, self.programs, self.seconds = budget, done + left, seconds
        rate = (f"{budget.per_program:.2f} s a program (wall, measured on the first {budget.measured_on} compiled "
                "in this run)")
        if passed:
            text = (f"the compiles passed the budget of {budget.seconds:.0f} s with {left} of {done + left} programs "
                    f"left (the probe measured {rate})")
        else:
            text = (f"{done + left} programs to compile at {rate} take ~{seconds:.0f} s, over the budget of "
                    f"{budget.seconds:.0f} s")
        super().__init__(text)


def _start_pool(jobs: int) -> Any:
    """The compile workers: spawned processes without TRITON_INTERPRET (tests replace this)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with _compile_environment():  # spawned workers inherit the environment at start
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_worker_init)
        list(pool.map(_worker_init_probe, range(jobs)))
    return pool


def _stop_pool(pool: Any, finished: bool) -> None:
    """Shut the workers down; a run stopped early (its budget) does not wait for their compiles."""
    if finished:
        pool.shutdown()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())  # ProcessPoolExecutor's workers
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()


def _compile_queue(pool: Any, todo: list[Variant], cache: ResultCache, results: dict[str, dict], bar: Any,
                   budget: Budget | None) -> None:
    """Compile every queued variant on the pool, in queue order, storing each result."""
    from concurrent.futures import FIRST_COMPLETED, wait

    futures = {pool.submit(compile_isolated, _job(v)): v for v in todo}
    pending = set(futures)
    probe_left = budget.probe & {v.key for v in todo} if budget else set()
    started = time.perf_counter()
    while pending:
        done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
        for future in done:
            variant = futures[future]
            result = future.result()
            cache.put(variant.key, result)
            results[variant.key] = {**result, "cached": False}
            probe_left.discard(variant.key)
            bar.set_postfix_str(variant.arch)
            bar.update(1)
        if budget is not None:
            budget.check(len(futures) - len(pending), len(pending), time.perf_counter() - started, len(probe_left))


def compile_all(variants: list[Variant], archs: list[str], jobs: int, cache: ResultCache,
                progress: bool = True, budget: Budget | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """Results by variant key, and per arch: distinct programs, compiled, cached, and the
    seconds its compiles took (summed over the workers); "all" adds the wall time.

    The queue is the costliest first; with a ``budget``, its probe programs go before the rest
    and the run stops (BudgetExceeded) when the rest would take it past the budget."""
    from tqdm import tqdm

    started = time.perf_counter()
    results: dict[str, dict] = {}
    todo: list[Variant] = []
    for variant in variants:
        hit = cache.get(variant.key)
        if hit is not None:
            results[variant.key] = {**hit, "cached": True}
        else:
            todo.append(variant)
    todo.sort(key=_expected_cost)
    if budget is not None:
        todo = budget.queue(todo)
    bar = tqdm(total=len(todo), desc="kgen check", unit="program", disable=not progress or not todo)
    pool, finished = None, False
    try:
        if todo:
            pool = _start_pool(max(1, jobs))
            _compile_queue(pool, todo, cache, results, bar, budget)
        finished = True
    finally:
        bar.close()
        if pool is not None:
            _stop_pool(pool, finished)
    return results, _timing(variants, archs, results, len(todo), time.perf_counter() - started, max(1, jobs))


def _timing(variants: list[Variant], archs: list[str], results: dict[str, dict], compiled: int, wall_s: float,
            jobs: int) -> dict[str, dict]:
    timing: dict[str, dict] = {}
    for arch in archs:
        mine = [v for v in variants if v.arch == arch]
        fresh = [v for v in mine if not results[v.key]["cached"]]
        timing[arch] = {"programs": len(mine), "compiled": len(fresh), "cached": len(mine) - len(fresh),
                        "compile_s": round(sum(results[v.key].get("compile_s", 0) for v in fresh), 1)}
    timing["all"] = {"programs": len(variants), "compiled": compiled, "cached": len(variants) - compiled,
                     "compile_s": round(sum(t["compile_s"] for t in timing.values()), 1),
                     "wall_s": round(wall_s, 1), "jobs": jobs}
    return timing


def family_seconds(report: CheckReport) -> list[tuple[str, int, int, float]]:
    """(kernel family, programs, compiled, compile seconds), most seconds first: a family is a
    kernel of one layout and KV dtype, whichever module and target launch it."""
    by: dict[str, list] = {}
    for variant in report.enumeration.variants:
        row = by.setdefault(variant.family, [0, 0, 0.0])
        result = report.results.get(variant.key, {})
        row[0] += 1
        if not result.get("cached", True):
            row[1] += 1
            row[2] += result.get("compile_s", 0)
    return sorted(((f, n, c, round(sec, 1)) for f, (n, c, sec) in by.items()), key=lambda r: (-r[3], r[0]))


def format_timing(report: CheckReport) -> str:
    """Where the check's time goes: per target, then per kernel family."""
    t = report.timing
    lines = [f"{'target':8s} {'programs':>8s} {'compiled':>8s} {'cached':>7s} {'compile s':>10s}"]
    for arch in report.archs:
        a = t.get(arch, {})
        lines.append(f"{arch:8s} {a.get('programs', 0):8d} {a.get('compiled', 0):8d} {a.get('cached', 0):7d} "
                     f"{a.get('compile_s', 0):10.1f}")
    total = t.get("all", {})
    lines.append(f"{'all':8s} {total.get('programs', 0):8d} {total.get('compiled', 0):8d} "
                 f"{total.get('cached', 0):7d} {total.get('compile_s', 0):10.1f}  (wall {total.get('wall_s', 0)} s "
                 f"on {total.get('jobs', 1)} workers)")
    lines += ["", f"{'kernel family':56s} {'programs':>8s} {'compiled':>8s} {'compile s':>10s}"]
    lines += [f"{f:56s} {n:8d} {c:8d} {sec:10.1f}" for f, n, c, sec in family_seconds(report)]
    return "\n".join(lines)


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
            "mask": "/".join(x for x, on in (("chain", any(not p.mask for p in points)),
                                              ("tree", any(p.mask for p in points))) if on),
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

    def rows(self) -> list[dict]:
        rows = []
        for v in self.enumeration.variants:
            r = self.results.get(v.key, {"error": "not compiled"})
            rows.append({"module": v.module, "modules": sorted(v.modules), "arch": v.arch, "kernel": v.kernel,
                         "constexprs": v.constexprs,
                         "options": v.options, "signature": v.signature, "key": v.key,
                         "domain": describe_points(v.points), "points": len(v.points),
                         "from_table": v.from_table, "result": r,
                         "problems": verdict(v, r), "spills": spill_note(v, r)})
        return rows

    def failures(self) -> list[dict]:
        return [r for r in self.rows() if r["problems"]]


def summarize(report: CheckReport) -> list[dict]:
    """One line per module x arch with the worst numbers."""
    by: dict[tuple[str, str], list[dict]] = {}
    for row in report.rows():
        for module in row["modules"] or [row["module"]]:  # a program several modules launch counts for each
            by.setdefault((module, row["arch"]), []).append(row)
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
                         f"{d['batch']} {d['entry']} {d['mask']} [{d['config']}]{status}")
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
        modules = ", ".join(r["modules"]) or r["module"]  # one compile can serve several modules
        lines.append(f"FAIL {modules} {r['arch']} {r['kernel']}: {'; '.join(r['problems'])}\n"
                     f"     at group {d['groups']}, draft length {d['draft']}, batch {d['batch']}, {d['entry']} "
                     f"({d['mask']}), "
                     f"index {d['index']}, {d['config']} config\n"
                     f"     {_config_text(v)}; program {v.key}")
    return "\n".join(lines)


def to_json(report: CheckReport) -> dict:
    e = report.enumeration
    return {
        "archs": report.archs, "timing": report.timing,
        "limits": {a: ARCHS[a].shared_limit for a in report.archs},
        "refused": [dataclasses.asdict(r) for r in e.refused],
        "domain_points": sum(e.points.values()), "launches": dict(e.launches),
        "axis_multipliers": e.axis_multipliers,
        "variants": report.rows(),
        "programs": len(e.variants), "module_variants": module_variant_count(e),
        "families": [{"family": f, "programs": n, "compiled": c, "compile_s": sec}
                     for f, n, c, sec in family_seconds(report)],
        "failures": len(report.failures()),
    }


def module_variant_count(enumeration: Enumeration) -> int:
    """How many (module, launch) variants the enumeration's programs compile for: each module's
    own launches, before programs shared between modules are counted once."""
    return len(set().union(*(v.module_variants for v in enumeration.variants)))


def format_markdown(report: CheckReport) -> str:
    e = report.enumeration
    out = ["# kgen check", ""]
    out += ["| arch | distinct programs | compiled | cached | compile s | launches walked | failing |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fails = Counter(r["arch"] for r in report.failures())
    for arch in report.archs:
        t = report.timing.get(arch, {})
        out.append(f"| {arch} | {t.get('programs', 0)} | {t.get('compiled', 0)} | {t.get('cached', 0)} | "
                   f"{t.get('compile_s', 0)} | {e.launches.get(arch, 0)} | {fails.get(arch, 0)} |")
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


def select_variants(archs: list[str], layouts: Iterable[str] = (), kv_dtypes: Iterable[str] = (),
                    q_dtypes: Iterable[str] = (), variants: Iterable[str] = (),
                    generated: Path | None = None,
                    launch_params_for: Callable[[ModuleType], Callable] | None = None,
                    entries: Iterable[str] = ENTRIES, index_dtypes: Iterable[str] = INDEX_DTYPES) -> Enumeration:
    """The distinct variants to compile (nothing is compiled)."""
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise CheckError(f"unknown arch {unknown}: kgen check knows {', '.join(ARCHS)}")
    modules = find_modules(generated, layouts, kv_dtypes, q_dtypes, variants)
    bad = sorted(set(entries) - set(ENTRIES)) + sorted(set(index_dtypes) - set(INDEX_DTYPES))
    if bad or not entries or not index_dtypes:
        raise CheckError(f"narrowing {bad or 'to nothing'}: entries are {', '.join(ENTRIES)}, index dtypes "
                         f"{', '.join(INDEX_DTYPES)}")
    return enumerate_variants(modules, archs, launch_params_for, entries, index_dtypes)


# Constexprs that set how many rows a program holds; the rest of a variant is its program's shape.
# How many draft-row programs share a head block (ROW_BLOCKS) only changes the program index
# arithmetic; whether the draft columns run in a loop (rows split, or tiles narrower than the
# draft) stays in the shape.
ROW_CONSTEXPRS = ("GROUP", "BLOCK_H", "L_PAD", "DRAFT_N", "MERGE_HEADS", "ROW_BLOCKS")


GLUON_KERNEL_PREFIX = "_gluon"  # a generated module's Gluon kernels (kgen/templates/gluon/)


def _rows_of(variant: Variant) -> tuple[int, int, int]:
    """(rows a program holds, its draft tile's columns, its draft row blocks): the larger is
    the worse case (a wider draft tile holds more scores beside the same accumulator)."""
    cx = {k: _decode(v) for k, v in variant.constexprs.items()}
    rows = int(cx.get("BLOCK_H", cx.get("MERGE_HEADS", 1))) * int(cx.get("L_PAD", 1))
    return rows, int(cx.get("DRAFT_N", 0)), int(cx.get("ROW_BLOCKS", 1))


def _shape_of(variant: Variant) -> tuple:
    """A variant's program shape: everything but its row blocking and its group (a Gluon
    kernel's every constexpr: see largest_rows)."""
    every_row = variant.kernel.startswith(GLUON_KERNEL_PREFIX)
    rest = {k: v for k, v in variant.constexprs.items() if every_row or k not in ROW_CONSTEXPRS}
    cx = variant.constexprs
    rest["draft loop"] = rules.draft_columns_loop(int(cx.get("ROW_BLOCKS", 1)), int(cx.get("DRAFT_N", 0)),
                                                  int(cx.get("L_PAD", 0)))
    return (variant.program, variant.arch, variant.kernel, json.dumps(variant.options, sort_keys=True),
            json.dumps(variant.signature, sort_keys=True), json.dumps(rest, sort_keys=True))


def largest_rows(enumeration: Enumeration) -> Enumeration:
    """Only the variant with the most rows of each program shape (everything but the row blocking
    and the group): the one that holds the most of q, of the accumulator and of p, so the most
    shared memory and registers. The domain points of the variants it stands for stay listed
    with it. A proof of the worst case, not of every variant: `kgen check` without
    --largest-rows compiles them all. Gluon kernels (GLUON_KERNEL_PREFIX) are always 64 rows:
    every one of their variants is the largest, and every one is kept."""
    worst: dict[tuple, Variant] = {}
    for variant in enumeration.variants:
        shape = _shape_of(variant)
        kept = worst.get(shape)
        if kept is None or _rows_of(variant) > _rows_of(kept):
            if kept is not None:
                _stand_for(variant, kept)
            worst[shape] = variant
        else:
            _stand_for(kept, variant)
    return dataclasses.replace(enumeration, variants=list(worst.values()))


def _stand_for(kept: Variant, dropped: Variant) -> None:
    """The kept variant answers for the dropped one: its domain points and its modules."""
    kept.points.extend(dropped.points)
    kept.module_variants |= dropped.module_variants


def format_counts(enumeration: Enumeration, archs: list[str]) -> str:
    """Counts per arch and kernel, and how much each domain axis multiplies the variants."""
    counts = Counter((v.arch, v.kernel) for v in enumeration.variants)
    lines = [f"{'arch':7s} {'launches':>9s} {'programs':>8s}  per kernel; x multiplier of each axis"]
    for arch in archs:
        kernels = ", ".join(f"{k.strip('_')} {n}" for (a, k), n in sorted(counts.items()) if a == arch)
        mult = ", ".join(f"{axis} x{m:.2f}" for axis, m in enumeration.axis_multipliers.get(arch, {}).items())
        lines.append(f"{arch:7s} {enumeration.launches.get(arch, 0):9d} "
                     f"{sum(n for (a, _), n in counts.items() if a == arch):8d}  {kernels}; {mult}")
    lines.append(f"total {len(enumeration.variants)} distinct programs for {module_variant_count(enumeration)} module "
                 f"variants from {sum(enumeration.points.values())} domain points "
                 f"({sum(enumeration.refused_points.values())} refused by launch_params: no program fits); "
                 f"{len(enumeration.refused)} module x arch refused")
    return "\n".join(lines)


def select_scope(archs: list[str], worst_case_only: bool = False, **selection: Any) -> Enumeration:
    """The distinct programs of a scope: ``select_variants``'s, or with ``worst_case_only`` the
    largest-rows program of each shape (nothing is compiled)."""
    enumeration = select_variants(archs, **selection)
    return largest_rows(enumeration) if worst_case_only else enumeration


def run_check(archs: list[str], layouts: Iterable[str] = (), kv_dtypes: Iterable[str] = (), jobs: int | None = None,
              use_cache: bool = True, progress: bool = True,
              generated: Path | None = None, q_dtypes: Iterable[str] = (), variants: Iterable[str] = (),
              launch_params_for: Callable[[ModuleType], Callable] | None = None,
              entries: Iterable[str] = ENTRIES, index_dtypes: Iterable[str] = INDEX_DTYPES,
              worst_case_only: bool = False) -> CheckReport:
    """Enumerate, compile (or read the cache) and judge every distinct variant (or, with
    ``worst_case_only``, the largest-rows variant of each program shape)."""
    enumeration = select_scope(archs, worst_case_only, layouts=layouts, kv_dtypes=kv_dtypes, q_dtypes=q_dtypes,
                               variants=variants, generated=generated, launch_params_for=launch_params_for,
                               entries=entries, index_dtypes=index_dtypes)
    cache = ResultCache(cache_dir() if use_cache else None)
    results, timing = compile_all(enumeration.variants, archs, jobs or os.cpu_count() or 1, cache, progress)
    return CheckReport(enumeration, results, timing, list(archs))
