"""Find and import generated modules (``kgen.load``)."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

from kgen.plan import Variant, module_uri
from kgen.spec import KV_DTYPES, Q_DTYPES, canonical_dtype

_LOCK = threading.Lock()
_LOADED: dict[str, ModuleType] = {}


def generated_dir() -> Path:
    """``$KGEN_GENERATED_DIR`` if set, else the repository's ``generated/``."""
    env = os.environ.get("KGEN_GENERATED_DIR")
    if env:
        return Path(env)
    from kgen.passes.context import DEFAULT_OUT_DIR

    return DEFAULT_OUT_DIR


def _build_one(layout: str, kv_dtype: str, q_dtype: str, variant: Variant, out_dir: Path) -> Path:
    from kgen.build import build_one

    return Path(build_one(layout, kv_dtype, q_dtype, variant, out_dir=out_dir).output_path)


def load(layout: str, kv_dtype: str = "bfloat16", q_dtype: str = "bfloat16",
         variant: Variant = "grouped") -> ModuleType:
    """The generated module for a layout and dtypes (``bf16``/``fp8`` spellings accepted).

    Loads ``generated/<uri>.py``; if the file is missing (an installed kgen without the
    repository), builds it into ``$KGEN_GENERATED_DIR`` or the repository's generated/.
    """
    kv = canonical_dtype(kv_dtype, KV_DTYPES, "KV")
    q = canonical_dtype(q_dtype, Q_DTYPES, "query")
    uri = module_uri(layout, kv, q, variant)
    with _LOCK:
        module = _LOADED.get(uri)
        if module is not None:
            return module
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
