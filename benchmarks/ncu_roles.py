"""Where the warps of a warp-specialized kernel wait, by role: Nsight Compute's per-instruction
stall samples split by partition and by stretch of code (CPU, no GPU).

On the GPU machine, profile with the SourceCounters section and export the SASS page:

  ncu --clock-control none --kernel-name regex:_gluon_prefix --launch-skip 2 --launch-count 1 \\
      --section SourceCounters -o /tmp/rep python3 benchmarks/ncu_probe.py --layout mla_absorbed_512_64 \\
      --group 16 --batch 64 --prefix 16384 --draft 16
  ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass | gzip > $OUT/sass.csv.gz

then here:

  python benchmarks/ncu_roles.py sass.csv.gz --roles 256=scorer,208=second_pv,40=producer

A partition of a Triton Gluon kernel starts where its warps set their registers
(`USETMAXREG ... <count>`), so the count names the role; the out-of-line retry loops of the
mbarrier waits, placed after the kernel's last EXIT, count for the role whose wait names the
same barrier. Within a role, a stretch starts at each wait on a barrier (`SYNCS.PHASECHK`), each
wgmma wait (`WARPGROUP.DEPBAR`) and the first wgmma of a run (`HGMMA`), so the table reads as
"issue S / wait for S / softmax / ...": samples are warp time, split by what the warp did next.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
SETS_REGISTERS = re.compile(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:\w+,\s*)?(0x[0-9a-f]+|\d+)")
BARRIER_OPERAND = re.compile(r"SYNCS\.PHASECHK\S*\s+\w+,\s*(\[[^\]]+\])")
STRETCH_STARTS = ("SYNCS.PHASECHK", "WARPGROUP.DEPBAR")


@dataclass
class Instruction:
    address: int
    source: str
    samples: int
    stalls: Counter = field(default_factory=Counter)


@dataclass
class Role:
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)


def read_source_page(path: Path) -> list[Instruction]:
    """The rows of `ncu --page source --csv --print-source sass` (plain or gzip), in address order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if header_at is None or SAMPLES not in rows[header_at]:
        raise SystemExit(f"{path}: no '{SAMPLES}' column: profile with --section SourceCounters and export "
                         "with --page source --csv --print-source sass")
    header = rows[header_at]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[header_at + 1:]:
        if len(r) != len(header) or not r[0].startswith("0x"):
            continue
        stalls = Counter({h[len("stall_"):]: int(r[col[h]] or 0) for h in reasons})
        out.append(Instruction(int(r[0], 16), r[col["Source"]].strip(), int(r[col[SAMPLES]] or 0), +stalls))
    return sorted(out, key=lambda i: i.address)


def split_roles(instructions: list[Instruction], names: dict[int, str]) -> list[Role]:
    """Cut the code at each register setting; a stretch set to a count in `names` is that role's,
    any other (the idle dispatch loop, the prologue) is named by its count. The retry loops
    after the last EXIT join the role that waits on the same barrier."""
    last_exit = max((k for k, i in enumerate(instructions) if re.search(r"\bEXIT\b", i.source)), default=-1)
    roles: dict[str, Role] = {}
    current = roles.setdefault("prologue", Role("prologue"))
    waits: dict[str, Role] = {}
    for k, ins in enumerate(instructions):
        match = SETS_REGISTERS.search(ins.source)
        if match and k <= last_exit:
            count = int(match.group(1), 0)
            name = names.get(count, f"{count} registers")
            current = roles.setdefault(name, Role(name))
        owner = current
        barrier = BARRIER_OPERAND.search(ins.source)
        if k > last_exit and barrier and barrier.group(1) in waits:
            owner = waits[barrier.group(1)]
        elif barrier and k <= last_exit:
            waits.setdefault(barrier.group(1), current)
        owner.instructions.append(ins)
    return [r for r in roles.values() if r.instructions]


def stretches(role: Role) -> list[tuple[Instruction, int, Counter]]:
    """(first instruction, samples, stall reasons) of each stretch of the role's code: a wait is
    a stretch of its own, and so is what follows it up to the next wait or wgmma run."""
    out: list[tuple[Instruction, int, Counter]] = []
    previous = ""
    for ins in role.instructions:
        starts_mma_run = ins.source.startswith("HGMMA") and not previous.startswith("HGMMA")
        after_wait = previous.startswith(STRETCH_STARTS)
        if not out or starts_mma_run or after_wait or ins.source.startswith(STRETCH_STARTS):
            out.append((ins, 0, Counter()))
        first, samples, stalls = out[-1]
        out[-1] = (first, samples + ins.samples, stalls + ins.stalls)
        previous = ins.source
    return out


def report(roles: list[Role], min_share: float) -> str:
    total = sum(r.samples for r in roles) or 1
    start = min(i.address for r in roles for i in r.instructions)
    lines = [f"{'role':<16} {'samples':>8} {'share':>6}  top stall reasons"]
    for role in sorted(roles, key=lambda r: -r.samples):
        reasons = sum((i.stalls for i in role.instructions), Counter())
        top = ", ".join(f"{k} {100 * v / max(role.samples, 1):.0f}%" for k, v in reasons.most_common(3))
        lines.append(f"{role.name:<16} {role.samples:>8} {100 * role.samples / total:>5.1f}%  {top}")
    for role in sorted(roles, key=lambda r: -r.samples):
        if role.samples < min_share * total:
            continue
        lines += ["", f"{role.name}: stretches with at least {100 * min_share:.0f}% of the role's samples",
                  f"{'offset':>8} {'share':>6}  {'starts with':<58} top stall reasons"]
        for first, samples, stalls in stretches(role):
            if samples < min_share * role.samples:
                continue
            top = ", ".join(f"{k} {100 * v / max(samples, 1):.0f}%" for k, v in stalls.most_common(2))
            share = 100 * samples / role.samples
            lines.append(f"{first.address - start:>#8x} {share:>5.1f}%  {first.source[:58]:<58} {top}")
    return "\n".join(lines)


def parse_roles(text: str) -> dict[int, str]:
    names = {}
    for item in filter(None, text.split(",")):
        count, sep, name = item.partition("=")
        if not sep or not count.strip().isdigit() or not name.strip():
            raise SystemExit(f"--roles: '{item}' is not COUNT=NAME (e.g. 256=scorer)")
        names[int(count)] = name.strip()
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source_page", type=Path, help="CSV (or .csv.gz) of ncu --page source --print-source sass")
    ap.add_argument("--roles", default="", help="COUNT=NAME,...: the role whose warps set COUNT registers")
    ap.add_argument("--min-share", type=float, default=0.02, help="hide stretches below this share (default 0.02)")
    args = ap.parse_args()
    print(report(split_roles(read_source_page(args.source_page), parse_roles(args.roles)), args.min_share))


if __name__ == "__main__":
    main()
