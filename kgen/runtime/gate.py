"""The gate: which verify path a model starts on, decided once, from plain values.

SGLang's ``_should_use_verify_shared_kv`` hard-codes one GPU (gfx950), two model families
and "exactly one TP-local KV head" in ``if`` chains. kgen generalizes it:

- which model architectures use which layout is data (``LayoutSpec.architectures``);
- the archs served are data too (``kgen/tables/targets.json``, the targets every generated
  module was checked for and accepts): an arch outside them, or an FP8 KV format its tensor
  cores lack, goes to the general path, as both kernels' ``why_not`` refuse it;
- the grouped kernel is chosen wherever a generated module exists for the layout and
  dtypes and a block config exists for the arch (a table entry, tuned or hand-picked, or the
  built-in default), for chains (``topk == 1``) and trees (``topk > 1``) alike: the modules
  read a tree's custom mask on the device;
- several TP-local KV heads are fine (the kernel has a program group per KV head), the
  decision follows the layout and the reason says so.

``decide_path`` is pure: everything it needs (the model as a ``GateQuery``, the device
arch, what modules and tables exist, the enable/force ``Switches``) comes in as arguments,
so it is unit-tested with mocked values. ``gate_from_env`` is the thin wrapper that reads the environment, the GPU
and the disk; ``explain_gate`` renders the same decision, step by step, for ``kgen explain``.

The gate only picks where the chain *starts*; every kernel still checks each call with
``can_handle`` and the chain falls through to the general path, so a wrong "grouped"
costs speed, never correctness.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, get_args

from kgen.launcher.switches import env_flag
from kgen.spec import FP8_DTYPES, KV_DTYPES, Q_DTYPES, LayoutSpec, canonical_dtype, layouts_for_architecture
from kgen.targets import read_targets

PathName = Literal["grouped", "per_head", "general"]
PATHS: tuple[PathName, ...] = get_args(PathName)
DISABLE_ENV = "KGEN_DISABLE"
FORCE_ENV = "KGEN_FORCE_PATH"
INTERPRETER_ENV = "TRITON_INTERPRET"
INTERPRETER_ARCH = "interpreter"


@dataclass(frozen=True)
class GateDecision:
    """Where the verify chain starts (``path``), for which layout, and why."""

    path: PathName
    layout: str | None
    reason: str


@dataclass(frozen=True)
class GateQuery:
    """One model on one rank, as the engine knows it at start-up.

    ``qk_dim`` is the whole K width (nope + pe), ``group_size`` the query heads per KV head
    on this rank, ``num_local_kv_heads`` the KV heads on this rank (TP-local).
    """

    model_arch: str
    topk: int
    qk_dim: int
    pe_dim: int
    v_dim: int
    group_size: int
    num_local_kv_heads: int
    kv_dtype: str = "bfloat16"
    q_dtype: str = "bfloat16"

    @property
    def dims(self) -> tuple[int, int, int]:
        """(qk, pe, v) widths."""
        return self.qk_dim, self.pe_dim, self.v_dim


@dataclass(frozen=True)
class Switches:
    """The operator's switches: kgen on or off, a forced path, Triton's CPU interpreter."""

    enabled: bool = True
    force_path: str | None = None
    interpreter: bool = False


@functools.lru_cache(maxsize=1)
def _read_shipped_targets() -> Mapping[str, frozenset[str]]:
    return MappingProxyType({arch: frozenset(t.fp8) for arch, t in read_targets().items()})


def shipped_targets() -> Mapping[str, frozenset[str]]:
    """Each arch of ``kgen/tables/targets.json`` with the FP8 formats its tensor cores take.

    ``kgen build`` renders the same file into every module, whose ``why_not`` refuses any
    other arch (and an FP8 KV format outside the arch's list), so the gate reads it too.
    """
    return _read_shipped_targets()


@dataclass(frozen=True)
class Inventory:
    """What exists, as plain data: layouts, generated modules, block-config table entries, targets.

    ``table_entries`` holds ``(arch, layout, kv_dtype, group_size)`` for every table row;
    ``tuned_arches`` the arches whose table says it was tuned on the hardware (the gfx950
    table shipped with kgen holds hand-picked values until ``kgen tune`` replaces them);
    ``targets`` the archs the modules accept, each with its FP8 formats (``shipped_targets``).
    """

    layouts: Mapping[str, LayoutSpec]
    available_uris: frozenset[str] = frozenset()
    table_entries: frozenset[tuple[str, str, str, int]] = frozenset()
    tuned_arches: frozenset[str] = frozenset()
    has_default_config: bool = True
    generated_dir: str = ""
    notes: tuple[str, ...] = field(default=())
    targets: Mapping[str, frozenset[str]] = field(default_factory=shipped_targets)


def module_uri(layout: str, kv_dtype: str, q_dtype: str, variant: str) -> str:
    """The module name of a specialization (``kgen.plan.module_uri``, one definition)."""
    from kgen.plan import module_uri as plan_uri

    return plan_uri(layout, kv_dtype, q_dtype, variant)  # type: ignore[arg-type]


class _Trace:
    """The checks the gate made, in order; ``explain_gate`` prints them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)

    def done(self, path: PathName, layout: str | None, reason: str) -> GateDecision:
        self.lines.append(f"=> {path}: {reason}")
        return GateDecision(path=path, layout=layout, reason=reason)


