"""``kgen explain``: the plan after each pass, the table that applies, and the gate's decision."""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

from kgen.blockconfig import compact_notation
from kgen.errors import SpecError, UsageError
from kgen.loader import check_variant
from kgen.passes.context import load_context
from kgen.passes.pipeline import PASSES, run_pipeline
from kgen.plan import SECTION_OF_PASS, Decision, Plan, module_uri, new_plan
from kgen.spec import KV_DTYPES, Q_DTYPES, LayoutSpec, canonical_dtype, layouts_for_architecture, load_layouts
from kgen.targets import read_targets


def _show(value: object) -> str:
    """A section field or decision value in full, for ``--verbose``: configs spelled out, big
    structures summarized."""
    if hasattr(value, "short"):
        return value.short()
    if isinstance(value, dict) and value and all(isinstance(v, tuple) for v in value.values()):
        return ", ".join(f"{k}: {len(v)} rows" for k, v in sorted(value.items()))
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return ", ".join(value)  # targets: their names (the rows are in kgen/tables/targets.json)
    if isinstance(value, str) and "\n" in value:
        return f"<{value.count(chr(10))} lines>"
    return str(value)


WIDTH = 100  # characters a line of `kgen explain` may take
PASS_WIDTH = max(len(fn.__name__) for fn in PASSES)
# The what column: a pass aligns its rows to its widest what up to this; a wider one pushes
# its own value right.
WHAT_WIDTH = 17
_ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def _relative(text: object) -> str:
    """Paths under the checkout without its root."""
    return str(text).replace(_ROOT, "")


def _shown(value: object, splits: bool) -> str:
    """A decision value on its one line: configs in their compact notation (without their split
    policies where the module does not use them), paths relative."""
    return _relative(value.compact(splits) if hasattr(value, "compact") else value)


def _wrap(text: str, first: str, rest: str) -> list[str]:
    """``text`` after the prefix ``first``, continued under ``rest``: broken between words, never cut."""
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False) or [first.rstrip()]


def _row(label: str, what: str, what_width: int, value: str, brief: str) -> list[str]:
    """One row, ``label  what = value — brief``, on one line where it fits. Where it does not,
    the brief goes on the next line under the value, and a value wider than its line continues
    there too; a word of it too wide to follow the ``=`` (a long file name) starts a line of its
    own under the what column. Rows wrap between words, never cut."""
    head = f"{label:<{PASS_WIDTH}}  {what:<{what_width}} = "
    under = " " * min(len(head), PASS_WIDTH + 2 + WHAT_WIDTH + 3)
    if len(head) + len(value.split(" ", 1)[0]) > WIDTH:
        under = " " * (PASS_WIDTH + 4)
        lines = [head.rstrip(), *_wrap(value, under, under)]
    else:
        lines = _wrap(value, head, under)
    if not brief:
        return lines
    if len(lines[-1]) + 3 + len(brief) <= WIDTH:
        lines[-1] += f" — {brief}"
        return lines
    return lines + _wrap(f"— {brief}", under, under + "  ")


def _table(label: str, rows: list[tuple[str, str, str]]) -> list[str]:
    """(what, value, brief) rows under a label shown once, in the first column, their ``=``
    aligned to the widest what up to WHAT_WIDTH."""
    what_width = min(WHAT_WIDTH, max(len(what) for what, _, _ in rows))
    lines: list[str] = []
    for i, (what, value, brief) in enumerate(rows):
        lines += _row(label if i == 0 else "", what, what_width, value, brief)
    return lines


_ROW_OF_GROUP = re.compile(r"(?P<arch>\S+) row group (?P<group>\d+) batch (?P<batches>\S+)")


