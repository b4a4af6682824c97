"""``kgen explain``: the plan after each pass, the table that applies, and the gate's decision."""

from __future__ import annotations

import dataclasses

from kgen.errors import SpecError, UsageError
from kgen.loader import check_variant
from kgen.passes.context import load_context
from kgen.passes.pipeline import run_pipeline
from kgen.plan import Plan, new_plan
from kgen.spec import KV_DTYPES, Q_DTYPES, canonical_dtype, load_layouts

# Plan fields each pass fills, shown after that pass.
_FIELDS_BY_PASS = {
    "specialize": ("has_pe", "fp8_kv", "v_from_k_tile", "draft_tile_first", "draft_tile_either",
                   "draft_first_rows", "unmasked_full_tiles", "prefix_dot_dtype"),
    "legalize": ("block_d", "block_dpe", "block_dv", "merge_block_dv", "merge_rows", "merge_split_chunk",
                 "mask_d", "mask_dv"),
    "select_config": ("default_config",),
    "fit": ("kernel_shape",),
    "check": ("checked",),
    "emit": ("output_path", "written"),
}


def _format_pass(name: str, plan: Plan) -> list[str]:
    lines = [f"── after {name} " + "─" * max(0, 60 - len(name))]
    for d in plan.decisions_of(name):
        lines.append(f"  {d.what:18s} = {d.value}")
        lines.append(f"  {'':18s}   why: {d.why}")
    for field in _FIELDS_BY_PASS.get(name, ()):
        value = getattr(plan, field)
        if dataclasses.is_dataclass(value) or hasattr(value, "short"):
            value = value.short()
        lines.append(f"  plan.{field} = {value}")
    return lines


def _table_lines(plan: Plan, arch: str | None, group: int) -> list[str]:
    lines = ["── block config at run time " + "─" * 34]
    arches = [arch] if arch else sorted(plan.arch_configs) or ["<any arch without a table>"]
    for a in arches:
        rows = [r for r in plan.arch_configs.get(a, ()) if r.group_size == group]
        source = plan.table_sources.get(a, "no table for this arch")
        if rows:
            for r in rows:
                lines.append(f"  {a} group {group} batch {r.batch_min}..{r.batch_max}: {r.config.short()}")
            lines.append(f"  {'':6s}from {source}")
        else:
            lines.append(f"  {a} group {group}: default {plan.default_config.short()} ({source})")
    return lines


def _gate_lines(spec_name: str, arch: str | None, model: str | None, topk: int, group: int,
                kv: str, q: str) -> list[str]:
    from kgen.runtime.gate import DETECT, explain_gate

    specs = load_layouts()
    model = model or (specs[spec_name].architectures[0] if specs[spec_name].architectures else None)
    if model is None:
        return ["── gate: the layout lists no model architecture, so no model is routed to it"]
    try:
        text = explain_gate(model, device_arch=DETECT if arch is None else arch, topk=topk, group_size=group,
                            kv_dtype=kv, q_dtype=q)
    except (TypeError, ValueError) as exc:
        return [f"── gate: cannot evaluate ({exc})"]
    return ["── runtime gate " + "─" * 46, *("  " + line for line in str(text).splitlines())]


def explain(layout: str, kv_dtype: str = "bfloat16", q_dtype: str = "bfloat16", variant: str = "grouped",
            arch: str | None = None, model: str | None = None, topk: int = 1, group: int | None = None,
            show_source: bool = False) -> str:
    specs = load_layouts()
    if layout not in specs:
        raise SpecError(f"unknown layout {layout!r}; known layouts: {', '.join(sorted(specs))}")
    spec = specs[layout]
    kv = canonical_dtype(kv_dtype, KV_DTYPES, "KV")
    q = canonical_dtype(q_dtype, Q_DTYPES, "query")
    variant = check_variant(variant)
    listed = spec.attention.group_sizes
    if group is None:
        group = max(listed)
    elif isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise UsageError(f"--group must be a positive number of query heads per KV head, got {group!r}")
    lines = [f"kgen explain {layout} --kv-dtype {kv} --q-dtype {q} --variant {variant}"]
    if group not in listed:
        # Explained, not refused: a module runs any group; only the table rows and the gate differ.
        lines.append(
            f"warning: group {group} is not one of {layout}'s listed groups {list(listed)}: no table row "
            f"is tuned for it, so a module called directly runs it with the default block config, and "
            f"the runtime gate sends it to the per-head kernel"
        )
    collected: list[str] = []
    # Explaining writes nothing: emit runs in check mode against the real output directory.
    ctx = load_context(check_only=True)
    plan = run_pipeline(new_plan(spec, kv, q, variant), ctx,
                        on_pass=lambda name, p: collected.extend(_format_pass(name, p)))
    lines.append(f"uri: {plan.uri}")
    lines.extend(collected)
    lines.extend(_table_lines(plan, arch, group))
    lines.extend(_gate_lines(layout, arch, model, topk, group, kv, q))
    if show_source:
        lines.extend(["── source " + "─" * 52, plan.source or ""])
    return "\n".join(lines)