def _check_numbers(topk: int, group_size: int, num_local_kv_heads: int) -> None:
    if topk < 1:
        raise ValueError(f"topk must be >= 1 (EAGLE's number of branches per step), got {topk}")
    if group_size < 1:
        raise ValueError(f"group_size (query heads per KV head) must be >= 1, got {group_size}")
    if num_local_kv_heads < 1:
        raise ValueError(f"num_local_kv_heads (KV heads on this rank) must be >= 1, got {num_local_kv_heads}")


def _canonical_or_none(name: str, allowed: Mapping[str, str], what: str) -> str | None:
    try:
        return canonical_dtype(name, allowed, what)
    except ValueError:
        return None


def _resolve_layout(
    trace: _Trace, model_arch: str, dims: tuple[int, int, int], layouts: Mapping[str, LayoutSpec]
) -> tuple[LayoutSpec | None, str]:
    """The layout listing ``model_arch`` whose widths match, or None and the reason."""
    candidates = sorted(layouts_for_architecture(model_arch, dict(layouts)), key=lambda s: s.name)
    if not candidates:
        return None, (
            f"no layout lists model architecture {model_arch!r}; to route it, add the name to "
            "`architectures` in the kgen/layouts/*.toml file whose widths match"
        )
    qk_dim, pe_dim, v_dim = dims
    matching = [
        s
        for s in candidates
        if (s.attention.qk_dim, s.attention.pe_dim, s.attention.v_head_dim) == (qk_dim, pe_dim, v_dim)
    ]
    if not matching:
        have = ", ".join(
            f"{s.name} (qk {s.attention.qk_dim}, pe {s.attention.pe_dim}, v {s.attention.v_head_dim})"
            for s in candidates
        )
        return None, (
            f"{model_arch!r} is listed by {have}, but the model has qk {qk_dim}, pe {pe_dim}, "
            f"v {v_dim}; write a layout with these widths (or fix the model's numbers)"
        )
    if len(matching) > 1:
        trace.note(f"several layouts list {model_arch!r} with these widths; taking {matching[0].name!r}")
    return matching[0], f"layout {matching[0].name!r} lists {model_arch!r} and its widths match"


def _config_source(inv: Inventory, arch: str, layout: str, kv_dtype: str, group_size: int) -> str | None:
    """Where the grouped kernel's block config comes from on ``arch``, or None."""
    if (arch, layout, kv_dtype, group_size) in inv.table_entries:
        state = "tuned" if arch in inv.tuned_arches else "untuned, hand-picked"
        return f"block config from the {arch} table ({state})"
    if inv.has_default_config and arch == INTERPRETER_ARCH:
        return "built-in default block config (interpreter: configs only matter on a GPU)"
    if inv.has_default_config:
        return f"built-in default block config (no {arch} table entry; `kgen tune` on {arch} makes one)"
    return None


def _not_a_target(arch: str, targets: Mapping[str, frozenset[str]]) -> str:
    return (
        f"{arch} is not a target the generated modules were checked for (kgen/tables/targets.json: "
        f"{', '.join(targets)}), so every kernel's why_not refuses it; to serve it add its row there, "
        f"then run `kgen build` (the modules take their targets from it) and `kgen check --arch {arch}`"
    )


