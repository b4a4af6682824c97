"""benchmarks/fp8_math_error.py's emulation: the facts its table rests on. A bf16 q split into two
e4m3 terms at a power-of-two scale is q itself (so the FP8-math mode's q.k can be exact), the
accumulation model cuts what it says, and the table's exact mode is the FP8 kernels' arithmetic."""

from __future__ import annotations

import pytest
import torch
from benchmark_tools import load_tool


def _tool():
    return load_tool("fp8_math_error")


@pytest.mark.parametrize("q_scale", [1.0, 10.0, 1e-3])
def test_two_e4m3_terms_at_a_power_of_two_scale_are_a_bf16_q(q_scale: float) -> None:
    """The cast keeps q's top 4 significant bits and the residual its other 4: exact for every
    entry of at least a quarter of the scale (about 1/900 of the row's max), whose 8th bit is no
    finer than e4m3's least subnormal (2^-9)."""
    tool = _tool()
    q = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * q_scale).bfloat16().double()
    hi, scale = tool._per_row_e4m3(q, power_of_two=True)
    assert torch.equal(scale, torch.exp2(torch.round(torch.log2(scale))))
    lo = (q / scale - hi.double()).to(tool.E4M3)
    rebuilt = (hi.double() + lo.double()) * scale
    large = q.abs() >= scale / 4
    assert large.float().mean() > 0.99
    assert torch.equal(rebuilt[large], q[large])
    # At the amax / 448 scale the same split is not exact: the scale is not a power of two.
    hi, amax_scale = tool._per_row_e4m3(q)
    lo = (q / amax_scale - hi.double()).to(tool.E4M3)
    assert not torch.equal(((hi.double() + lo.double()) * amax_scale)[large], q[large])


def test_the_accumulation_model_keeps_the_bits_it_says() -> None:
    """Aligned to the largest term and cut toward zero to 14 bits; and on the probe's operands the
    model keeps what the H100 kept: a product 2^-13 of the largest, in its k step and in the next
    (--probe-bits: "2^-13 ... 2^-13")."""
    tool = _tool()
    terms = torch.tensor([[1.0, 2.0 ** -13, 2.0 ** -14], [-3.0, 1.0 + 2.0 ** -13, 0.0]], dtype=torch.float64)
    # Beside 3 (leading bit 2^1) the 14 bits end at 2^-12: 1 + 2^-13 loses its 2^-13.
    assert tool._aligned_sum(terms, 14).tolist() == [1.0 + 2.0 ** -13, -2.0]
    q, k = tool.probe_operands("cpu")
    assert tool.kept_bits(tool._e4m3_dot(q, k, 14, None)[:2, :tool.PROBE_BITS + 1]) == (13, 13)
    q8 = torch.ones(1, 64).to(tool.E4M3)
    k8 = torch.ones(1, 64).to(tool.E4M3)
    assert tool._e4m3_dot(q8, k8, 14, None).item() == 64.0
    assert tool._e4m3_dot(q8, k8, None, 32).item() == 64.0


def test_the_exact_modes_scores_are_the_dequantized_dot_to_fp16_q() -> None:
    """The exact mode's only rounding before the softmax is q x K's descale in fp16."""
    tool = _tool()
    pool = tool.make_pool(tool.SHAPES["128/128"], 16, 256, 1.0, seed=1)
    reference = pool.q @ (pool.k8.double() * pool.k_scale).T
    relative = (tool.exact_scores(pool) - reference).abs().max() / reference.abs().max()
    assert 0 < relative < 2.0 ** -9


def test_the_table_names_a_bad_shape() -> None:
    tool = _tool()
    with pytest.raises(SystemExit):
        tool.main(["--shape", "100/100"])
    with pytest.raises(SystemExit):
        tool.main(["--promote", "48"])


def test_the_probe_reads_the_bits_of_fp32_sums_in_the_interpreter() -> None:
    """The interpreter's e4m3 dot sums in fp32 (24 significant bits): beside 2^8 a product of
    2^-15 survives and one of 2^-16 does not, in either k step."""
    tool = _tool()
    assert tool.probe_bits("cpu") == (23, 23)


def test_the_probe_reads_a_narrower_sum() -> None:
    """kept_bits on sums that keep fewer bits: products past 2^-13 of the large one lost."""
    tool = _tool()
    small = [2.0 ** (8 - b) if b <= 13 else 0.0 for b in range(1, tool.PROBE_BITS + 1)]
    sums = torch.tensor([[0.0] + [256.0 + x for x in small]] * 2, dtype=torch.float64)
    assert tool.kept_bits(sums) == (13, 13)


def test_p_on_e4m3_tensor_cores_needs_two_terms() -> None:
    """P.V on e4m3: P cast once (4 significant bits) is far from the reference; as two terms (8
    bits, beside the exact mode's fp16 P) it stays within issue 37's bound of the exact mode."""
    tool = _tool()
    shape = tool.SHAPES["128/128"]
    pool = tool.make_pool(shape, 16, 256, 1.0, seed=2)
    scores = tool.two_term_scores(pool, power_of_two=True)
    error = {terms: tool.relative_error(tool._attend(pool, shape, scores, terms), pool.reference)
             for terms in (0, 1, 2)}
    assert error[2] <= tool.BOUND * error[0] < error[1] / 4, error
