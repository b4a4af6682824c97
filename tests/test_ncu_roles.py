"""benchmarks/ncu_roles.py: Nsight Compute's per-instruction stall samples split by warp role."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import pytest
from benchmark_tools import load_tool


def _tool():
    return load_tool("ncu_roles")


# A two-role kernel as ncu's source page lays it out: the scorer (256 registers) waits for a
# tile, issues a wgmma and waits for it; the producer (40 registers) waits for a free stage; the
# retry loops of both waits sit after the last EXIT.
SASS = [
    ("0x100", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x100", 1, {"stall_wait": 1}),
    ("0x110", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R1+URZ+0x10], R2", 2, {"stall_long_sb": 2}),
    ("0x120", "HGMMA.64x64x16.F32.BF16 R8, gdesc[UR4], R8", 3, {"stall_wait": 3}),
    ("0x130", "HGMMA.64x64x16.F32.BF16 R8, gdesc[UR6], R8, gsb0", 4, {"stall_mio": 4}),
    ("0x140", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 10, {"stall_barrier": 10}),
    ("0x150", "FMUL R0, R8, R9", 6, {"stall_selected": 6}),
    ("0x160", "MUFU.EX2 R0, R0", 4, {"stall_short_sb": 4}),
    ("0x170", "USETMAXREG.DEALLOC.CTAPOOL 0x28", 1, {"stall_wait": 1}),
    ("0x180", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x20], R3", 5, {"stall_long_sb": 5}),
    ("0x190", "LDGSTS.E.BYPASS.128 [R4], desc[UR8][R6.64]", 2, {"stall_lg": 2}),
    ("0x1a0", "EXIT", 0, {}),
    ("0x1b0", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R1+URZ+0x10], R2", 7, {"stall_long_sb": 7}),
    ("0x1c0", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR6+0x20], R3", 9, {"stall_long_sb": 9}),
]
REASONS = ["stall_barrier", "stall_long_sb", "stall_lg", "stall_mio", "stall_selected", "stall_short_sb",
           "stall_wait"]


def _write(path: Path) -> Path:
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", *REASONS,
              *(r + " (Not Issued)" for r in REASONS)]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "_gluon_prefix_stage", ""])
        w.writerow(header)
        for address, source, samples, stalls in SASS:
            w.writerow([address, "      " + source, samples, 1, *(stalls.get(r, 0) for r in REASONS),
                        *(0 for _ in REASONS)])
    return path


def test_samples_go_to_the_role_that_set_its_registers_and_owns_the_barrier(tmp_path: Path) -> None:
    tool = _tool()
    roles = {r.name: r for r in tool.split_roles(tool.read_source_page(_write(tmp_path / "s.csv.gz")),
                                                 {256: "scorer", 40: "producer"})}
    # The scorer's code (1+2+3+4+10+6+4) and the retry of its `ready` wait (7); the producer's
    # (1+5+2) and its retry (9); EXIT has none.
    assert roles["scorer"].samples == 37 and roles["producer"].samples == 17
    stretches = [(first.source.split()[0], samples) for first, samples, _ in tool.stretches(roles["scorer"])]
    # A wait is a stretch, what follows a wait another, a wgmma run another.
    assert stretches == [("USETMAXREG.TRY_ALLOC.CTAPOOL", 1), ("SYNCS.PHASECHK.TRANS64.TRYWAIT", 2),
                         ("HGMMA.64x64x16.F32.BF16", 7), ("WARPGROUP.DEPBAR.LE", 10), ("FMUL", 10),
                         ("SYNCS.PHASECHK.TRANS64.TRYWAIT", 7)]
    text = tool.report(list(roles.values()), 0.02)
    assert text.splitlines()[1].split()[:3] == ["scorer", "37", "68.5%"]


def test_a_page_without_samples_or_a_bad_role_is_refused(tmp_path: Path) -> None:
    tool = _tool()
    plain = tmp_path / "page.csv"
    plain.write_text('"Address","Source"\n"0x100","EXIT"\n')
    with pytest.raises(SystemExit, match="SourceCounters"):
        tool.read_source_page(plain)
    with pytest.raises(SystemExit, match="COUNT=NAME"):
        tool.parse_roles("256:scorer")
