"""Packaging: the wheel ships generated/ as kgen/_generated/, and an installed kgen.load works without the generator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from kgen import loader

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "generated"


def test_every_folder_of_the_package_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        ".".join(p.relative_to(ROOT).parts)
        for p in [ROOT / "kgen", *(ROOT / "kgen").rglob("*")]
        if p.is_dir() and p.name != "__pycache__"
    }
    assert set(setuptools["packages"]) == folders | {"kgen._generated"}, "update [tool.setuptools] packages"
    assert setuptools["package-dir"] == {"kgen._generated": "generated"}
    assert loader.INSTALLED_DIR == ROOT / "kgen" / "_generated"


INSTALLED_CHECK = """
import json, sys
from pathlib import Path
import kgen, kgen.loader, kgen.locations
from kgen.spec import load_layouts
uris = []
for name, spec in sorted(load_layouts().items()):
    for kv in spec.dtypes.kv:
        for q in spec.dtypes.q:
            for variant, batch_invariant in (("grouped", False), ("per_head", False), ("grouped", True)):
                m = kgen.load(name, kv, q, variant=variant, batch_invariant=batch_invariant)
                assert Path(m.__file__).parent == kgen.loader.INSTALLED_DIR, m.__file__
                uris.append(m.URI)
bad = sorted(n for n in sys.modules if n.split(".")[0] == "jinja2" or n.startswith(("kgen.passes", "kgen.build")))
from kgen.cli import main
rc = main(["build", "-q"])
root = str(kgen.locations.source_root())
print(json.dumps({"kgen": kgen.__file__, "root": root, "uris": uris, "bad": bad, "rc": rc}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", loader.GENERATED_ENV)}
    return {**env, "TRITON_INTERPRET": "1", **extra}


def test_installed_wheel_loads_every_shipped_module_without_the_generator(tmp_path):
    # Build from a copy: an in-tree build leaves build/ behind, whose stale files would ship.
    source, wheels, target = tmp_path / "source", tmp_path / "wheels", tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__")
    for folder in ("kgen", "generated"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # The build and install read only this checkout: no index, no isolation (setuptools of this venv).
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)],
                   check=True, cwd=tmp_path, timeout=120, capture_output=True)  # fmt: skip
    (wheel,) = wheels.glob("kgen-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path, timeout=120, capture_output=True)  # fmt: skip
    before = sorted(p.relative_to(target) for p in target.rglob("*") if "__pycache__" not in p.parts)
    out = subprocess.run([sys.executable, "-c", INSTALLED_CHECK], cwd=tmp_path, env=clean_env(PYTHONPATH=str(target)),
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert Path(result["kgen"]).parent == target / "kgen"
    assert result["root"] == "None"  # not a source checkout
    assert sorted(result["uris"]) == sorted(p.stem for p in GENERATED.glob("verify_*.py"))
    assert result["bad"] == [], f"kgen.load imported build code: {result['bad']}"
    assert result["rc"] == 2 and "pass --out DIR" in out.stderr  # kgen build refuses site-packages
    after = sorted(p.relative_to(target) for p in target.rglob("*") if "__pycache__" not in p.parts)
    assert after == before


def test_the_engines_pins_agree_on_every_package_they_share():
    """CI installs every .ci/engines/*.txt into one venv, one after another: a package two
    files pin differently would end at whichever file came last, and the other engine's test
    would run against a version its pins do not name."""
    pins: dict[str, dict[str, str]] = {}
    for path in sorted((ROOT / ".ci" / "engines").glob("*.txt")):
        for line in path.read_text().splitlines():
            requirement = line.split("#")[0].strip()
            if requirement:
                name, sep, version = requirement.partition("==")
                assert sep, f"{path.name}: {requirement!r} is not pinned exactly (name==version)"
                pins.setdefault(name.lower().replace("_", "-"), {})[path.name] = version
    differing = {name: files for name, files in pins.items() if len(set(files.values())) > 1}
    assert not differing, f"pinned differently: {differing}"


def test_the_package_version_is_pyprojects() -> None:
    """kgen/version.py and pyproject.toml state one version."""
    from kgen.version import __version__

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_ci_sets_up_its_venvs_with_the_readmes_set_up_command() -> None:
    """.ci/run sets up each venv with the script the README's Quick start runs (its two commands:
    tests/test_cli.py) and runs the same test command, so the two cannot drift apart."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'bash scripts/setup-dev.sh --triton "$triton_version"' in ci
    assert "python -m pytest -q -n auto" in ci
    script = (ROOT / "scripts" / "setup-dev.sh").read_text()
    assert ".ci/engines/*.txt" in script  # the engines' pins, installed --no-deps
