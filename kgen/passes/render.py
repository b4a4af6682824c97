"""render: the plan's decisions become Triton source through the Jinja templates.

StrictUndefined makes a variable the template uses but the plan lacks a build error.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import jinja2

from kgen import rules
from kgen.blockconfig import BlockConfig, SplitPolicy
from kgen.errors import BuildError
from kgen.passes.context import REPO_ROOT, BuildContext
from kgen.passes.specialize import GQA_DRAFT_FIRST_WHY
from kgen.plan import Decision, Plan

NAME = "render"
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "templates"
TEMPLATE = "verify_kernel.py.j2"


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def config_literal(config: BlockConfig) -> str:
    """A config as a Python dict literal with stable key order."""
    return repr(config.model_dump(exclude_none=True))


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return path


def template_context(plan: Plan, ctx: BuildContext) -> dict[str, object]:
    spec, shape = plan.spec, plan.spec.attention
    layout_summary = (
        f"Layout {spec.name}: {shape.kind.upper()}, K width {shape.qk_dim} "
        f"(nope {shape.nope_dim} + pe {shape.pe_dim}), V width {shape.v_head_dim}, "
        f"KV {plan.kv_dtype}, queries {plan.q_dtype}."
    )
    tables = ", ".join(f"{arch} ({src})" for arch, src in sorted(plan.table_sources.items())) or "none"
    return {
        "uri": plan.uri,
        "kgen_version": ctx.kgen_version,
        "spec_source": _relative(spec.source),
        "table_summary": tables.replace(str(REPO_ROOT) + "/", ""),
        "variant": plan.variant,
        "grouped": plan.variant == "grouped",
        "variant_summary": "grouped-head shared-KV" if plan.variant == "grouped"
        else "per-head split-KV baseline (one query head per program)",
        "layout_summary": layout_summary,
        "layout_name": spec.name,
        "kv_dtype": plan.kv_dtype,
        "q_dtype": plan.q_dtype,
        "qk_dim": shape.qk_dim,
        "nope_dim": shape.nope_dim,
        "pe_dim": shape.pe_dim,
        "v_head_dim": shape.v_head_dim,
        "group_sizes": tuple(shape.group_sizes),
        "architectures": tuple(spec.architectures),
        "page_sizes": plan.page_sizes,
        "has_pe": plan.has_pe,
        "fp8_kv": plan.fp8_kv,
        "v_from_k_tile": plan.v_from_k_tile,
        "draft_tile_first": plan.draft_tile_first,
        "draft_tile_either": plan.draft_tile_either,
        "draft_first_rows": plan.draft_first_rows,
        "draft_first_why": GQA_DRAFT_FIRST_WHY,
        "unmasked_full_tiles": plan.unmasked_full_tiles,
        "prefix_dot_dtype": plan.prefix_dot_dtype,
        "prefix_dot_why": "Prefix stage: " + next(
            d.why for d in plan.decisions_of("specialize") if d.what == "prefix dot dtype") + ".",
        "block_d": plan.block_d,
        "block_dpe": plan.block_dpe,
        "block_dv": plan.block_dv,
        "merge_block_dv": plan.merge_block_dv,
        "merge_rows": plan.merge_rows,
        "merge_split_chunk": plan.merge_split_chunk,
        "mask_d": plan.mask_d,
        "mask_dv": plan.mask_dv,
        "max_draft_tokens": plan.max_draft_tokens,
        "targets": repr(plan.targets),
        "rules_source": rules_source(),
        "k_width": plan.kernel_shape["q_row_bytes"] // 2,
        "acc_width": plan.kernel_shape["acc_width"],
        "kv_bytes": 1 if plan.fp8_kv else 2,
        "arch_configs": [(arch, rows) for arch, rows in sorted(plan.arch_configs.items())],
        "default_config": config_literal(plan.default_config),
        "split_defaults": repr(SplitPolicy().model_dump()),
        "default_why": "the built-in default for this K width (kgen/tables/defaults.json)",
    }


@functools.cache
def rules_source() -> str:
    """kgen/rules.py without its module docstring: the launch rules every module carries."""
    text = Path(rules.__file__).read_text()
    docstring = ast.parse(text).body[0]
    lines = text.splitlines(keepends=True)
    return "".join(lines[docstring.end_lineno:]).strip("\n")


def render(plan: Plan, ctx: BuildContext) -> Plan:
    if plan.default_config is None or not plan.targets:
        raise BuildError(f"{plan.uri}: render needs select_config and fit to have run")
    context = template_context(plan, ctx)
    context["arch_configs"] = [
        (arch, [{"group_size": r.group_size, "batch_min": r.batch_min, "batch_max": r.batch_max,
                 "config": config_literal(r.config)} for r in rows])
        for arch, rows in context["arch_configs"]
    ]
    try:
        source = environment().get_template(TEMPLATE).render(**context)
    except jinja2.UndefinedError as exc:
        raise BuildError(f"{plan.uri}: template {TEMPLATE} uses an undefined variable: {exc}") from None
    lines = source.count("\n")
    return plan.with_([Decision(NAME, "source", f"{lines} lines", f"rendered {TEMPLATE}")], source=source)
