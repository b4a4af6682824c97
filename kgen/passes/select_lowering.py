"""select_lowering: the kernel language the plan is rendered into.

A lowering is one folder of templates (kgen/templates/<name>/kernel.py.j2 and what it
includes) that turns the same plan into one kernel language. Triton renders every module.
A layout may also get a second lowering of its prefix stage, written in Gluon for one arch
and one Triton version (kgen/templates/lowerings.json says which layouts); the module then
carries both kernels, and a block-config table row that measured the Gluon kernel faster
(its config's ``gluon`` section) makes the launcher pick it. Everywhere else, and wherever
the Gluon kernel does not apply at run time, the Triton kernel serves.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from kgen.passes.context import BuildContext
from kgen.plan import Decision, Lowering, Plan
from kgen.spec import FP8_DTYPES

NAME = "select_lowering"
TRITON = "triton"
LOWERINGS_FILE = Path(__file__).resolve().parents[1] / "templates" / "lowerings.json"


@functools.cache
def second_lowerings() -> dict[str, Any]:
    data = json.loads(LOWERINGS_FILE.read_text())
    return {name: entry for name, entry in data.items() if isinstance(entry, dict)}


def _layout_facts(plan: Plan) -> dict[str, Any]:
    shape = plan.spec.attention
    return {"variant": plan.variant, "v_source": shape.v_source, "nope_dim": shape.nope_dim,
            "pe_dim": shape.pe_dim, "kv_storage": "fp8" if plan.kv_dtype in FP8_DTYPES else "16-bit",
            "q_dtype_is_kv_dtype": plan.q_dtype == plan.kv_dtype}


def unmet(requires: dict[str, Any], facts: dict[str, Any]) -> list[str]:
    """The requirements a layout misses, as 'field: wanted X, layout has Y'."""
    return [f"{k}: wanted {v!r}, layout has {facts.get(k)!r}" for k, v in requires.items() if facts.get(k) != v]


def select_lowering(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    plan.need("fit", NAME)
    decisions = [Decision(NAME, "lowering", TRITON,
                          "Triton kernels for every target in kgen/tables/targets.json: the portable path, the "
                          "fallback and the parity reference")]
    entry = second_lowerings()["gluon_prefix"]
    missing = unmet(entry["requires"], _layout_facts(plan))
    if missing:
        decisions.append(Decision(NAME, "gluon_prefix", None, "no Gluon prefix stage: " + "; ".join(missing)))
        return plan.with_(decisions, lowering=Lowering(TRITON))
    decisions.append(Decision(
        NAME, "gluon_prefix", entry["template"],
        f"{entry['why']}. Emitted beside the Triton kernel; launched on {entry['arch']} under Triton "
        f"{entry['triton']}.x for table rows whose config has a gluon section"))
    return plan.with_(decisions, lowering=Lowering(TRITON, gluon_prefix=entry["template"], gluon_arch=entry["arch"],
                                                   gluon_triton=entry["triton"]))
