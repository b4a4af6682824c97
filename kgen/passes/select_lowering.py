"""select_lowering: the kernel language the plan is rendered into.

A lowering is one folder of templates that turns the same plan into one kernel language.
Triton renders every module (kgen/templates/triton/kernel.py.j2). A layout may also get a
second lowering of its prefix stage: a package, kgen/templates/<folder>/ with its
lowering.json (which layouts, which arch and Triton version, its templates) and its host side
in kgen/launcher/. The Gluon prefix stages are two, for disjoint layouts: absorbed MLA's
(kgen/templates/gluon/) and GQA's (kgen/templates/gluon_gqa/, built on the first's ring and
producer). A module gets the one whose requirements it meets and carries both kernels, and
a block-config table row that measured the Gluon kernel faster (its config's ``gluon``
section) makes the launcher pick it. Everywhere else, and wherever
the Gluon kernel does not apply at run time, the Triton kernel serves.

``offered_lowering`` answers "does this module have a Gluon prefix stage" from the layout,
dtypes and variant alone; the pass and the tuner's search space (kgen/tuner/space.py) both
ask it. The pass also says, for the default config and each table row of the Gluon arch with
a ``gluon`` section, whether the Gluon program fits the arch's shared memory (kgen/launcher/rules.py,
``gluon_shared_bytes``) and at which draft lengths it launches (``gluon_rows``): the
launcher's own rules, so explain and launch agree. A module without the stage runs the
Triton fields of such configs (rows are shared by the query dtypes of a KV dtype), and says
so; a ``gluon`` section in another arch's table is an error (nothing could launch it).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from kgen.blockconfig import BlockConfig, GluonConfig
from kgen.errors import TableError
from kgen.launcher import rules
from kgen.passes.context import BuildContext
from kgen.passes.fit import ranges
from kgen.plan import BRIEF_WIDTH, ConfigEntry, Decision, Lowering, Plan
from kgen.spec import FP8_DTYPES

NAME = "select_lowering"
TRITON = "triton"
TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
MANIFEST = "lowering.json"


@functools.cache
def second_lowerings() -> dict[str, Any]:
    """Every lowering package's manifest (kgen/templates/*/lowering.json), by its name."""
    manifests = (json.loads(path.read_text()) for path in sorted(TEMPLATES.glob(f"*/{MANIFEST}")))
    return {entry["name"]: entry for entry in manifests}


def _stage_dtype(plan: Plan) -> str | None:
    """The 16-bit type a Gluon stage's tiles hold: the KV dtype where q has it too, fp16 for
    e4m3fn and e5m2 KV (the producer converts, exactly); None otherwise (no such stage)."""
    if plan.kv_dtype in ("float8_e4m3fn", "float8_e5m2"):
        return "float16"
    if plan.kv_dtype not in FP8_DTYPES and plan.q_dtype == plan.kv_dtype:
        return plan.kv_dtype
    return None


def _layout_facts(plan: Plan) -> dict[str, Any]:
    shape = plan.spec.attention
    return {"variant": plan.variant, "v_source": shape.v_source, "nope_dim": shape.nope_dim,
            "pe_dim": shape.pe_dim, "stage_dtype": _stage_dtype(plan), "kv_dtype": plan.kv_dtype}


def _met(wanted: Any, has: Any) -> bool:
    """A requirement holds where the fact is its value, or one of its values (a list)."""
    return has in wanted if isinstance(wanted, list) else has == wanted


def unmet(requires: dict[str, Any], facts: dict[str, Any]) -> list[str]:
    """The requirements a layout misses, as 'field: wanted X, layout has Y'."""
    return [f"{k}: wanted {v!r}, layout has {facts.get(k)!r}" for k, v in requires.items()
            if not _met(v, facts.get(k))]


def _needs(entry: dict[str, Any], facts: dict[str, Any]) -> str:
    """Why a layout has no such lowering, in one clause of at most BRIEF_WIDTH characters: the
    requirements it misses ("needs v_source 'k_latent', pe_dim 64") where they fit, else what
    the lowering serves (its manifest's ``serves``)."""
    missed = ", ".join(f"{k} {v!r}" for k, v in entry["requires"].items() if not _met(v, facts.get(k)))
    return f"needs {missed}" if len(missed) <= BRIEF_WIDTH - len("needs ") else f"only for {entry['serves']}"


