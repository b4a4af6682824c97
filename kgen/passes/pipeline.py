"""The pass pipeline: validate -> specialize -> legalize -> select_config -> fit -> render -> check -> emit."""

from __future__ import annotations

from collections.abc import Callable

from kgen.passes.check import check
from kgen.passes.context import BuildContext
from kgen.passes.emit import emit
from kgen.passes.fit import fit
from kgen.passes.legalize import legalize
from kgen.passes.render import render
from kgen.passes.select_config import select_config
from kgen.passes.specialize import specialize
from kgen.passes.validate import validate
from kgen.plan import Plan

PassFn = Callable[[Plan, BuildContext], Plan]

PASSES: tuple[tuple[str, PassFn], ...] = (
    ("validate", lambda plan, ctx: validate(plan)),
    ("specialize", lambda plan, ctx: specialize(plan)),
    ("legalize", lambda plan, ctx: legalize(plan)),
    ("select_config", select_config),
    ("fit", fit),
    ("render", render),
    ("check", lambda plan, ctx: check(plan)),
    ("emit", emit),
)


def run_pipeline(plan: Plan, ctx: BuildContext, stop_after: str | None = None,
                 on_pass: Callable[[str, Plan], None] | None = None) -> Plan:
    """Run the passes in order; ``on_pass(name, plan)`` sees the plan after each one."""
    names = [name for name, _ in PASSES]
    if stop_after is not None and stop_after not in names:
        raise ValueError(f"unknown pass {stop_after!r}; passes are {', '.join(names)}")
    for name, fn in PASSES:
        plan = fn(plan, ctx)
        if on_pass is not None:
            on_pass(name, plan)
        if name == stop_after:
            break
    return plan
