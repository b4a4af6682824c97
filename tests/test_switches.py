"""One way to parse an on/off switch: kgen/launcher/switches.py's env_flag. Generated modules read
no environment themselves, and the launcher they run reads it through env_flag alone."""

import ast
from pathlib import Path

import pytest

import kgen.launcher
import kgen.launcher.switches

GENERATED = Path(__file__).resolve().parents[1] / "generated"
MODULES = sorted(GENERATED.glob("verify_*.py"))
LAUNCHER_FILES = sorted(Path(kgen.launcher.__file__).parent.glob("*.py"))


def _environ_reads(tree: ast.Module) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv")]


def test_the_shipped_modules_are_found():
    assert MODULES, f"no generated modules under {GENERATED}"
    assert Path(kgen.launcher.switches.__file__) in LAUNCHER_FILES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_a_module_reads_no_environment(path):
    tree = ast.parse(path.read_text())
    assert _environ_reads(tree) == [], f"{path.name} reads the environment; switches belong to kgen.launcher"
    assert "import os" not in path.read_text()


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=lambda p: p.name)
def test_the_launcher_reads_switches_through_env_flag(path):
    """Only switches.py touches os.environ; the rest of the launcher calls env_flag."""
    reads = _environ_reads(ast.parse(path.read_text()))
    if path.name == "switches.py":
        assert reads, "env_flag reads os.environ"
    else:
        assert reads == [], f"{path.name} reads the environment past env_flag"
