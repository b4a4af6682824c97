"""Importing a real engine (SGLang, vLLM) in a test, as CI installs it: the pinned release,
without its GPU-only dependencies, from the pins in ``.ci/engines/<engine>.txt``.

CI sets ``KGEN_REQUIRE_ENGINES=1``, so there a missing engine fails the test instead of
skipping it: the integration tests must run against the engines' real code.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from kgen.launcher.switches import env_flag

PINS_DIR = Path(__file__).resolve().parents[1] / ".ci" / "engines"


def import_engine(engine: str, module: str) -> ModuleType:
    """``module`` of ``engine``'s installed release; a skip (a failure under CI) naming the
    install command when it is not importable."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        how = f"pip install --no-deps -r {PINS_DIR / (engine + '.txt')}"
        why = f"{engine} is not importable ({exc}); install its pinned release: {how}"
        if env_flag("KGEN_REQUIRE_ENGINES"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
