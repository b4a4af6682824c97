"""specialize: decide what the emitted source contains at all (not just skips at run time)."""

from __future__ import annotations

from kgen.passes.context import BuildContext
from kgen.plan import Decision, Plan, Specialization
from kgen.spec import FP8_DTYPES, AttentionShape

NAME = "specialize"
# Row counts (BLOCK_H x L_PAD) of grouped GQA programs that run the draft tile before the
# prefix loop unless a block config says otherwise.
GQA_DRAFT_FIRST_ROWS = (32,)
GQA_DRAFT_FIRST_WHY = (
    "32-row programs run mma.sync and hold q's fragments in registers through the loop; a draft "
    "tile after it keeps a second copy (ptxas sm_90a, 64-token tiles: 208 B of spills a thread "
    "after, none before). 16-row programs ran slower before it, and 64-row ones spill 20 B before "
    "it and none after (docs/perf-notes.md, 'Draft tile placement')."
)


def reads_v_from_k_tile(attention: AttentionShape) -> bool:
    """Absorbed MLA: V is the latent (nope) columns of the K tile itself."""
    return attention.v_source == "k_latent" and attention.v_head_dim == attention.nope_dim


def draft_tile_either(attention: AttentionShape, variant: str = "grouped") -> bool:
    """Whether the module emits both draft-tile placements (before and after the prefix
    loop) and lets the launcher pick: grouped GQA programs. Absorbed MLA always runs it
    first (q's 64 x 576 register copy would spill through the loop) and the per-head
    baseline after."""
    return variant == "grouped" and not reads_v_from_k_tile(attention)


# Why an FP8 pool's prefix tiles are multiplied in fp16: (why, brief) by KV dtype.
_E4M3_TO_FP16 = ("fp8 KV: e4m3 -> fp16 is a native conversion and exact; e4m3 -> bf16 is emulated",
                 "e4m3 -> fp16 is native and exact")
_FP8_TO_FP16 = {
    "float8_e4m3fn": _E4M3_TO_FP16,
    "float8_e4m3fnuz": _E4M3_TO_FP16,
    "float8_e5m2": ("fp8 KV: e5m2 -> fp16 is exact, a byte shift (e5m2 is fp16's top byte); e5m2 -> bf16 "
                    "rounds no value but takes more instructions", "e5m2 -> fp16 is exact (a byte shift)"),
}


def _prefix_dot(kv_dtype: str, q_dtype: str) -> tuple[str, str, str]:
    """(dtype, why, brief) of the prefix stage's dot operands. fp16 holds every e4m3 and e5m2
    value exactly, and converting to it is cheap where bf16 is not; queries are far inside
    fp16's range, so q converts where the pool would otherwise convert every tile."""
    if kv_dtype in FP8_DTYPES:
        return "float16", *_FP8_TO_FP16[kv_dtype]
    if kv_dtype == q_dtype:
        return q_dtype, "the pool is already in the query dtype", "the pool is already in the query dtype"
    if kv_dtype == "float16":
        return ("float16", "fp16 KV: the pool's own dtype, so no tile converts; the bf16 queries convert once",
                "the pool's dtype: no tile converts")
    return (q_dtype, f"{kv_dtype} KV with {q_dtype} queries: each tile converts to the queries' dtype",
            "tiles convert to the queries' dtype")