def _fp8_unsupported(arch: str, kv_dtype: str, targets: Mapping[str, frozenset[str]]) -> str | None:
    """Why ``arch``'s tensor cores cannot take this FP8 KV format (None when they can, or it is not FP8)."""
    if kv_dtype not in FP8_DTYPES or arch == INTERPRETER_ARCH or kv_dtype in targets[arch]:
        return None
    takes = ", ".join(sorted(targets[arch])) or "none"
    return f"{arch} has no {kv_dtype} tensor-core format (it takes: {takes}), so every kernel's why_not refuses it"


def _kv_heads_note(num_local_kv_heads: int) -> str:
    if num_local_kv_heads == 1:
        return "1 TP-local KV head"
    return (
        f"{num_local_kv_heads} TP-local KV heads: the grouped kernel gives each KV head its own "
        "programs, so the decision follows the layout (SGLang's gate required exactly 1)"
    )


def _device_label(device_arch: str | None, interpreter: bool) -> str | None:
    if device_arch:
        return device_arch
    return INTERPRETER_ARCH if interpreter else None


def _decide(
    trace: _Trace, query: GateQuery, device_arch: str | None, switches: Switches, inventory: Inventory
) -> GateDecision:
    _check_numbers(query.topk, query.group_size, query.num_local_kv_heads)
    force_path = switches.force_path
    if force_path is not None and force_path not in PATHS:
        raise ValueError(f"{FORCE_ENV}={force_path!r} is not a path; use one of {', '.join(PATHS)}")
    if not switches.enabled:
        return trace.done("general", None, f"kgen is disabled ({DISABLE_ENV}=1 or enabled=False)")

    spec, why = _resolve_layout(trace, query.model_arch, query.dims, inventory.layouts)
    trace.note(why)
    layout = spec.name if spec else None
    if force_path is not None:
        return trace.done(
            force_path,  # type: ignore[arg-type]
            layout,
            f"forced by {FORCE_ENV}={force_path} (debugging); kernels still refuse what they "
            "cannot handle and the chain falls through",
        )
    arch = _device_label(device_arch, switches.interpreter)
    if arch is None:
        return trace.done("general", layout, "no GPU: the Triton kernels need one (or TRITON_INTERPRET=1)")
    if arch == INTERPRETER_ARCH:
        trace.note("no GPU, TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter (tests only)")
    elif arch not in inventory.targets:
        return trace.done("general", layout, _not_a_target(arch, inventory.targets))
    if spec is None:
        return trace.done("general", None, why)
    return _decide_for_layout(trace, spec, arch, query, inventory)


def _decide_for_layout(trace: _Trace, spec: LayoutSpec, arch: str, query: GateQuery, inv: Inventory) -> GateDecision:
    kv_dtype, q_dtype, group_size = query.kv_dtype, query.q_dtype, query.group_size
    num_local_kv_heads = query.num_local_kv_heads
    kv = _canonical_or_none(kv_dtype, KV_DTYPES, "KV")
    q = _canonical_or_none(q_dtype, Q_DTYPES, "query")
    if kv not in spec.dtypes.kv or q not in spec.dtypes.q:
        return trace.done(
            "general",
            spec.name,
            f"layout {spec.name!r} is generated for KV {list(spec.dtypes.kv)} and query "
            f"{list(spec.dtypes.q)}, not KV {kv_dtype!r} / query {q_dtype!r}",
        )
    fp8_refused = _fp8_unsupported(arch, kv, inv.targets)
    if fp8_refused:
        return trace.done("general", spec.name, fp8_refused)
    grouped_uri = module_uri(spec.name, kv, q, "grouped")
    per_head_uri = module_uri(spec.name, kv, q, "per_head")
    if num_local_kv_heads > 1:
        trace.note(_kv_heads_note(num_local_kv_heads))
    per_head_ok = per_head_uri in inv.available_uris
    if group_size not in spec.attention.group_sizes:
        why = (
            f"group size {group_size} is not one of {spec.name!r}'s {list(spec.attention.group_sizes)} "
            "(the grouped kernel is specialized and tuned for those; add it to group_sizes and "
            "rebuild)"
        )
        return _fallback(trace, spec.name, why, per_head_ok, per_head_uri)
    if grouped_uri not in inv.available_uris:
        why = f"module {grouped_uri} is not generated (run `kgen build`)"
        return _fallback(trace, spec.name, why, per_head_ok, per_head_uri)
    config = _config_source(inv, arch, spec.name, kv, group_size)
    if config is None:
        why = f"no block config for {arch} and no built-in default (kgen/tables/defaults.json)"
        return _fallback(trace, spec.name, why, per_head_ok, per_head_uri)
    draft = "a chain" if query.topk == 1 else "a tree (the module reads its custom mask)"
    reason = (
        f"topk={query.topk}: {draft}, layout {spec.name!r} (group {group_size}), module {grouped_uri}, {config}; "
        f"{_kv_heads_note(num_local_kv_heads)}"
    )
    return trace.done("grouped", spec.name, reason)


