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
        labelled.append((f"row group {row.group_size} batch {row.batch_min}-{row.batch_max}", row.config,
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


def _fit_decisions(plan: Plan, arch: str, target: dict, shape: dict) -> tuple[list[Decision], list[str]]:
    decisions, refusals = [], []
    invariance = plan.need("invariance", NAME)
    # A batch-invariant module fits each program once, for its fixed draft rows.
    lengths = (invariance.draft_rows,) if invariance.enabled else range(1, plan.tiles.max_draft_tokens + 1)
    for label, config, groups in _configs_for(plan.config, tuple(plan.spec.attention.group_sizes), arch):
        launch = config.model_dump(exclude_none=True)
        for group in groups:
            changes: dict[str, list[int]] = {}
            for length in lengths:
                fitted = fit_program(target, shape, launch, group, length, plan.grouped)
                if fitted is None:
                    refusals.append(f"{arch} {label}, group {group}, draft length {length}")
                    continue
                if fitted.reasons:
                    key = (f"BLOCK_H {fitted.block_h} x L_PAD {fitted.l_pad}, BLOCK_N {fitted.block_n}, "
                           f"{fitted.num_stages} stages, {fitted.num_warps} warps: " + "; ".join(fitted.reasons))
                    changes.setdefault(key, []).append(length)
            for key, changed in changes.items():  # not `lengths`: the next group walks those
                decisions.append(Decision(NAME, f"{arch} group {group}", f"L {ranges(changed)}",
                                          f"{label}: {key}"))
    return decisions, refusals


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
                          "every program below for each")]
    all_refusals = []
    for arch, target in targets.items():
        arch_decisions, refusals = _fit_decisions(plan, arch, target, shape)
        decisions += arch_decisions
        all_refusals += refusals
    if all_refusals:
        decisions.append(Decision(NAME, "refused", len(all_refusals),
                                  "no program fits: " + "; ".join(all_refusals[:8])
                                  + (" ..." if len(all_refusals) > 8 else "")))
    else:
        decisions.append(Decision(NAME, "refused", 0,
                                  "every listed group at every draft length has a program that fits every target"))
    return plan.with_(decisions, fit=dataclasses.replace(section, refusals=tuple(all_refusals)))
