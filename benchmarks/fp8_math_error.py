"""The FP8-math mode's error, emulated on the CPU: how far each way of running the prefix's q.k on
e4m3 tensor cores moves the output from the exact FP8 mode (issue 37's bound: at most 1.25x the
exact mode's error).

Every row is one request's prefix attention over an e4m3 K/V pool with one per-tensor scale each
(as engines store it), against an fp64 reference on the dequantized pool: the error is the output's
relative L2 error, the median over seeds, and its ratio to the exact mode's. The exact mode is what
kgen's FP8 kernels compute: q scaled by K's descale and rounded to fp16, K converted to fp16
(exact), fp32 dots, P in fp16, fp32 P.V. The FP8-math variants change q.k alone (V stays converted
for P.V, as the issue's mode does):

  one term           q quantized to e4m3 with one scale a row (a token's head: amax / 448)
  two terms          q as e4m3(q / s) plus the residual's e4m3 at the same scale: two e4m3 MMAs
                     into one sum
  two terms, 2^n     the same with s a power of two (the least >= amax / 448): then q / s is q's
                     bf16 bits, its cast keeps the top 4 of its 8 significant bits and the residual
                     is the other 4, exact in e4m3 for every entry of at least s / 4 (about
                     amax / 900: its 8th bit no finer than e4m3's least subnormal), so the two
                     terms are q itself but for its smallest entries

and P.V on e4m3 tensor cores too (P / 2^-8 cast once or as two terms, times V as stored), with
the best q.k; and, for the power-of-two split, the tensor core's accumulation: Hopper's e4m3 wgmma keeps about 14
bits of its running sum (DeepSeek-V3's report, arXiv 2412.19437, section 3.3.2; docs/perf-notes.md,
"The prefix dots on e4m3 tensor cores"). Modelled here as the probe below finds it: in each 32-wide
k step the products and the running sum are aligned to the largest of them and cut there to
``--acc-bits`` significant bits (toward zero), then added; the sum is promoted into an fp32
register accumulator every ``promote`` dims of the head (a fresh wgmma accumulator each time), or
never. A model, not the hardware: the GPU's tests have the last word (an earlier model that added
each k step's products exactly before cutting the sum was kinder than an H100: docs/perf-notes.md,
"The FP8-math mode on the Triton stage (experiment, lost)").

``--probe-bits`` measures the model's one parameter on a GPU instead: a Triton e4m3 dot (wgmma on
sm_90) of rows whose sum is one large product and one small one 2^-b of it, for b = 1 to 30, the
small one in the large one's k step or in the next; where the largest b whose small product
survives is B, the running sum keeps B + 1 significant bits (Triton's interpreter, which sums in
fp32, keeps 2^-23: 24 bits).

Not the benchmark of record (docs/perf-notes.md cites its runs). Usage, from the repository root:
  python3 benchmarks/fp8_math_error.py                  # the default shapes, q at scale 1 and 10
  python3 benchmarks/fp8_math_error.py --shape 128/128 --q-scale 1,10,30 --seeds 5
  python3 benchmarks/fp8_math_error.py --probe-bits     # on a GPU: the e4m3 dot's accumulation bits
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
K_STEP = 32  # one e4m3 wgmma's k: 32 bytes of a row
BOUND = 1.25  # issue 37: the FP8-math mode's error over the exact mode's
EXACT = "exact (the FP8 mode)"


@dataclass(frozen=True)
class Shape:
    """A layout's head dims (K's and V's; MLA's V is K's first columns) and its softmax scale."""
    k_dim: int
    v_dim: int
    sm_scale: float

    @property
    def label(self) -> str:
        return f"{self.k_dim}/{self.v_dim}"


SHAPES = {
    "128/128": Shape(128, 128, 128 ** -0.5),  # GQA 128 (Llama, Qwen3)
    "256/256": Shape(256, 256, 256 ** -0.5),  # GQA 256 (Qwen3.5)
    "576/512": Shape(576, 512, 192 ** -0.5),  # absorbed MLA (DeepSeek's 128 + 64 dims softmax scale)
}


def _per_tensor_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """x as an engine stores it: e4m3 with one descale for the tensor."""
    scale = x.abs().max().item() / E4M3_MAX
    return (x / scale).to(E4M3), scale


def _per_row_e4m3(x: torch.Tensor, power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows x dims, fp64) quantized to e4m3 with a scale a row: amax / 448, or with
    ``power_of_two`` the least power of two at least that (1 for a zero row)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (x / scale).to(E4M3), scale


