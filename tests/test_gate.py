"""The gate's truth table with mocked devices and inventories (pure, no GPU, no kernels)."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_cases import build

import kgen
from kgen.launcher.switches import env_flag
from kgen.plan import module_uri
from kgen.runtime import device as device_mod
from kgen.runtime.gate import (
    GateDecision,
    GateQuery,
    Inventory,
    Switches,
    decide_path,
    env_switches,
    explain_gate,
    gate_from_env,
    scan_inventory,
)
from kgen.spec import KV_DTYPES, canonical_dtype, load_layouts, parse_layout
from kgen.targets import read_targets

LAYOUTS = load_layouts()
QWEN = dict(model_arch="Qwen3_5MoeForCausalLM", qk_dim=256, pe_dim=0, v_dim=256)
KIMI = dict(model_arch="KimiK3ForConditionalGeneration", qk_dim=576, pe_dim=64, v_dim=512)


def all_uris(layouts=LAYOUTS) -> frozenset[str]:
    return frozenset(
        module_uri(name, kv, q, variant)
        for name, spec in layouts.items()
        for kv in spec.dtypes.kv
        for q in spec.dtypes.q
        for variant in ("grouped", "per_head")
    )


def inventory(**changes) -> Inventory:
    base = dict(
        layouts=LAYOUTS,
        available_uris=all_uris(),
        table_entries=frozenset(
            ("gfx950", layout, "bfloat16", g)
            for layout, groups in (("qwen3_5_gqa256", (4, 8, 16)), ("mla_absorbed_512_64", (8, 16)))
            for g in groups
        ),
        tuned_arches=frozenset(),
        has_default_config=True,
    )
    base.update(changes)
    return Inventory(**base)


def query(model=QWEN, topk=1, group=16, kv_heads=1, **dtypes) -> GateQuery:
    return GateQuery(topk=topk, group_size=group, num_local_kv_heads=kv_heads, **model, **dtypes)


def decide(arch="gfx950", model=QWEN, topk=1, group=16, kv_heads=1, inv=None, **kw) -> GateDecision:
    switch_kw = {k: kw.pop(k) for k in ("enabled", "force_path", "interpreter") if k in kw}
    return decide_path(
        query(model, topk, group, kv_heads, **kw), device_arch=arch, inventory=inv or inventory(),
        switches=Switches(**switch_kw),
    )  # fmt: skip


# ------------------------------------------------------------------ the seed's cases


@pytest.mark.parametrize(
    ("arch", "path", "why"),
    [
        ("gfx950", "grouped", "gfx950 table"),
        ("gfx942", "grouped", "built-in default"),
        ("sm_90", "grouped", "built-in default"),
        ("sm_100", "grouped", "built-in default"),
        (None, "general", "no GPU"),
    ],
)
def test_truth_table_by_device(arch, path, why):
    for model, group in ((QWEN, 16), (KIMI, 16)):
        d = decide(arch=arch, model=model, group=group)
        assert d.path == path, d
        assert why in d.reason
        assert d.layout == ("qwen3_5_gqa256" if model is QWEN else "mla_absorbed_512_64")


def test_kimi_k3_mla_is_grouped():
    d = decide(model=KIMI, group=16)
    assert (d.path, d.layout) == ("grouped", "mla_absorbed_512_64")
    assert "verify_mla_absorbed_512_64__kv_bf16__q_bf16" in d.reason


@pytest.mark.parametrize("group", [4, 8, 16])
def test_qwen35_one_local_kv_head_is_grouped(group):
    d = decide(group=group, kv_heads=1)
    assert (d.path, d.layout) == ("grouped", "qwen3_5_gqa256")
    assert "1 TP-local KV head" in d.reason


def test_qwen35_two_local_kv_heads_follow_the_layout_and_say_so():
    # TP1: 32 query heads over 2 KV heads, group 16. SGLang refused this; kgen's kernel
    # has a program group per KV head, so the layout decides.
    d = decide(group=16, kv_heads=2)
    assert d.path == "grouped"
    assert "2 TP-local KV heads" in d.reason and "SGLang's gate required exactly 1" in d.reason
    # and a group the layout does not list is not grouped, whatever the KV heads
    assert decide(group=2, kv_heads=2).path == "per_head"


@pytest.mark.parametrize("topk", [2, 4, 8])
def test_topk_above_one_is_grouped_too(topk):
    """Trees go to the grouped kernel: the modules read the custom mask on the device."""
    d = decide(topk=topk)
    assert d.path == "grouped"
    assert f"topk={topk}: a tree" in d.reason


def test_kgen_disable_turns_everything_off():
    env = {"KGEN_DISABLE": "1"}
    d = gate_from_env(query(), device_arch="gfx950", env=env, inventory=inventory())
    assert d.path == "general" and "disabled" in d.reason
    assert decide(enabled=False).path == "general"


# ------------------------------------------------------------------ the rest of the table


@pytest.mark.parametrize("forced", ["grouped", "per_head", "general"])
def test_force_path_from_env(forced):
    env = {"KGEN_FORCE_PATH": forced}
    d = gate_from_env(query(topk=2), device_arch=None, env=env, inventory=inventory())
    assert d.path == forced and "KGEN_FORCE_PATH" in d.reason
    assert d.layout == "qwen3_5_gqa256"


def test_force_path_rejects_unknown_names():
    with pytest.raises(ValueError, match="KGEN_FORCE_PATH='fast'.*grouped, per_head, general"):
        decide(force_path="fast")


def test_disable_beats_force():
    assert decide(enabled=False, force_path="grouped").path == "general"


def test_interpreter_without_gpu_runs_kernels():
    d = decide(arch=None, interpreter=True)
    assert d.path == "grouped" and "built-in default" in d.reason


def test_unknown_model_goes_general_and_says_how_to_route_it():
    d = decide(model=dict(model_arch="MistralForCausalLM", qk_dim=128, pe_dim=0, v_dim=128), group=8)
    assert d.path == "general" and d.layout is None
    assert "architectures" in d.reason


def test_widths_that_do_not_match_the_layout_go_general():
    d = decide(model=dict(QWEN, qk_dim=128, v_dim=128))
    assert d.path == "general" and "qwen3_5_gqa256 (qk 256" in d.reason


def test_group_not_in_layout_goes_per_head_then_general():
    assert decide(group=32).path == "per_head"
    inv = inventory(available_uris=frozenset())
    d = decide(group=32, inv=inv)
    assert d.path == "general" and "not generated either" in d.reason


def test_missing_grouped_module_falls_back_to_per_head():
    uris = all_uris() - {module_uri("qwen3_5_gqa256", "bfloat16", "bfloat16", "grouped")}
    d = decide(inv=inventory(available_uris=uris))
    assert d.path == "per_head" and "kgen build" in d.reason


def test_no_block_config_at_all_is_not_grouped():
    d = decide(arch="sm_90", inv=inventory(has_default_config=False))
    assert d.path == "per_head" and "no block config" in d.reason
    # gfx950 still has its table rows
    assert decide(arch="gfx950", inv=inventory(has_default_config=False)).path == "grouped"


def test_tuned_tables_are_reported_as_tuned():
    d = decide(inv=inventory(tuned_arches=frozenset({"gfx950"})))
    assert "(tuned)" in d.reason


@pytest.mark.parametrize(
    ("kv", "q", "arch", "path"),
    [
        ("fp8", "bf16", "gfx950", "grouped"),
        ("float8_e4m3fnuz", "float16", "gfx942", "grouped"),
        # gfx950's FP8 is the OCP e4m3fn (kgen/tables/targets.json): the MI300 format is refused there.
        ("float8_e4m3fnuz", "float16", "gfx950", "general"),
        ("float16", "bfloat16", "gfx950", "grouped"),
        ("e5m2", "bfloat16", "gfx950", "grouped"),
        ("e5m2", "bfloat16", "gfx942", "general"),
        ("float32", "float32", "gfx950", "general"),
        ("bf16", "float32", "gfx950", "general"),
    ],
)
def test_dtypes_come_from_the_layout(kv, q, arch, path):
    assert decide(arch=arch, kv_dtype=kv, q_dtype=q).path == path


def test_architecture_mapping_is_data():
    custom = parse_layout(
        """
        name = "toy"
        architectures = ["ToyForCausalLM"]
        [attention]
        kind = "gqa"
        nope_dim = 64
        pe_dim = 0
        v_head_dim = 64
        group_sizes = [4]
        [dtypes]
        kv = ["bf16"]
        q = ["bf16"]
        """
    )
    layouts = {**LAYOUTS, "toy": custom}
    inv = inventory(layouts=layouts, available_uris=all_uris(layouts))
    d = decide(model=dict(model_arch="ToyForCausalLM", qk_dim=64, pe_dim=0, v_dim=64), group=4, inv=inv)
    assert (d.path, d.layout) == ("grouped", "toy")


def test_decide_path_is_pure(monkeypatch):
    monkeypatch.setenv("KGEN_DISABLE", "1")
    monkeypatch.setenv("KGEN_FORCE_PATH", "general")
    assert decide() == decide()
    assert decide().path == "grouped"  # the pure function never reads the environment


@pytest.mark.parametrize("bad", [dict(topk=0), dict(group=0), dict(kv_heads=0)])
def test_impossible_numbers_raise(bad):
    with pytest.raises(ValueError, match="must be >= 1"):
        decide(**bad)


def test_gate_decision_is_frozen():
    d = decide()
    with pytest.raises(AttributeError):
        d.path = "general"  # type: ignore[misc]


# ------------------------------------------------------------------ targets: the gate agrees with the modules

LLAMA = dict(model_arch="LlamaForCausalLM", qk_dim=128, pe_dim=0, v_dim=128)
# Every target, and two real archs outside targets.json (Turing, MI250).
ARCHS = [*read_targets(), "sm_75", "gfx90a"]


def _module_refusal(monkeypatch, kv: str, variant: str, arch: str) -> str:
    """The why_not of gqa128's module on ``arch`` (its device probe mocked) for a call it otherwise takes."""
    module = kgen.load("gqa128", kv_dtype=kv, variant=variant)
    monkeypatch.setattr(module.LAUNCHER, "device_info", lambda device_type, index: (arch, 132, arch.startswith("gfx")))
    case = build("gqa128", [40, 9], [2, 3], 8, kv_dtype=canonical_dtype(kv, KV_DTYPES, "KV"))
    return module.why_not(*case.sglang_args())


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3fn", "fp8_e4m3fnuz"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gate_refuses_exactly_the_archs_and_fp8_formats_the_modules_refuse(monkeypatch, arch, kv):
    """The gate reads kgen/tables/targets.json, each module the copy `kgen build` rendered into it:
    a grouped start the grouped and per-head kernels both refuse would be a wasted chain level,
    and a general start they would take a lost kernel."""
    refusals = {variant: _module_refusal(monkeypatch, kv, variant, arch) for variant in ("grouped", "per_head")}
    d = decide(arch=arch, model=LLAMA, group=8, kv_dtype=kv)
    if any(refusals.values()):
        assert all(arch in reason for reason in refusals.values()), refusals
        assert d.path == "general", (d, refusals)
        assert arch in d.reason and "why_not refuses it" in d.reason
    else:
        assert d.path == "grouped", d


