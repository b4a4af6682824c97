"""benchmarks/gather_ceiling.py's probe kernel in the interpreter: it sums exactly the K and V
rows its page table names (so its GPU figures are those rows' bandwidth), pages of 1 and 16."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "gather_ceiling.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gather_ceiling", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # dataclasses look their module up there
    spec.loader.exec_module(tool)
    return tool


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