def specialize(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    shape = plan.spec.attention
    has_pe = shape.pe_dim > 0
    fp8_kv = plan.kv_dtype in FP8_DTYPES
    v_from_k_tile = reads_v_from_k_tile(shape)
    prefix_dot, prefix_dot_why, prefix_dot_brief = _prefix_dot(plan.kv_dtype, plan.q_dtype)
    # Where the last split runs the draft tile. After the prefix loop, the draft's q·k keeps
    # a register copy of q alive through the whole loop; with a 64x576 q (MLA) that spills.
    draft_tile_first = v_from_k_tile
    # GQA's grouped programs: both placements are emitted; the block config's draft_tile picks
    # one, else the launcher places it by the program's rows (measured per row count).
    either = draft_tile_either(shape, plan.variant)
    draft_first_rows = GQA_DRAFT_FIRST_ROWS if either else ()
    # Whole tiles in a loop without the -inf score select, the partial last tile in a second
    # loop: measured on the H200, only MLA BF16 gains.
    unmasked_full_tiles = v_from_k_tile and not fp8_kv
    return plan.with_(
        [
            Decision(NAME, "has_pe", has_pe,
                     f"pe_dim = {shape.pe_dim}: " + ("emit the q_pe/k_pe loads and their dot" if has_pe
                     else "no PE pointer, load, dot or argument is emitted"),
                     f"pe_dim = {shape.pe_dim}: " + ("q_pe/k_pe loads and their dot" if has_pe
                     else "no PE pointer, load or dot")),
            Decision(NAME, "fp8_kv", fp8_kv,
                     f"KV is {plan.kv_dtype}: " + ("k_scale/v_scale read from 1-element device "
                     "tensors (a float becomes a cached one), and the descale" if fp8_kv else
                     "k_scale/v_scale as float arguments only (SGLang's 16-bit pool scales): no device "
                     "read of them"),
                     f"KV is {plan.kv_dtype}: " + ("scales read on the device" if fp8_kv
                     else "scales are float arguments")),
            Decision(NAME, "v_from_k_tile", v_from_k_tile,
                     "absorbed MLA: V is the latent columns of the K tile already loaded, so no V "
                     "pointer or load is emitted" if v_from_k_tile else
                     f"V comes from its own buffer (v_source = {shape.v_source!r})",
                     "V is the K tile's latent columns: no V load" if v_from_k_tile else
                     f"V has its own buffer (v_source {shape.v_source!r})"),
            Decision(NAME, "draft tile", _draft_tile_what(draft_tile_first, either, draft_first_rows),
                     "MLA: before the loop, so q's register copy for the draft dot dies before it; ptxas "
                     "sm_90a, FP8, 32-token tiles, 3 stages: 1576 -> 404 B of spills a thread (BF16 "
                     "unchanged at 52 B)" if draft_tile_first else
                     "both placements emitted; a block config's draft_tile picks one, else the launcher "
                     "picks by rows. " + GQA_DRAFT_FIRST_WHY if either else
                     "after the loop: the per-head baseline keeps its measured placement",
                     "q's draft copy would spill after it" if draft_tile_first else
                     "a row's draft_tile overrides" if either else
                     "the per-head baseline's measured placement"),
            Decision(NAME, "draft mask", "HAS_MASK constexpr",
                     "a tree's custom mask is read on the device by the draft tile alone (the prefix loop "
                     "reads none); HAS_MASK False compiles the causal chain with no mask parameter or code, so a "
                     "chain costs nothing for the trees. A draft longer than one program's rows goes to "
                     "ROW_BLOCKS programs (kgen/launcher/rules.py, draft_row_blocks)",
                     "a chain compiles with no mask code"),
            Decision(NAME, "full tiles", "whole tiles, then the partial one" if unmasked_full_tiles else "one loop",
                     "MLA BF16: whole tiles in a loop without the -inf score select, then the partial tile; "
                     "measured faster than one loop on the H200 (docs/perf-notes.md, 'Whole tiles without the "
                     "-inf select')" if unmasked_full_tiles else
                     "one loop, the -inf select on every tile: with the K/V gather clamped (no load masks) a "
                     "second loop measured slower on the H200 for MLA FP8 and, with masked loads, for GQA "
                     "(docs/perf-notes.md, 'Whole tiles without the -inf select')",
                     "measured faster on the H200" if unmasked_full_tiles else "a second loop measured slower"),
            Decision(NAME, "merge", "second launch",
                     "a merge kernel after the prefix stage, fp32 partials; merging inside the prefix stage "
                     "(the last split to finish merges) measured slower on the H200 at every size tried, most "
                     "at batch 16, prefix 1K, since one program merges a request's splits serially "
                     "(docs/perf-notes.md, 'Fused merge'). A row's split.merge 'cluster' launches a head "
                     "block's 2-16 splits as one thread-block cluster (sm_90+, not the batch-invariant mode) "
                     "that merges them itself, one launch: on an H100 faster at batches 2-8 where the clusters "
                     "fit (sm_90's BF16 GQA rows there), slower where its 16 splits cut a longer grid "
                     "(docs/perf-notes.md, 'The merge in a cluster')",
                     "or a row's cluster; last-split merges lost"),
            Decision(NAME, "prefix dot dtype", prefix_dot, prefix_dot_why, prefix_dot_brief),
        ],
        specialization=Specialization(
            has_pe=has_pe, fp8_kv=fp8_kv, v_from_k_tile=v_from_k_tile, draft_tile_first=draft_tile_first,
            draft_tile_either=either, draft_first_rows=draft_first_rows,
            draft_first_why=GQA_DRAFT_FIRST_WHY if either else "", unmasked_full_tiles=unmasked_full_tiles,
            prefix_dot_dtype=prefix_dot, prefix_dot_why=prefix_dot_why,
        ),
    )


def _draft_tile_what(first: bool, either: bool, first_rows: tuple[int, ...]) -> str:
    """Where the draft tile runs; with both placements emitted, the launcher's rule by rows."""
    if first:
        return "before the prefix loop"
    if either:
        rows = ", ".join(str(r) for r in first_rows) or "no"
        return f"before at {rows} rows, else after"
    return "after the prefix loop"
