"""The variant patches of benchmarks/exp_variants.py still apply to today's generated text
and stay correct (interpreter): a template change that breaks them fails here, not on the GPU."""

import importlib.util
from pathlib import Path

import pytest
import torch
from kernel_cases import build, tolerance

import kgen
from kgen.testing import relative_error

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("exp_variants", ROOT / "benchmarks" / "exp_variants.py")
exp_variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp_variants)


@pytest.mark.parametrize(("layout", "kv"), [("qwen3_5_gqa256", "bfloat16"), ("qwen3_5_gqa256", "float8_e4m3fn"),
                                            ("gqa64", "bfloat16")])
def test_unmasked_full_tiles_patch_applies(layout, kv):
    text = Path(kgen.load(layout, kv).__file__).read_text()
    patched = exp_variants.unmasked_full_tiles(text)
    assert patched != text and patched.count("for start_n in range(") == 2
    assert "full_end = split_start" in patched


def test_lazy_is_the_config_switch_not_a_patch():
    module = kgen.load("qwen3_5_gqa256", "bfloat16")
    variants, configs = exp_variants.lazy_configs(module, ("qk_ahead", "lazy"), (None, {"block_n": 32}), 16, 64)
    assert variants == ("qk_ahead",)
    assert configs[0] == {**module._DEFAULT_CONFIG, "lazy_rescale": True}
    assert configs[1] == {"block_n": 32, "lazy_rescale": True}
    assert exp_variants.lazy_configs(module, ("unmasked",), (None,), 16, 64) == (("unmasked",), (None,))
    assert "lazy" not in exp_variants.PATCHES


@pytest.mark.parametrize("variants", [("unmasked",), ("fused", "unmasked"), ("lazy",), ("qk_ahead",),
                                      ("qk_ahead", "lazy"), ("no_pdl",),
                                      ("half",), ("half", "fused", "unmasked"),
                                      ("e4m3", "fp16_qk"), ("e4m3", "precise_qk"), ("draft_after",),
                                      ("draft_first64",), ("pdl_late_trigger",), ("transposed_loop",),
                                      ("transposed_loop", "lazy")])
def test_variants_match_the_reference(tmp_path, variants):
    # qk_ahead and transposed_loop rewrite the 16-bit loop; FP8 modules (bf16 q) carry the
    # e4m3 q.k beside it.
    kv = "bfloat16" if {"qk_ahead", "transposed_loop"} & set(variants) else "float8_e4m3fn"
    base = kgen.load("qwen3_5_gqa256", kv)
    variants, (config,) = exp_variants.lazy_configs(base, variants, (exp_variants.cfg(8, 16, 4, 1, 8, 16),), 8, 3)
    module = exp_variants.load_variant("qwen3_5_gqa256", kv, variants, str(tmp_path))
    scales = {"k_scale": 0.6, "v_scale": 1.7} if kv != "bfloat16" else {}
    case = build("qwen3_5_gqa256", [70, 0, 33], [4, 2, 3], 8, kv_dtype=kv, seed=5, **scales)
    module.launch(*case.launch_args(), config=config)
    assert relative_error(case.o, case.reference(torch.float64)) <= tolerance(case)


def test_saved_variant_loads_the_whole_saved_module(tmp_path, monkeypatch):
    """`saved:TAG` replaces the module text with SAVED_DIR/<URI>__TAG.py (an older build)."""
    base = kgen.load("gqa64", "bfloat16")
    saved = Path(base.__file__).read_text().replace('VARIANT = "grouped"', 'VARIANT = "grouped"\nSAVED_MARK = 1')
    (tmp_path / f"{base.URI}__prev.py").write_text(saved)
    monkeypatch.setattr(exp_variants, "SAVED_DIR", str(tmp_path))
    module = exp_variants.load_variant("gqa64", "bfloat16", ("saved:prev",), str(tmp_path / "out"))
    assert module.SAVED_MARK == 1
    case = build("gqa64", [40, 3], [3, 1], 8, seed=2)
    module.launch(*case.launch_args())
    assert relative_error(case.o, case.reference(torch.float64)) <= tolerance(case)
    with pytest.raises(FileNotFoundError):
        exp_variants.load_variant("gqa64", "bfloat16", ("saved:missing",), str(tmp_path / "out"))


@pytest.mark.parametrize("probe", ["no_merge_probe", "no_prefix_loop_probe"])
def test_timing_probes_apply_and_change_the_output(tmp_path, probe):
    """The probes still patch today's text, and their output is wrong as documented (a probe
    that silently matched the reference would be timing the shipped kernel)."""
    module = exp_variants.load_variant("qwen3_5_gqa256", "bfloat16", (probe,), str(tmp_path))
    case = build("qwen3_5_gqa256", [70, 33], [4, 3], 8, seed=6)
    case.o.zero_()
    module.launch(*case.launch_args(), config=exp_variants.cfg(8, 16, 4, 1, 8, 16))
    assert relative_error(case.o, case.reference(torch.float64)) > 10 * tolerance(case)
