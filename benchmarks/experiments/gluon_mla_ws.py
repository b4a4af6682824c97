"""Spike (issue 33): a warp-specialized Gluon prefix stage for absorbed MLA 512+64 on sm_90.

Same arguments, grid, split plan, partials and draft tile as the generated modules'
`_gluon_prefix_stage` (default mode, token-slot entry), so the module's own launcher and merge run
it: `install(module, ...)` swaps it in. What differs is who does what:

- a producer partition (PRODUCER_WARPS warps, PRODUCER_REGS registers a thread) gathers each tile's
  K rows through kv_indices with cp.async into a ring of NUM_STAGES stages. Each of its threads
  arrives on the stage's `ready` barrier when its own copies have landed
  (cp.async.mbarrier.arrive.noinc), so `ready` completes when the whole tile is in shared memory;
- the default partition (8 warps: two consumer warpgroups) never issues a global load in the loop.
  It waits on `ready`, runs S = q.K^T (each warpgroup half of the tile's keys), the online softmax,
  P through shared memory and acc += P.V (each warpgroup 256 of the 512 output columns), then
  arrives on the stage's `empty` barrier, which the producer waits on before refilling it.

`QK_AHEAD`: the consumers issue tile t+1's q.K^T before tile t's softmax, so the softmax overlaps
the tensor cores (needs tile t+1 landed while tile t is held: NUM_STAGES >= 3 to keep a tile in
flight).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

NOPE_DIM = tl.constexpr(512)
PE_DIM = tl.constexpr(64)
CONSUMER_WARPS = tl.constexpr(8)


@gluon.jit
def _split_plan(prefix_len, max_splits, min_tokens_per_split, block_n):
    num_splits = gl.minimum(gl.maximum(gl.cdiv(prefix_len, min_tokens_per_split), 1), max_splits)
    split_len = gl.maximum(gl.cdiv(gl.cdiv(prefix_len, num_splits), block_n) * block_n, block_n)
    return split_len, gl.maximum(gl.cdiv(prefix_len, split_len), 1)


@gluon.jit
def _copy_rows(nope_dst, pe_dst, src, row_nope, row_pe, NOPE_LOAD: gl.constexpr, PE_LOAD: gl.constexpr,
               mask_nope=None, mask_pe=None):
    cols = gl.arange(0, NOPE_DIM, layout=gl.SliceLayout(0, NOPE_LOAD))
    async_copy.async_copy_global_to_shared(nope_dst, src + row_nope[:, None] + cols[None, :], mask=mask_nope)
    cols_pe = gl.arange(0, PE_DIM, layout=gl.SliceLayout(0, PE_LOAD))
    async_copy.async_copy_global_to_shared(pe_dst, src + NOPE_DIM + row_pe[:, None] + cols_pe[None, :], mask=mask_pe)


@gluon.jit
def _producer(K_Buffer, K_Extend, table_words, k_nope_stages, k_pe_stages, ready, empty, split_start, split_end,
              num_tiles, draft_tiles, head_off, stride_k_slot, q_start, q_len, ke_head, stride_ke_tok,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, INDEX_WORDS: gl.constexpr,
              PRODUCER_WARPS: gl.constexpr):
    """Fill the ring: tile t into stage t % NUM_STAGES once its consumers released it."""
    # One layout for the latent and the PE columns: 8 lanes cover one row's 128 bytes (a line)
    # per copy, so a thread owns BLOCK_N / (4 * PRODUCER_WARPS) rows and needs only their slots.
    ROW_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PRODUCER_WARPS, 1], [1, 0])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROW_LOAD))
    # Slots of tile 0, then each tile's slots load while the tile before it waits for its stage.
    last = split_end - 1
    slots = gl.load(table_words + INDEX_WORDS * gl.minimum(split_start + offs_n, last))
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        # Parity of the round: a fresh barrier counts as a completed phase 1, so round 0 passes.
        mbarrier.wait(empty.index(stage), ((t // NUM_STAGES) & 1) ^ 1)
        row = slots.to(gl.int64) * stride_k_slot + head_off
        _copy_rows(k_nope_stages.index(stage), k_pe_stages.index(stage), K_Buffer, row, row, ROW_LOAD, ROW_LOAD)
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)
        first = split_start + (t + 1) * BLOCK_N
        slots = gl.load(table_words + INDEX_WORDS * gl.minimum(first + offs_n, last))
    for t in range(num_tiles, num_tiles + draft_tiles):
        stage = t % NUM_STAGES
        mbarrier.wait(empty.index(stage), ((t // NUM_STAGES) & 1) ^ 1)
        row = (q_start + offs_n) * stride_ke_tok + ke_head
        in_draft = (offs_n < q_len)[:, None]
        _copy_rows(k_nope_stages.index(stage), k_pe_stages.index(stage), K_Extend, row, row, ROW_LOAD, ROW_LOAD,
                   mask_nope=in_draft, mask_pe=in_draft)
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@gluon.jit
def _scores(q_nope, q_pe, k_nope, k_pe, ROWS: gl.constexpr, S_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr):
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_LAYOUT)
    s = warpgroup_mma(q_nope, k_nope.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_pv(s, k_nope, p_smem, m_i, l_cols, acc, visible, qk_scale, O_LAYOUT: gl.constexpr):
    m_new, l_cols, acc = _softmax_pv_async(s, k_nope, p_smem, m_i, l_cols, acc, visible, qk_scale, O_LAYOUT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return m_new, l_cols, acc


@gluon.jit
def _softmax_pv_async(s, k_nope, p_smem, m_i, l_cols, acc, visible, qk_scale, O_LAYOUT: gl.constexpr):
    """Tile t's online softmax and its P.V, issued and not waited: returns (m, l_cols, acc token)."""
    s = gl.where(visible, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[:, None])
    l_cols = l_cols * alpha[:, None] + p
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()  # both warpgroups' halves of P are in shared memory
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    acc = warpgroup_mma(p_smem, k_nope, acc, is_async=True)
    return m_new, l_cols, acc


