"""fix_invariance: what the batch-invariant mode fixes, and why.

A default module chooses its launch from the batch: the split count from the batch size and
the GPU's multiprocessors, the block config from the batch's bucket of the table, the draft
padding (L_PAD, and with it the program's rows, its matrix instruction and where the draft
tile runs) from the batch's longest draft. Each choice changes the order in which a request's
floating-point sums are taken, so the same request gives other bits in another batch.

A batch-invariant module (``kgen.load(..., batch_invariant=True)``) fixes all of them: one
block config per arch and group, programs fitted for one draft length, splits of a fixed
number of tokens counted from the prefix's first token, and the merge in split order, a
fixed chunk at a time. What is left to the batch is only how many programs run (the grid),
never what one computes. This pass records each fixed choice with its reason; for a default
module it records that the module is not batch invariant.
"""

from __future__ import annotations

import dataclasses

from kgen.blockconfig import OPEN_BATCH_MAX, BlockConfig, batch_span
from kgen.passes.context import BuildContext
from kgen.plan import ConfigEntry, Decision, Invariance, Plan

NAME = "fix_invariance"
# Prefix tokens per split: the granule of the split plan. A prefix of up to MAX_SPLITS granules
# has splits of exactly one (prefix 1K: 4 splits); a longer one takes MAX_SPLITS splits of a whole
# multiple of it (16K: 8 of 2048), so short and long prefixes both spread over the GPU at every
# batch. Measured against the default (docs/perf-notes.md, "The batch-invariant split granule"):
# 256 keeps batch 16 near the default's time and every batch / prefix point within 1.5x; 4096
# ran batch 16 prefix 1K as one split a request (1.9x), 128 and 512 lose at batch 64 prefix 1K
# and batch 16 prefix 1K.
TOKENS_PER_SPLIT = 256
# Splits per request before the split size grows: prefixes up to MAX_SPLITS x TOKENS_PER_SPLIT
# keep splits of exactly TOKENS_PER_SPLIT; a longer one takes splits of a whole multiple of it
# (its own length decides). It bounds the split grid and the scratch of a call whose kv_indices (or block
# table) is sized for the engine's longest context, as under CUDA-graph capture: MLA at
# batch 128, L 4 then takes 134 MB (16 would double it).
MAX_SPLITS = 8
# The draft length every program is fitted for: EAGLE chains of 3 steps, the benchmark's L 4.
# Longer drafts run in blocks of L_PAD rows over more programs.
DRAFT_ROWS = 4
# The batch whose table row becomes the one config of a group: the mode's speed bar.
CONFIG_BATCH = 64
ALL_BATCHES = (1, OPEN_BATCH_MAX)

NOT_INVARIANT_WHY = (
    "default mode: the split count follows the batch size and the GPU's multiprocessors, the block config "
    "the batch's bucket and the draft padding the batch's longest draft, so a request's output bits depend on "
    "the batch it is in; build and load the batch-invariant module (kgen.load(..., batch_invariant=True)) "
    "for bitwise-reproducible results"
)


def mode_config(config: BlockConfig, batch_invariant: bool) -> BlockConfig:
    """The config as a mode runs it: the batch-invariant mode takes its invariant_block_h, where
    set, as the head block (that mode's draft-column loop needs the smaller program); neither
    mode's module carries the field."""
    if config.invariant_block_h is None:
        return config
    update = {"invariant_block_h": None, **({"block_h": config.invariant_block_h} if batch_invariant else {})}
    return config.model_copy(update=update)


def _one_row_per_group(rows: tuple[ConfigEntry, ...]) -> tuple[tuple[ConfigEntry, ...], list[str]]:
    """Each group's row whose bucket holds CONFIG_BATCH, widened to every batch (a group whose
    rows miss that batch keeps the default config), and a line per group saying which."""
    chosen: list[ConfigEntry] = []
    lines: list[str] = []
    for group in sorted({row.group_size for row in rows}):
        row = next((r for r in rows if r.group_size == group and r.batch_min <= CONFIG_BATCH <= r.batch_max), None)
        if row is None:
            lines.append(f"group {group}: the default config (no row holds batch {CONFIG_BATCH})")
            continue
        config = mode_config(row.config, batch_invariant=True)
        chosen.append(ConfigEntry(group, *ALL_BATCHES, config))
        lines.append(f"group {group}: the batch {batch_span(row.batch_min, row.batch_max)} row ({config.short()})")
    return tuple(chosen), lines


