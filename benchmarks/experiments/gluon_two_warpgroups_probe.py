"""Offline probe (CPU, Triton 3.6): can a two-warpgroup Gluon kernel (8 warps, maxnreg 256) hold,
in each warpgroup, a 64 x 256 fp32 half of O, a 64 x 64 S and its P, with S and P.V as wgmma?
That is the register budget of FlashMLA's seesaw schedule (docs/perf-notes.md, "Gluon prefix
stage"). Prints ptxas's registers and spills, shared memory and the setmaxnreg counts.

    python benchmarks/experiments/gluon_two_warpgroups_probe.py
"""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _half(q_smem, k_smem, p_smem, out, COL0: gl.constexpr, n_tiles):
    """One warpgroup: per tile S = q.k^T, the online softmax, P into its shared slot, then
    acc = alpha x acc + P.V over the 256 columns from COL0."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    acc = gl.zeros([64, 256], gl.float32, layout=ACC)
    m_i = gl.full([64], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_LAYOUT))
    p_slot = p_smem.index(COL0 // 256)
    for t in range(n_tiles):
        k_tile = k_smem.index(t % 2)
        s = gl.zeros([64, 64], gl.float32, layout=S_LAYOUT)
        s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        p_slot.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, ACC))[:, None]
        acc = warpgroup_mma(p_slot, k_tile.slice(COL0, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, ACC))
    l_acc = gl.convert_layout(l_i, gl.SliceLayout(1, ACC))
    gl.store(out + rows[:, None] * 512 + COL0 + cols[None, :], acc / l_acc[:, None])


@gluon.jit
def _second_half(q_smem, k_smem, p_smem, out, n_tiles):
    _half(q_smem, k_smem, p_smem, out, 256, n_tiles)


@gluon.jit
def two_warpgroups(Q, K, Out, n_tiles):
    """q and two K tiles into shared memory, then both halves of O, one warpgroup each."""
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], SMEM)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], SMEM)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SMEM)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD))
    for i in gl.static_range(4):
        offsets = rows[:, None] * 512 + i * 128 + cols[None, :]
        q_smem.slice(i * 128, 128, dim=1).store(gl.load(Q + offsets))
        for stage in gl.static_range(2):
            k_smem.index(stage).slice(i * 128, 128, dim=1).store(gl.load(K + offsets))
    fence_async_shared()
    gl.thread_barrier()
    gl.warp_specialize([(_half, (q_smem, k_smem, p_smem, Out, 0, n_tiles)),
                        (_second_half, (q_smem, k_smem, p_smem, Out, n_tiles))], [4], [256])


def main() -> None:
    signature = {"Q": "*bf16", "K": "*bf16", "Out": "*fp32", "n_tiles": "i32"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    source = GluonASTSource(fn=two_warpgroups, signature=signature, constexprs={}, attrs=aligned)
    triton.knobs.nvidia.dump_ptxas_log = True  # registers and spills, printed by the compile
    triton.knobs.compilation.always_compile = True
    options = {"num_warps": 4, "num_stages": 1, "maxnreg": 256}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    counts = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])))
    print(f"shared {compiled.metadata.shared} B, setmaxnreg {counts}")


if __name__ == "__main__":
    main()