def _aligned_sum(terms: torch.Tensor, bits: int) -> torch.Tensor:
    """The sum over the last dim as a narrow adder makes it: every term aligned to the largest
    one's exponent and cut there to ``bits`` significant bits, toward zero, then added."""
    _, exponent = torch.frexp(terms.abs().amax(-1, keepdim=True))
    unit = torch.ldexp(torch.ones_like(terms[..., :1]), exponent - bits)
    return (torch.trunc(terms / unit) * unit).sum(-1)


def _e4m3_dot(q8: torch.Tensor, k8: torch.Tensor, acc_bits: int | None, promote: int | None) -> torch.Tensor:
    """q8 @ k8^T as an e4m3 wgmma sums it: each k step's exact products and the running sum aligned
    to the largest of them and cut to ``acc_bits`` bits (_aligned_sum; None: fp32 sums), that sum
    promoted into fp32 every ``promote`` dims (None: once, at the end)."""
    q, k = q8.double(), k8.double()
    dims = q.shape[-1]
    promote = promote or dims
    total = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float32)
    for block in range(0, dims, promote):
        running = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float64)
        for step in range(block, min(block + promote, dims), K_STEP):
            if acc_bits:
                products = q[:, None, step:step + K_STEP] * k[None, :, step:step + K_STEP]
                running = _aligned_sum(torch.cat([products, running[..., None]], dim=-1), acc_bits)
            else:
                running = (running + q[:, step:step + K_STEP] @ k[:, step:step + K_STEP].T).float().double()
        total = total + running.float()
    return total.double()


@dataclass(frozen=True)
class Pool:
    """One request's prefix in an e4m3 pool, its queries, and the fp64 reference output."""
    q: torch.Tensor  # rows x k_dim, bf16 values in fp64
    k8: torch.Tensor
    k_scale: float
    v8: torch.Tensor
    v_scale: float
    reference: torch.Tensor


