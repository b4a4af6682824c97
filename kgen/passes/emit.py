"""emit: write generated/<uri>.py atomically, and only when the text changed.

In check mode nothing is written; the plan records whether the file on disk is stale.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kgen.blockconfig import write_text_atomic
from kgen.errors import BuildError
from kgen.passes.context import BuildContext
from kgen.plan import Decision, Plan

NAME = "emit"


def output_path(plan: Plan, ctx: BuildContext) -> Path:
    return Path(ctx.out_dir) / f"{plan.uri}.py"


def emit(plan: Plan, ctx: BuildContext) -> Plan:
    output = plan.need("output", NAME)
    if not output.inspected:
        raise BuildError(f"{plan.uri}: emit needs an inspected source: run inspect_source first")
    path = output_path(plan, ctx)
    if ctx.check_only:
        current = path.read_text(encoding="utf-8") if path.exists() else None
        stale = current != output.source
        why = "missing" if current is None else ("differs from a fresh render" if stale else "up to date")
        return plan.with_([Decision(NAME, "file", str(path), f"check only: {why}", why)],
                          output=dataclasses.replace(output, path=str(path), written=stale))
    changed = write_text_atomic(path, output.source)
    why = "written (text changed)" if changed else "unchanged: not rewritten"
    return plan.with_([Decision(NAME, "file", str(path), why)],
                      output=dataclasses.replace(output, path=str(path), written=changed))
