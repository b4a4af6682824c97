"""The FP8-math switch's plumbing, from the operator (``KGEN_FP8_MATH``) and the entries'
``fp8_math`` down to the Gluon prefix stage's launch (``GluonPrefixStage.prefix_launch``).

CPU only: the Gluon kernel cannot run here, so these tests check what reaches the launcher
and what it would compile (``launch_params``); the mode's numbers are checked on the GPU
(tests/test_gpu_fp8_math.py).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
from test_runtime_support import FakeModule, fake_loader, runtime_case, to_pages

import kgen
from kgen.integrations import vllm as kv
from kgen.launcher.gluon import GluonPrefixStage
from kgen.launcher.launches import GLUON_PREFIX_KERNEL, PREFIX_KERNEL
from kgen.plan import module_uri
from kgen.runtime.adapters import verify_chain_for
from kgen.runtime.chain import VerifyChain
from kgen.runtime.gate import GateDecision, GateQuery, Inventory, decide_path, env_switches, explain_gate
from kgen.spec import load_layouts

ARCH, SMS = "sm_90", 132
# gqa128's e4m3fn table row for group 8 at batches 33-96 on sm_90 has a gluon section; from_rows
# 128 asks for group x draft >= 128, so a draft of 16.
GROUP, BATCH, DRAFT = 8, 64, 16


def module():
    return kgen.load("gqa128", "float8_e4m3fn", "bfloat16")


def launcher(has_mode: bool = False):
    """A fresh launcher of the e4m3fn gqa128 module (its own set-up cache), with the mode's code
    where ``has_mode`` (identity.fp8_math, which the module gets when it is built with it) and the
    Gluon stage on whatever Triton is installed (launch_params only: nothing launches)."""
    base = module().LAUNCHER
    fresh = type(base)(replace(base.identity, fp8_math=has_mode), base.kernels, base.block_configs,
                       base.default_config)  # fmt: skip
    fresh.gluon_enabled = True
    return fresh


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_an_fp8_math_that_is_not_a_bool_raises_before_any_other_check(bad):
    # Every other argument is junk: an entry that checked them first would return False instead.
    mod = module()
    with pytest.raises(TypeError, match="fp8_math must be True or False"):
        mod.verify_shared_kv_fwd(*[None] * 15, fp8_math=bad)
    with pytest.raises(TypeError, match="fp8_math must be True or False"):
        mod.verify_paged_fwd(*[None] * 10, fp8_math=bad)
    with pytest.raises(TypeError, match="fp8_math must be True or False"):
        mod.launch(*[None] * 10, fp8_math=bad)


def _inventory() -> Inventory:
    layouts = load_layouts()
    uris = frozenset(
        module_uri(name, kv_dtype, q, variant)
        for name, spec in layouts.items()
        for kv_dtype in spec.dtypes.kv
        for q in spec.dtypes.q
        for variant in ("grouped", "per_head")
    )
    return Inventory(layouts=layouts, available_uris=uris)


def test_kgen_fp8_math_reaches_the_switches_the_decision_and_explain():
    on, off = {"KGEN_FP8_MATH": "1"}, {}
    assert env_switches(on).fp8_math is True and env_switches(off).fp8_math is False
    query = GateQuery("Qwen3ForCausalLM", topk=1, qk_dim=128, pe_dim=0, v_dim=128, group_size=8,
                      num_local_kv_heads=1, kv_dtype="float8_e4m3fn")  # fmt: skip
    for env, expected in ((on, True), (off, False)):
        decision = decide_path(query, device_arch=ARCH, inventory=_inventory(), switches=env_switches(env))
        assert decision.path == "grouped" and decision.fp8_math is expected
        text = explain_gate("Qwen3ForCausalLM", device_arch=ARCH, env=env, inventory=_inventory())
        assert f"KGEN_FP8_MATH={int(expected)}" in text


@pytest.mark.parametrize("fp8_math", [True, False])
def test_the_chain_passes_fp8_math_to_both_kernel_entries(fp8_math):
    fake = FakeModule("g", groups=(4,))
    # False: the chain's default, no argument given.
    chain = VerifyChain("fake", "float32", "float32", loader=fake_loader({"grouped": fake}),
                        **({"fp8_math": True} if fp8_math else {}))  # fmt: skip
    case = runtime_case([20, 8], [3, 2], group=4)
    assert chain(*case.flat_args(case.out()), None, True, None, case.max_len, 1.0, 1.0) == "grouped"
    assert fake.last_fp8_math is fp8_math
    fake.last_fp8_math = None
    pages = to_pages(case, 16)
    assert chain.paged(case.q, case.k, case.v, case.out(), pages["k_cache"], pages["v_cache"], pages["block_table"],
                       pages["prefix_lens"], case.qo_indptr, case.max_len) == "grouped"  # fmt: skip
    assert fake.last_fp8_math is fp8_math


def test_the_gate_and_the_vllm_layer_build_chains_with_the_operators_switch():
    gate_args = dict(
        model_arch="Qwen3ForCausalLM",
        num_q_heads=8,
        num_kv_heads=1,
        qk_dim=128,
        v_dim=128,
        device_arch=ARCH,
        inventory=_inventory(),
        loader=fake_loader({"grouped": FakeModule("g")}),
    )
    for env, expected in (({"KGEN_FP8_MATH": "1"}, True), ({}, False)):
        chain, decision = verify_chain_for(env=env, **gate_args)
        assert decision.path == "grouped" and chain.fp8_math is decision.fp8_math is expected
    gate = GateDecision("grouped", "gqa128", "test", fp8_math=True)
    layer = kv.KgenLayer(kv.LayerFacts("TRITON_ATTN", gate, max_verify_len=4), "bfloat16")
    assert layer.verify is not None and layer.verify.chain.fp8_math is True


@pytest.fixture
def gluon_calls(monkeypatch):
    """The fp8_math every GluonPrefixStage.prefix_launch call gets (it still chooses as before)."""
    seen = []
    original = GluonPrefixStage.prefix_launch
    signature = inspect.signature(original)

    def prefix_launch(*args, **kwargs):
        seen.append(signature.bind(*args, **kwargs).arguments.get("fp8_math", False))
        return original(*args, **kwargs)

    monkeypatch.setattr(GluonPrefixStage, "prefix_launch", prefix_launch)
    return seen


def test_launch_params_hand_fp8_math_to_the_gluon_stage(gluon_calls):
    fresh = launcher()
    for fp8_math in (True, False, True):  # through the cached set-up (the table row): fp8_math is in its key
        launches = fresh.launch_params(ARCH, SMS, GROUP, BATCH, DRAFT, fp8_math=fp8_math)
        assert launches[0][0] == GLUON_PREFIX_KERNEL
    assert gluon_calls == [True, False]
    config = dict(fresh.select_config(ARCH, GROUP, BATCH))
    fresh.launch_params(ARCH, SMS, GROUP, BATCH, DRAFT, config=config, fp8_math=True)  # a given config
    fresh.launch_params(ARCH, SMS, GROUP, BATCH, DRAFT, config=config)  # the default
    assert gluon_calls == [True, False, True, False]


def test_fp8_math_sets_the_gluon_programs_constexpr_and_leaves_the_triton_stage_alone():
    fresh = launcher(has_mode=True)
    config = dict(fresh.select_config(ARCH, GROUP, BATCH))
    # Without a landing ring (rules.gluon_fp8_math: the mode's K has no conversion to run ahead of).
    config["gluon"] = {k: v for k, v in config["gluon"].items() if k != "landing_stages"}
    modes = [fresh.launch_params(ARCH, SMS, GROUP, BATCH, DRAFT, config=config, fp8_math=f)[0] for f in (False, True)]
    assert [(name, constexprs["FP8_MATH"]) for name, constexprs, _ in modes] == [
        (GLUON_PREFIX_KERNEL, False),
        (GLUON_PREFIX_KERNEL, True),
    ]
    # A draft of 4 rows is below from_rows: the Triton stage, the same launches either way.
    triton = [fresh.launch_params(ARCH, SMS, GROUP, BATCH, 4, fp8_math=f) for f in (False, True)]
    assert triton[0][0][0] == PREFIX_KERNEL and triton[0] == triton[1]
    # A module without the mode's code compiles the same Gluon program whatever fp8_math says.
    plain = launcher()
    assert (plain.launch_params(ARCH, SMS, GROUP, BATCH, DRAFT, config=config, fp8_math=True)
            == plain.launch_params(ARCH, SMS, GROUP, BATCH, DRAFT, config=config))  # fmt: skip


@pytest.mark.parametrize("fp8_math", [True, False])
def test_both_entries_set_up_their_launch_with_fp8_math(monkeypatch, fp8_math):
    fresh = launcher()
    seen = []

    def setup_for(*args, **kwargs):
        seen.append(kwargs.get("fp8_math", False))
        return None  # no program: run raises before it launches anything

    monkeypatch.setattr(fresh, "setup_for", setup_for)
    case = runtime_case([20, 13], [2, 3], group=GROUP, d_qk=128, d_v=128, q_dtype=torch.bfloat16,
                        kv_dtype=torch.float8_e4m3fn)  # fmt: skip
    with pytest.raises(ValueError, match="no program fits"):
        fresh.verify_shared_kv_fwd(*case.flat_args(case.out()), None, True, None, case.max_len, 1.0, 1.0,
                                   fp8_math=fp8_math)  # fmt: skip
    pages = to_pages(case, 16)
    with pytest.raises(ValueError, match="no program fits"):
        fresh.verify_paged_fwd(case.q, case.k, case.v, case.out(), pages["k_cache"], pages["v_cache"],
                               pages["block_table"], pages["prefix_lens"], case.qo_indptr, case.max_len,
                               fp8_math=fp8_math)  # fmt: skip
    assert seen == [fp8_math, fp8_math]
