"""fit: every program a module can launch fits its target's shared memory and registers.

The module fits at run time with the launch rules it carries (kgen/launcher/rules.py), because the
draft length is known only then. This pass runs the same rules over the whole accepted
domain (every checked target, every config the module holds for it, every listed group,
draft lengths 1..MAX_DRAFT_TOKENS, or the one draft length a batch-invariant module fits
every program for) so that ``kgen explain`` shows what changes where and why, and so that a
module that would refuse an input on a target says so at build time. ``kgen check`` then
compiles those programs offline and proves the rules right.
"""

from __future__ import annotations

import dataclasses
import re

from kgen.blockconfig import BlockConfig
from kgen.launcher.rules import fit_program, kernel_shape
from kgen.passes.context import BuildContext
from kgen.plan import BlockConfigs, Decision, Fit, Plan
from kgen.targets import read_targets, target_dicts

NAME = "fit"
FP8_BYTES = 1
HALF_BYTES = 2


def _configs_for(configs: BlockConfigs, groups: tuple[int, ...],
                 arch: str) -> list[tuple[str, BlockConfig, tuple[int, ...]]]:
    """(label, config, groups it serves) for the default and each table row of an arch."""
    labelled = [("default", configs.default, groups)]
    for row in configs.by_arch.get(arch, ()):
        labelled.append((f"row group {row.group_size} batch {row.batches}", row.config,
                         (row.group_size,)))
    return labelled


def ranges(lengths: list[int]) -> str:
    """'1-4, 9' for [1, 2, 3, 4, 9]."""
    spans: list[list[int]] = []
    for n in lengths:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


# The launcher's reasons (rules.fit_program) name a change as "KNOB before -> after: why".
_CHANGE = re.compile(r"^(num_warps|num_stages|BLOCK_N|BLOCK_H|L_PAD) (\d+) -> (\d+)")
# What a reason's limit is, by the words the launcher's reasons use for it.
_LIMITS = {"shared memory": "shared memory", "registers": "registers", "row budget": "the row budget",
           "draft columns loop": "the FP8 draft loop"}
# How the summary names a knob, and whether its refits raise it (warps) or lower it.
_KNOBS = {"num_warps": ("warps", max), "num_stages": ("stages", min), "BLOCK_N": ("BLOCK_N", min),
          "BLOCK_H": ("BLOCK_H", min), "L_PAD": ("L_PAD", min)}


def _limits(reasons: list[str]) -> list[str]:
    """The limits a program's reasons name (shared memory, registers, ...), in _LIMITS order."""
    return [name for words, name in _LIMITS.items() if any(words in r for r in reasons)]


def _target_summary(arch: str, refits: list[list[str]], programs: int) -> Decision:
    """A target's refits in one decision: how far each knob went (its value), the limits that
    moved them (its brief) and how many of the target's programs changed (its why); its cells,
    per group and draft lengths, follow it as details."""
    reached: dict[str, int] = {}
    for reasons in refits:
        for reason in reasons:
            change = _CHANGE.match(reason)
            if change:
                knob, to = change.group(1), int(change.group(3))
                reached[knob] = _KNOBS[knob][1](to, reached.get(knob, to))
    limits = _limits([r for reasons in refits for r in reasons])
    knobs = ", ".join(f"{_KNOBS[k][0]} to {reached[k]}" for k in _KNOBS if k in reached) or "draft rows split"
    return Decision(NAME, arch, knobs,
                    f"{len(refits)} of the {programs} (config, group, draft length) programs {arch} can launch "
                    f"change to fit its {' and '.join(limits)}, {knobs} at the furthest (the cells below)",
                    f"for {', '.join(limits)}")


def _fit_decisions(plan: Plan, arch: str, target: dict, shape: dict) -> tuple[list[Decision], list[str]]:
    """The target's summary and its cells (detail decisions), and the programs it refuses."""
    cells, refusals, refits, programs = [], [], [], 0
    invariance = plan.need("invariance", NAME)
    # A batch-invariant module fits each program once, for its fixed draft rows.
    lengths = (invariance.draft_rows,) if invariance.enabled else range(1, plan.tiles.max_draft_tokens + 1)
    for label, config, groups in _configs_for(plan.config, tuple(plan.spec.attention.group_sizes), arch):
        launch = config.model_dump(exclude_none=True)
        for group in groups:
            changes: dict[str, tuple[list[str], list[int]]] = {}
            for length in lengths:
                programs += 1
                fitted = fit_program(target, shape, launch, group, length, plan.grouped)
                if fitted is None:
                    refusals.append(f"{arch} {label}, group {group}, draft length {length}")
                    continue
                if fitted.reasons:
                    refits.append(fitted.reasons)
                    key = (f"BLOCK_H {fitted.block_h} x L_PAD {fitted.l_pad}, BLOCK_N {fitted.block_n}, "
                           f"{fitted.num_stages} stages, {fitted.num_warps} warps: " + "; ".join(fitted.reasons))
                    changes.setdefault(key, (fitted.reasons, []))[1].append(length)
            for key, (reasons, changed) in changes.items():
                cells.append(Decision(NAME, f"{arch} group {group}", f"L {ranges(changed)}", f"{label}: {key}",
                                      " and ".join(_limits(reasons)), detail=True))
    summary = [_target_summary(arch, refits, programs)] if refits else []
    return summary + cells, refusals


def _staging(plan: Plan) -> dict:
    """What one program of this plan stages: the arguments of rules.kernel_shape."""
    specialization, tiles = plan.need("specialization", NAME), plan.need("tiles", NAME)
    return {"k_width": tiles.block_d + (tiles.block_dpe or 0),
            "acc_width": tiles.block_d if specialization.v_from_k_tile else tiles.block_dv,
            "kv_bytes": FP8_BYTES if specialization.fp8_kv else HALF_BYTES,
            "v_separate": not specialization.v_from_k_tile}


def plan_kernel_shape(plan: Plan) -> dict:
    """What one program of this plan stages per prefix token and per row (rules.kernel_shape),
    once specialize and legalize have run (the tuner prunes its space with it)."""
    return kernel_shape(**_staging(plan))


def fit(plan: Plan, ctx: BuildContext) -> Plan:
    plan.need("config", NAME)  # _fit_decisions walks its configs
    targets = target_dicts(ctx.targets if ctx.targets is not None else read_targets())
    section = Fit(targets=targets, **_staging(plan))
    shape = section.kernel_shape
    decisions = [Decision(NAME, "targets", ", ".join(targets),
                          "kgen/tables/targets.json: the module refuses other archs; `kgen check` compiles "
                          "every program below for each", "other archs are refused")]
    all_refusals = []
    for arch, target in targets.items():
        arch_decisions, refusals = _fit_decisions(plan, arch, target, shape)
        decisions += arch_decisions
        all_refusals += refusals
    if all_refusals:
        shown = "; ".join(all_refusals[:8]) + (f"; and {len(all_refusals) - 8} more" if len(all_refusals) > 8 else "")
        decisions.append(Decision(NAME, "refused", len(all_refusals), "no program fits: " + shown,
                                  "no program fits: why_not refuses those calls"))
    else:
        decisions.append(Decision(NAME, "refused", 0,
                                  "every listed group at every draft length has a program that fits every target",
                                  "every program fits every target"))
    return plan.with_(decisions, fit=dataclasses.replace(section, refusals=tuple(all_refusals)))