def _fallback(trace: _Trace, layout: str, why: str, per_head_ok: bool, per_head_uri: str) -> GateDecision:
    if per_head_ok:
        return trace.done("per_head", layout, f"{why}; per-head split-KV module {per_head_uri} exists")
    return trace.done("general", layout, f"{why}; per-head module {per_head_uri} is not generated either")


def decide_path(
    query: GateQuery, *, device_arch: str | None, inventory: Inventory, switches: Switches = Switches()
) -> GateDecision:
    """Pure: the path the verify chain should start on for one model on one device.

    ``device_arch`` is ``"gfx950"``, ``"sm_90"``... or None without a GPU (then only
    ``switches.interpreter`` lets the kernels run, on CPU); an arch outside
    ``inventory.targets`` goes to the general path. Raises ValueError only for
    impossible numbers (topk < 1, ...) or an unknown forced path.
    """
    return _decide(_Trace(), query, device_arch, switches, inventory)


# --------------------------------------------------------------------------- impure edge


def scan_inventory(directory: Path | None = None, env: Mapping[str, str] | None = None) -> Inventory:
    """Read layouts, the generated modules' names and the block-config tables from disk.

    Modules are those ``kgen.load`` finds (its search path, ``$KGEN_GENERATED_DIR`` first),
    or only those in ``directory`` when given.
    """
    from kgen.blockconfig import read_defaults, resolve_tables
    from kgen.loader import available_modules, search_path
    from kgen.spec import load_layouts

    if directory is not None:
        uris = frozenset(p.stem for p in Path(directory).glob("verify_*.py"))
        where = str(directory)
    else:
        uris = frozenset(available_modules(env))
        where = os.pathsep.join(str(d) for d in search_path(env) if d.is_dir())
    entries: set[tuple[str, str, str, int]] = set()
    tuned: set[str] = set()
    notes: list[str] = []
    for arch, source in resolve_tables(env=dict(os.environ if env is None else env)).items():
        if source.table is None:
            continue
        notes.append(f"table {arch}: {source.origin} {source.path}")
        if source.table.metadata.tuned:
            tuned.add(arch)
        entries.update((arch, e.layout, e.kv_dtype, e.group_size) for e in source.table.entries)
    try:
        has_default = bool(read_defaults().rules)
    except ValueError as exc:
        notes.append(f"built-in defaults unreadable: {exc}")
        has_default = False
    return Inventory(
        layouts=load_layouts(),
        available_uris=uris,
        table_entries=frozenset(entries),
        tuned_arches=frozenset(tuned),
        has_default_config=has_default,
        generated_dir=where,
        notes=tuple(notes),
        targets=shipped_targets(),
    )


@functools.lru_cache(maxsize=1)
def cached_inventory() -> Inventory:
    """``scan_inventory()`` once per process: the hot path never touches the disk."""
    return scan_inventory()


def env_switches(env: Mapping[str, str] | None = None) -> Switches:
    """The switches from ``KGEN_DISABLE``, ``KGEN_FORCE_PATH`` and ``TRITON_INTERPRET``."""
    env = os.environ if env is None else env
    return Switches(
        enabled=not env_flag(DISABLE_ENV, env),
        force_path=env.get(FORCE_ENV, "").strip().lower() or None,
        interpreter=env_flag(INTERPRETER_ENV, env),
    )


# Default of `device_arch`: detect the GPU (pass None explicitly for "no GPU").
DETECT = object()


