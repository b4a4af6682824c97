"""Where kgen's files live: the source checkout (if kgen runs from one), the installed
package's generated modules, and the environment variables that point elsewhere. Imports only
the standard library, so the loader and the build both read these facts from one place."""

from __future__ import annotations

import functools
import re
from pathlib import Path

GENERATED_ENV = "KGEN_GENERATED_DIR"
TABLES_DIR_ENV = "KGEN_TABLES_DIR"
PACKAGE_DIR = Path(__file__).resolve().parent
INSTALLED_DIR = PACKAGE_DIR / "_generated"


@functools.lru_cache(maxsize=1)
def source_root() -> Path | None:
    """The repository root when kgen runs from a source checkout (or an editable install), else None.

    A checkout is recognized by kgen's own ``pyproject.toml`` next to the package; an
    installed kgen sits in site-packages, which has none.
    """
    pyproject = PACKAGE_DIR.parent / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    return PACKAGE_DIR.parent if re.search(r'^name\s*=\s*"kgen"', text, re.MULTILINE) else None


def source_generated_dir() -> Path | None:
    """The repository's ``generated/`` in a source checkout, else None."""
    root = source_root()
    return root / "generated" if root is not None else None