@gluon.jit
def _consumers(Q, Out, Partial_O, Partial_Lse, Custom_Mask, Mask_Indptr, q_nope_smem, q_pe_smem, k_nope_stages,
               k_pe_stages, p_smem, ready, empty, q_start, q_len, kv_head, head_block, batch, split, num_written,
               prefix_len, split_start, split_end, num_tiles, draft_tiles, qk_scale, k_scale, v_scale,
               draft_lookahead_len, stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_po_tok,
               stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
               GROUP: gl.constexpr, BLOCK_H: gl.constexpr, L_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
               NUM_STAGES: gl.constexpr, HAS_MASK: gl.constexpr, QK_AHEAD: gl.constexpr):
    ROWS: gl.constexpr = BLOCK_H * L_PAD
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BLOCK_N // 2, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, NOPE_DIM // 2, 16])
    NOPE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [CONSUMER_WARPS, 1], [1, 0])
    PE_LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONSUMER_WARPS, 1], [1, 0])

    # q into shared memory (the consumers' only global loads): row r is head
    # head_block * BLOCK_H + r // L_PAD, draft token r % L_PAD; padding rows are zeros.
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, NOPE_LOAD))
    head = head_block * BLOCK_H + rows // L_PAD
    q_row = (q_start + rows % L_PAD) * stride_q_tok + (kv_head * GROUP + head).to(gl.int64) * stride_q_head
    cols = gl.arange(0, NOPE_DIM, layout=gl.SliceLayout(0, NOPE_LOAD))
    row_ok = (head < GROUP) & (rows % L_PAD < q_len)
    q_nope_smem.store(gl.load(Q + q_row[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0))
    rows_pe = gl.arange(0, ROWS, layout=gl.SliceLayout(1, PE_LOAD))
    head_pe = head_block * BLOCK_H + rows_pe // L_PAD
    q_row_pe = (q_start + rows_pe % L_PAD) * stride_q_tok + (kv_head * GROUP + head_pe).to(gl.int64) * stride_q_head
    cols_pe = gl.arange(0, PE_DIM, layout=gl.SliceLayout(0, PE_LOAD))
    ok_pe = (head_pe < GROUP) & (rows_pe % L_PAD < q_len)
    q_pe_smem.store(gl.load(Q + NOPE_DIM + q_row_pe[:, None] + cols_pe[None, :], mask=ok_pe[:, None], other=0.0))
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    l_cols = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_LAYOUT)
    acc = gl.zeros([ROWS, NOPE_DIM], gl.float32, layout=O_LAYOUT)
    tile_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    prefix_scale = qk_scale * k_scale
    if QK_AHEAD:
        if num_tiles > 0:
            mbarrier.wait(ready.index(0), 0)
            fence_async_shared()  # the producer's cp.async wrote it through the generic proxy; wgmma reads async
            s = _scores(q_nope_smem, q_pe_smem, k_nope_stages.index(0), k_pe_stages.index(0), ROWS, S_LAYOUT,
                        BLOCK_N)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            for t in range(num_tiles - 1):
                stage = t % NUM_STAGES
                ahead = (t + 1) % NUM_STAGES
                mbarrier.wait(ready.index(ahead), ((t + 1) // NUM_STAGES) & 1)
                fence_async_shared()
                # Tile t+1's scores run on the tensor cores while tile t's softmax runs.
                s_ahead = _scores(q_nope_smem, q_pe_smem, k_nope_stages.index(ahead), k_pe_stages.index(ahead),
                                  ROWS, S_LAYOUT, BLOCK_N)
                visible = (tile_cols < split_end - split_start - t * BLOCK_N)[None, :]
                m_i, l_cols, acc = _softmax_pv_async(s, k_nope_stages.index(stage), p_smem, m_i, l_cols, acc,
                                                     visible, prefix_scale, O_LAYOUT)
                s, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_ahead, acc))
                gl.thread_barrier()  # both warpgroups are past their P.V of this stage
                mbarrier.arrive(empty.index(stage), count=1)
            t = num_tiles - 1
            stage = t % NUM_STAGES
            visible = (tile_cols < split_end - split_start - t * BLOCK_N)[None, :]
            m_i, l_cols, acc = _softmax_pv(s, k_nope_stages.index(stage), p_smem, m_i, l_cols, acc, visible,
                                           prefix_scale, O_LAYOUT)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(stage), count=1)
    else:
        for t in range(num_tiles):
            stage = t % NUM_STAGES
            mbarrier.wait(ready.index(stage), (t // NUM_STAGES) & 1)
            fence_async_shared()
            s = _scores(q_nope_smem, q_pe_smem, k_nope_stages.index(stage), k_pe_stages.index(stage), ROWS, S_LAYOUT,
                        BLOCK_N)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            visible = (tile_cols < split_end - split_start - t * BLOCK_N)[None, :]
            m_i, l_cols, acc = _softmax_pv(s, k_nope_stages.index(stage), p_smem, m_i, l_cols, acc, visible,
                                           prefix_scale, O_LAYOUT)
            gl.thread_barrier()  # both warpgroups are past their P.V of this stage
            mbarrier.arrive(empty.index(stage), count=1)
    acc = acc * v_scale

    if draft_tiles > 0:
        stage = num_tiles % NUM_STAGES
        mbarrier.wait(ready.index(stage), (num_tiles // NUM_STAGES) & 1)
        fence_async_shared()
        draft_pos = gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_LAYOUT)) % L_PAD
        if HAS_MASK:
            mask_row = (Custom_Mask + gl.load(Mask_Indptr + batch).to(gl.int64)
                        + draft_pos.to(gl.int64) * (prefix_len + q_len) + prefix_len)
            bits = gl.load(mask_row[:, None] + tile_cols[None, :],
                           mask=(draft_pos < q_len)[:, None] & (tile_cols < q_len)[None, :], other=0)
            visible = bits != 0
        else:
            visible = tile_cols[None, :] < gl.minimum(draft_pos + 1 + draft_lookahead_len, q_len)[:, None]
        s = _scores(q_nope_smem, q_pe_smem, k_nope_stages.index(stage), k_pe_stages.index(stage), ROWS, S_LAYOUT,
                    BLOCK_N)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        m_i, l_cols, acc = _softmax_pv(s, k_nope_stages.index(stage), p_smem, m_i, l_cols, acc, visible, qk_scale,
                                       O_LAYOUT)

    rows_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
    cols_o = gl.arange(0, NOPE_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
    head_o = head_block * BLOCK_H + rows_o // L_PAD
    draft_o = rows_o % L_PAD
    ok_o = (head_o < GROUP) & (draft_o < q_len)
    q_head_o = (kv_head * GROUP + head_o).to(gl.int64)
    q_tok_o = q_start + draft_o
    l_i = gl.convert_layout(gl.sum(l_cols, 1), gl.SliceLayout(1, O_LAYOUT))
    l_safe = gl.where(ok_o & (l_i > 0), l_i, 1.0)
    out = acc / l_safe[:, None]
    if num_written == 1:
        o_ptr = Out + q_tok_o[:, None] * stride_o_tok + q_head_o[:, None] * stride_o_head + cols_o[None, :]
        gl.store(o_ptr, out.to(Out.dtype.element_ty), mask=ok_o[:, None])
    else:
        po_ptr = (Partial_O + q_tok_o[:, None] * stride_po_tok + q_head_o[:, None] * stride_po_head
                  + split * stride_po_split + cols_o[None, :])
        gl.store(po_ptr, out, mask=ok_o[:, None])
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_LAYOUT))
        gl.store(Partial_Lse + q_tok_o * stride_pl_tok + q_head_o * stride_pl_head + split, m_o + gl.log2(l_safe),
                 mask=ok_o)


@gluon.jit(do_not_specialize=["max_splits", "min_tokens_per_split", "prefix_trim_len", "draft_lookahead_len",
                              "stride_pl_head"])
def mla_ws_prefix_stage(
    Q, K_Buffer, K_Extend, Out, Qo_Indptr, Kv_Bounds, Kv_Table, Partial_O, Partial_Lse, qk_scale, k_scale, v_scale,
    max_splits, min_tokens_per_split, prefix_trim_len, draft_lookahead_len, stride_q_tok, stride_q_head,
    stride_k_slot, stride_k_head, stride_ke_tok, stride_ke_head, stride_o_tok, stride_o_head, stride_po_tok,
    stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head, Custom_Mask, Mask_Indptr,
    GROUP: gl.constexpr, BLOCK_H: gl.constexpr, L_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, LAZY_RESCALE: gl.constexpr, HAS_MASK: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr = 4, PRODUCER_REGS: gl.constexpr = 40, QK_AHEAD: gl.constexpr = False,
):
    ROWS: gl.constexpr = BLOCK_H * L_PAD
    gl.static_assert(ROWS == 64, "a program is one wgmma's 64 rows")
    TILE_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], Q.dtype.element_ty)
    HEAD_BLOCKS: gl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    pid_heads = gl.program_id(0)
    split = gl.program_id(1)
    batch = gl.program_id(2)
    kv_head = pid_heads // HEAD_BLOCKS
    head_block = pid_heads % HEAD_BLOCKS
    q_start = gl.load(Qo_Indptr + batch).to(gl.int64)
    q_len = (gl.load(Qo_Indptr + batch + 1) - gl.load(Qo_Indptr + batch)).to(gl.int32)
    table_start = gl.load(Kv_Bounds + batch).to(gl.int64)
    prefix_len = (gl.load(Kv_Bounds + batch + 1) - gl.load(Kv_Bounds + batch)).to(gl.int32) - prefix_trim_len
    split_len, num_written = _split_plan(prefix_len, max_splits, min_tokens_per_split, BLOCK_N)
    split_start = split * split_len
    split_end = gl.minimum(split_start + split_len, prefix_len)
    if split < num_written:
        q_nope_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, NOPE_DIM], TILE_SMEM)
        q_pe_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, PE_DIM], TILE_SMEM)
        k_nope_stages = gl.allocate_shared_memory(K_Buffer.dtype.element_ty, [NUM_STAGES, BLOCK_N, NOPE_DIM],
                                                  TILE_SMEM)
        k_pe_stages = gl.allocate_shared_memory(K_Buffer.dtype.element_ty, [NUM_STAGES, BLOCK_N, PE_DIM], TILE_SMEM)
        p_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, BLOCK_N], P_SMEM)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(i), count=1)
        num_tiles = gl.cdiv(split_end - split_start, BLOCK_N)
        draft_tiles = (split == num_written - 1).to(gl.int32)
        INDEX_WORDS: gl.constexpr = Kv_Table.dtype.element_ty.primitive_bitwidth // 32
        table_words = Kv_Table.to(gl.pointer_type(gl.int32)) + table_start * INDEX_WORDS
        head_off = kv_head.to(gl.int64) * stride_k_head
        ke_head = kv_head.to(gl.int64) * stride_ke_head
        gl.warp_specialize([
            (_consumers, (Q, Out, Partial_O, Partial_Lse, Custom_Mask, Mask_Indptr, q_nope_smem, q_pe_smem,
                          k_nope_stages, k_pe_stages, p_smem, ready, empty, q_start, q_len, kv_head, head_block,
                          batch, split, num_written, prefix_len, split_start, split_end, num_tiles, draft_tiles,
                          qk_scale, k_scale, v_scale, draft_lookahead_len, stride_q_tok, stride_q_head,
                          stride_o_tok, stride_o_head, stride_po_tok, stride_po_head, stride_po_split,
                          stride_pl_tok, stride_pl_head, GROUP, BLOCK_H, L_PAD, BLOCK_N, NUM_STAGES, HAS_MASK,
                          QK_AHEAD)),
            (_producer, (K_Buffer, K_Extend, table_words, k_nope_stages, k_pe_stages, ready, empty, split_start,
                         split_end, num_tiles, draft_tiles, head_off, stride_k_slot, q_start, q_len, ke_head,
                         stride_ke_tok, BLOCK_N, NUM_STAGES, INDEX_WORDS, PRODUCER_WARPS)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


@dataclasses.dataclass(frozen=True)
class SpikeKernel:
    """The spike kernel with its extra constexprs and options bound, launched as the module's
    launcher launches its Gluon stage (`kernels.gluon_prefix[grid](...)`)."""

    constexprs: dict[str, Any]
    maxnreg: int

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            kwargs.update(self.constexprs)
            return mla_ws_prefix_stage[grid](*args, maxnreg=self.maxnreg, **kwargs)
        return run


def _with_gluon(config: dict[str, Any], block_n: int, num_stages: int) -> dict[str, Any]:
    return {**config, "gluon": {**config["gluon"], "block_n": block_n, "num_stages": num_stages}}


def install(module: Any, block_n: int | None = None, num_stages: int = 2, producer_warps: int = 4,
            producer_regs: int = 40, qk_ahead: bool = False, maxnreg: int = 168) -> None:
    """Launch the spike in place of `module`'s Gluon prefix stage (same rows, grid and merge). With
    block_n, every table row's and the default's gluon section also become block_n / num_stages."""
    launcher = module.LAUNCHER
    spike = SpikeKernel({"PRODUCER_WARPS": producer_warps, "PRODUCER_REGS": producer_regs, "QK_AHEAD": qk_ahead},
                        maxnreg)
    launcher.kernels = dataclasses.replace(launcher.kernels, gluon_prefix=spike)
    launcher.gluon_enabled = True
    launcher.cached_setup.cache_clear()
    if block_n is not None:
        launcher.default_config = _with_gluon(dict(launcher.default_config), block_n, num_stages)
        launcher.replace_block_configs({
            arch: tuple((g, lo, hi, _with_gluon(dict(c), block_n, num_stages) if "gluon" in c else c)
                        for g, lo, hi, c in rows)
            for arch, rows in launcher.block_configs.items()})


def compile_offline(block_n: int = 64, num_stages: int = 2, has_mask: bool = False, **knobs: Any) -> Any:
    """Compile the spike for sm_90a on this machine (no GPU): returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"Q": "*bf16", "K_Buffer": "*bf16", "K_Extend": "*bf16", "Out": "*bf16", "Qo_Indptr": "*i64",
           "Kv_Bounds": "*i64", "Kv_Table": "*i64", "Partial_O": "*fp32", "Partial_Lse": "*fp32", "qk_scale": "fp32",
           "k_scale": "fp32", "v_scale": "fp32"}
    for name in ("max_splits", "min_tokens_per_split", "prefix_trim_len", "draft_lookahead_len", "stride_q_tok",
                 "stride_q_head", "stride_k_slot", "stride_k_head", "stride_ke_tok", "stride_ke_head", "stride_o_tok",
                 "stride_o_head", "stride_po_tok", "stride_po_head", "stride_po_split", "stride_pl_tok",
                 "stride_pl_head"):
        sig[name] = "i32"
    constexprs = {"GROUP": 16, "BLOCK_H": 16, "L_PAD": 4, "BLOCK_N": block_n, "NUM_STAGES": num_stages,
                  "LAZY_RESCALE": False, "HAS_MASK": has_mask, "PRODUCER_WARPS": knobs.get("producer_warps", 4),
                  "PRODUCER_REGS": knobs.get("producer_regs", 40), "QK_AHEAD": knobs.get("qk_ahead", False)}
    if has_mask:
        sig.update({"Custom_Mask": "*u8", "Mask_Indptr": "*i64"})
    else:
        sig.update({"Custom_Mask": "constexpr", "Mask_Indptr": "constexpr"})
        constexprs.update({"Custom_Mask": None, "Mask_Indptr": None})
    for name in constexprs:
        sig.setdefault(name, "constexpr")
    names = mla_ws_prefix_stage.arg_names
    # What the JIT gives contiguous tensors: 16-aligned pointers and strides (not the block table's).
    divisible = [n for n in sig if sig[n].startswith("*") or n.startswith("stride_")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = GluonASTSource(mla_ws_prefix_stage, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    log = io.StringIO()
    with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope():
        triton.knobs.compilation.always_compile = True
        triton.knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": 8, "num_stages": 1, "maxnreg": knobs.get("maxnreg", 168)})
    return compiled, log.getvalue()
