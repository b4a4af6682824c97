"""Find and import generated modules (``kgen.load``)."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from kgen.errors import UsageError
from kgen.plan import VARIANTS, Variant, module_uri
from kgen.spec import KV_DTYPES, Q_DTYPES, canonical_dtype, load_layouts

_LOCK = threading.Lock()
_LOADED: dict[str, ModuleType] = {}


def generated_dir() -> Path:
    """``$KGEN_GENERATED_DIR`` if set, else the repository's ``generated/``."""
    env = os.environ.get("KGEN_GENERATED_DIR")
    if env:
        return Path(env)
    from kgen.passes.context import DEFAULT_OUT_DIR

    return DEFAULT_OUT_DIR


def check_variant(variant: str) -> Variant:
    """``variant`` if it is one of ``VARIANTS``, else a ``UsageError`` listing them."""
    if variant not in VARIANTS:
        raise UsageError(
            f"unknown variant {variant!r}; expected one of {', '.join(map(repr, VARIANTS))} "
            "('grouped': one program per block of query heads, 'per_head': one per query head)"
        )
    return variant  # type: ignore[return-value]


def _known_layouts(directory: Path) -> list[str]:
    """Layout names of the shipped specs and of the modules already in ``directory``."""
    names = set(load_layouts())
    for path in directory.glob("verify_*__kv_*.py"):
        stem = path.stem.removeprefix("verify_").removeprefix("perhead_")
        names.add(stem.split("__kv_")[0])
    return sorted(names)


def _check_layout(layout: str, directory: Path) -> None:
    """A layout must be a shipped spec or have modules in ``directory`` (it becomes part of a file name)."""
    known = _known_layouts(directory)
    if layout not in known:
        raise UsageError(f"unknown layout {layout!r}; expected one of {', '.join(known)} (`kgen list` shows the specs)")


def _build_one(layout: str, kv_dtype: str, q_dtype: str, variant: Variant, out_dir: Path) -> Path:
    from kgen.build import build_one

    return Path(build_one(layout, kv_dtype, q_dtype, variant, out_dir=out_dir).output_path)


def load(layout: str, kv_dtype: str = "bfloat16", q_dtype: str = "bfloat16",
         variant: Variant = "grouped") -> ModuleType:
    """The generated module for a layout and dtypes (``bf16``/``fp8`` spellings accepted).

    Loads ``generated/<uri>.py``; if the file is missing (an installed kgen without the
    repository), builds it into ``$KGEN_GENERATED_DIR`` or the repository's generated/.
    Unknown dtypes, variants or layouts raise ``kgen.errors.UsageError`` (a ``ValueError``)
    listing the valid values.
    """
    kv = canonical_dtype(kv_dtype, KV_DTYPES, "KV")
    q = canonical_dtype(q_dtype, Q_DTYPES, "query")
    variant = check_variant(variant)
    uri = module_uri(str(layout), kv, q, variant)
    with _LOCK:
        module = _LOADED.get(uri)
        if module is not None:
            return module
        _check_layout(layout, generated_dir())
        path = generated_dir() / f"{uri}.py"
        if not path.exists():
            path = _build_one(layout, kv, q, variant, generated_dir())
        spec = importlib.util.spec_from_file_location(f"kgen_generated.{uri}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import generated module {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _LOADED[uri] = module
        return module