def test_an_arch_outside_the_targets_names_them_and_the_bring_up():
    d = decide(arch="sm_75", model=LLAMA, group=8)
    assert (d.path, d.layout) == ("general", "gqa128")
    assert ", ".join(read_targets()) in d.reason
    assert "kgen/tables/targets.json" in d.reason and "`kgen check --arch sm_75`" in d.reason
    # the inventory's targets decide: an arch added there is served
    inv = inventory(targets={"sm_75": frozenset()})
    assert decide(arch="sm_75", model=LLAMA, group=8, inv=inv).path == "grouped"
    assert decide(arch="sm_90", model=LLAMA, group=8, inv=inv).path == "general"


def test_interpreter_is_not_held_to_the_targets():
    d = decide(arch=None, interpreter=True, kv_dtype="fp8_e4m3fnuz", inv=inventory(targets={}))
    assert d.path == "grouped", d


# ------------------------------------------------------------------ inventory and explain


def test_scan_inventory_sees_the_generated_modules():
    inv = scan_inventory()
    assert set(inv.layouts) == set(LAYOUTS)
    assert ("sm_90", "qwen3_5_gqa256", "bfloat16", 4) in inv.table_entries
    assert inv.has_default_config
    if not inv.available_uris:
        pytest.skip("no generated modules in this checkout (run `kgen build`)")
    assert module_uri("qwen3_5_gqa256", "bfloat16", "bfloat16", "grouped") in inv.available_uris
    assert module_uri("qwen3_5_gqa256", "bfloat16", "bfloat16", "per_head") in inv.available_uris