def _arch(device_arch: str | None | object) -> str | None:
    from kgen.runtime.device import detect_arch

    return detect_arch() if device_arch is DETECT else device_arch  # type: ignore[return-value]


def gate_from_env(
    query: GateQuery,
    *,
    enabled: bool = True,
    device_arch: str | None | object = DETECT,
    env: Mapping[str, str] | None = None,
    inventory: Inventory | None = None,
) -> GateDecision:
    """``decide_path`` with the switches read from the environment (``enabled=False`` turns
    kgen off whatever they say), the arch detected and the inventory scanned (once per
    process). Call it at engine start-up, not per step."""
    switches = env_switches(env)
    return decide_path(
        query,
        device_arch=_arch(device_arch),
        inventory=inventory if inventory is not None else cached_inventory(),
        switches=Switches(switches.enabled and enabled, switches.force_path, switches.interpreter),
    )


def _explain_one(query: GateQuery, arch: str | None, switches: Switches, inventory: Inventory) -> list[str]:
    trace = _Trace()
    decision = _decide(trace, query, arch, switches, inventory)
    order = PATHS[PATHS.index(decision.path) :]
    lines = [f"  group {query.group_size}, {query.num_local_kv_heads} TP-local KV head(s):"]
    lines += [f"    - {line}" for line in trace.lines]
    lines.append(f"    decision: {decision.path} (layout {decision.layout})")
    lines.append(f"    chain: {' -> '.join(order)} (first whose can_handle accepts runs)")
    return lines


def _default_dims(model_arch: str, inventory: Inventory) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    specs = sorted(layouts_for_architecture(model_arch, dict(inventory.layouts)), key=lambda s: s.name)
    if not specs:
        raise ValueError(
            f"no layout lists {model_arch!r}: pass qk_dim, pe_dim, v_dim and group_size, or add "
            "the architecture to a layout's `architectures`"
        )
    a = specs[0].attention
    return (a.qk_dim, a.pe_dim, a.v_head_dim), a.group_sizes


def explain_gate(
    model_arch: str,
    *,
    topk: int = 1,
    group_size: int | None = None,
    num_local_kv_heads: int = 1,
    qk_dim: int | None = None,
    pe_dim: int | None = None,
    v_dim: int | None = None,
    kv_dtype: str = "bfloat16",
    q_dtype: str = "bfloat16",
    device_arch: str | None | object = DETECT,
    env: Mapping[str, str] | None = None,
    inventory: Inventory | None = None,
) -> str:
    """A readable account of the gate's decision for ``kgen explain``.

    Widths left out are taken from the first layout listing ``model_arch``; without
    ``group_size`` every group size of that layout is explained. The environment switches,
    the device and the inventory are read like ``gate_from_env`` does.
    """
    inv = inventory if inventory is not None else cached_inventory()
    arch = _arch(device_arch)
    switches = env_switches(env)
    if None in (qk_dim, pe_dim, v_dim) or group_size is None:
        (dq, dp, dv), groups = _default_dims(model_arch, inv)
        dims = (qk_dim or dq, dp if pe_dim is None else pe_dim, v_dim or dv)
    else:
        dims, groups = (qk_dim, pe_dim, v_dim), ()
    group_list = (group_size,) if group_size is not None else groups
    lines = [
        f"kgen gate for {model_arch} (topk={topk}, qk {dims[0]}, pe {dims[1]}, v {dims[2]}, "
        f"KV {kv_dtype}, query {q_dtype})",
        f"  device: {arch or 'none'}{' (TRITON_INTERPRET=1)' if switches.interpreter else ''}",
        f"  switches: {DISABLE_ENV}={'0' if switches.enabled else '1'}, {FORCE_ENV}={switches.force_path or '-'}",
        f"  generated modules: {len(inv.available_uris)} in {inv.generated_dir or '?'}",
    ]
    lines += [f"  {note}" for note in inv.notes]
    for g in group_list:
        query = GateQuery(
            model_arch=model_arch, topk=topk, qk_dim=dims[0], pe_dim=dims[1], v_dim=dims[2],  # type: ignore[arg-type]
            group_size=g, num_local_kv_heads=num_local_kv_heads, kv_dtype=kv_dtype, q_dtype=q_dtype,
        )  # fmt: skip
        lines += _explain_one(query, arch, switches, inv)
    return "\n".join(lines)
