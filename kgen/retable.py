"""Tables read at load: a generated module takes the block-config rows of ``$KGEN_TABLES_DIR``
(where ``kgen tune --out DIR`` writes) or ``$KGEN_TABLE`` when ``kgen.load`` imports it, with
no rebuild.

A module is built with the shipped tables' rows baked into ``_BLOCK_CONFIGS``, which its
launcher reads. When either variable is set, the loader runs the same passes the build runs up
to ``select_lowering`` (``select_config`` reads the tables in their lookup order, ``fit`` refits
each row to its target) and hands the launcher the rows they give in place of the baked ones.
A row the module cannot run (a Gluon prefix stage it was built without) is an error at load
that says how to rebuild.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kgen.errors import TableError
from kgen.passes.context import load_context
from kgen.passes.pipeline import run_pipeline
from kgen.plan import Plan, Variant, new_plan
from kgen.spec import load_layouts


def module_configs(plan: Plan) -> dict[str, tuple[tuple[int, int, int, dict[str, Any]], ...]]:
    """The block configs a module's launcher reads (as its ``_BLOCK_CONFIGS``) for a plan that ran ``select_config`` and
    ``fit``: per arch, (group, batch_min, batch_max, config) rows, as the template renders them."""
    return {arch: tuple((r.group_size, r.batch_min, r.batch_max, r.value) for r in rows)
            for arch, rows in sorted(plan.config.by_arch.items())}


def planned_configs(layout: str, kv_dtype: str, q_dtype: str, variant: Variant,
                    batch_invariant: bool) -> Plan:
    """The plan of one module through ``select_lowering``, under the tables in use now."""
    specs = load_layouts()
    if layout not in specs:
        raise TableError(f"layout {layout!r} has no spec in kgen/layouts/, so kgen.load cannot apply "
                         "$KGEN_TABLES_DIR / $KGEN_TABLE to its module: build the module with the tables "
                         "set (kgen build --out DIR) instead")
    plan = new_plan(specs[layout], kv_dtype, q_dtype, variant, batch_invariant)
    return run_pipeline(plan, load_context(check_only=True), stop_after="select_lowering")


def apply_tables(module: ModuleType, layout: str, kv_dtype: str, q_dtype: str, variant: Variant,
                 batch_invariant: bool) -> None:
    """Put the rows of the tables in use into ``module`` (in place), or raise ``TableError``
    when a row needs a kernel the module was built without."""
    plan = planned_configs(layout, kv_dtype, q_dtype, variant, batch_invariant)
    if plan.lowering.gluon_prefix and module.LAUNCHER.identity.gluon_arch is None:
        sources = ", ".join(f"{arch} ({src})" for arch, src in sorted(plan.config.table_sources.items()))
        raise TableError(f"{module.URI}: a table row in use ({sources}) picks the Gluon prefix stage, which "
                         "this module was built without: rebuild it with the tables set (kgen build --out DIR, "
                         "then KGEN_GENERATED_DIR=DIR) or remove the row's gluon section")
    module.LAUNCHER.replace_block_configs(module_configs(plan))
