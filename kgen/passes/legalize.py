"""legalize: Triton's rules. Power-of-two tl.arange extents, >= 16 rows/cols/K in tl.dot,
never next_power_of_2(0), and the limits that keep a program's registers bounded."""

from __future__ import annotations

from kgen.launcher.rules import MAX_DRAFT_SCORES, MAX_ROWS, MIN_DOT, WIDE_MAX_ROWS, WIDE_MAX_WARPS, next_pow2
from kgen.passes.context import BuildContext
from kgen.plan import Decision, Plan, Tiles

NAME = "legalize"
# EAGLE chains are 1..8 tokens; trees (topk > 1) 8..64 (topk 4 with 3 steps gives up to 64).
MAX_DRAFT_TOKENS = 64
MERGE_BLOCK_DV_CAP = 64  # V columns per merge program
MERGE_ROWS = 16  # (head, draft) rows per merge program
MERGE_SPLIT_CHUNK = 8  # splits a merge program has in flight at once
PAGE_SIZES = (1, 8, 16, 32, 64, 128, 256)


def dot_width(x: int) -> int:
    return max(MIN_DOT, next_pow2(x))


def _width_decision(name: str, field: str, width: int, padded: int) -> Decision:
    """A tile width: the layout's width padded to a power of two >= MIN_DOT, masked where it grew."""
    masked = padded != width
    return Decision(NAME, name, padded,
                    f"{field} {width} padded to a power of two >= {MIN_DOT}"
                    + (" (masked)" if masked else " (exact: no mask emitted)"),
                    f"{field} {width} padded to a power of two, masked" if masked
                    else f"{field} {width} is a power of two: no mask")


def legalize(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    shape = plan.spec.attention
    has_pe = plan.need("specialization", NAME).has_pe
    block_d = dot_width(shape.nope_dim)
    block_dv = dot_width(shape.v_head_dim)
    block_dpe = dot_width(shape.pe_dim) if has_pe else None
    merge_block_dv = min(block_dv, MERGE_BLOCK_DV_CAP)
    decisions = [
        _width_decision("BLOCK_D", "nope_dim", shape.nope_dim, block_d),
        _width_decision("BLOCK_DV", "v_head_dim", shape.v_head_dim, block_dv),
        # The PE columns are always loaded under their own mask (dpe_ok), padded or not.
        Decision(NAME, "BLOCK_DPE", block_dpe, f"pe_dim {shape.pe_dim} padded to a power of two >= {MIN_DOT}")
        if has_pe else Decision(NAME, "BLOCK_DPE", None,
                                "no PE part: never computed, so next_power_of_2(0) is never asked",
                                "no PE part: never computed"),
        Decision(NAME, "L_PAD rule", f"next_pow2(L), BLOCK_H x L_PAD >= {MIN_DOT}",
                 f"L_PAD = max(next_pow2(cdiv({MIN_DOT}, BLOCK_H)), next_pow2(L)): tl.dot needs >= {MIN_DOT} "
                 "rows: R = BLOCK_H x L_PAD; computed by the launcher from the Python int max_len_extend",
                 f"tl.dot needs M >= {MIN_DOT}"),
        Decision(NAME, "DRAFT_N rule", f"L_PAD, <= BLOCK_N, <= {MAX_DRAFT_SCORES} // rows",
                 f"DRAFT_N = max({MIN_DOT}, min(L_PAD, BLOCK_N, {MAX_DRAFT_SCORES} // rows)): the draft block runs "
                 f"on tensor cores: >= {MIN_DOT} draft columns, masked; no wider than the prefix tile and at most "
                 f"{MAX_DRAFT_SCORES} scores, since beside them it holds the mask's bits and the draft positions "
                 "(rules.draft_tile_columns); a program whose draft rows are split over several (ROW_BLOCKS > 1), "
                 "or whose draft is wider than DRAFT_N, loops over DRAFT_N-wide tiles of every draft column its "
                 "rows can see, not software-pipelined",
                 f"tensor cores need >= {MIN_DOT}"),
        Decision(NAME, "MAX_ROWS", MAX_ROWS,
                 "BLOCK_H is halved at launch until BLOCK_H x L_PAD fits this row budget (and the "
                 "target's accumulator registers: see the fit pass); a wgmma program with 16-bit KV "
                 f"widened to {WIDE_MAX_WARPS} warps holds up to {WIDE_MAX_ROWS} where its accumulator fits",
                 f"BLOCK_H halves to fit it ({WIDE_MAX_ROWS} on {WIDE_MAX_WARPS} warps)"),
        Decision(NAME, "MAX_DRAFT_TOKENS", MAX_DRAFT_TOKENS,
                 "EAGLE trees (topk 4, 3 steps) reach 64 draft tokens; a draft longer than one program's "
                 "rows is split over programs, and longer drafts are refused (can_handle False) and fall back",
                 "EAGLE trees (topk 4, 3 steps) reach 64 draft tokens"),
        Decision(NAME, "MERGE_BLOCK_DV", merge_block_dv,
                 f"the merge stage is a log-sum-exp combine with no dot: V's {block_dv} columns go "
                 f"to programs of at most {MERGE_BLOCK_DV_CAP} so the grid is wide enough to stream "
                 "the partials (a merge of one program per request took most of the time at batch 16, prefix "
                 "1K: docs/perf-notes.md, 'Draft tile placement')",
                 "narrow programs: the grid streams the partials"),
        Decision(NAME, "MERGE_ROWS", MERGE_ROWS,
                 "rows (head x draft position) per merge program; no tensor-core minimum applies",
                 "no dot in the merge: no tensor-core minimum"),
        Decision(NAME, "MERGE_SPLIT_CHUNK", MERGE_SPLIT_CHUNK,
                 f"a merge program takes a request's splits {MERGE_SPLIT_CHUNK} at a time through an unrolled body "
                 "whose loads depend on nothing, so they are in flight together instead of one memory latency per "
                 "split (measured faster on the H200 at batch 1, prefix 4K, 64 splits); the same chunk as one "
                 "3-D block load ran slower (ptxas 239 registers, the split-axis sums through shared memory; "
                 "docs/perf-notes.md, 'The merge stage')",
                 f"{MERGE_SPLIT_CHUNK} splits' loads in flight at once"),
        Decision(NAME, "page sizes", PAGE_SIZES,
                 "PAGE_SIZE is a constexpr of the kernel: page index and offset fold at compile time",
                 "a constexpr: page math folds"),
    ]
    return plan.with_(decisions, tiles=Tiles(
        block_d=block_d, block_dpe=block_dpe, block_dv=block_dv,
        mask_d=block_d != shape.nope_dim, mask_dv=block_dv != shape.v_head_dim,
        merge_block_dv=merge_block_dv, merge_rows=MERGE_ROWS, merge_split_chunk=MERGE_SPLIT_CHUNK,
        min_dot_rows=MIN_DOT, max_draft_tokens=MAX_DRAFT_TOKENS, page_sizes=PAGE_SIZES,
    ))
