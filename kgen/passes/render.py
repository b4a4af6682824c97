"""render: the plan's decisions become Triton source through the Jinja templates.

StrictUndefined makes a variable the template uses but the plan lacks a build error.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from kgen.blockconfig import BlockConfig, SplitPolicy
from kgen.errors import BuildError
from kgen.passes.context import REPO_ROOT, BuildContext
from kgen.plan import Decision, Plan
from kgen.spec import FP8_FORMATS

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
    half_partials = plan.partial_dtype != "float32"
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
        "unmasked_full_tiles": plan.unmasked_full_tiles,
        "fused_merge": plan.fused_merge,
        "partial_dtype": plan.partial_dtype,
        "half_partials": half_partials,
        "active_experiments": [name for name, on in (("fused_merge", plan.fused_merge),
                                                     ("half_partials", half_partials),
                                                     ("e4m3_qk", plan.fp8_qk_dot)) if on],
        "fp8_qk_dot": plan.fp8_qk_dot,
        **_fp8_format(plan.kv_dtype),
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
        "min_dot_rows": plan.min_dot_rows,
        "max_draft_tokens": plan.max_draft_tokens,
        "max_rows": plan.max_rows,
        "arch_configs": [(arch, rows) for arch, rows in sorted(plan.arch_configs.items())],
        "default_config": config_literal(plan.default_config),
        "split_defaults": repr(SplitPolicy().model_dump()),
        "default_why": "the built-in default for this K width (kgen/tables/defaults.json)",
    }


def _fp8_format(kv_dtype: str) -> dict:
    """Triton dtype, largest finite value and the power of two below it (where e4m3 operands
    are scaled to, so that rounding never overflows) of an FP8 pool; nothing for 16-bit KV."""
    if kv_dtype not in FP8_FORMATS:
        return {}
    tl_name, largest = FP8_FORMATS[kv_dtype]
    return {"fp8_tl_dtype": tl_name, "fp8_max": int(largest), "fp8_pow2": 1 << (int(largest).bit_length() - 1)}


def render(plan: Plan, ctx: BuildContext) -> Plan:
    if plan.default_config is None:
        raise BuildError(f"{plan.uri}: render needs select_config to have run")
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
