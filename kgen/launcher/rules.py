"""Launch rules: how a launch turns a block config into the program a GPU runs.

One definition, three users: the launcher every generated module runs (``kgen.launcher``),
the tuner and ``kgen check`` import it, and the ``fit`` pass calls ``fit_program`` to explain its
choices. Standard library only.

A *target* is one row of ``kgen/tables/targets.json`` (shared memory per block, threads per
warp, which matrix instruction Triton uses there). A *kernel shape* is what the layout
makes of a program's bytes: see ``kernel_shape``.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

# A row of kgen/tables/targets.json, what kernel_shape returns, and a block config as a dict.
Target = Mapping[str, Any]
KernelShape = Mapping[str, int]
Config = Mapping[str, Any]

MIN_DOT = 16  # tl.dot needs M, N and K of at least 16
MAX_ROWS = 128  # BLOCK_H x L_PAD rows: the largest tl.dot M any program uses
# fp32 accumulator registers a thread may hold: rows x accumulator width / threads. Past
# this the accumulator spills (ptxas sm_90a, GQA 256 at 128 rows: 256 registers, 4 KB of
# spills a thread), so the row blocking halves the head block first.
ACC_REGISTERS_PER_THREAD = 128
SHARED_MARGIN_BYTES = 1024  # barriers and alignment Triton adds beside the tile buffers
WGMMA_MIN_ROWS = 64  # one warpgroup's wgmma is 64 rows; smaller programs run mma.sync
# Software-pipeline stages of the merge's chunk loop on CUDA targets: its partials go through
# shared memory by cp.async, every load of a chunk issued before one wait, where register loads
# take one L2 latency a split (ptxas sm_90a; docs/perf-notes.md, "The merge stage"). Which calls
# take it: merge_split_stages.
MERGE_SPLIT_STAGES = 2
MAX_DRAFT_SCORES = 2048  # rows x columns of one draft tile: 64 x 32, 16 registers a thread at 4 warps
# Rows of a wgmma FP8 program with an accumulator this wide whose draft columns run in a loop:
# the loop carries the register accumulator beside the e4m3 -> fp16 conversion (absorbed MLA,
# 64 x 512, ptxas sm_90a: 64 rows spilled 3.1 KB a thread, 32 rows 64 B; straight-line at 64
# rows 1008 B). Other targets run another matrix instruction and keep their rows; kgen check
# compiles their looped programs too.
FP8_LOOPED_DRAFT_WIDE_ACC = 512
FP8_LOOPED_DRAFT_MAX_ROWS = 32
# Warps a wgmma program may grow to so that its rows share one KV read: two warpgroups, each
# a 64-row wgmma tile of the same K/V stage (docs/perf-notes.md, "Two warpgroups on one KV read").
WIDE_MAX_WARPS = 8
# Rows a widened program (WIDE_MAX_WARPS, wgmma, 16-bit KV) may hold where its accumulator fits:
# two warpgroups of 128 rows on one KV read (head dims 128 and 64; docs/perf-notes.md, "256 rows
# in one program").
WIDE_MAX_ROWS = 256


class FittedProgram(NamedTuple):
    """A config's program made to fit a target (``fit_program``): ``reasons`` says what changed."""

    block_h: int
    l_pad: int
    block_n: int
    num_stages: int
    num_warps: int
    reasons: list[str]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x, with next_pow2(0) == 1 (Triton 3.6's returns 0)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def kernel_shape(k_width: int, acc_width: int, kv_bytes: int, v_separate: bool) -> KernelShape:
    """Bytes per prefix token a program stages (K's padded width, plus V when it is its own
    buffer), bytes per 16-bit row of q and the accumulator's width."""
    return {
        "kv_row_bytes": (k_width + (acc_width if v_separate else 0)) * kv_bytes,
        "q_row_bytes": k_width * 2,
        "acc_width": acc_width,
        "kv_bytes": kv_bytes,
        "v_separate": int(v_separate),
    }


def draft_rows(block_h: int, max_len: int) -> int:
    """L_PAD, the rows a program gives each of its BLOCK_H heads: a power of two that holds
    the draft and, with the other heads, makes at least MIN_DOT rows for tl.dot."""
    return max(next_pow2(cdiv(MIN_DOT, block_h)), next_pow2(max_len))


def row_blocking(block_h: int, group: int, max_len: int, max_rows: int = MAX_ROWS,
                 grouped: bool = True) -> tuple[int, int]:
    """BLOCK_H (query heads a program owns) and L_PAD (draft rows per head, a power of two):
    at least MIN_DOT rows, at most max_rows, halving the head block until it fits. A draft
    longer than max_rows rows of one head is split over programs (``draft_row_blocks``)."""
    block_h = min(block_h, next_pow2(group)) if grouped else 1
    while True:
        l_pad = draft_rows(block_h, max_len)
        if block_h * l_pad <= max_rows:
            return block_h, l_pad
        if block_h == 1:
            return 1, max(max_rows, MIN_DOT)
        block_h //= 2


def draft_row_blocks(l_pad: int, max_len: int) -> int:
    """Programs that share one head block's draft rows: 1 while L_PAD holds the whole draft,
    else cdiv(L, L_PAD) (each takes L_PAD consecutive draft tokens)."""
    return max(1, cdiv(max_len, l_pad))


def draft_tile_columns(rows: int, l_pad: int, block_n: int) -> int:
    """DRAFT_N, the draft tile's width: L_PAD (the program's whole draft in one tile), but no
    wider than the prefix tile's BLOCK_N and no more than MAX_DRAFT_SCORES scores for the
    program's rows; at least MIN_DOT for tl.dot. Beside its scores a draft tile holds the mask's
    bits and the draft positions, which a prefix tile does not: 64 columns beside a 64 x 256
    accumulator spilled 2.7 KB a thread (ptxas sm_80/sm_89, 4 warps), 128 rows x 64 columns
    4.7 KB (GQA 128, sm_90), and 32 columns beside MLA's 32 x 512 took 106496 B of shared
    memory on sm_89, over its 101376 B. A narrower tile walks the draft columns in a loop."""
    return max(MIN_DOT, min(l_pad, block_n, MAX_DRAFT_SCORES // rows))


def draft_columns_loop(row_blocks: int, draft_n: int, l_pad: int) -> bool:
    """Whether a program walks its draft columns in a loop (the kernel's branch): its draft rows
    are split over programs, or its draft tile is narrower than its rows' draft."""
    return row_blocks > 1 or draft_n < l_pad


def widens(target: Target, shape: KernelShape) -> bool:
    """Whether a program may take more warps to keep its rows on one KV read: wgmma, 16-bit KV."""
    return target["mma"] == "wgmma" and shape["kv_bytes"] == 2


def row_cap(target: Target, shape: KernelShape, num_warps: int) -> int:
    """The most rows a program of num_warps may hold: WIDE_MAX_ROWS for a widening target at
    WIDE_MAX_WARPS, else MAX_ROWS."""
    return WIDE_MAX_ROWS if widens(target, shape) and num_warps >= WIDE_MAX_WARPS else MAX_ROWS


def wanted_rows_cap(target: Target, shape: KernelShape) -> int:
    """The most rows a program may want before its warps are chosen: MAX_ROWS, or more where a
    widened program's accumulator holds them (head dims 128 and 64 on a widening target)."""
    if not widens(target, shape):
        return MAX_ROWS
    return max(MAX_ROWS, max_rows_for(target, shape, WIDE_MAX_WARPS))


def max_rows_for(target: Target, shape: KernelShape, num_warps: int) -> int:
    """The row budget of one program: row_cap, and no more accumulator than
    ACC_REGISTERS_PER_THREAD registers a thread (a power of two, at least MIN_DOT)."""
    threads = num_warps * target["warp_size"]
    budget = ACC_REGISTERS_PER_THREAD * threads // shape["acc_width"]
    rows = MIN_DOT
    while rows * 2 <= min(budget, row_cap(target, shape, num_warps)):
        rows *= 2
    return rows


def shared_bytes(target: Target, shape: KernelShape, rows: int, block_n: int, num_stages: int,
                 num_warps: int) -> int:
    """Shared memory (LDS) Triton gives one prefix-stage program, from its tile buffers.

    A "measured" target (targets.json: sm_90) uses the allocation Triton 3.6 reported offline
    for every shipped layout, BF16 and FP8, 16 to 128 rows, 32/64-token tiles, 2-3 stages:
    wgmma programs keep num_stages K/V buffers and q; mma.sync programs keep num_stages - 1
    buffers, q and one 16-bit row of p per row. Every other target takes an upper bound, since
    Triton's allocation there differs by program (sm_89 MLA: 106496 B where the sm_90 rule
    gives 95232; sm_100 MLA at 64 rows keeps the 64 x 512 fp32 accumulator in shared memory,
    250928 B): every buffer, q, a 16-bit copy of the accumulator and of p per row, and on
    tcgen05 the fp32 accumulator once it is 512 wide. The bound is not exact everywhere (sm_89
    MLA at 32 rows: 90112 B against 80896): ``kgen check`` compiles every variant and fails
    where what Triton allocates exceeds the target.
    """
    kv_tile = block_n * shape["kv_row_bytes"]
    if target["shared_estimate"] == "measured":
        if target["mma"] == "wgmma" and rows >= WGMMA_MIN_ROWS and num_warps % 4 == 0:
            tiles = num_stages * kv_tile + rows * shape["q_row_bytes"]
        else:
            tiles = max(num_stages - 1, 1) * kv_tile + rows * (shape["q_row_bytes"] + 2 * block_n)
        return tiles + SHARED_MARGIN_BYTES
    tiles = num_stages * kv_tile + rows * (shape["q_row_bytes"] + 2 * shape["acc_width"] + 2 * block_n)
    if target["mma"] == "tcgen05" and shape["acc_width"] >= 512:
        tiles += rows * shape["acc_width"] * 4
    return tiles + SHARED_MARGIN_BYTES


def widened_warps(target: Target, shape: KernelShape, config: Config, rows: int) -> int:
    """The warps a program of ``rows`` rows runs with: the config's, doubled (up to
    WIDE_MAX_WARPS) on a wgmma target with 16-bit KV while its accumulator would not fit their
    registers, or its rows reach the config's ``widen_from_rows``, and twice the warps would
    hold it. The rows then stay in one program, which reads each K/V tile once for all of them,
    instead of a halved head block reading the prefix again. FP8 programs keep their warps:
    they convert each e4m3 tile on the same warps, and widened they ran slower than two head
    blocks (docs/perf-notes.md)."""
    num_warps = config["num_warps"]
    if not widens(target, shape):
        return num_warps
    widen_from = config.get("widen_from_rows") or MAX_ROWS + 1
    while (num_warps < WIDE_MAX_WARPS
           and (rows > max_rows_for(target, shape, num_warps) or rows >= widen_from)
           and rows <= max_rows_for(target, shape, 2 * num_warps)):
        num_warps *= 2
    return num_warps


def fit_program(target: Target, shape: KernelShape, config: Config, group: int, max_len: int,
                grouped: bool = True) -> FittedProgram | None:
    """The config's program, made to fit the target (a FittedProgram). In order: a wgmma
    program takes more warps where that keeps its rows in one program (``widened_warps``); the
    accumulator's row budget halves the head block (and past one head, splits the draft rows
    over programs); then, while the tile buffers overflow shared memory, fewer stages (down to
    2, then 1), then narrower tiles (down to MIN_DOT tokens), then fewer heads, then fewer
    draft rows a program. ``reasons`` says what changed and why."""
    block_n, stages = config["block_n"], config["num_stages"]
    wanted_h, wanted_l = row_blocking(config["block_h"], group, max_len, wanted_rows_cap(target, shape), grouped)
    wanted_rows = wanted_h * wanted_l
    num_warps = widened_warps(target, shape, config, wanted_rows)
    reasons = []
    if num_warps != config["num_warps"] and wanted_rows > max_rows_for(target, shape, config["num_warps"]):
        reasons.append(f"num_warps {config['num_warps']} -> {num_warps}: {wanted_rows} rows x "
                       f"{shape['acc_width']} fp32 accumulator fit {ACC_REGISTERS_PER_THREAD} registers a thread "
                       f"at {num_warps} warps, so every row shares one KV read")
    elif num_warps != config["num_warps"]:
        reasons.append(f"num_warps {config['num_warps']} -> {num_warps}: {wanted_rows} rows reach the "
                       f"row's widen_from_rows {config['widen_from_rows']} (at {config['num_warps']} warps the "
                       f"accumulator takes all {ACC_REGISTERS_PER_THREAD} registers a thread may hold, and the "
                       f"loop spills)")
    max_rows = max_rows_for(target, shape, num_warps)
    block_h, l_pad = row_blocking(config["block_h"], group, max_len, max_rows, grouped)
    if block_h < wanted_h:
        reasons.append(f"BLOCK_H {wanted_h} -> {block_h}: {wanted_rows} rows x {shape['acc_width']} fp32 "
                       f"accumulator exceed {ACC_REGISTERS_PER_THREAD} registers a thread at {num_warps} warps")
    rows = block_h * l_pad
    loops = draft_columns_loop(draft_row_blocks(l_pad, max_len), draft_tile_columns(rows, l_pad, block_n), l_pad)
    if (target["mma"] == "wgmma" and shape["kv_bytes"] == 1 and shape["acc_width"] >= FP8_LOOPED_DRAFT_WIDE_ACC
            and rows > FP8_LOOPED_DRAFT_MAX_ROWS and loops):
        while block_h * l_pad > FP8_LOOPED_DRAFT_MAX_ROWS:
            block_h, l_pad = (block_h // 2, l_pad) if block_h > 1 else (1, l_pad // 2)
        reasons.append(f"{block_h * l_pad} rows: an FP8 program whose draft columns loop carries its "
                       f"{shape['acc_width']}-wide accumulator beside the e4m3 conversion, at most "
                       f"{FP8_LOOPED_DRAFT_MAX_ROWS} rows")
    row_blocks = draft_row_blocks(l_pad, max_len)
    if row_blocks > 1:
        reasons.append(f"draft rows over {row_blocks} programs of L_PAD {l_pad}: {draft_rows(1, max_len)} rows "
                       f"of one head exceed the {max_rows}-row budget at {num_warps} warps")
    limit = target["shared_bytes"]
    while shared_bytes(target, shape, block_h * l_pad, block_n, stages, num_warps) > limit:
        need = shared_bytes(target, shape, block_h * l_pad, block_n, stages, num_warps)
        if stages > 1:
            change, stages = f"num_stages {stages} -> {stages - 1}", stages - 1
        elif block_n > MIN_DOT:
            change, block_n = f"BLOCK_N {block_n} -> {block_n // 2}", block_n // 2
        elif block_h > 1:
            change, block_h = f"BLOCK_H {block_h} -> {block_h // 2}", block_h // 2
            l_pad = draft_rows(block_h, max_len)
        elif l_pad > MIN_DOT:
            change, l_pad = f"L_PAD {l_pad} -> {l_pad // 2} (draft rows over more programs)", l_pad // 2
        else:
            reasons.append(f"nothing fits: {need} B of shared memory at the smallest program")
            return None
        reasons.append(f"{change}: {need} B of tile buffers exceed {limit} B of shared memory")
    return FittedProgram(block_h, l_pad, block_n, stages, num_warps, reasons)


# The Gluon prefix stage's program rows: absorbed MLA's two consumer warpgroups split one wgmma's
# 64 rows by output columns (gluon/mla_ws_prefix_stage.py.j2); GQA's split 128 rows into two
# wgmma tiles of 64 on one K/V stage (gluon_gqa/ws_prefix_stage.py.j2). Where a KV head has more
# rows, its programs each read the prefix (the second read mostly an L2 hit): 256-row programs
# lost to that (docs/perf-notes.md, "256 rows in one Gluon program (experiment, lost)").
GLUON_ROWS = 64
GLUON_GQA_ROWS = 128
GLUON_MAX_ROW_BLOCK = 64  # L_PAD past this leaves no head per program


def gluon_program_rows(shape: KernelShape) -> int:
    """Rows of one Gluon program of this kernel shape: GLUON_GQA_ROWS for GQA, GLUON_ROWS for
    absorbed MLA."""
    return GLUON_GQA_ROWS if shape["v_separate"] else GLUON_ROWS


def gluon_shared_bytes(shape: KernelShape, block_n: int, num_stages: int, landing_stages: int = 0,
                       consumers: int = 2) -> int:
    """Shared memory of the Gluon prefix stage: q (16-bit) of a program's rows, NUM_STAGES
    gathered K tiles (and V tiles where V is its own buffer), absorbed MLA's fp32 rows (each
    stage's rescale row and the rows' final max and sum-exp; its P lives in its stage's PE slot),
    an FP8 GQA converter's landing ring (``landing_stages`` tiles of the pool's rows as stored),
    plus the margin (measured with Triton 3.6 for sm_90: the mbarrier arrays and Triton's own
    scratch add 336-352 bytes to these buffers). Beside a landing ring q takes a 64-row tile for
    each of ``consumers`` (the consumers with rows, rules.gluon_consumers), else the program's
    rows."""
    rows = gluon_program_rows(shape)
    rows_fp32 = 0 if shape["v_separate"] else (num_stages + 2) * rows * 4
    q_rows = GLUON_ROWS * consumers if landing_stages else rows
    # A stage holds 16-bit rows whatever the pool's bytes (an FP8 producer converts to fp16).
    stage_row_bytes = shape["kv_row_bytes"] // shape["kv_bytes"] * 2
    tiles = q_rows * shape["q_row_bytes"] + num_stages * block_n * stage_row_bytes
    landing = landing_stages * block_n * shape["kv_row_bytes"]
    return tiles + rows_fp32 + landing + SHARED_MARGIN_BYTES


def gluon_rows(shape: KernelShape, max_len: int, block_n: int) -> tuple[int, int] | None:
    """(BLOCK_H, L_PAD) of a Gluon program, or None when the draft does not fit one tile of
    draft keys or one program's rows (the Triton kernel serves it)."""
    l_pad = next_pow2(max_len)
    if max_len > block_n or l_pad > GLUON_MAX_ROW_BLOCK:
        return None
    return gluon_program_rows(shape) // l_pad, l_pad


# A Gluon program's warps: warpgroups of four. At launch every thread gets the register file's
# share (maxnreg, a multiple of 8), which setmaxnreg then moves between the partitions; every
# instruction must still fit that share (docs/perf-notes.md, "What Triton 3.6's Gluon does on sm_90").
GLUON_WARPGROUP = 4
REGISTER_FILE = 65536  # 32-bit registers of an SM (sm_90)
# FP8 GQA: a converter warpgroup holds a tile in registers until its stage frees, so one keeps one
# tile in flight (docs/perf-notes.md, "GQA with FP8 KV: the converting producer"). Two converters
# take the odd and the even tiles: in consumer 1's warpgroup where it has no rows (12 warps), or as
# a fourth warpgroup beside two consumers (16 warps, 128 registers a thread at launch, which a
# consumer's 64-row wgmma accumulator must fit: head dims to this). Or one converter lands the
# rows with cp.async in a ring of its own (a section's landing_stages, 2 to 4 tiles), several
# tiles in flight in shared memory rather than registers.
GLUON_FOUR_WARPGROUP_MAX_ACC = 128


def gluon_consumers(group: int, l_pad: int) -> int:
    """Consumer warpgroups with rows in a GQA Gluon program: 2, or 1 where the group's rows all
    fall in the first half of its GLUON_GQA_ROWS (the kernel's CONSUMERS)."""
    return 2 if GLUON_GQA_ROWS // 2 // l_pad < group else 1


def gluon_converters_refusal(shape: KernelShape, converters: int) -> str | None:
    """Why a gluon section's ``converters`` cannot be this module's, or None."""
    if not shape["v_separate"] or shape["kv_bytes"] != 1:
        return "only GQA's FP8 programs convert in warpgroups of their own"
    if converters == 2 and shape["acc_width"] > GLUON_FOUR_WARPGROUP_MAX_ACC:
        return (f"head dim {shape['acc_width']}: beside two consumers a second converter makes 16 warps, whose "
                f"{gluon_launch_registers(4 * GLUON_WARPGROUP)} registers a thread at launch a 64 x "
                f"{shape['acc_width']} wgmma accumulator does not fit")
    return None


def gluon_landing_refusal(shape: KernelShape, landing_stages: int, converters: int | None) -> str | None:
    """Why a gluon section's ``landing_stages`` cannot be this module's, or None."""
    if not shape["v_separate"] or shape["kv_bytes"] != 1:
        return "only GQA's FP8 programs land the pool's rows in a ring of their own"
    if converters == 2:
        return "a landing ring is filled and read by one converter; two converters hold their tiles in registers"
    return None


def gluon_landing_stages(shape: KernelShape, block_n: int, num_stages: int, asked: int | None, consumers: int,
                         shared_limit: int) -> int:
    """Tiles of an FP8 GQA program's landing ring: the section's ``asked`` where the ring fits
    shared memory beside q's tiles for its ``consumers`` with rows, else 0 (the converters take
    their rows through registers: at head dim 256, two consumers' q leaves no room for it)."""
    if not asked or gluon_shared_bytes(shape, block_n, num_stages, asked, consumers) > shared_limit:
        return 0
    return asked


def gluon_converters(shape: KernelShape, consumers: int, converters: int | None = None,
                     landing_stages: int = 0) -> int:
    """Converter warpgroups of an FP8 GQA Gluon program (``consumers`` with rows): 1 where it
    lands its rows in a ring (``landing_stages``), else the section's ``converters`` where the
    module takes it, else 2 where consumer 1's warpgroup has no rows (it converts), 1 beside two
    consumers. 0 for a program that does not convert (cp.async)."""
    if not shape["v_separate"] or shape["kv_bytes"] != 1:
        return 0
    if landing_stages:
        return 1
    if converters is not None and gluon_converters_refusal(shape, converters) is None:
        return converters
    return 2 if consumers == 1 else 1


def gluon_warps(consumers: int, converters: int) -> int:
    """A GQA Gluon program's warps: three warpgroups (two consumers, or a consumer and its idle
    or converting neighbour, and a producer), four where two converters sit beside two consumers."""
    return GLUON_WARPGROUP * (4 if consumers == 2 and converters == 2 else 3)


def gluon_launch_registers(warps: int) -> int:
    """maxnreg of a Gluon launch of ``warps``: the register file's share a thread, rounded down
    to a multiple of 8 (168 at 12 warps, 128 at 16)."""
    return REGISTER_FILE // (32 * warps) // 8 * 8


def gluon_refusal(shape: KernelShape, draft: int, block_n: int, group: int | None, from_rows: int = 0,
                  invariant_draft: int | None = None, max_draft_tokens: int = 0) -> str | None:
    """Why the launcher runs the Triton stage at this draft length in place of a config's
    gluon section, or None where it launches the Gluon stage (at ``gluon_rows`` of the fitted
    draft). A batch-invariant module (``invariant_draft``, its DRAFT_ROWS) fits every program
    for that draft, and its longest draft (``max_draft_tokens``) must fit a key tile: which
    kernel serves never depends on the batch. ``group`` None leaves from_rows unapplied (the
    default config, which serves every group)."""
    fitted = draft if invariant_draft is None else invariant_draft
    if invariant_draft is not None and max_draft_tokens > block_n:
        return f"batch-invariant programs take drafts to {max_draft_tokens}, over BLOCK_N {block_n}"
    if gluon_rows(shape, fitted, block_n) is None:
        return f"longer than BLOCK_N {block_n}"
    if group is not None and group * fitted < from_rows:
        return f"under {from_rows} rows a KV head, group x L (from_rows)"
    return None


def merge_split_stages(target: Target, rows: int, columns: int, split_chunk: int, max_splits: int) -> int:
    """Software-pipeline stages of a merge program's chunk loop: MERGE_SPLIT_STAGES on a CUDA
    target for a call whose grid has more than one chunk of splits and where one chunk's partials
    and sums (fp32, rows x (columns + 1) x split_chunk, the one buffer two stages stage) fit its
    shared memory; else 1, register loads. One chunk has no next chunk to overlap, and such calls
    ran slower pipelined (docs/perf-notes.md, "The merge stage", which says what may cause it).
    A 64-row program's chunk is 133 KB: over sm_89's 99 KB (kgen check)."""
    if target["family"] != "cuda" or max_splits <= split_chunk:
        return 1
    staged = rows * (columns + 1) * split_chunk * 4
    return MERGE_SPLIT_STAGES if staged + SHARED_MARGIN_BYTES <= target["shared_bytes"] else 1


def cluster_merge_stages(split_policy: Mapping[str, Any], cluster_splits: int) -> int:
    """Software-pipeline stages of the merge in a cluster: MERGE_SPLIT_STAGES where the call
    merges in clusters and the table row's split policy asks for it (merge_pipelined), else 1,
    register loads. A cluster's splits are one chunk; staged through shared memory its loads go
    out together, which won on some programs and lost on others (docs/perf-notes.md, "The merge
    stage"), so the row decides."""
    return MERGE_SPLIT_STAGES if cluster_splits > 1 and split_policy.get("merge_pipelined") else 1
