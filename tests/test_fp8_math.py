"""The FP8-math mode (a call's fp8_math=True, the operator's KGEN_FP8_MATH; issue 37): an e4m3fn
pool's prefix q.k on e4m3 tensor cores, q as two e4m3 terms at a power-of-two scale a row, K as
stored. Programs the launch rules give it (64-row wgmma programs, q up to 128 wide:
rules.fp8_math_applies) stay within 1.25x the exact mode's error; every other program computes
exactly, bit for bit.

On the CPU the interpreter runs the kernels (its e4m3 rounding in software, its dot in fp32), so
these tests prove the arithmetic and the plumbing; tests/test_gpu_fp8_math.py bounds the error of
the tensor cores' own accumulation.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from case_tools import set_draft_masks, to_paged
from kernel_cases import build, tolerance
from test_runtime_adapters import sglang_args
from test_runtime_support import FakeModule, fake_loader, runtime_case

import kgen
from kgen.launcher import rules
from kgen.launcher.device import INTERPRETER
from kgen.problems import eagle_tree
from kgen.reference import relative_error
from kgen.runtime.adapters import SGLangVerify
from kgen.runtime.chain import VerifyChain
from kgen.runtime.gate import FP8_MATH_ENV, GateQuery, cached_inventory, decide_path, env_switches

GQA = "gqa128"
E4M3 = "float8_e4m3fn"
# A Triton prefix stage at 64 rows (BLOCK_H 16 x L_PAD 4): no gluon section, so the Triton stage runs.
TRITON_64_ROWS = {"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 1,
                  "split": {"programs_per_sm": 8, "max_splits": 4, "min_tokens_per_split": 32}}
# The bound issue 37 sets: the mode's error at most 1.25x the exact mode's on the same inputs.
ERROR_BOUND = 1.25


def _prefix_constexprs(module, arch: str, group: int, draft: int, config=None, fp8_math: bool = True) -> dict:
    launches = module.launch_params(arch, 132, group, 2, draft, None, config, fp8_math=fp8_math)
    return next(c for name, c, _ in launches if name == "_verify_prefix_stage")


def _run(case, module, fp8_math: bool, config: dict | None = None) -> float:
    if config is None:
        assert module.verify_shared_kv_fwd(*case.sglang_args(), fp8_math=fp8_math)
    else:
        module.launch(*case.launch_args(), config=config, fp8_math=fp8_math, **case.mask_kwargs())
    return relative_error(case.o, case.reference(torch.float64))


def test_the_mode_runs_where_the_rules_say():
    module = kgen.load(GQA, E4M3, "bfloat16")
    assert module.LAUNCHER.identity.fp8_math
    assert _prefix_constexprs(module, "sm_90", 16, 4, TRITON_64_ROWS)["FP8_MATH"] is True
    assert _prefix_constexprs(module, "sm_90", 16, 4, TRITON_64_ROWS, fp8_math=False)["FP8_MATH"] is False
    # 16 rows run mma.sync (slower with e4m3 operands), 128 rows spill, and sm_89 is not measured:
    # exact there.
    assert _prefix_constexprs(module, "sm_90", 4, 4, TRITON_64_ROWS)["FP8_MATH"] is False
    assert _prefix_constexprs(module, "sm_90", 16, 8, TRITON_64_ROWS)["FP8_MATH"] is False
    assert _prefix_constexprs(module, "sm_89", 16, 4, TRITON_64_ROWS)["FP8_MATH"] is False
    shape = module.LAUNCHER.identity.kernel_shape
    assert rules.fp8_math_applies({"mma": "wgmma"}, shape, 64)
    assert not rules.fp8_math_applies({"mma": "mma"}, shape, 64)


@pytest.mark.parametrize(("layout", "kv", "q"), [
    (GQA, "bfloat16", "bfloat16"), (GQA, "float8_e5m2", "bfloat16"), (GQA, E4M3, "float16"),
    ("qwen3_5_gqa256", E4M3, "bfloat16"), ("mla_absorbed_512_64", E4M3, "bfloat16")])
def test_modules_without_the_mode_take_the_flag_and_compute_exactly(layout, kv, q):
    """fp16 queries carry 11 significant bits, two e4m3 terms 8; e5m2 and 16-bit pools are not the
    mode's; q wider than 128 (GQA 256, absorbed MLA's 576) spills its terms in a Triton program.
    Their modules have no FP8_MATH, and a call that allows it runs what it always ran."""
    module = kgen.load(layout, kv, q)
    assert not module.LAUNCHER.identity.fp8_math
    assert "FP8_MATH" not in _prefix_constexprs(module, "sm_90", 16, 4, TRITON_64_ROWS)
    scales = {"k_scale": 0.5, "v_scale": 1.5} if kv != "bfloat16" else {}
    case = build(layout, [40], [4], 4, kv_dtype=kv, q_dtype=q, seed=2, **scales)
    exact = build(layout, [40], [4], 4, kv_dtype=kv, q_dtype=q, seed=2, **scales)
    _run(case, module, True)
    _run(exact, module, False)
    assert torch.equal(case.o, exact.o)


@pytest.mark.parametrize("layout", [GQA, "gqa64"])
@pytest.mark.parametrize("q_scale", [1.0, 10.0])
@pytest.mark.parametrize("draft_tile", ["first", "after"])
def test_the_error_stays_within_the_bound(layout, q_scale, draft_tile):
    """The mode's error against fp64 at most 1.25x the exact mode's on the same pool, for q at its
    own scale and 10x (a sharper softmax), the draft tile before the prefix loop and after it."""
    module = kgen.load(layout, E4M3, "bfloat16")
    config = {**TRITON_64_ROWS, "draft_tile": draft_tile}
    assert _prefix_constexprs(module, INTERPRETER, 16, 4, config)["FP8_MATH"] is True
    errors = {}
    for fp8_math in (False, True):
        case = build(layout, [150, 61, 0], [4, 3, 2], 16, kv_dtype=E4M3, k_scale=0.37, v_scale=1.9, seed=7)
        case.q.mul_(q_scale)
        errors[fp8_math] = _run(case, module, fp8_math, config)
        assert errors[fp8_math] <= tolerance(case), errors
    assert errors[True] <= ERROR_BOUND * errors[False], errors


def test_programs_below_a_warpgroup_compute_exactly():
    """Group 4 at L 4: 16-row programs, which the mode leaves exact: the same bits either way."""
    module = kgen.load(GQA, E4M3, "bfloat16")
    outputs = []
    for fp8_math in (False, True):
        case = build(GQA, [90, 33], [4, 2], 4, kv_dtype=E4M3, k_scale=0.6, v_scale=1.3, seed=5)
        _run(case, module, fp8_math, TRITON_64_ROWS)
        outputs.append(case.o)
    assert torch.equal(*outputs)


def test_trees_and_the_paged_entry_in_the_mode():
    module = kgen.load(GQA, E4M3, "bfloat16")
    tree = build(GQA, [70, 20], [4, 4], 16, kv_dtype=E4M3, k_scale=0.4, v_scale=2.0, seed=11)
    set_draft_masks(tree, [eagle_tree(4, topk=2, seed=b) for b in range(2)])
    assert _run(tree, module, True, TRITON_64_ROWS) <= tolerance(tree)
    paged_case = build(GQA, [70, 20], [4, 4], 16, kv_dtype=E4M3, k_scale=0.4, v_scale=2.0, seed=12)
    paged = to_paged(paged_case, 16)
    assert module.verify_paged_fwd(*paged.paged_args(paged_case), config=TRITON_64_ROWS, fp8_math=True)
    assert relative_error(paged_case.o, paged_case.reference(torch.float64)) <= tolerance(paged_case)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_fp8_math_must_be_true_or_false(bad):
    module = kgen.load(GQA, E4M3, "bfloat16")
    case = build(GQA, [20], [2], 16, kv_dtype=E4M3, seed=1)
    o_before = case.o.clone()
    with pytest.raises(TypeError, match="fp8_math must be True or False"):
        module.verify_shared_kv_fwd(*case.sglang_args(), fp8_math=bad)
    assert torch.equal(case.o.view(torch.int16), o_before.view(torch.int16))  # untouched, NaN bits and all


@triton.jit
def _split_rows(Q, Hi, Lo, Unscale, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    q = tl.load(Q + rows[:, None] * COLS + cols[None, :]).to(tl.float32)
    scale, unscale = _MODULE._e4m3_row_scale(tl.max(tl.abs(q), 1))
    hi, lo = _MODULE._e4m3_terms(q * scale[:, None], True)
    tl.store(Hi + rows[:, None] * COLS + cols[None, :], hi)
    tl.store(Lo + rows[:, None] * COLS + cols[None, :], lo)
    tl.store(Unscale + rows, unscale)


_MODULE = kgen.load(GQA, E4M3, "bfloat16")


@pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="the interpreter's software e4m3 rounding")
def test_two_terms_hold_a_bf16_q_exactly():
    """The kernel's split (not the benchmark's emulation): the scale is a power of two that puts a
    row's largest magnitude in (224, 448], both terms lie on e4m3's grid, and their sum is q for
    every entry of at least a row's scale / 4; a zero row stays zero."""
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(16, 64, generator=gen) * torch.logspace(-3, 3, 16)[:, None]).to(torch.bfloat16)
    q[5] = 0
    hi, lo, unscale = torch.empty(16, 64), torch.empty(16, 64), torch.empty(16)
    _split_rows[(1,)](q, hi, lo, unscale, 16, 64)
    assert torch.equal(torch.log2(unscale), torch.log2(unscale).round())
    amax = q.float().abs().amax(1)
    scaled = amax / unscale
    live = amax > 0
    assert ((scaled[live] > 224) & (scaled[live] <= 448)).all()
    for term in (hi, lo):
        assert torch.equal(term, term.to(torch.float8_e4m3fn).float())
    big = q.float().abs() >= unscale[:, None] / 4
    assert torch.equal(((hi + lo) * unscale[:, None])[big], q.float()[big])
    assert (hi[5] == 0).all() and (lo[5] == 0).all()


def test_the_operator_switch_reaches_the_kernels():
    """KGEN_FP8_MATH=1: the gate's decision carries it, and the chain hands every kernel call
    fp8_math=True (off by default)."""
    assert env_switches({FP8_MATH_ENV: "1"}).fp8_math and not env_switches({}).fp8_math
    query = GateQuery(model_arch="Qwen3_5ForCausalLM", topk=1, qk_dim=256, pe_dim=0, v_dim=256, group_size=4,
                      num_local_kv_heads=1, kv_dtype=E4M3)
    decision = decide_path(query, device_arch=None, inventory=cached_inventory(),
                           switches=env_switches({FP8_MATH_ENV: "on"}))
    assert decision.fp8_math
    for fp8_math in (False, True):
        module = FakeModule("g", groups=(4,))
        adapter = SGLangVerify(VerifyChain("fake", loader=fake_loader({"grouped": module}), fp8_math=fp8_math))
        case = runtime_case([20, 8], [3, 2], group=4)
        args, _ = sglang_args(case, case.out())
        assert adapter(*args) is True
        assert module.last_fp8_math is fp8_math