def make_pool(shape: Shape, rows: int, keys: int, q_scale: float, seed: int) -> Pool:
    """Queries of ``rows`` (heads x draft tokens) at ``q_scale`` times unit variance, over ``keys``
    prefix tokens, with the reference attention on the dequantized pool."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(rows, shape.k_dim, generator=gen) * q_scale).bfloat16().double()
    k8, k_scale = _per_tensor_e4m3(torch.randn(keys, shape.k_dim, generator=gen))
    if shape.v_dim == shape.k_dim:
        v8, v_scale = _per_tensor_e4m3(torch.randn(keys, shape.v_dim, generator=gen))
    else:  # absorbed MLA: V is K's latent columns
        v8, v_scale = k8[:, :shape.v_dim], k_scale
    weights = torch.softmax(q @ (k8.double() * k_scale).T * shape.sm_scale, dim=-1)
    return Pool(q, k8, k_scale, v8, v_scale, weights @ (v8.double() * v_scale))


P_SCALE = 2.0 ** -8  # P <= 1 (its row max subtracted), so P / 2^-8 <= 256 fits e4m3


def _attend(pool: Pool, shape: Shape, scores: torch.Tensor, p_terms: int = 0, acc_bits: int | None = None,
            promote: int | None = None) -> torch.Tensor:
    """The kernels' softmax and P.V from fp32 scores (K's descale applied), V's descale once, the
    output rounded to bf16. P.V as the exact mode runs it (``p_terms`` 0: P in fp16, fp32 dots on
    the converted V), or on e4m3 tensor cores: P / 2^-8 as ``p_terms`` e4m3 terms (1 or 2) times
    V as stored, summed as _e4m3_dot sums (``acc_bits``; ``promote`` keys a fresh accumulator)."""
    s = scores.float() * shape.sm_scale
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    if p_terms == 0:
        pv = p.half().float() @ pool.v8.float()
    else:
        hi = (p.double() / P_SCALE).to(E4M3)
        terms = [hi] if p_terms == 1 else [(p.double() / P_SCALE - hi.double()).to(E4M3), hi]
        both_p = torch.cat(terms, dim=-1)
        both_v = torch.cat([pool.v8.T] * len(terms), dim=-1)
        pv = (_e4m3_dot(both_p, both_v, acc_bits, promote) * P_SCALE).float()
    out = pv * pool.v_scale / p.sum(dim=-1, keepdim=True)
    return out.bfloat16().double()


def exact_scores(pool: Pool) -> torch.Tensor:
    """The exact FP8 mode's q.k: q x K's descale in fp16, K converted to fp16 (exact), fp32 dots."""
    q16 = (pool.q * pool.k_scale).half().float()
    return (q16 @ pool.k8.float().T).double()


def one_term_scores(pool: Pool) -> torch.Tensor:
    """q quantized to e4m3 once, a scale a row."""
    q8, scale = _per_row_e4m3(pool.q)
    return _e4m3_dot(q8, pool.k8, None, None) * scale * pool.k_scale


def two_term_scores(pool: Pool, power_of_two: bool = False, acc_bits: int | None = None,
                    promote: int | None = None) -> torch.Tensor:
    """q as two e4m3 terms at one scale a row (``power_of_two``: _per_row_e4m3), its cast and the
    residual's, both MMAs into one running sum as the tensor core sums it (``acc_bits``,
    ``promote``: _e4m3_dot; the residual's MMA goes first, so the small terms are summed before
    the large ones)."""
    hi, scale = _per_row_e4m3(pool.q, power_of_two)
    lo = (pool.q / scale - hi.double()).to(E4M3)
    both_q = torch.cat([lo.double(), hi.double()], dim=-1).to(E4M3)
    both_k = torch.cat([pool.k8, pool.k8], dim=-1)
    return _e4m3_dot(both_q, both_k, acc_bits, promote) * scale * pool.k_scale


Variant = Callable[[Pool, Shape], torch.Tensor]


def _qk_only(scores: Callable[[Pool], torch.Tensor]) -> Variant:
    """A variant that changes q.k alone: P.V as the exact mode runs it."""
    return lambda pool, shape: _attend(pool, shape, scores(pool))


def variants(acc_bits: int, promotes: list[int]) -> dict[str, Variant]:
    """The rows of the table, each a pool's output: the exact mode first, then the FP8-math
    variants of q.k, then (with the best q.k) P.V on e4m3 tensor cores as well."""
    table: dict[str, Variant] = {
        EXACT: _qk_only(exact_scores),
        "one term": _qk_only(one_term_scores),
        "two terms": _qk_only(two_term_scores),
        "two terms, 2^n": _qk_only(lambda pool: two_term_scores(pool, True)),
        f"two terms, 2^n, {acc_bits}-bit sums": _qk_only(lambda pool: two_term_scores(pool, True, acc_bits)),
    }
    for promote in promotes:
        table[f"two terms, 2^n, {acc_bits}-bit sums, fp32 every {promote}"] = _qk_only(
            lambda pool, promote=promote: two_term_scores(pool, True, acc_bits, promote))
    for p_terms, p_name in ((1, "P cast once"), (2, "P as two terms")):
        table[f"two terms, 2^n; P.V e4m3, {p_name}"] = (
            lambda pool, shape, p_terms=p_terms: _attend(pool, shape, two_term_scores(pool, True), p_terms))
        table[f"two terms, 2^n; P.V e4m3, {p_name}, {acc_bits}-bit sums, fp32 every 64 keys"] = (
            lambda pool, shape, p_terms=p_terms: _attend(pool, shape, two_term_scores(pool, True), p_terms,
                                                         acc_bits, 64))
    return table


PROBE_BITS = 26  # the small products a probe tries: 2^-1 to 2^-26 of the large one (e4m3's range allows)
PROBE_DIMS = 64  # two e4m3 k steps


def probe_operands(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (64 x PROBE_DIMS, e4m3): row 0 of q . row b of k is 2^8 (16 x 16 at dim 0) plus
    2^(8 - b), in the same k step (dims 1 and 2); row 1's is the same in the next step (dims
    K_STEP + 1 and + 2). The small product is 1 x 2^(8 - b) for b <= 16 and 2^-9 x 2^(17 - b)
    past it, each factor within e4m3's range. The other rows are zero."""
    q = torch.zeros(64, PROBE_DIMS, dtype=torch.float64)
    k = torch.zeros(64, PROBE_DIMS, dtype=torch.float64)
    for row, first in ((0, 1), (1, K_STEP + 1)):
        q[row, 0] = 16.0
        q[row, first], q[row, first + 1] = 1.0, 2.0 ** -9
        for b in range(1, PROBE_BITS + 1):
            k[b, 0] = 16.0
            if b <= 16:
                k[b, first] = 2.0 ** (8 - b)
            else:
                k[b, first + 1] = 2.0 ** (17 - b)
    return q.to(E4M3).to(device), k.to(E4M3).to(device)


def kept_bits(sums: torch.Tensor) -> tuple[int, int]:
    """From the probe's 2 x (PROBE_BITS + 1) sums: the largest b whose small product 2^(8 - b)
    survived beside 2^8, with it in the same k step and in the next."""
    def kept(row: torch.Tensor) -> int:
        return max([b for b in range(1, PROBE_BITS + 1) if row[b].item() - 256.0 == 2.0 ** (8 - b)], default=0)
    return kept(sums[0]), kept(sums[1])