def _closest_package(facts: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The lowering package whose requirements the layout misses least, and what it misses
    (nothing: the layout gets it). Packages serve disjoint layouts, so at most one has no miss."""
    misses = [(entry, unmet(entry["requires"], facts)) for entry in second_lowerings().values()]
    return min(misses, key=lambda entry_missing: len(entry_missing[1]))


def offered_lowering(plan: Plan) -> tuple[Lowering, Decision]:
    """The lowering of a plan from its layout, KV dtype and variant alone, and the decision
    about its Gluon prefix stage: the package (kgen/templates/*/lowering.json) whose
    requirements hold, with the reason; else the one it misses least and what it misses."""
    facts = _layout_facts(plan)
    entry, missing = _closest_package(facts)
    if missing:
        # A requirement may say why it holds (the manifest's "<field>_why").
        whys = [entry[f"{k}_why"] for k, v in entry["requires"].items() if not _met(v, facts.get(k))
                and f"{k}_why" in entry]
        return Lowering(TRITON), Decision(NAME, "gluon_prefix", None,
                                          f"no Gluon prefix stage ({entry['name']}, the closest): "
                                          + "; ".join(missing + whys), _needs(entry, facts))
    decision = Decision(
        NAME, "gluon_prefix", entry["template"],
        f"{entry['why']}. Emitted beside the Triton kernel; launched on {entry['arch']} under Triton "
        f"{entry['triton']}.x for configs (the default, table rows) with a gluon section",
        f"for {entry['arch']} under Triton {entry['triton']}")
    return Lowering(TRITON, gluon_prefix=entry["template"], gluon_imports=entry["imports"], gluon_arch=entry["arch"],
                    gluon_triton=entry["triton"]), decision


def _row_label(arch: str, row: ConfigEntry) -> str:
    return f"{arch} row group {row.group_size} batch {row.batches}"


def _gluon_launches(plan: Plan, lowering: Lowering, label: str, config: BlockConfig, group: int | None) -> Decision:
    """What a config with a gluon section launches on the Gluon arch (both entries), by
    draft length, and why: the launcher's rules (``_gluon_prefix``) run over the module's drafts.
    A row's from_rows counts its group's rows; the default's (group None) is said, not applied."""
    gluon, arch = config.gluon, lowering.gluon_arch
    triton = config.model_copy(update={"gluon": None}).short()
    # A landing ring that does not fit a program is left out of it (rules.gluon_landing_stages):
    # the section fits where its stages and q do.
    need = rules.gluon_shared_bytes(plan.fit.kernel_shape, gluon.block_n, gluon.num_stages)
    limit = plan.fit.targets[arch]["shared_bytes"]
    if need > limit:
        return Decision(NAME, label, "Triton at every L",
                        f"{gluon.short()} does not fit: its program needs {need} B of shared memory, {arch} has "
                        f"{limit} B (rules.gluon_shared_bytes), so the launcher runs the Triton config "
                        f"({triton}) instead", f"the Gluon program needs {need} B of {limit}", warning=True)
    drafts = range(1, plan.tiles.max_draft_tokens + 1)
    invariance = plan.need("invariance", NAME)
    invariant_draft = invariance.draft_rows if invariance.enabled else None  # every program's draft there
    why_triton = {n: rules.gluon_refusal(plan.fit.kernel_shape, n, gluon.block_n, group, gluon.from_rows,
                                         invariant_draft, plan.tiles.max_draft_tokens) for n in drafts}
    gluon_at = [n for n in drafts if why_triton[n] is None]
    triton_at = [n for n in drafts if why_triton[n] is not None]
    because = list(dict.fromkeys(why_triton[n] for n in triton_at))
    by_rows: dict[str, list[int]] = {}
    for n in gluon_at:
        by_rows.setdefault(_program_of(plan, gluon, group, invariant_draft or n, limit), []).append(n)
    programs = ", ".join(f"{program} at L {ranges(ns)}" for program, ns in by_rows.items())
    return Decision(
        NAME, label, f"Gluon at L {ranges(gluon_at)}" if gluon_at else "Triton at every L",
        f"{gluon.short()} fits: {need} of {limit} B of shared memory (rules.gluon_shared_bytes); BLOCK_H x L_PAD "
        f"{programs or '-'} (rules.gluon_rows). Launched under Triton {lowering.gluon_triton}.x, both entries; "
        + (f"L {ranges(triton_at)} ({', '.join(because)}), " if triton_at else "")
        + (f"groups under {gluon.from_rows} rows a KV head (from_rows), " if group is None and gluon.from_rows else "")
        + f"another Triton and other archs run the Triton config ({triton})",
        f"it fits: {need} of {limit} B")


def _program_of(plan: Plan, gluon: GluonConfig, group: int | None, draft: int, shared_limit: int) -> str:
    """'BLOCK_H x L_PAD' of the program a draft launches (rules.gluon_rows), with its converter
    warpgroups where it converts FP8 in them (rules.gluon_converters) and its landing ring where
    one fits (rules.gluon_landing_stages; the default's group None counts no group's rows)."""
    shape = plan.fit.kernel_shape
    block_h, l_pad = rules.gluon_rows(shape, draft, gluon.block_n)
    consumers = rules.gluon_consumers(group or block_h, l_pad)
    landing = rules.gluon_landing_stages(shape, gluon.block_n, gluon.num_stages, gluon.landing_stages, consumers,
                                         shared_limit)
    converters = rules.gluon_converters(shape, consumers, gluon.converters, landing)
    landing_note = f", a {landing}-tile landing ring" if converters and landing else ""
    return f"{block_h} x {l_pad}" + (f" ({converters} converter{'s' if converters > 1 else ''}{landing_note})"
                                     if converters else "")


def _refuse_program_fields(plan: Plan, gluon: GluonConfig | None, where: str) -> None:
    """A TableError where a gluon section's converters or landing ring are not this module's
    (rules.gluon_converters_refusal, rules.gluon_landing_refusal): no launch could honour them."""
    if gluon is None:
        return
    shape = plan.fit.kernel_shape
    why = None if gluon.converters is None else rules.gluon_converters_refusal(shape, gluon.converters)
    if why:
        raise TableError(f"{where} asks its gluon section for {gluon.converters} converters, which this module's "
                         f"programs cannot have ({why}); remove converters")
    why = (None if gluon.landing_stages is None
           else rules.gluon_landing_refusal(shape, gluon.landing_stages, gluon.converters))
    if why:
        raise TableError(f"{where} asks its gluon section for a {gluon.landing_stages}-tile landing ring, which this "
                         f"module's programs cannot have ({why}); remove landing_stages")


def gluon_config_decisions(plan: Plan, lowering: Lowering) -> list[Decision]:
    """What the default and each table row with a gluon section launch in this module. A
    gluon section in a table of another arch than the Gluon stage's is an error naming the
    table and the row: no module could launch it."""
    configs = plan.need("config", NAME)
    closest, missing = _closest_package(_layout_facts(plan))
    gluon_arch = lowering.gluon_arch or closest["arch"]
    for arch, rows in configs.by_arch.items():
        for row in rows:
            if row.config.gluon is not None and arch != gluon_arch:
                raise TableError(
                    f"{configs.table_sources.get(arch, arch)}: the row for {plan.spec.name} ({plan.kv_dtype}, group "
                    f"{row.group_size}, batch {row.batch_min}-{row.batch_max}) has a gluon section, but the Gluon "
                    f"prefix stage runs on {gluon_arch} only; remove the section")
            _refuse_program_fields(plan, row.config.gluon, f"{configs.table_sources.get(arch, arch)}: the row for "
                             f"{plan.spec.name} ({plan.kv_dtype}, group {row.group_size}, batch {row.batch_min}-"
                             f"{row.batch_max})")
    _refuse_program_fields(plan, configs.default.gluon, f"the default config for {plan.spec.name} ({plan.kv_dtype})")
    labelled = [(f"{gluon_arch} default", configs.default, None)]
    labelled += [(_row_label(gluon_arch, row), row.config, row.group_size)
                 for row in configs.by_arch.get(gluon_arch, ())]
    labelled = [(label, config, group) for label, config, group in labelled if config.gluon is not None]
    if lowering.gluon_prefix is not None:
        return [_gluon_launches(plan, lowering, label, config, group) for label, config, group in labelled]
    if not labelled:
        return []
    return [Decision(NAME, "gluon sections", "not launched",
                     f"{', '.join(label for label, _, _ in labelled)} carry a gluon section, but this module has no "
                     f"Gluon prefix stage ({'; '.join(missing)}): their Triton fields serve",
                     "no Gluon stage here: their Triton fields serve")]


def select_lowering(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    plan.need("fit", NAME)
    lowering, gluon = offered_lowering(plan)
    decisions = [Decision(NAME, "lowering", TRITON,
                          "Triton kernels for every target in kgen/tables/targets.json: the portable path, the "
                          "fallback and the parity reference", "the portable path, fallback and parity reference"),
                 gluon]
    return plan.with_([*decisions, *gluon_config_decisions(plan, lowering)], lowering=lowering)
