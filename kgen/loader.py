"""Find and import generated modules (``kgen.load``); never runs the generator.

A generated module is a plain file ``<uri>.py``. ``kgen.load`` looks for it in these
directories, in order (``search_path()``):

1. ``$KGEN_GENERATED_DIR``: one directory or several separated by ``os.pathsep``
   (where ``kgen build --out DIR`` wrote them);
2. the repository's ``generated/`` when kgen runs from a source checkout (or an
   editable install of one);
3. ``kgen/_generated/`` inside the installed package: the repository's ``generated/``
   shipped as package data (see pyproject.toml).

This module imports neither the compiler passes nor Jinja: an engine process that loads
kernels never builds one. Only when ``$KGEN_TABLES_DIR`` or ``$KGEN_TABLE`` is set does
``kgen.load`` run the planning passes once per module, to apply those tables
(``kgen/retable.py``). A module that is not found raises ``ModuleNotGeneratedError``
saying how to build it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from kgen.blockconfig import tables_overridden
from kgen.errors import UsageError
from kgen.locations import GENERATED_ENV, INSTALLED_DIR, source_generated_dir
from kgen.plan import VARIANTS, Variant, module_uri
from kgen.spec import KV_DTYPES, Q_DTYPES, canonical_dtype

_LAYOUT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE_NAME = re.compile(r"verify_(?:perhead_|batch_invariant_)?(?P<layout>\w+?)__kv_(?P<kv>\w+?)__q_(?P<q>\w+)")

_LOCK = threading.Lock()
_LOADED: dict[str, ModuleType] = {}


class ModuleNotGeneratedError(UsageError):
    """No generated module for the asked layout and dtypes in the search path (the message says how to build it)."""


def search_path(env: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """The directories ``kgen.load`` searches, in order (existing or not)."""
    env = os.environ if env is None else env
    dirs = [Path(p) for p in env.get(GENERATED_ENV, "").split(os.pathsep) if p.strip()]
    source = source_generated_dir()
    if source is not None:
        dirs.append(source)
    dirs.append(INSTALLED_DIR)
    unique: dict[Path, None] = {}
    for d in dirs:
        unique.setdefault(d, None)
    return tuple(unique)


def generated_dir(env: Mapping[str, str] | None = None) -> Path:
    """The first directory of ``search_path()`` that exists (the first place ``kgen.load`` looks)."""
    dirs = search_path(env)
    return next((d for d in dirs if d.is_dir()), dirs[0])


def available_modules(env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Every generated module in the search path by URI; an earlier directory wins."""
    found: dict[str, Path] = {}
    for directory in search_path(env):
        for path in sorted(directory.glob("verify_*.py")):
            found.setdefault(path.stem, path)
    return found


def check_variant(variant: str) -> Variant:
    """``variant`` if it is one of ``VARIANTS``, else a ``UsageError`` listing them."""
    if variant not in VARIANTS:
        raise UsageError(
            f"unknown variant {variant!r}; expected one of {', '.join(map(repr, VARIANTS))} "
            "('grouped': one program per block of query heads, 'per_head': one per query head)"
        )
    return variant  # type: ignore[return-value]


def _dirs_text(dirs: tuple[Path, ...]) -> str:
    return ", ".join(str(d) for d in dirs)


def _build_hint() -> str:
    return (
        f"build it with `kgen build --out DIR` (from a kgen source checkout) and set {GENERATED_ENV}=DIR "
        "before loading"
    )


def _spec_names() -> list[str]:
    """Names of the shipped layout specs; empty when they cannot be read (only for messages)."""
    from kgen.spec import load_layouts

    try:
        return sorted(load_layouts())
    except Exception:  # noqa: BLE001 - a broken spec must not hide the real error
        return []


def _not_found(layout: str, kv: str, q: str, variant: Variant, uri: str, mode: str) -> UsageError:
    """The error for a module that is not in the search path: what exists and how to build it."""
    dirs = search_path()
    modules = available_modules()
    built: dict[str, set[str]] = {}
    for name in modules:
        match = _MODULE_NAME.fullmatch(name)
        if match:
            built.setdefault(match["layout"], set()).add(f"kv {match['kv']} / q {match['q']}")
    if layout in built:
        return ModuleNotGeneratedError(
            f"no generated module {uri}.py for layout {layout!r} ({mode}, KV {kv}, query {q}) "
            f"in {_dirs_text(dirs)}; "
            f"the dtypes generated for it are {', '.join(sorted(built[layout]))}; "
            f"to use other dtypes add them to the layout spec and {_build_hint()}"
        )
    specs = _spec_names()
    if layout in specs:
        return ModuleNotGeneratedError(
            f"layout {layout!r} has a spec but no generated module {uri}.py in {_dirs_text(dirs)}; {_build_hint()}"
        )
    known = sorted(built) or specs
    return UsageError(
        f"unknown layout {layout!r}; expected one of {', '.join(known)} (the generated layouts; "
        f"`kgen list` shows the specs, and a new spec needs `kgen build --out DIR` and {GENERATED_ENV}=DIR)"
    )


def _import_file(uri: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kgen_generated.{uri}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import generated module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def load(layout: str, kv_dtype: str = "bfloat16", q_dtype: str = "bfloat16",
         variant: Variant = "grouped", batch_invariant: bool = False) -> ModuleType:
    """The generated module for a layout and dtypes (``bf16``/``fp8`` spellings accepted).

    ``batch_invariant=True`` gives the grouped kernel's batch-invariant mode (its own module,
    ``verify_batch_invariant_...``): a request's output bits do not depend on the batch it is
    in. The default modules are NOT batch invariant (docs/runtime.md).

    Imports ``<uri>.py`` from the first directory of ``search_path()`` that has it; each
    module is imported once per process. It never builds: a module that is not generated
    raises ``ModuleNotGeneratedError`` naming the dtypes that exist and how to build it.
    Unknown dtypes, variants or layouts raise ``kgen.errors.UsageError`` (a ``ValueError``)
    listing the valid values.
    """
    kv = canonical_dtype(kv_dtype, KV_DTYPES, "KV")
    q = canonical_dtype(q_dtype, Q_DTYPES, "query")
    variant = check_variant(variant)
    if not isinstance(batch_invariant, bool):
        raise UsageError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    layout = str(layout)
    if not _LAYOUT_NAME.fullmatch(layout):
        raise UsageError(f"unknown layout {layout!r}: a layout name is a Python identifier (`kgen list` shows them)")
    uri = module_uri(layout, kv, q, variant, batch_invariant)
    with _LOCK:
        module = _LOADED.get(uri)
        if module is not None:
            return module
        path = next((d / f"{uri}.py" for d in search_path() if (d / f"{uri}.py").is_file()), None)
        if path is None:
            raise _not_found(layout, kv, q, variant, uri, "batch-invariant" if batch_invariant else variant)
        module = _import_file(uri, path)
        if tables_overridden():
            # Imported here, not at the top: without user tables the passes are never loaded.
            from kgen.retable import apply_tables

            apply_tables(module, layout, kv, q, variant, batch_invariant)
        _LOADED[uri] = module
        return module
