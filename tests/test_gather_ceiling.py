"""benchmarks/gather_ceiling.py's probe kernel in the interpreter: it sums exactly the K and V
rows its page table names (so its GPU figures are those rows' bandwidth), pages of 1 and 16."""

from __future__ import annotations

import pytest
from benchmark_tools import load_tool


def _tool():
    return load_tool("gather_ceiling")


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_probe_sums_the_rows_its_pages_name(page_size: int) -> None:
    tool = _tool()
    pool = tool.Pool.make(512, 64, page_size, device="cpu")
    tool.check_sum(pool, 256)


def test_a_probe_that_misreads_is_refused() -> None:
    """check_sum stops the run when the kernel's sums are not the named rows': a pool whose
    gather reads a shifted page table."""
    tool = _tool()

    class Shifted(tool.Pool):
        def gather_sum(self, tokens: int, *launch: int):
            shifted = tool.Pool(self.k, self.v, (self.pages + 1) % self.k.shape[0], self.page_size)
            return shifted.gather_sum(tokens, *launch)

    pool = tool.Pool.make(512, 64, 1, device="cpu")
    with pytest.raises(SystemExit, match="differ from torch's gather"):
        tool.check_sum(Shifted(pool.k, pool.v, pool.pages, 1), 256)
