"""``kgen explain``: the plan after each pass, the table that applies, and the gate's decision."""

from __future__ import annotations

import dataclasses

from kgen.errors import SpecError, UsageError
from kgen.loader import check_variant
from kgen.passes.context import load_context
from kgen.passes.pipeline import run_pipeline
from kgen.plan import SECTION_OF_PASS, Plan, module_uri, new_plan
from kgen.spec import KV_DTYPES, Q_DTYPES, LayoutSpec, canonical_dtype, layouts_for_architecture, load_layouts
from kgen.targets import read_targets


def _show(value: object) -> str:
    """A section field as one readable line: configs by their short form, big structures summarized."""
    if hasattr(value, "short"):
        return value.short()
    if isinstance(value, dict) and value and all(isinstance(v, tuple) for v in value.values()):
        return ", ".join(f"{k}: {len(v)} rows" for k, v in sorted(value.items()))
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return ", ".join(value)  # targets: their names (the rows are in kgen/tables/targets.json)
    if isinstance(value, str) and "\n" in value:
        return f"<{value.count(chr(10))} lines>"
    return str(value)


def _format_pass(name: str, before: Plan | None, plan: Plan) -> list[str]:
    """The decisions a pass made, then each field of its section that it filled or changed."""
    lines = [f"── after {name} " + "─" * max(0, 60 - len(name))]
    for d in plan.decisions_of(name):
        lines.append(f"  {d.what:18s} = {d.value}" + ("   [warning]" if d.warning else ""))
        lines.append(f"  {'':18s}   why: {d.why}")
    section_name = SECTION_OF_PASS.get(name)
    section = getattr(plan, section_name) if section_name else None
    if section is not None:
        old = getattr(before, section_name) if before is not None else None
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if old is None or getattr(old, field.name) != value:
                lines.append(f"  plan.{section_name}.{field.name} = {_show(value)}")
    return lines


def _table_lines(plan: Plan, arch: str | None, group: int) -> list[str]:
    lines = ["── block config at run time " + "─" * 34]
    configs = plan.config
    arches = [arch] if arch else sorted(configs.by_arch) or ["<any arch without a table>"]
    for a in arches:
        rows = [r for r in configs.by_arch.get(a, ()) if r.group_size == group]
        source = configs.table_sources.get(a, "no table for this arch")
        if rows:
            for r in rows:
                lines.append(f"  {a} group {group} batch {r.batch_min}..{r.batch_max}: {r.config.short()}")
            lines.append(f"  {'':6s}from {source}")
        else:
            lines.append(f"  {a} group {group}: default {configs.default.short()} ({source})")
    return lines


def _gate_lines(spec: LayoutSpec, arch: str | None, model: str | None, topk: int, group: int,
                kv: str, q: str) -> list[str]:
    from kgen.runtime.gate import DETECT, explain_gate

    model = model or (spec.architectures[0] if spec.architectures else None)
    if model is None:
        return ["── gate: the layout lists no model architecture, so no model is routed to it"]
    a = spec.attention
    try:
        # The explained layout's widths: a model no layout lists is then refused with the fix.
        text = explain_gate(model, device_arch=DETECT if arch is None else arch, topk=topk, group_size=group,
                            qk_dim=a.qk_dim, pe_dim=a.pe_dim, v_dim=a.v_head_dim, kv_dtype=kv, q_dtype=q)
    except ValueError as exc:
        raise UsageError(f"the runtime gate cannot evaluate this: {exc}") from None
    return ["── runtime gate " + "─" * 46, *("  " + line for line in str(text).splitlines())]


def _check_arch(arch: str | None) -> None:
    """An arch the modules accept (kgen/tables/targets.json), else a UsageError naming them."""
    known = list(read_targets())
    if arch is not None and arch not in known:
        raise UsageError(
            f"unknown --arch {arch!r}: the generated modules are checked for and accept {', '.join(known)} "
            f"(kgen/tables/targets.json); to bring up another GPU add its row there (README.md, "
            f"\"Tuning a new GPU\")"
        )


def _check_model(model: str | None, spec: LayoutSpec, specs: dict[str, LayoutSpec]) -> None:
    """Refuse a model that another layout serves: the gate would explain that layout, not this one."""
    if model is None or model in spec.architectures:
        return
    owners = sorted(s.name for s in layouts_for_architecture(model, specs))
    if owners:
        raise UsageError(
            f"--model {model!r} is served by layout {', '.join(owners)}, not {spec.name!r} (whose models are "
            f"{', '.join(spec.architectures) or 'none'}): run `kgen explain {owners[0]} --model {model}`, or add "
            f"it to `architectures` in {spec.source} if {spec.name!r} is its layout"
        )


def _check_topk(topk: int) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise UsageError(f"--topk must be EAGLE's branches per step, a whole number >= 1 (1: a chain, "
                         f"> 1: a tree), got {topk!r}")


def explain(layout: str, kv_dtype: str = "bfloat16", q_dtype: str = "bfloat16", variant: str = "grouped",
            arch: str | None = None, model: str | None = None, topk: int = 1, group: int | None = None,
            show_source: bool = False, batch_invariant: bool = False) -> str:
    """The text of ``kgen explain``. Raises UsageError (exit 2) for an unknown layout, dtype or
    arch, a model another layout serves, or a topk or group below 1."""
    specs = load_layouts()
    if layout not in specs:
        raise SpecError(f"unknown layout {layout!r}; known layouts: {', '.join(sorted(specs))}")
    spec = specs[layout]
    _check_arch(arch)
    _check_model(model, spec, specs)
    _check_topk(topk)
    kv = canonical_dtype(kv_dtype, KV_DTYPES, "KV")
    q = canonical_dtype(q_dtype, Q_DTYPES, "query")
    variant = check_variant(variant)
    module_uri(layout, kv, q, variant, batch_invariant)  # a UsageError for a mode the variant lacks
    listed = spec.attention.group_sizes
    if group is None:
        group = max(listed)
    elif isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise UsageError(f"--group must be a positive number of query heads per KV head, got {group!r}")
    lines = [f"kgen explain {layout} --kv-dtype {kv} --q-dtype {q} --variant {variant}"
             + (" --batch-invariant" if batch_invariant else "")]
    if group not in listed:
        # Explained, not refused: a module runs any group; only the table rows and the gate differ.
        lines.append(
            f"warning: group {group} is not one of {layout}'s listed groups {list(listed)}: no table row "
            f"is tuned for it, so a module called directly runs it with the default block config, and "
            f"the runtime gate sends it to the per-head kernel"
        )
    collected: list[str] = []
    previous: list[Plan] = [new_plan(spec, kv, q, variant, batch_invariant)]

    def show_pass(name: str, after: Plan) -> None:
        collected.extend(_format_pass(name, previous[-1], after))
        previous.append(after)

    # Explaining writes nothing: emit runs in check mode against the real output directory.
    ctx = load_context(check_only=True)
    plan = run_pipeline(previous[0], ctx, on_pass=show_pass)
    lines.append(f"uri: {plan.uri}")
    lines.extend(collected)
    lines.extend(_table_lines(plan, arch, group))
    lines.extend(_gate_lines(spec, arch, model, topk, group, kv, q))
    if show_source:
        lines.extend(["── source " + "─" * 52, plan.output.source])
    return "\n".join(lines)
