"""kgen.load only imports generated modules: it never runs the generator, and says how to build what is missing."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kgen
from kgen import check, loader, locations
from kgen.cli import main as kgen_main
from kgen.errors import UsageError
from kgen.passes import context

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "generated"
BUILD_MODULES = ("kgen.passes", "kgen.build", "jinja2")


def run_python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", loader.GENERATED_ENV)}
    return {**env, "TRITON_INTERPRET": "1", **extra}


LOADS_WITHOUT_BUILDING = """
import sys
import kgen
from kgen.runtime import VerifyChain
m = kgen.load("gqa64", "bf16")
chain = VerifyChain("qwen3_5_gqa256", "bf16", "bf16")
assert all(level.module is not None for level in chain.levels), chain.describe()
bad = sorted(n for n in sys.modules if n.split(".")[0] == "jinja2" or n.startswith(("kgen.passes", "kgen.build")))
print(m.__file__)
print(bad)
"""


def test_load_in_a_fresh_interpreter_imports_no_build_code(tmp_path):
    out = run_python(LOADS_WITHOUT_BUILDING, clean_env(PYTHONPATH=str(ROOT)), tmp_path)
    assert out.returncode == 0, out.stderr
    path, bad = out.stdout.splitlines()
    assert Path(path) == GENERATED / "verify_gqa64__kv_bf16__q_bf16.py"
    assert bad == "[]", f"kgen.load imported build code: {bad}"


def test_generated_dir_env_comes_first_and_holds_several_dirs(tmp_path):
    first, second = tmp_path / "empty", tmp_path / "mine"
    second.mkdir()
    name = "verify_gqa64__kv_bf16__q_bf16.py"
    (second / name).write_text((GENERATED / name).read_text() + '\nFROM_KGEN_GENERATED_DIR = True\n')
    env = clean_env(PYTHONPATH=str(ROOT), KGEN_GENERATED_DIR=os.pathsep.join([str(first), str(second)]))
    code = "import kgen; m = kgen.load('gqa64', 'bf16'); print(m.__file__, m.FROM_KGEN_GENERATED_DIR)"
    out = run_python(code, env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(second / name), "True"]


def test_search_path_order(monkeypatch, tmp_path):
    monkeypatch.setenv(loader.GENERATED_ENV, os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert loader.search_path() == (tmp_path / "a", tmp_path / "b", GENERATED, loader.INSTALLED_DIR)
    assert locations.source_root() == ROOT
    monkeypatch.delenv(loader.GENERATED_ENV)
    assert loader.generated_dir() == GENERATED


@pytest.fixture
def only_gqa64_bf16(monkeypatch, tmp_path):
    """A search path holding one module (gqa64, KV bf16, query bf16, grouped) and an empty cache."""
    shutil.copy(GENERATED / "verify_gqa64__kv_bf16__q_bf16.py", tmp_path)
    monkeypatch.setattr(loader, "search_path", lambda env=None: (tmp_path,))
    monkeypatch.setattr(loader, "_LOADED", {})
    return tmp_path


def test_missing_dtype_names_what_exists_and_how_to_build(only_gqa64_bf16):
    with pytest.raises(loader.ModuleNotGeneratedError) as err:
        kgen.load("gqa64", "fp8")
    text = str(err.value)
    assert "verify_gqa64__kv_fp8_e4m3fn__q_bf16.py" in text and str(only_gqa64_bf16) in text
    assert "kv bf16 / q bf16" in text
    assert "kgen build --out DIR" in text and "KGEN_GENERATED_DIR=DIR" in text
    assert not list(only_gqa64_bf16.glob("*fp8*")), "a failed load must not build the module"


def test_missing_variant_and_layout_with_a_spec_say_how_to_build(only_gqa64_bf16):
    with pytest.raises(loader.ModuleNotGeneratedError, match="kgen build --out DIR"):
        kgen.load("gqa64", "bf16", variant="per_head")
    with pytest.raises(loader.ModuleNotGeneratedError, match="'qwen3_5_gqa256' has a spec but no generated module"):
        kgen.load("qwen3_5_gqa256")


def test_unknown_layout_lists_the_generated_ones(only_gqa64_bf16):
    with pytest.raises(UsageError, match=r"unknown layout 'nope'; expected one of gqa64 \("):
        kgen.load("nope")
    assert kgen.load("gqa64", "bf16").URI == "verify_gqa64__kv_bf16__q_bf16"


# ----------------------------------------------------------------- kgen build's output directory


def test_build_writes_to_the_checkout_by_default():
    assert context.default_out_dir() == GENERATED


def test_build_outside_a_checkout_needs_out(monkeypatch, capsys):
    monkeypatch.setattr(context, "source_generated_dir", lambda: None)
    with pytest.raises(UsageError, match="pass --out DIR"):
        context.default_out_dir()
    assert context.default_out_dir(check_only=True) == loader.INSTALLED_DIR  # writes nothing
    assert kgen_main(["build", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--out DIR" in err and "KGEN_GENERATED_DIR" in err


def test_every_module_declares_its_public_names():
    """A module's __all__ is its documented surface (docs/design.md): every name exists, the engine
    entries are among them, and nothing of its machinery (rules, the switch parser) is."""
    for uri, path in loader.available_modules().items():
        module = check.load_module_file(path)
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{uri}: __all__ names {missing}, which the module lacks"
        assert {"verify_shared_kv_fwd", "can_handle", "why_not", "verify_paged_fwd", "launch"} <= set(module.__all__)
        assert not {"fit", "env_flag", "cdiv", "os", "torch", "triton"} & set(module.__all__), uri
        assert ("PE_DIM" in module.__all__) == hasattr(module, "PE_DIM"), uri
        assert ("TOKENS_PER_SPLIT" in module.__all__) == module.BATCH_INVARIANT, uri


def test_no_generated_module_holds_host_code():
    """At module level a generated module holds only imports, constants, its identity declaration
    (the LAUNCHER and the names bound from it) and @triton.jit / @gluon.jit functions: host code
    lives once, in kgen/launcher/. The build refuses such source too (inspect_source)."""
    import ast

    from kgen.passes.inspect_source import host_code

    paths = sorted(GENERATED.glob("verify_*.py"))
    assert len(paths) >= 72
    for path in paths:
        tree = ast.parse(path.read_text())
        found = [f"line {n.lineno}: {type(n).__name__}" for n in host_code(tree.body)]
        assert found == [], f"{path.name}: {found}"
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.col_offset == 0]
        assert functions, path.name


def test_the_host_code_rule_catches_host_code():
    """The rule above can fail: a plain function, a class, a loop or a lambda at module level."""
    import ast

    from kgen.passes.inspect_source import host_code

    source = '''
import triton
X = 3
@triton.jit
def kernel(a):
    pass
def helper():
    return 1
class Thing:
    pass
for i in range(2):
    pass
f = lambda: 0
if FLAG:
    def hidden():
        pass
'''
    found = [type(n).__name__ + (f" {n.name}" if hasattr(n, "name") else "") for n in host_code(ast.parse(source).body)]
    assert found == ["FunctionDef helper", "ClassDef Thing", "For", "Assign", "FunctionDef hidden"]


VENDORED = """
import sys
import torch
import verify_gqa64__kv_bf16__q_bf16 as m
torch.manual_seed(0)
P, L, H, D = 9, 2, 4, 64  # one request: 9 prefix tokens, a chain of 2, group 4, one KV head
kb, vb = torch.randn(P, 1, D, dtype=torch.bfloat16), torch.randn(P, 1, D, dtype=torch.bfloat16)
q, ke, ve = (torch.randn(L, n, D, dtype=torch.bfloat16) for n in (H, 1, 1))
o = torch.zeros(L, H, D, dtype=torch.bfloat16)
i32 = dict(dtype=torch.int32)
ok = m.verify_shared_kv_fwd(q, ke, ve, o, kb, vb, torch.tensor([0, L], **i32), torch.tensor([0, P], **i32),
                            torch.arange(P, dtype=torch.int64), None, True, None, L, 1.0, 1.0)
