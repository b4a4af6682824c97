"""Experiment (lost): a Gluon sm_90 prefix stage for GQA 256 with e4m3 KV: cp.async e4m3 stages, converted to fp16 through registers into the wgmma operand buffers. H200, group 16, batch 64, prefix 16K, L 4: 269.7 us against the Triton stage's 264.2 (docs/perf-notes.md)."""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _split_plan(prefix_len, max_splits, min_tokens_per_split, block_n):
    num_splits = gl.minimum(gl.maximum(gl.cdiv(prefix_len, min_tokens_per_split), 1), max_splits)
    split_len = gl.maximum(gl.cdiv(gl.cdiv(prefix_len, num_splits), block_n) * block_n, block_n)
    return split_len, gl.maximum(gl.cdiv(prefix_len, split_len), 1)


@gluon.jit
def _slots(table_words, tok, INDEX_WORDS: gl.constexpr):
    return gl.load(table_words + INDEX_WORDS * tok, mask=tok >= 0, other=0)


@gluon.jit
def _issue(k_dst, v_dst, K_Buffer, V_Buffer, slots, k_head_off, v_head_off, stride_k_slot, stride_v_slot,
           D: gl.constexpr, LOAD: gl.constexpr):
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    s64 = slots.to(gl.int64)
    async_copy.async_copy_global_to_shared(k_dst, K_Buffer + (s64 * stride_k_slot + k_head_off)[:, None] + cols[None, :])
    async_copy.async_copy_global_to_shared(v_dst, V_Buffer + (s64 * stride_v_slot + v_head_off)[:, None] + cols[None, :])


