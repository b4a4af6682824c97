"""Experiment e4m3_qk (FP8 KV, bf16 q): the prefix q.k on e4m3 tensor cores, q split into
two e4m3 terms.

The split is exact for bf16 q, so in the interpreter (fp32 dots) the e4m3 path must agree
with the fp16-converted one to fp32 rounding, not merely both sit inside the tolerance.
The launcher takes it for programs of at least _E4M3_QK_MIN_ROWS rows; the tests move that
threshold to force either path.
"""

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import SMALL_SPLITS, build, build_module, tolerance

from kgen.build import build_one
from kgen.passes.context import load_context
from kgen.testing import relative_error


def _e4m3_module(tmp_path, layout):
    return build_module(tmp_path, layout, "float8_e4m3fn", "e4m3_qk")[1]


def _run(module, case, monkeypatch, min_rows):
    """o and the fp32 partials (every request here spans several splits) of one launch."""
    monkeypatch.setattr(module, "_E4M3_QK_MIN_ROWS", min_rows)
    module.launch(*case.launch_args(), config=SMALL_SPLITS)  # allocates the scratch
    for buffer in (case.o, *(t for pair in module._SCRATCH.values() for t in pair)):
        buffer.zero_()  # slots no split writes stay equal between the two runs
    module.launch(*case.launch_args(), config=SMALL_SPLITS)
    (partial_o, partial_lse), = module._SCRATCH.values()
    return case.o.float().clone(), partial_o.clone(), partial_lse.clone()


@pytest.mark.parametrize(("layout", "group"), [("qwen3_5_gqa256", 16), ("qwen3_5_gqa256", 4),
                                               ("mla_absorbed_512_64", 16), ("gqa64", 8)])
def test_e4m3_qk_equals_the_fp16_qk(tmp_path, monkeypatch, layout, group):
    module = _e4m3_module(tmp_path, layout)
    case = build(layout, [64, 35, 58, 120], [4, 4, 4, 3], group, kv_dtype="float8_e4m3fn", seed=9,
                 k_scale=0.6, v_scale=1.7)
    # Query heads five decades apart: each row's power-of-two scale must follow its own size.
    case.q.mul_(torch.logspace(-3, 2, case.q.shape[1]).to(case.q.dtype)[None, :, None])
    o, partial_o, partial_lse = _run(module, case, monkeypatch, 0)
    assert relative_error(o, case.reference(torch.float64)) <= tolerance(case)
    _, fp16_partial_o, fp16_partial_lse = _run(module, case, monkeypatch, 1 << 30)
    # The same products summed in fp32 in another order: the fp32 partials agree to ~1e-6,
    # where an inexact split (one e4m3 term) is off by ~1e-2 at the large heads.
    assert relative_error(partial_o, fp16_partial_o) < 1e-5
    assert relative_error(partial_lse, fp16_partial_lse) < 1e-5


def test_e4m3_qk_is_only_in_modules_that_ask_and_can_take_it(tmp_path):
    shipped = build_one("qwen3_5_gqa256", "float8_e4m3fn", "bfloat16", ctx=load_context(tmp_path / "plain", env={}))
    assert not shipped.fp8_qk_dot and "E4M3_QK" not in shipped.source
    assert "experiment e4m3_qk" in next(d.why for d in shipped.decisions if d.what == "e4m3 q.k")
    ctx = load_context(tmp_path, env={"KGEN_EXPERIMENTS": "e4m3_qk"})
    taken = build_one("qwen3_5_gqa256", "float8_e4m3fn", "bfloat16", ctx=ctx)
    assert taken.fp8_qk_dot and "experiments : e4m3_qk" in taken.source
    assert "_two_e4m3_terms" in taken.source and "_E4M3_QK_MIN_ROWS = 64" in taken.source
    for kv, q, variant, why in (("bfloat16", "bfloat16", "grouped", "16-bit KV"),
                                ("float8_e4m3fnuz", "bfloat16", "grouped", "float8_e4m3fn only"),
                                ("float8_e4m3fn", "float16", "grouped", "not an fp16 one"),
                                ("float8_e4m3fn", "bfloat16", "per_head", "per-head")):
        plan = build_one("qwen3_5_gqa256", kv, q, variant, ctx=ctx)
        assert not plan.fp8_qk_dot and "E4M3_QK" not in plan.source
        assert why in next(d.why for d in plan.decisions if d.what == "e4m3 q.k")


_ROUND_TO_E4M3 = None  # a generated module's _round_to_e4m3, set by the test below


@triton.jit
def _round_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _ROUND_TO_E4M3(tl.load(X + offs)))


def test_software_e4m3_rounding_matches_torch(tmp_path, monkeypatch):
    """The interpreter's stand-in for cvt rounds exactly as torch's float8_e4m3fn cast does."""
    monkeypatch.setitem(globals(), "_ROUND_TO_E4M3", _e4m3_module(tmp_path, "gqa64")._round_to_e4m3)
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4096) * 40, torch.randn(2048) * 0.01,
                   torch.tensor([-7.875, 7.9375, 447.0, 0.0, 0.0029296875, -0.0009765625])]).clamp(-448, 448)
    x = torch.nn.functional.pad(x, (0, 8192 - x.numel()))
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, 8192)
    assert torch.equal(y, x.to(torch.float8_e4m3fn).float())
