"""The pass pipeline: validate -> specialize -> legalize -> select_config -> fix_invariance -> fit
-> select_lowering -> render -> inspect_source -> emit. Every pass is ``(plan, ctx) -> plan``;
its name is its function's. Passes that read nothing from the build context (validate,
specialize, legalize, fix_invariance, select_lowering, inspect_source) also take ``ctx=None``,
so the tuner can run specialize and legalize alone."""

from __future__ import annotations

from collections.abc import Callable

from kgen.passes.context import BuildContext
from kgen.passes.emit import emit
from kgen.passes.fit import fit
from kgen.passes.fix_invariance import fix_invariance
from kgen.passes.inspect_source import inspect_source
from kgen.passes.legalize import legalize
from kgen.passes.render import render
from kgen.passes.select_config import select_config
from kgen.passes.select_lowering import select_lowering
from kgen.passes.specialize import specialize
from kgen.passes.validate import validate
from kgen.plan import Plan

PassFn = Callable[[Plan, BuildContext], Plan]

PASSES: tuple[PassFn, ...] = (validate, specialize, legalize, select_config, fix_invariance, fit, select_lowering,
                              render, inspect_source, emit)


def run_pipeline(plan: Plan, ctx: BuildContext, stop_after: str | None = None,
                 on_pass: Callable[[str, Plan], None] | None = None) -> Plan:
    """Run the passes in order; ``on_pass(name, plan)`` sees the plan after each one."""
    names = [fn.__name__ for fn in PASSES]
    if stop_after is not None and stop_after not in names:
        raise ValueError(f"unknown pass {stop_after!r}; passes are {', '.join(names)}")
    for fn in PASSES:
        plan = fn(plan, ctx)
        if on_pass is not None:
            on_pass(fn.__name__, plan)
        if fn.__name__ == stop_after:
            break
    return plan