k, v = torch.cat([kb, ke]).float()[:, 0], torch.cat([vb, ve]).float()[:, 0]
s = torch.einsum("lhd,td->lht", q.float(), k) / D ** 0.5
s[:, :, P:] = s[:, :, P:].masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1)[:, None, :], float("-inf"))
ref = torch.einsum("lht,td->lhd", s.softmax(-1), v)
print(ok, float((o.float() - ref).abs().max()))
print(m.LAUNCHER.__class__.__module__)
print(sorted(n for n in sys.modules if n.split(".")[0] in ("kgen", "pydantic", "jinja2")))
"""


def test_a_module_runs_vendored_with_the_launcher_alone(tmp_path):
    """What an engine that vendors kernels copies: one generated module and kgen/launcher/ (under
    an empty kgen/__init__.py). It imports nothing else of kgen, nor pydantic or Jinja."""
    vendor = tmp_path / "vendor"
    shutil.copytree(ROOT / "kgen" / "launcher", vendor / "kgen" / "launcher",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (vendor / "kgen" / "__init__.py").write_text("")
    shutil.copy(GENERATED / "verify_gqa64__kv_bf16__q_bf16.py", vendor)
    out = run_python(VENDORED, clean_env(PYTHONPATH=str(vendor)), tmp_path)
    assert out.returncode == 0, out.stderr
    verdict, cls_module, imported = out.stdout.splitlines()
    ok, error = verdict.split()
    assert ok == "True" and float(error) < 0.05, verdict  # bf16 output against a float32 reference
    assert cls_module == "kgen.launcher.verify"
    names = ast.literal_eval(imported)
    assert names and all(n == "kgen" or n.startswith("kgen.launcher") for n in names), names
