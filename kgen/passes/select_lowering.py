"""select_lowering: the kernel language the plan is rendered into.

A lowering is one folder of templates (kgen/templates/<name>/kernel.py.j2 and what it
includes) that turns the same plan into one kernel language. A second lowering (Gluon on
Hopper, for example) is a new folder and a new choice here, chosen per plan with its reason.
"""

from __future__ import annotations

from kgen.passes.context import BuildContext
from kgen.plan import Decision, Lowering, Plan

NAME = "select_lowering"
TRITON = "triton"


def select_lowering(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    plan.need("fit", NAME)
    return plan.with_([Decision(NAME, "lowering", TRITON,
                                "the only lowering: Triton kernels for every target in kgen/tables/targets.json")],
                      lowering=Lowering(TRITON))