def probe_bits(device: str) -> tuple[int, int]:
    """Run the probe's e4m3 dot with Triton on ``device`` (cuda, or cpu under TRITON_INTERPRET=1)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _e4m3_dot_kernel(Q, K, Out, DIMS: tl.constexpr):
        rows = tl.arange(0, 64)
        dims = tl.arange(0, DIMS)
        q = tl.load(Q + rows[:, None] * DIMS + dims[None, :])
        k = tl.load(K + rows[:, None] * DIMS + dims[None, :])
        tl.store(Out + rows[:, None] * 64 + rows[None, :], tl.dot(q, tl.trans(k), out_dtype=tl.float32))

    q, k = probe_operands(device)
    expected = q.double() @ k.double().T
    wanted = torch.tensor([256.0 + 2.0 ** (8 - b) for b in range(1, PROBE_BITS + 1)], dtype=torch.float64)
    if not all(torch.equal(expected[row, 1:PROBE_BITS + 1].cpu(), wanted) for row in (0, 1)):
        raise RuntimeError("the probe's operands do not make the sums it reads (a bug in probe_operands)")
    out = torch.empty(64, 64, dtype=torch.float32, device=device)
    _e4m3_dot_kernel[(1,)](q, k, out, DIMS=PROBE_DIMS)
    return kept_bits(out[:2, :PROBE_BITS + 1].double().cpu())


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference)).item()


def _cell(error: float, exact: float | None) -> str:
    """A table cell: the error, and its ratio to the exact mode's (marked where past the bound)."""
    if exact is None:
        return f"{error:.2e}"
    ratio = error / exact
    return f"{error:.2e} ({ratio:.2f}x{', over' if ratio > BOUND else ''})"


def _csv(kind: type, text: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {kind.__name__}s") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=lambda t: _csv(str, t), default=list(SHAPES),
                        help=f"head dims K/V, comma-separated, of {', '.join(SHAPES)} (default: all)")
    parser.add_argument("--q-scale", type=lambda t: _csv(float, t), default=[1.0, 10.0],
                        help="q's standard deviation, comma-separated (default 1,10: 10 sharpens the softmax)")
    parser.add_argument("--rows", type=int, default=64, help="query rows: heads x draft tokens (default 64)")
    parser.add_argument("--keys", type=int, default=4096, help="prefix tokens (default 4096)")
    parser.add_argument("--seeds", type=int, default=3, help="pools a cell, the median taken (default 3)")
    parser.add_argument("--acc-bits", type=int, default=14,
                        help="significant bits the e4m3 wgmma keeps of its running sum (default 14: "
                             "--probe-bits on an H100)")
    parser.add_argument("--promote", type=lambda t: _csv(int, t), default=[64, 128],
                        help="dims between promotions into fp32, comma-separated multiples of 32 (default 64,128)")
    parser.add_argument("--probe-bits", action="store_true",
                        help="measure the e4m3 dot's accumulation bits on this machine's GPU and stop")
    args = parser.parse_args(argv)
    if args.probe_bits:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        same, next_step = probe_bits(device)
        print(f"{device}: the e4m3 dot's running sum keeps a product 2^-{same} of the largest in its k step, "
              f"2^-{next_step} of the sum so far in a later one (--acc-bits {min(same, next_step) + 1})")
        return 0
    unknown = [s for s in args.shape if s not in SHAPES]
    if unknown:
        parser.error(f"--shape {','.join(unknown)}: not one of {', '.join(SHAPES)}")
    if any(p <= 0 or p % K_STEP for p in args.promote):
        parser.error(f"--promote {args.promote}: each must be a positive multiple of {K_STEP} (a wgmma k step)")
    if min(args.rows, args.keys, args.seeds, args.acc_bits) < 1:
        parser.error("--rows, --keys, --seeds and --acc-bits must be at least 1")

    table = variants(args.acc_bits, args.promote)
    columns = [(SHAPES[s], q) for s in args.shape for q in args.q_scale]
    errors: dict[str, list[float]] = {name: [] for name in table}
    for shape, q_scale in columns:
        pools = [make_pool(shape, args.rows, args.keys, q_scale, seed) for seed in range(args.seeds)]
        for name, output in table.items():
            errors[name].append(statistics.median(relative_error(output(pool, shape), pool.reference)
                                                  for pool in pools))
        print(f"  {shape.label}, q x {q_scale:g}: done", file=sys.stderr)

    exact = errors[EXACT]
    heads = [f"{shape.label}, q x {q:g}" for shape, q in columns]
    print(f"| variant | {' | '.join(heads)} |")
    print(f"| --- |{' ---: |' * len(heads)}")
    for name, row in errors.items():
        cells = [_cell(error, None if name == EXACT else exact[i]) for i, error in enumerate(row)]
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"\nrelative L2 error of the output against fp64 on the dequantized pool; median of {args.seeds} pools; "
          f"{args.rows} rows x {args.keys} keys; 'over': past issue 37's {BOUND}x of the exact mode", file=sys.stderr)
    return 0 if all(math.isfinite(e) for row in errors.values() for e in row) else 1


if __name__ == "__main__":
    sys.exit(main())
