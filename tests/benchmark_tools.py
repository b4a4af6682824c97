"""The tools under benchmarks/ as modules: they are scripts, not a package, so tests load them by
path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_tool(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported as module ``name`` (registered in sys.modules first, where
    its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    return tool