def _merged_groups(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """One line for table rows that differ in their group alone: 'sm_90 row group 4 batch 1+'
    and 'sm_90 row group 8 batch 1+' with the same value and brief become 'sm_90 groups 4, 8
    batch 1+'."""
    merged: list[tuple[str, str, str]] = []
    run: tuple[str, str, str, str] | None = None  # the last line's (arch, batches, value, brief)
    groups: list[str] = []
    for what, value, brief in rows:
        match = _ROW_OF_GROUP.fullmatch(what)
        key = (match["arch"], match["batches"], value, brief) if match else None
        if key is not None and key == run:
            groups.append(match["group"])
            merged[-1] = (f"{match['arch']} groups {', '.join(groups)} batch {match['batches']}", value, brief)
            continue
        run, groups = key, [match["group"]] if match else []
        merged.append((what, value, brief))
    return merged


def _shown_by_decisions(name: str, value: object, decisions: list[Decision]) -> bool:
    """A section field a decision already prints: named by its ``what`` or equal to its value."""
    key, shown = name.lower().replace("_", " "), _show(value)
    return any(d.what.lower().replace("_", " ") == key or shown in (_show(d.value), d.why) for d in decisions)


def _format_pass(name: str, before: Plan | None, plan: Plan, verbose: bool) -> list[str]:
    """A pass's decisions: one line each with its brief (the fit pass's cells counted in its
    summaries), or (``verbose``) every decision with its whole reason and then the section
    fields the pass filled that no decision shows."""
    decisions = plan.decisions_of(name)
    if not verbose:
        splits = not plan.batch_invariant  # the batch-invariant mode's fixed splits replace the policies
        rows = [(d.what, _shown(d.value, splits), _relative(d.brief)) for d in decisions if not d.detail]
        rows = _merged_groups(rows)
        return _table(name, rows or [("(nothing)", "-", "this pass decided nothing here")])
    lines = [f"── {name} " + "─" * max(0, WIDTH - 4 - len(name))]
    for d in decisions:
        # The value whole on its line (it may pass WIDTH: a config spelled out), the reason wrapped.
        lines.append(f"  {d.what} = {_show(d.value)}" + ("   [warning]" if d.warning else ""))
        lines += _wrap(d.why, "      why: ", "      ")
    section_name = SECTION_OF_PASS.get(name)
    section = getattr(plan, section_name) if section_name else None
    if section is not None:
        old = getattr(before, section_name) if before is not None else None
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            changed = old is None or getattr(old, field.name) != value
            if changed and not _shown_by_decisions(field.name, value, decisions):
                lines += _wrap(f"plan.{section_name}.{field.name} = {_show(value)}", "  ", "      ")
    return lines


def _table_lines(plan: Plan, arch: str | None, group: int, verbose: bool) -> list[str]:
    """The block config a call of this group takes at run time on each arch with rows (or the
    one asked for): its table rows by batch, or the default."""
    configs = plan.config
    arches = [arch] if arch else sorted(configs.by_arch) or [None]
    if verbose:
        lines = ["block config at run time:"]
        for a in arches:
            rows = [r for r in configs.by_arch.get(a, ()) if r.group_size == group]
            where = a or "any arch without a table"
            source = configs.table_sources.get(a, "no table for this arch")
            if rows:
                for r in rows:
                    lines += _wrap(f"{where} group {group} batch {r.batches}: {r.config.short()}", "  ", "      ")
                lines += _wrap(f"from {source}", "      ", "      ")
            else:
                lines += _wrap(f"{where} group {group}: default {configs.default.short()} ({source})", "  ", "      ")
        return lines
    table: list[tuple[str, str, str]] = []
    splits = not plan.batch_invariant
    for a in arches:
        rows = [r for r in configs.by_arch.get(a, ()) if r.group_size == group]
        where = f"{a or 'any arch'} group {group}"
        if rows:
            source = configs.table_sources[a].replace(": ", " ", 1)
            table.append((where, f"{len(rows)} row{'s' if len(rows) > 1 else ''} by batch",
                          _relative(f"from {source}")))
            table += [(f"  batch {r.batches}", r.config.compact(splits), "") for r in rows]
        else:
            table.append((where, configs.default.compact(splits),
                          "the default: no row for this group" if a in configs.by_arch else "the default: no table"))
    table.append(("configs", compact_notation(splits), ""))
    return _table("run time", table)


def _gate_lines(spec: LayoutSpec, arch: str | None, model: str | None, topk: int, group: int,
                kv: str, q: str, verbose: bool) -> list[str]:
    from kgen.runtime.gate import DETECT, explain_gate

    model = model or (spec.architectures[0] if spec.architectures else None)
    if model is None:
        return ["gate: the layout lists no model architecture, so no model is routed to it"]
    a = spec.attention
    try:
        # The explained layout's widths: a model no layout lists is then refused with the fix.
        text = explain_gate(model, device_arch=DETECT if arch is None else arch, topk=topk, group_size=group,
                            qk_dim=a.qk_dim, pe_dim=a.pe_dim, v_dim=a.v_head_dim, kv_dtype=kv, q_dtype=q)
    except ValueError as exc:
        raise UsageError(f"the runtime gate cannot evaluate this: {exc}") from None
    lines = str(text).splitlines()
    if not verbose:  # the answer for whom on one line, then the reason it turned on (it says how to fix)
        stripped = [line.strip() for line in lines]
        path = next(line for line in stripped if line.startswith("decision:")).split()[1]
        out = _table("gate", [("decision", path, f"{model}, topk {topk}, group {group}")])
        indent = " " * (PASS_WIDTH + 2)
        for line in (line for line in stripped if line.startswith("- =>")):
            out += _wrap(_relative(line), indent, indent + "  ")
        return out
    return ["── runtime gate " + "─" * (WIDTH - 16), *("  " + line for line in lines)]


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
            show_source: bool = False, batch_invariant: bool = False, verbose: bool = False,
            only_pass: str | None = None) -> str:
    """The text of ``kgen explain``: one line per decision, or (``verbose``, or ``only_pass``
    for one pass alone) every decision with its whole reason. Raises UsageError (exit 2) for an
    unknown layout, dtype, arch or pass, a model another layout serves, or a topk or group
    below 1."""
    names = [fn.__name__ for fn in PASSES]
    if only_pass is not None and only_pass not in names:
        raise UsageError(f"unknown --pass {only_pass!r}: the passes are {', '.join(names)}")
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
    lines = [f"kgen explain {layout} --kv-dtype {kv} --q-dtype {q}"
             + (f" --variant {variant}" if variant != "grouped" else "")
             + (" --batch-invariant" if batch_invariant else "")]
    if group not in listed:
        # Explained, not refused: a module runs any group; only the table rows and the gate differ.
        lines += _wrap(
            f"warning: group {group} is not one of {layout}'s listed groups {list(listed)}: no table row "
            f"is tuned for it, so a module called directly runs it with the default block config, and "
            f"the runtime gate sends it to the per-head kernel", "", "  ")
    collected: list[str] = []
    previous: list[Plan] = [new_plan(spec, kv, q, variant, batch_invariant)]

    def show_pass(name: str, after: Plan) -> None:
        if only_pass in (None, name):
            collected.extend(_format_pass(name, previous[-1], after, verbose or only_pass is not None))
        previous.append(after)

    # Explaining writes nothing: emit runs in check mode against the real output directory.
    ctx = load_context(check_only=True)
    plan = run_pipeline(previous[0], ctx, on_pass=show_pass)
    if verbose or only_pass is not None:  # by default the emit row names the file
        lines.append(f"uri: {plan.uri}")
    lines.extend(collected)
    if only_pass is None:
        lines.extend(_table_lines(plan, arch, group, verbose))
        lines.extend(_gate_lines(spec, arch, model, topk, group, kv, q, verbose))
    if show_source:
        lines.extend(["── source " + "─" * 52, plan.output.source])
    return "\n".join(lines)