def _rows_kept(chosen: tuple[ConfigEntry, ...]) -> str:
    """The groups that keep a table row (the others run the default config)."""
    if not chosen:
        return f"no row holds batch {CONFIG_BATCH}"
    return "rows of group " + ", ".join(str(row.group_size) for row in chosen)


def fix_invariance(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    configs = plan.need("config", NAME)
    if not plan.batch_invariant:
        plain = dataclasses.replace(
            configs, default=mode_config(configs.default, batch_invariant=False),
            by_arch={arch: tuple(dataclasses.replace(r, config=mode_config(r.config, batch_invariant=False))
                                 for r in rows) for arch, rows in configs.by_arch.items()})
        return plan.with_([Decision(NAME, "batch invariant", False, NOT_INVARIANT_WHY,
                                    "a request's bits depend on its batch")],
                          config=plain, invariance=Invariance(enabled=False))
    tiles = plan.need("tiles", NAME)
    by_arch: dict[str, tuple[ConfigEntry, ...]] = {}
    decisions = [Decision(NAME, "batch invariant", True,
                          "a request's output bits do not depend on the batch size, its position, the other "
                          "requests' prefix and draft lengths, the GPU's multiprocessor count or CUDA-graph "
                          "capture: every choice below is fixed by the module",
                          "a request's bits do not depend on its batch")]
    for arch, rows in sorted(configs.by_arch.items()):
        chosen, lines = _one_row_per_group(rows)
        if chosen:
            by_arch[arch] = chosen
        decisions.append(Decision(
            NAME, f"config {arch}", _rows_kept(chosen),
            f"one block config for every batch (no buckets): tile width and pipeline decide the order of a "
            f"split's sums; the row tuned for batch {CONFIG_BATCH}, the mode's speed bar: " + "; ".join(lines),
            f"the batch-{CONFIG_BATCH} row for every batch"))
    default = mode_config(configs.default, batch_invariant=True)
    decisions += [
        Decision(NAME, "config elsewhere", default,
                 "archs without table rows and groups without a row take the built-in default, as in the default "
                 "mode (its split policies, the Gluon section's too, are not used: the splits below replace them); "
                 "a config's invariant_block_h, where set, replaces its head block"
                 + (f" (here {configs.default.invariant_block_h} heads, set by {configs.default_why})"
                    if configs.default.invariant_block_h is not None else ""),
                 "the built-in default"),
        Decision(NAME, "prefix stage", "the config's: Gluon or Triton",
                 "which stage runs depends on the config row, the GPU, the Triton version and the entry, never on "
                 "the batch: the Gluon stage's program is fitted for the draft rows below too, and it serves only "
                 "where the module's longest draft fits its key tile (not the batch's longest)",
                 "never chosen by the batch"),
        Decision(NAME, "draft rows", DRAFT_ROWS,
                 f"every program is fitted for drafts of {DRAFT_ROWS} (BLOCK_H and L_PAD from the fit rules at "
                 f"L = {DRAFT_ROWS}) whatever the batch's longest draft: the rows a program holds decide its "
                 "matrix instruction (wgmma from 64 rows) and where its draft tile runs. Longer drafts take "
                 "cdiv(L, L_PAD) row blocks, one program each (a runtime argument, where the default's "
                 "ROW_BLOCKS is a constexpr); at L <= "
                 f"{DRAFT_ROWS} the programs are the default's at L = {DRAFT_ROWS} (GQA 256 group 16: 16 heads "
                 "x 4 rows)",
                 f"every program is fitted for L = {DRAFT_ROWS}"),
        Decision(NAME, "draft columns", "DRAFT_N tiles from column 0",
                 "every program walks the draft columns its rows may see (all of the request's draft under a "
                 "custom mask, up to its last row's token in a chain) in tiles of DRAFT_N "
                 "(rules.draft_tile_columns), from column 0: the request's own draft length decides the tiles, "
                 "never the batch's longest (the default takes one tile where L_PAD holds the whole draft)",
                 "the request's own draft decides"),
        Decision(NAME, "draft mask", "HAS_MASK, per request",
                 "custom_mask governs, read on the device (HAS_MASK): a tree runs the Triton prefix stage with the "
                 "same fixed programs, splits and merge as a chain: whether a call has a mask is the call's, not "
                 "the batch's, and the mask's bits are read per request",
                 "a mask is the call's, not the batch's"),
        Decision(NAME, "tokens per split", TOKENS_PER_SPLIT,
                 f"split k of every request covers prefix tokens [k x {TOKENS_PER_SPLIT}, (k + 1) x "
                 f"{TOKENS_PER_SPLIT}): a fixed split size, not a count (Thinking Machines, 'Defeating "
                 "Nondeterminism in LLM Inference', 2025), so the splits depend on the request's own prefix "
                 f"only. Prefix 1K: {1024 // TOKENS_PER_SPLIT} splits a request; prefix 16K: {MAX_SPLITS} of "
                 f"{16384 // MAX_SPLITS} (max splits). On the H200 every batch / prefix point of batch 16 and "
                 "64, prefix 1K and 16K, stays within 1.5x of the default (docs/perf-notes.md, 'The "
                 "batch-invariant split granule'), where 4096 ran a 1K prefix as one split (1.9x at batch "
                 "16). A request with one split writes o itself (its own length decides)",
                 "a fixed split size, not a count"),
        Decision(NAME, "max splits", MAX_SPLITS,
                 f"a prefix up to {MAX_SPLITS * TOKENS_PER_SPLIT} tokens keeps splits of exactly "
                 f"{TOKENS_PER_SPLIT}; a longer one takes splits of a whole multiple of {TOKENS_PER_SPLIT} (its "
                 "own length decides). It bounds the split grid and the scratch of a call whose kv_indices or "
                 "block table is sized for the engine's longest context (SGLang's captured kv_indices holds "
                 "max_bs x max_context_len entries): MLA at batch 128, L 4 then takes 134 MB of scratch",
                 "longer prefixes take wider splits"),
        Decision(NAME, "split grid", f"min({MAX_SPLITS}, cdiv(longest prefix, {TOKENS_PER_SPLIT}))",
                 "min(max splits, cdiv(longest possible prefix, tokens per split)), from shapes only "
                 "(len(kv_indices), or block table width x page size): programs past a request's splits exit; "
                 "the grid decides how many programs run, never what one computes",
                 "from shapes only"),
        Decision(NAME, "scratch", "[draft rows, H_q, slots, D_v]",
                 "[draft rows, H_q, slots, D_v] fp32 partials and their log2-sum-exp; request b's splits take "
                 "consecutive slots from kv_indptr[b] // S + b (token slots: at most len(kv_indices) // S + batch "
                 "in all, rounded up to one of 8 sizes per power of two so that engines' varying lengths reuse a "
                 "few buffers), or from b x the grid's splits where that is fewer and for block tables; sized "
                 "from shapes, cached by shape (graph-safe)",
                 "slots of the request's own"),
        Decision(NAME, "merge order", f"split order, {tiles.merge_split_chunk} at a time",
                 "the merge combines a request's partials in split order through a fixed unrolled chunk of "
                 f"{tiles.merge_split_chunk}; the default narrows the chunk to the grid's split count",
                 "the chunk is fixed, not the grid's"),
    ]
    section = Invariance(enabled=True, tokens_per_split=TOKENS_PER_SPLIT, max_splits=MAX_SPLITS,
                         draft_rows=DRAFT_ROWS, merge_split_chunk=tiles.merge_split_chunk)
    return plan.with_(decisions, config=dataclasses.replace(configs, default=default, by_arch=by_arch),
                      invariance=section)
