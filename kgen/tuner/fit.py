"""A tuned row over its whole domain, judged before the row is written.

The tuner times a bucket's workloads at 4 draft tokens; the row it writes serves every draft
length, entry, mask, index dtype and query dtype of its group and batches. Before a finalist
may win, the programs its row would launch there are compiled offline for the job's arch and
judged by ``kgen check``'s rule (``check.verdict``: shared memory over the target's, more than
2048 B of spills a thread on NVIDIA, a compile error). A finalist that fails loses to the next
(``results.finalize``), and the reason prints with the study's result.

The compiles run in a child process (``python -m kgen.tuner.fit``) whose ``$KGEN_TABLE`` holds
the candidate row alone, so the generated modules take it at load as they take any table
(kgen/retable.py), and a compile that crashes takes only the child down. They go through
kgen check's result cache: a program compiles once, whichever finalist launches it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kgen.blockconfig import TABLE_SCHEMA, BlockConfig, TableEntry, TableFile, write_table

if TYPE_CHECKING:
    from kgen.tuner.job import TuneJob

# The child's wall-clock limit: an MLA row's programs take seconds each to compile.
FIT_TIMEOUT_S = 900


def candidate_table(job: TuneJob, config: BlockConfig) -> TableFile:
    """A table holding only the job's row with ``config``: every other group and batch takes
    the built-in default, and only the job's own points are judged."""
    entry = TableEntry(layout=job.layout.name, kv_dtype=job.kv_dtype, group_size=job.group_size,
                       batch_min=job.bucket.batch_min, batch_max=job.bucket.batch_max,
                       config=config.for_arch(job.arch))
    return TableFile.model_validate({
        "schema": TABLE_SCHEMA,
        "arch": job.arch,
        "metadata": {"arch": job.arch, "tuned": False, "note": "kgen tune's fit check of one candidate row"},
        "entries": [entry.model_dump()],
    })


def row_problems(arch: str, layout: str, kv_dtype: str, group: int, batch_min: int, batch_max: int,
                 narrowing: dict | None = None, jobs: int | None = None) -> list[str]:
    """What is wrong with the programs the table row (layout, KV dtype, group, batches) launches
    on ``arch``: one line a failing program, naming where it launches. Reads the row from the
    tables in effect (this process's ``$KGEN_TABLE``). ``narrowing``: select_scope's selection
    keywords (q_dtypes, variants, entries, index_dtypes), for tests."""
    from kgen import check

    selection = {"layouts": [layout], "kv_dtypes": [kv_dtype], **(narrowing or {})}
    enumeration = check.select_scope([arch], True, **selection)

    def the_rows(points: list[check.Point]) -> list[check.Point]:
        return [p for p in points if p.from_table and p.group == group and batch_min <= p.batch <= batch_max]

    launched = [v for v in enumeration.variants if the_rows(v.points)]
    cache = check.ResultCache(check.cache_dir())
    results, _ = check.compile_all(launched, [arch], jobs or os.cpu_count() or 1, cache, progress=False)
    problems = []
    for variant in launched:
        for problem in check.verdict(variant, results[variant.key]):
            where = check.describe_points(the_rows(variant.points))
            problems.append(f"{variant.kernel} at draft {where['draft']} ({where['entry']}, {where['mask']}): "
                            f"{problem}")
    return problems


def fit_error(job: TuneJob, config: BlockConfig, timeout_s: float = FIT_TIMEOUT_S,
              narrowing: dict | None = None) -> str | None:
    """Why the job's row with ``config`` may not be written (its failing programs), or None."""
    with tempfile.TemporaryDirectory(prefix="kgen-fit-") as tmp:
        table = Path(tmp) / f"{job.arch}.json"
        write_table(table, candidate_table(job, config))
        command = [sys.executable, "-m", "kgen.tuner.fit", "--arch", job.arch, "--layout", job.layout.name,
                   "--kv-dtype", job.kv_dtype, "--group", str(job.group_size), "--batch-min",
                   str(job.bucket.batch_min), "--batch-max", str(job.bucket.batch_max)]
        if narrowing:
            command += ["--narrowing", json.dumps(narrowing)]
        env = {**os.environ, "KGEN_TABLE": str(table)}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return f"its programs were not all compiled within {timeout_s:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the fit check could not run (exit {done.returncode}: {last})"
    problems = json.loads(done.stdout)
    if not problems:
        return None
    more = f"; and {len(problems) - 2} more" if len(problems) > 2 else ""
    return "kgen check: " + "; ".join(problems[:2]) + more


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kgen.tuner.fit", description=(
        "The programs one table row launches over its domain, compiled offline and judged by kgen check's "
        "rule; prints a JSON list of problems ([] when the row fits). The row comes from $KGEN_TABLE."))
    parser.add_argument("--arch", required=True)
    parser.add_argument("--layout", required=True)
    parser.add_argument("--kv-dtype", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--batch-min", type=int, required=True)
    parser.add_argument("--batch-max", type=int, required=True)
    parser.add_argument("--narrowing", type=json.loads, default=None,
                        help="select_scope keywords as JSON, e.g. '{\"entries\": [\"token-slot\"]}' (tests)")
    args = parser.parse_args(argv)
    problems = row_problems(args.arch, args.layout, args.kv_dtype, args.group, args.batch_min, args.batch_max,
                            args.narrowing)
    print(json.dumps(problems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