@gluon.jit
def _attend(q_smem, k16, v16, p_smem, m_i, l_cols, acc, limit, score_scale,
            ROWS: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, BLOCK_N: gl.constexpr):
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_LAYOUT)
    s = warpgroup_mma(q_smem, k16.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    s = gl.where(cols[None, :] < limit[:, None], s * score_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_ref)
    p = gl.exp2(s - m_ref[:, None])
    l_cols = l_cols * alpha[:, None] + p
    p_smem.store(p.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    acc = warpgroup_mma(p_smem, v16, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return m_new, l_cols, acc


@gluon.jit
def gqa_fp8_prefix_gluon(
    Q, K_Buffer, V_Buffer, K_Extend, V_Extend, O, Qo_Indptr, Kv_Bounds, Kv_Table, Partial_O, Partial_Lse,
    qk_scale, k_scale, v_scale, max_splits, min_tokens_per_split,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_ke_tok, stride_ke_head, stride_ve_tok, stride_ve_head,
    stride_o_tok, stride_o_head, stride_po_tok, stride_po_head, stride_po_split, stride_pl_tok, stride_pl_head,
    GROUP: gl.constexpr, BLOCK_H: gl.constexpr, L_PAD: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, D: gl.constexpr,
):
    ROWS: gl.constexpr = BLOCK_H * L_PAD
    gl.static_assert(ROWS == 64)
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D // 2, 16])
    # e4m3 copies: 16 elements (16 bytes) a thread; converted tiles: 8 fp16 a thread a vector.
    LOAD8: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [8, 1], [1, 0])
    ROW16: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    F8_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    T16_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], gl.float16)

    HEAD_BLOCKS: gl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    pid_heads = gl.program_id(0)
    split = gl.program_id(1)
    batch = gl.program_id(2)
    kv_head = pid_heads // HEAD_BLOCKS
    head_block = pid_heads % HEAD_BLOCKS

    q_start = gl.load(Qo_Indptr + batch).to(gl.int64)
    q_len = (gl.load(Qo_Indptr + batch + 1) - gl.load(Qo_Indptr + batch)).to(gl.int32)
    table_start = gl.load(Kv_Bounds + batch).to(gl.int64)
    prefix_len = (gl.load(Kv_Bounds + batch + 1) - gl.load(Kv_Bounds + batch)).to(gl.int32)
    split_len, num_written = _split_plan(prefix_len, max_splits, min_tokens_per_split, BLOCK_N)
    split_start = split * split_len
    split_end = gl.minimum(split_start + split_len, prefix_len)
    if split < num_written:
        q_smem = gl.allocate_shared_memory(gl.float16, [ROWS, D], T16_SMEM)
        k8_stages = gl.allocate_shared_memory(K_Buffer.dtype.element_ty, [NUM_STAGES, BLOCK_N, D], F8_SMEM)
        v8_stages = gl.allocate_shared_memory(K_Buffer.dtype.element_ty, [NUM_STAGES, BLOCK_N, D], F8_SMEM)
        k16 = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D], T16_SMEM)
        v16 = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D], T16_SMEM)
        p_smem = gl.allocate_shared_memory(gl.float16, [ROWS, BLOCK_N], P_SMEM)

        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ROW16))
        head = head_block * BLOCK_H + rows // L_PAD
        row_ok = (head < GROUP) & (rows % L_PAD < q_len)
        q_row = (q_start + rows % L_PAD) * stride_q_tok + (kv_head * GROUP + head).to(gl.int64) * stride_q_head
        cols16 = gl.arange(0, D, layout=gl.SliceLayout(0, ROW16))
        q_smem.store(gl.load(Q + q_row[:, None] + cols16[None, :], mask=row_ok[:, None], other=0.0).to(gl.float16))

        k_descale = gl.load(k_scale)
        v_descale = gl.load(v_scale)
        score_scale = qk_scale * k_descale
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
        l_cols = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_LAYOUT)
        acc = gl.zeros([ROWS, D], gl.float32, layout=O_LAYOUT)

        INDEX_WORDS: gl.constexpr = Kv_Table.dtype.element_ty.primitive_bitwidth // 32
        table_words = Kv_Table.to(gl.pointer_type(gl.int32)) + table_start * INDEX_WORDS
        k_head_off = kv_head.to(gl.int64) * stride_k_head
        v_head_off = kv_head.to(gl.int64) * stride_v_head
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD8))
        num_tiles = gl.cdiv(split_end - split_start, BLOCK_N)
        for i in gl.static_range(NUM_STAGES - 1):
            if i < num_tiles:
                _issue(k8_stages.index(i), v8_stages.index(i), K_Buffer, V_Buffer,
                       _slots(table_words, gl.minimum(split_start + i * BLOCK_N + offs_n, split_end - 1), INDEX_WORDS),
                       k_head_off, v_head_off, stride_k_slot, stride_v_slot, D, LOAD8)
            async_copy.commit_group()
        next_slots = _slots(table_words, gl.minimum(split_start + (NUM_STAGES - 1) * BLOCK_N + offs_n, split_end - 1), INDEX_WORDS)
        for t in range(num_tiles):
            async_copy.wait_group(NUM_STAGES - 2)
            gl.thread_barrier()  # every thread's e4m3 copies of tile t are in; every warp is past tile t - 1
            ahead = t + NUM_STAGES - 1
            if ahead < num_tiles:
                _issue(k8_stages.index(ahead % NUM_STAGES), v8_stages.index(ahead % NUM_STAGES), K_Buffer, V_Buffer,
                       next_slots, k_head_off, v_head_off, stride_k_slot, stride_v_slot, D, LOAD8)
            async_copy.commit_group()
            next_slots = _slots(table_words, gl.minimum(split_start + (ahead + 1) * BLOCK_N + offs_n, split_end - 1), INDEX_WORDS)
            stage = t % NUM_STAGES
            # e4m3 -> fp16 (native and exact), into the wgmma operand buffers.
            k16.store(k8_stages.index(stage).load(ROW16).to(gl.float16))
            v16.store(v8_stages.index(stage).load(ROW16).to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            limit = gl.full([ROWS], 0, gl.int32, layout=gl.SliceLayout(1, S_LAYOUT)) + (split_end - split_start - t * BLOCK_N)
            m_i, l_cols, acc = _attend(q_smem, k16, v16, p_smem, m_i, l_cols, acc, limit, score_scale,
                                       ROWS, S_LAYOUT, O_LAYOUT, BLOCK_N)
        async_copy.wait_group(0)
        # The prefix's P.V is descaled once, here; the draft tile's V is not quantized.
        acc = acc * v_descale

        if split == num_written - 1:
            gl.thread_barrier()
            j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROW16))
            j_ok = (j < q_len)[:, None]
            ke = K_Extend + ((q_start + j) * stride_ke_tok + kv_head.to(gl.int64) * stride_ke_head)[:, None] + cols16[None, :]
            ve = V_Extend + ((q_start + j) * stride_ve_tok + kv_head.to(gl.int64) * stride_ve_head)[:, None] + cols16[None, :]
            k16.store(gl.load(ke, mask=j_ok, other=0.0).to(gl.float16))
            v16.store(gl.load(ve, mask=j_ok, other=0.0).to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            draft_pos = gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_LAYOUT)) % L_PAD
            m_i, l_cols, acc = _attend(q_smem, k16, v16, p_smem, m_i, l_cols, acc, gl.minimum(draft_pos + 1, q_len),
                                       qk_scale, ROWS, S_LAYOUT, O_LAYOUT, BLOCK_N)

        rows_o = gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
        cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, O_LAYOUT))
        head_o = head_block * BLOCK_H + rows_o // L_PAD
        ok_o = (head_o < GROUP) & (rows_o % L_PAD < q_len)
        q_head_o = (kv_head * GROUP + head_o).to(gl.int64)
        q_tok_o = q_start + rows_o % L_PAD
        l_i = gl.convert_layout(gl.sum(l_cols, 1), gl.SliceLayout(1, O_LAYOUT))
        l_safe = gl.where(ok_o, l_i, 1.0)
        out = acc / l_safe[:, None]
        if num_written == 1:
            gl.store(O + q_tok_o[:, None] * stride_o_tok + q_head_o[:, None] * stride_o_head + cols_o[None, :],
                     out.to(O.dtype.element_ty), mask=ok_o[:, None])
        else:
            gl.store(Partial_O + q_tok_o[:, None] * stride_po_tok + q_head_o[:, None] * stride_po_head
                     + split * stride_po_split + cols_o[None, :], out, mask=ok_o[:, None])
            m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_LAYOUT))
            gl.store(Partial_Lse + q_tok_o * stride_pl_tok + q_head_o * stride_pl_head + split,
                     m_o + gl.log2(l_safe), mask=ok_o)
