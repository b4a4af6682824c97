"""Programmatic dependent launch (grid dependency control) with mocked device properties:
only NVIDIA sm_90+ launches ask for it, never the interpreter, ROCm or older GPUs, and every
kernel that may start early waits (gdc_wait) before it reads what an earlier kernel wrote."""

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
from case_tools import patch_kernels
from kernel_cases import build

import kgen
from kgen.launcher.switches import env_flag

MODULE = kgen.load("qwen3_5_gqa256", "bfloat16")


@pytest.mark.parametrize(("arch", "rocm", "pdl"), [("sm_90", False, True), ("sm_100", False, True),
                                                   ("sm_80", False, False), ("gfx950", True, False),
                                                   ("interpreter", False, False)])
def test_pdl_on_hopper_and_later_only(monkeypatch, arch, rocm, pdl):
    monkeypatch.setattr(MODULE.LAUNCHER, "interpret", False)
    assert MODULE.LAUNCHER.use_pdl(arch, rocm) == pdl


def _fresh_copy(name: str):
    """The module imported again: its switches are read from the environment at import."""
    spec = importlib.util.spec_from_file_location(name, MODULE.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


def test_engines_can_turn_pdl_off(monkeypatch):
    monkeypatch.setattr(MODULE.LAUNCHER, "interpret", False)
    monkeypatch.setattr(MODULE.LAUNCHER, "no_pdl", True)
    assert not MODULE.LAUNCHER.use_pdl("sm_90", False)
    monkeypatch.setattr(MODULE.LAUNCHER, "no_pdl", False)
    assert MODULE.LAUNCHER.use_pdl("sm_90", False)
    # The switch is read from the environment when a module is imported.
    monkeypatch.setenv("KGEN_NO_PDL", "1")
    assert _fresh_copy("no_pdl_copy").LAUNCHER.no_pdl is True


@pytest.mark.parametrize(("value", "pdl_off"), [("true", True), (" Yes ", True), ("ON", True), ("1", True),
                                                ("0", False), ("false", False), ("off", False), ("", False)])
def test_no_pdl_is_parsed_like_every_kgen_switch(monkeypatch, value, pdl_off):
    # KGEN_NO_PDL=true once left PDL on: the module compared the value with "1" alone.
    monkeypatch.setenv("KGEN_NO_PDL", value)
    copy = _fresh_copy("no_pdl_parsed_copy")
    monkeypatch.setattr(copy.LAUNCHER, "interpret", False)
    monkeypatch.setattr(copy.LAUNCHER, "grid_dependency_control", True)
    assert copy.LAUNCHER.no_pdl is pdl_off is env_flag("KGEN_NO_PDL")
    assert copy.LAUNCHER.use_pdl("sm_90", False) is not pdl_off


def test_no_pdl_under_the_interpreter_or_without_gdc(monkeypatch):
    assert MODULE.LAUNCHER.interpret  # the CPU tests run the interpreter
    assert not MODULE.LAUNCHER.use_pdl("sm_90", False)
    monkeypatch.setattr(MODULE.LAUNCHER, "interpret", False)
    monkeypatch.setattr(MODULE.LAUNCHER, "grid_dependency_control", False)
    assert not MODULE.LAUNCHER.use_pdl("sm_90", False)


class _Recorder:
    """Stands in for a @triton.jit kernel: records the launch keywords."""

    def __init__(self):
        self.kwargs = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


@pytest.mark.parametrize(("arch", "rocm"), [("sm_90", False), ("gfx950", True)])
def test_both_launches_carry_the_same_pdl_choice(monkeypatch, arch, rocm):
    prefix, merge = _Recorder(), _Recorder()
    monkeypatch.setattr(MODULE.LAUNCHER, "interpret", False)
    patch_kernels(monkeypatch, MODULE, prefix=prefix)
    patch_kernels(monkeypatch, MODULE, merge=merge)
    monkeypatch.setattr(MODULE.LAUNCHER, "device_info", lambda device_type, index: (arch, 8, rocm))
    case = build("qwen3_5_gqa256", [300], [2], 16, seed=1)
    MODULE.launch(*case.launch_args(), config={"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 2,
                                               "split": {"programs_per_sm": 4, "min_tokens_per_split": 16}})
    assert len(prefix.kwargs) == 1 and len(merge.kwargs) == 1, "the case must need a merge"
    for kwargs in prefix.kwargs + merge.kwargs:
        assert kwargs["USE_PDL"] is (not rocm)
        assert kwargs.get("launch_pdl", False) is (not rocm)


def _calls_in_order(kernel) -> list[str]:
    tree = ast.parse(inspect.getsource(kernel.fn))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return [c.func.id for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


@pytest.mark.parametrize("layout", ["qwen3_5_gqa256", "mla_absorbed_512_64"])
@pytest.mark.parametrize("kernel", ["_verify_prefix_stage", "_verify_merge_stage"])
def test_kernels_wait_before_their_first_read(layout, kernel):
    calls = _calls_in_order(getattr(kgen.load(layout, "bfloat16"), kernel))
    assert "gdc_wait" in calls, f"{kernel} never waits for the kernel before it"
    assert calls.index("gdc_wait") < calls.index("_request_bounds"), f"{kernel} reads before gdc_wait"
    # No early trigger: it let the merge launch while the prefix stage still ran, slower at
    # batch 16 on the H200 (docs/perf-notes.md, "Programmatic dependent launch").
    assert "gdc_launch_dependents" not in calls


def _module_function_calls(module, name: str) -> list[str]:
    """The calls of a function of a generated module's file, in source order (read from the
    file: the Gluon stage is defined only where Gluon imports)."""
    tree = ast.parse(Path(module.__file__).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    return [c.func.id for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


@pytest.mark.parametrize(("layout", "kv"), [("mla_absorbed_512_64", "bfloat16"), ("gqa128", "bfloat16"),
                                            ("gqa128", "float8_e4m3fn")])
def test_the_gluon_stage_waits_before_its_first_read(layout, kv):
    calls = _module_function_calls(kgen.load(layout, kv), "_gluon_prefix_stage")
    assert calls.index("_gluon_gdc_wait") < calls.index("_gluon_request_bounds")
    assert "gdc_launch_dependents" not in calls


@pytest.mark.parametrize("no_pdl", [False, True])
def test_the_gluon_stage_launches_early_where_pdl_applies(monkeypatch, no_pdl):
    """A Gluon row on sm_90 launches with PDL (launch_pdl, USE_PDL) as the Triton stage does,
    and both stop where the engine turns PDL off."""
    module = kgen.load("mla_absorbed_512_64", "bfloat16")
    monkeypatch.setattr(module.LAUNCHER, "interpret", False)
    monkeypatch.setattr(module.LAUNCHER, "gluon_enabled", True)
    monkeypatch.setattr(module.LAUNCHER, "no_pdl", no_pdl)
    setup = module.LAUNCHER.launch_setup("sm_90", 132, 16, 64, 4, None, None)
    assert setup.prefix_kernel == "_gluon_prefix_stage"
    assert setup.prefix_constexprs["USE_PDL"] is (not no_pdl)
    assert setup.prefix_pdl == ({} if no_pdl else {"launch_pdl": True}) == setup.merge_pdl