def test_explain_gate_lists_every_group_and_the_chain():
    text = explain_gate("Qwen3_5ForCausalLM", device_arch="gfx950", env={}, inventory=inventory())
    for g in (4, 8, 16):
        assert f"group {g}," in text
    assert "decision: grouped (layout qwen3_5_gqa256)" in text
    assert "grouped -> per_head -> general" in text
    off = explain_gate("Qwen3_5ForCausalLM", device_arch="gfx950", env={"KGEN_DISABLE": "1"}, inventory=inventory())
    assert "KGEN_DISABLE=1" in off and "decision: general" in off


def test_explain_gate_needs_numbers_for_unknown_models():
    with pytest.raises(ValueError, match="pass qk_dim"):
        explain_gate("NopeForCausalLM", device_arch="sm_90", env={}, inventory=inventory())
    text = explain_gate(
        "NopeForCausalLM", device_arch="sm_90", env={}, inventory=inventory(),
        qk_dim=128, pe_dim=0, v_dim=128, group_size=8,
    )  # fmt: skip
    assert "decision: general (layout None)" in text


# ------------------------------------------------------------------ device detection


@pytest.mark.parametrize(
    ("props", "arch"),
    [
        (dict(is_hip=True, gcn_arch_name="gfx950:sramecc+:xnack-"), "gfx950"),
        (dict(is_hip=True, gcn_arch_name="gfx942"), "gfx942"),
        (dict(is_hip=False, major=9, minor=0), "sm_90"),
        (dict(is_hip=False, major=10, minor=0), "sm_100"),
        (dict(is_hip=False, major=8, minor=9), "sm_89"),
    ],
)
def test_arch_from_properties(props, arch):
    assert device_mod.arch_from_properties(**props) == arch


