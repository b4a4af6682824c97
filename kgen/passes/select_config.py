"""select_config: bake each arch's block-config rows for this layout into the plan.

Lookup order per arch: $KGEN_TABLE > $KGEN_TABLES_DIR/<arch>.json > shipped
kgen/tables/<arch>.json > the built-in default (kgen/tables/defaults.json, chosen by the K
width). The module picks a row at run
time by arch, group size and batch; rows whose arch is not ROCm lose their AMD knobs.
"""

from __future__ import annotations

from kgen.blockconfig import DEFAULTS_FILE, BlockConfig, SplitPolicy, TableEntry, check_triton_version
from kgen.errors import TableError
from kgen.passes.context import BuildContext
from kgen.plan import BlockConfigs, ConfigEntry, Decision, Plan, Specialization

NAME = "select_config"
DEFAULT_WHY = "the built-in default for this K width (kgen/tables/defaults.json)"


def _per_head(config: BlockConfig) -> BlockConfig:
    return config.model_copy(update={"block_h": 1})


def _check_draft_tile(specialization: Specialization, entries: list[TableEntry], path: object) -> None:
    """A row may choose the draft tile's placement only where the module emits both."""
    if specialization.draft_tile_either:
        return
    fixed = "before" if specialization.draft_tile_first else "after"
    for e in entries:
        if e.config.draft_tile is not None:
            raise TableError(
                f"{path}: the row for {e.layout} ({e.kv_dtype}, group {e.group_size}, batch {e.batch_min}-"
                f"{e.batch_max}) sets draft_tile {e.config.draft_tile!r}, but this layout's module always runs "
                f"the draft tile {fixed} the prefix loop; remove draft_tile from that row"
            )


def _configs(default: BlockConfig, by_arch: dict[str, tuple[ConfigEntry, ...]],
             sources: dict[str, str]) -> BlockConfigs:
    return BlockConfigs(default=default, default_why=DEFAULT_WHY, by_arch=by_arch, table_sources=sources,
                        split_defaults=SplitPolicy().model_dump())


def select_config(plan: Plan, ctx: BuildContext) -> Plan:
    specialization = plan.need("specialization", NAME)
    qk_dim = plan.spec.attention.qk_dim
    rule = ctx.defaults.rule_for(qk_dim, plan.kv_dtype)
    default = rule.config if plan.variant == "grouped" else _per_head(rule.config)
    if default.draft_tile is not None and not specialization.draft_tile_either:
        # A rule covers every layout of its K width: placements are a per-row (tuned) choice.
        raise TableError(f"{DEFAULTS_FILE}: the rule for K width <= {rule.max_qk_dim} sets draft_tile, which "
                         f"layout {plan.spec.name} ({plan.variant}) cannot take; set it in a table row instead")
    kv_rule = f", {rule.kv_storage} KV" if rule.kv_storage else ""
    decisions = [Decision(NAME, "default config", default,
                          f"built-in rule for K width <= {rule.max_qk_dim}{kv_rule}: {rule.why}",
                          f"rule for K <= {rule.max_qk_dim}{kv_rule}")]
    arch_configs: dict[str, tuple[ConfigEntry, ...]] = {}
    sources: dict[str, str] = {}
    if plan.variant == "per_head":
        # The tables are tuned for the grouped kernel's BLOCK_H x L rows: a 64-row program's
        # tiles slowed the 16-row per-head baseline on the H200 (docs/perf-notes.md, "The
        # per-head baseline's config"), so the baseline keeps the built-in default.
        decisions.append(Decision(NAME, "tables", "not used",
                                  "per-head variant: the block-config tables are tuned for the grouped kernel",
                                  "they are tuned for the grouped kernel"))
        decisions.append(Decision(NAME, "BLOCK_H", 1, "per-head variant: one query head per program",
                                  "one query head per program"))
        return plan.with_(decisions, config=_configs(default, arch_configs, sources))
    for arch, source in sorted(ctx.tables.items()):
        entries, keyed_by = (source.table.rows_for(plan.spec.name, plan.kv_dtype) if source.table
                             else ([], plan.kv_dtype))
        borrowed = keyed_by != plan.kv_dtype
        _check_draft_tile(specialization, entries, source.path)
        rows = tuple(ConfigEntry(e.group_size, e.batch_min, e.batch_max, e.config.for_arch(arch)) for e in entries)
        sources[arch] = f"{source.origin}: {source.path}"
        meta = source.table.metadata if source.table else None
        tuned = "tuned" if meta and meta.tuned else "UNTUNED"
        warning = check_triton_version(source.table, ctx.triton_version, source.path) if source.table else None
        if rows:
            arch_configs[arch] = rows
            count = f"{len(rows)} row{'s' if len(rows) > 1 else ''}" + (f" of {keyed_by}" if borrowed else "")
            origin = f"from {source.origin} {source.path}"
            why = (f"{origin}: {plan.kv_dtype} has none, and {keyed_by}'s hold for it (the same bytes a token and "
                   "MMA work; blockconfig.TWIN_KV)" if borrowed else origin)
            if warning:
                # One line either way: a table of another Triton still serves, and says so.
                decisions.append(Decision(
                    NAME, f"table {arch}", f"{count} (tuned with Triton {meta.triton_version})",
                    f"{warning}; {why}; other groups/batches use the default",
                    f"re-tune under Triton {ctx.triton_version}", warning=True))
            else:
                decisions.append(Decision(NAME, f"table {arch}", f"{count} ({tuned})",
                                          f"{why}; other groups/batches use the default", origin))
        else:
            decisions.append(Decision(NAME, f"table {arch}", "no rows",
                                      f"{source.path} has no entry for this layout and KV dtype: default",
                                      "none for this layout and KV dtype"))
    return plan.with_(decisions, config=_configs(default, arch_configs, sources))
