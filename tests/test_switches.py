"""One way to parse an on/off switch: every generated module carries kgen/env.py's parser as
it is, and reads the environment through it alone."""

import ast
from pathlib import Path

import pytest

import kgen.env

GENERATED = Path(__file__).resolve().parents[1] / "generated"
MODULES = sorted(GENERATED.glob("verify_*.py"))


def _top_level(tree: ast.Module, name: str) -> ast.stmt:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
    raise AssertionError(f"no top-level {name}")


def _environ_reads_outside(tree: ast.Module, parser: ast.FunctionDef) -> list[int]:
    inside = {id(n) for n in ast.walk(parser)}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv") and id(n) not in inside]


def test_the_shipped_modules_are_found():
    assert MODULES, f"no generated modules under {GENERATED}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_module_parses_switches_with_kgen_env(path):
    tree = ast.parse(path.read_text())
    ours = ast.parse(Path(kgen.env.__file__).read_text())
    for name in ("env_flag", "TRUE_VALUES"):
        assert ast.dump(_top_level(tree, name)) == ast.dump(_top_level(ours, name)), f"{path.name}: {name}"
    parser = _top_level(tree, "env_flag")
    assert _environ_reads_outside(tree, parser) == [], f"{path.name} reads the environment past env_flag"