def test_arch_from_properties_rejects_missing_data():
    with pytest.raises(ValueError, match="gcnArchName"):
        device_mod.arch_from_properties(is_hip=True)
    with pytest.raises(ValueError, match="compute capability"):
        device_mod.arch_from_properties(is_hip=False)


@pytest.mark.parametrize(
    ("hip", "props", "arch"),
    [
        (None, dict(major=9, minor=0), "sm_90"),
        (None, dict(major=10, minor=0), "sm_100"),
        ("6.4", dict(major=9, minor=5, gcnArchName="gfx950:sramecc+:xnack-"), "gfx950"),
        ("6.4", dict(major=9, minor=4, gcnArchName="gfx942:sramecc+:xnack-"), "gfx942"),
    ],
)
def test_detect_arch_with_mocked_devices(monkeypatch, hip, props, arch):
    device_mod._detect_cached.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(**props))
    monkeypatch.setattr(torch.version, "hip", hip)
    try:
        assert device_mod.detect_arch() == arch
        assert device_mod.detect_arch(0) == arch
        assert device_mod.detect_arch(torch.device("cpu")) is None
    finally:
        device_mod._detect_cached.cache_clear()


def test_detect_arch_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_mod.detect_arch() is None
    d = gate_from_env(query(), env={}, inventory=inventory())
    assert d.path == "general" and "no GPU" in d.reason


def test_arch_of_reads_torch_device_properties():
    cuda = types.SimpleNamespace(major=9, minor=0, name="H200")
    rocm = types.SimpleNamespace(major=9, minor=4, gcnArchName="gfx942:sramecc+:xnack-", name="MI300X")
    assert device_mod.arch_of(cuda, is_hip=False) == "sm_90"
    assert device_mod.arch_of(rocm, is_hip=True) == "gfx942"
    with pytest.raises(ValueError, match="gcnArchName"):
        device_mod.arch_of(cuda, is_hip=True)


@pytest.mark.parametrize(("value", "on"), [("1", True), (" TRUE ", True), ("on", True), ("0", False), ("", False)])
def test_switches_parse_flags_one_way(value, on):
    switches = env_switches({"KGEN_DISABLE": value, "TRITON_INTERPRET": value})
    assert switches == Switches(enabled=not on, force_path=None, interpreter=on)
    assert env_flag("X", {"X": value}) is on
