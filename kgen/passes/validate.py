"""validate: the requested specialization is one the layout spec allows."""

from __future__ import annotations

from kgen.errors import SpecError
from kgen.passes.context import BuildContext
from kgen.plan import URI_PREFIXES, VARIANTS, Decision, Plan

NAME = "validate"


def validate(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    spec = plan.spec
    if plan.kv_dtype not in spec.dtypes.kv:
        raise SpecError(
            f"{spec.source}: field 'dtypes.kv': {plan.kv_dtype!r} is not listed "
            f"(the layout allows {', '.join(spec.dtypes.kv)})"
        )
    if plan.q_dtype not in spec.dtypes.q:
        raise SpecError(
            f"{spec.source}: field 'dtypes.q': {plan.q_dtype!r} is not listed "
            f"(the layout allows {', '.join(spec.dtypes.q)})"
        )
    if plan.variant not in VARIANTS:
        raise SpecError(f"unknown variant {plan.variant!r}; expected one of {VARIANTS}")
    if (plan.variant, plan.batch_invariant) not in URI_PREFIXES:
        raise SpecError(f"variant {plan.variant!r} has no batch-invariant mode: it is a specialization of the "
                        "grouped kernel")
    shape = spec.attention
    return plan.with_([
        Decision(NAME, "layout", spec.name, f"from {spec.source}"),
        Decision(NAME, "dtypes", f"kv={plan.kv_dtype} q={plan.q_dtype}", "both listed by the spec"),
        Decision(
            NAME, "widths", f"qk={shape.qk_dim} (nope {shape.nope_dim} + pe {shape.pe_dim}) v={shape.v_head_dim}",
            "v_head_dim <= K width, all positive: checked when the spec was parsed",
            "checked when the spec was parsed",
        ),
        Decision(NAME, "variant", plan.variant,
                 "grouped: BLOCK_H heads share each KV tile" if plan.variant == "grouped"
                 else "per_head: one query head per program, the split-KV baseline engines run today",
                 "BLOCK_H heads share each KV tile" if plan.variant == "grouped"
                 else "one query head per program, the engines' baseline"),
    ])
