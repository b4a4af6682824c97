"""The gather ceiling: how fast a kernel that only reads can gather K and V rows of R bytes
through a shuffled page table, against the device copy that `kgen bench` calls 100%.

A verify kernel over SGLang's token-slot pool (pages of 1 token) reads each token's K and V row
of one KV head where the allocator put it: rows of head_dim x dtype bytes (GQA 64 BF16: 128 B)
at random addresses. Below some row size DRAM serves such rows slower than a stream, whatever
the kernel, so `kgen bench`'s "% copy" of a small-row layout has a ceiling under 100%. This
probe measures it: a Triton kernel that gathers BATCH x PREFIX tokens' K and V rows through an
int64 page table (the prefix read of `kgen bench`'s batch 64, prefix 16K cases) and sums them,
over a small grid of programs and tile sizes; the best of the grid is the row's ceiling. Pages
of 16 tokens (a shuffled page order) show what contiguous runs give back.

Not the benchmark of record (docs/perf-notes.md cites its runs). Usage on a GPU machine, from
the repository root:
  python3 benchmarks/gather_ceiling.py                    # rows of 128, 256, 512 and 1024 B
  python3 benchmarks/gather_ceiling.py --row-bytes 128 --page-size 1,16
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kgen.bench.timing import CudaGraphTimer, bench_copy_ceiling_gbps

# (tokens a tile, tokens a program, warps, stages): small tiles over many programs keep more
# rows in flight, which small rows need; the grid is what the probe found to matter.
GRID = ((32, 1024, 4, 4), (64, 1024, 4, 4), (64, 2048, 4, 3), (32, 512, 4, 4), (128, 2048, 4, 3))


@triton.jit
def _gather_sum(k_ptr, v_ptr, page_ptr, out_ptr, tokens_per_program,
                ROW: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums the K and V rows of tokens [p x tokens_per_program, +tokens_per_program):
    token t lives in slot page_ptr[t // PAGE] x PAGE + t % PAGE. One store a program, so the
    bytes moved are the gathered rows (and the page table)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, ROW)
    acc = tl.zeros([BLOCK, ROW], tl.float32)
    first = pid.to(tl.int64) * tokens_per_program
    for start in range(0, tokens_per_program, BLOCK):
        tokens = first + start + tl.arange(0, BLOCK)
        slots = tl.load(page_ptr + tokens // PAGE) * PAGE + tokens % PAGE
        k = tl.load(k_ptr + slots[:, None] * ROW + cols[None, :])
        v = tl.load(v_ptr + slots[:, None] * ROW + cols[None, :])
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + pid * ROW + cols, tl.sum(acc, axis=0))


@dataclass(frozen=True)
class Pool:
    """K and V pools of bf16 rows (twice the tokens read, so the slots are spread) and a shuffled
    int64 page table naming the pages the read visits."""

    k: torch.Tensor
    v: torch.Tensor
    pages: torch.Tensor
    page_size: int

    @classmethod
    def make(cls, tokens: int, row_bytes: int, page_size: int, device: str = "cuda", seed: int = 0) -> Pool:
        gen = torch.Generator(device=device).manual_seed(seed)
        width = row_bytes // 2
        k = torch.randn(2 * tokens, width, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(2 * tokens, width, device=device, dtype=torch.bfloat16, generator=gen)
        order = torch.randperm(2 * tokens // page_size, device=device, generator=gen)
        return cls(k, v, order[: tokens // page_size].to(torch.int64).contiguous(), page_size)

    def gather_sum(self, tokens: int, block: int, per_program: int, warps: int, stages: int) -> torch.Tensor:
        width = self.k.shape[1]
        out = torch.empty(tokens // per_program, width, device=self.k.device, dtype=torch.float32)
        _gather_sum[(tokens // per_program,)](self.k, self.v, self.pages, out, per_program, ROW=width,
                                             PAGE=self.page_size, BLOCK=block, num_warps=warps, num_stages=stages)
        return out


def check_sum(pool: Pool, tokens: int) -> None:
    """The kernel reads what it should: its per-program sums over the first ``tokens`` tokens
    (four programs) against torch's gather of the same rows."""
    per_program = tokens // 4
    got = pool.gather_sum(tokens, 32, per_program, 4, 2)
    pages = pool.pages[: tokens // pool.page_size]
    slots = (pages.repeat_interleave(pool.page_size) * pool.page_size
             + torch.arange(tokens, device=pool.k.device) % pool.page_size)
    rows = (pool.k[slots].float() + pool.v[slots].float()).view(4, per_program, -1).sum(dim=1)
    if not torch.allclose(got, rows, rtol=1e-3, atol=1e-2):
        raise SystemExit("gather_ceiling: the probe kernel's sums differ from torch's gather; its figures would "
                         "not be the rows' bandwidth")


def best_of_grid(pool: Pool, tokens: int, timer: CudaGraphTimer) -> tuple[float, str]:
    """The highest gather bandwidth (GB/s of K and V rows) over GRID, and the config that gave it."""
    row_bytes = pool.k.shape[1] * pool.k.element_size()
    best = (0.0, "")
    for block, per_program, warps, stages in GRID:
        if block * row_bytes > 32 * 1024:  # a [block, row] fp32 sum past 256 registers a thread: spills
            continue
        us = timer(lambda _i, b=block, n=per_program, w=warps, s=stages: pool.gather_sum(tokens, b, n, w, s),
                   1).median_us
        gbps = 2 * tokens * row_bytes / (us * 1e-6) / 1e9
        best = max(best, (gbps, f"{block} / {per_program} / {warps} / {stages}"))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row-bytes", default="128,256,512,1024",
                        help="K (and V) row sizes in bytes, bf16 rows: head_dim x 2 (default 128,256,512,1024)")
    parser.add_argument("--page-size", default="1,16", help="page sizes in tokens (default 1,16)")
    parser.add_argument("--tokens", type=int, default=64 * 16384,
                        help="tokens read (default 64 x 16384, kgen bench's batch 64 prefix 16K)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gather_ceiling: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.row_bytes.split(",")]
    pages = [int(p) for p in args.page_size.split(",")]
    if any(r % 32 or r < 32 for r in rows) or any(args.tokens % (p * max(g[1] for g in GRID)) for p in pages):
        print("gather_ceiling: row bytes must be multiples of 32 (bf16 rows of a power-of-two width) and --tokens a "
              f"multiple of page size x {max(g[1] for g in GRID)}", file=sys.stderr)
        return 2
    timer = CudaGraphTimer()
    ceiling = bench_copy_ceiling_gbps()
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.0f} GB/s (kgen bench's 100%)")
    print("| row bytes | page tokens | best GB/s | % of copy | tile / tokens a program / warps / stages |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for row_bytes, page_size in itertools.product(rows, pages):
        pool = Pool.make(args.tokens, row_bytes, page_size)
        check_sum(pool, 4096)
        gbps, config = best_of_grid(pool, args.tokens, timer)
        print(f"| {row_bytes} | {page_size} | {gbps:.0f} | {100 * gbps / ceiling:.1f} | {config} |", flush=True)
        del pool
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
