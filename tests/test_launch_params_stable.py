"""Every generated module's launch_params returns what it returned when this expectation was
written, over a sweep of archs, block configs, groups, batches, draft lengths, page sizes and
chains and trees (a custom mask).

The compiler's plan, passes and templates may be rearranged freely; what a module launches
may not change by accident. The expectation holds one digest per (module, arch) of the JSON
of every launch in the sweep. When a change is meant to alter launches (a table row, a
target in kgen/tables/targets.json, a launch rule in kgen/launcher/rules.py), rewrite it with
``python tests/test_launch_params_stable.py --write`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

GENERATED = Path(__file__).resolve().parents[1] / "generated"
EXPECTED = Path(__file__).resolve().parent / "launch_params_expected.json"
# Each target at a multiprocessor count of its flagship part (the split grid depends on it).
ARCH_SMS = {"sm_80": 108, "sm_89": 128, "sm_90": 132, "sm_100": 148, "gfx942": 304, "gfx950": 256,
            "interpreter": 4}
CONFIGS = {
    "table": None,  # the module's own table row or default
    "wide": {"block_h": 16, "block_n": 64, "num_warps": 8, "num_stages": 3, "lazy_rescale": True,
             "split": {"programs_per_sm": 2, "max_splits": 32, "min_tokens_per_split": 64}},
    "amd": {"block_h": 4, "block_n": 32, "num_warps": 4, "num_stages": 1, "waves_per_eu": 2, "kpack": 2,
            "matrix_instr_nonkdim": 16, "draft_tile": "first"},
}
GROUPS = (1, 4, 6, 8, 16)
BATCHES = (1, 64, 200)
DRAFT_LENGTHS = (1, 4, 7, 16, 33, 64)
PAGE_SIZES = (None, 16)
MASKS = (False, True)


def _load(path: Path) -> ModuleType:
    """The module, as on a GPU machine with PDL available and, where the module has a Gluon
    stage, the Triton it is written for (the sweep must not depend on TRITON_INTERPRET,
    KGEN_NO_PDL, KGEN_NO_GLUON or the installed Triton)."""
    spec = importlib.util.spec_from_file_location(f"stable_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.LAUNCHER.interpret, module.LAUNCHER.no_pdl, module.LAUNCHER.grid_dependency_control = False, False, True
    if hasattr(module, "_HAS_GLUON"):
        module.LAUNCHER.gluon_enabled = True
    return module


def sweep_digests(module: ModuleType) -> dict[str, str]:
    """arch -> sha256 of the JSON of launch_params over the whole sweep on that arch."""
    digests = {}
    for arch, num_sms in ARCH_SMS.items():
        launches = [module.launch_params(arch, num_sms, group, batch, length, page_size, config, has_mask=mask)
                    for config in CONFIGS.values() for group in GROUPS for batch in BATCHES
                    for length in DRAFT_LENGTHS for page_size in PAGE_SIZES for mask in MASKS]
        digests[arch] = hashlib.sha256(json.dumps(launches, default=str).encode()).hexdigest()
    return digests


def _modules() -> list[Path]:
    return sorted(GENERATED.glob("verify*.py"))


def test_the_expectation_covers_every_generated_module():
    expected = json.loads(EXPECTED.read_text())
    assert sorted(expected) == [p.stem for p in _modules()], \
        "generated/ and tests/launch_params_expected.json list different modules: rewrite it (see the docstring)"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.stem)
def test_launch_params_are_unchanged(path: Path):
    expected = json.loads(EXPECTED.read_text()).get(path.stem)
    assert expected is not None, f"{path.stem} has no expectation: rewrite it (see the docstring)"
    changed = [arch for arch, digest in sweep_digests(_load(path)).items() if expected.get(arch) != digest]
    assert not changed, (f"{path.stem}: launch_params changed on {', '.join(changed)}; if that is meant, rewrite "
                         f"{EXPECTED.name} with `python {Path(__file__).name} --write`")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    EXPECTED.write_text(json.dumps({p.stem: sweep_digests(_load(p)) for p in _modules()}, indent=1) + "\n")
    print(f"wrote {EXPECTED}")
