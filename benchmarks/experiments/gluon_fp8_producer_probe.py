"""Offline probe (CPU, Triton 3.6): can the Gluon MLA stage's producer warpgroup convert FP8 KV
for the consumers (issue 37, "the conversion off the MMA warps")? The producer of this probe
gathers a tile's e4m3 K rows (64 tokens x 576 bytes) through a token table with 16-byte global
loads into registers, converts them to bf16 and stores them into a bf16 stage ring that the
consumers' wgmma read as today; no e4m3 buffer in shared memory. Launched as the stage is: 12
warps at maxnreg 168 (a consumer warpgroup holding S and a 64 x 256 fp32 accumulator, a second
one holding the other half, the producer), with the producer given 96 registers (the stage's
producer has 40: PRODUCER_REGISTERS below changes it). Prints ptxas's registers and spills, the shared
memory, and the producer's SASS instructions a tile.

    python benchmarks/experiments/gluon_fp8_producer_probe.py
"""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

ROWS, BLOCK_N, NOPE, PE, STAGES = (gl.constexpr(v) for v in (64, 64, 512, 64, 2))
PRODUCER_REGISTERS = gl.constexpr(96)


@gluon.jit
def _consumer(q_smem, k_stages, pe_stages, ready, empty, out, n_tiles, COL0: gl.constexpr):
    """S = q.K^T of each tile, then acc += P.V[:, COL0:COL0 + 256] with P = S in bf16 (not a
    softmax: the probe is about the producer, the consumers only hold what they hold)."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    acc = gl.zeros([ROWS, 256], gl.float32, layout=ACC)
    for t in range(n_tiles):
        stage = t % STAGES
        mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
        fence_async_shared()
        k = k_stages.index(stage)
        s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_smem, k.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_smem.slice(0, PE, dim=1), pe_stages.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p = gl.convert_layout(s.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2))
        acc = warpgroup_mma(p, k.slice(COL0, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(stage), count=1)
    # A row sum only: the probe's consumers keep their registers for the loop.
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ACC))
    gl.store(out + COL0 + rows, gl.sum(acc, 1))


@gluon.jit
def _second(q_smem, k_stages, pe_stages, ready, empty, out, n_tiles):
    _consumer(q_smem, k_stages, pe_stages, ready, empty, out, n_tiles, 256)


@gluon.jit
def _producer(K, table, k_stages, pe_stages, ready, empty, n_tiles):
    """Per tile: the 64 tokens' pool rows through the table, then the 9 column blocks of 64
    (8 latent, 1 PE) loaded to registers first (two 16-byte loads a thread a block, all in
    flight), converted to bf16 and stored into the stage; each thread arrives on `ready` after
    its stores and a proxy fence."""
    LOAD: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 32 rows x 64 bytes an instruction
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, LOAD))
    slots = gl.load(table + offs_n)
    for t in range(n_tiles):
        stage = t % STAGES
        row = slots.to(gl.int64) * (NOPE + PE)
        src = K + row[:, None] + cols[None, :]
        b0 = gl.load(src)
        b1 = gl.load(src + 64)
        b2 = gl.load(src + 128)
        b3 = gl.load(src + 192)
        b4 = gl.load(src + 256)
        b5 = gl.load(src + 320)
        b6 = gl.load(src + 384)
        b7 = gl.load(src + 448)
        b8 = gl.load(src + 512)
        slots = gl.load(table + (t + 1) * BLOCK_N + offs_n)  # the next tile's slots, under this one's wait
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)
        k = k_stages.index(stage)
        k.slice(0, 64, dim=1).store(b0.to(gl.bfloat16))
        k.slice(64, 64, dim=1).store(b1.to(gl.bfloat16))
        k.slice(128, 64, dim=1).store(b2.to(gl.bfloat16))
        k.slice(192, 64, dim=1).store(b3.to(gl.bfloat16))
        k.slice(256, 64, dim=1).store(b4.to(gl.bfloat16))
        k.slice(320, 64, dim=1).store(b5.to(gl.bfloat16))
        k.slice(384, 64, dim=1).store(b6.to(gl.bfloat16))
        k.slice(448, 64, dim=1).store(b7.to(gl.bfloat16))
        pe_stages.index(stage).store(b8.to(gl.bfloat16))
        fence_async_shared()  # generic-proxy stores, read next by wgmma
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def fp8_producer_probe(Q, K, table, Out, n_tiles):
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, NOPE], SMEM)
    k_stages = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, NOPE], SMEM)
    pe_stages = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, PE], SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=128)  # every producer thread
        mbarrier.init(empty.index(i), count=2)  # one thread of each consumer
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, NOPE, layout=gl.SliceLayout(0, LOAD))
    q_smem.store(gl.load(Q + rows[:, None] * NOPE + cols[None, :]))
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([(_consumer, (q_smem, k_stages, pe_stages, ready, empty, Out, n_tiles, 0)),
                        (_second, (q_smem, k_stages, pe_stages, ready, empty, Out, n_tiles)),
                        (_producer, (K, table, k_stages, pe_stages, ready, empty, n_tiles))],
                       [4, 4], [208, PRODUCER_REGISTERS])


def main() -> None:
    signature = {"Q": "*bf16", "K": "*fp8e4nv", "table": "*i32", "Out": "*fp32", "n_tiles": "i32"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    source = GluonASTSource(fn=fp8_producer_probe, signature=signature, constexprs={}, attrs=aligned)
    triton.knobs.compilation.always_compile = True
    options = {"num_warps": 4, "num_stages": 1, "maxnreg": 168}
    log = []
    with triton.knobs.nvidia.scope():
        triton.knobs.nvidia.dump_ptxas_log = True
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        log = buf.getvalue()
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    print(f"registers {regs.group(1) if regs else '?'}, spill stores/loads {spill.groups() if spill else '?'}, "
          f"shared {compiled.metadata.shared} B")
    ptx = compiled.asm["ptx"]
    print("cvt instructions in the PTX:", len(re.findall(r"\bcvt\.", ptx)),
          "| e4m3 conversions:", len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
          "| st.shared:", len(re.findall(r"\bst\.shared", ptx)), "| ld.global:", len(re.findall(r"\bld\.global", ptx)))


if __name__ == "__main__":
    main()
