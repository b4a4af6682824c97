"""Prototype (dev tool): split V's columns over programs, the q.k computed by each.

The MLA prefix stage holds a 64 x 512 fp32 accumulator: two warpgroups split it by columns,
and then also split the 64 x BLOCK_N score tile, whose row max and sum cross warpgroups
through shared memory every tile. Here DV_PARTS programs each own 512 / DV_PARTS columns
of V and compute the whole q.k themselves (more flops, no cross-warpgroup softmax); the
programs of one split sit next to each other in the grid, so their K reads meet in L2.
For GQA (separate V) the same split halves each program's V loads and accumulator.

Times the prefix stage alone (no draft tile, no merge) against the generated module's
whole launch; checks the partials against a float32 reference. Usage on the H200:
python benchmarks/proto_dv_split.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import torch
import triton
import triton.language as tl

import kgen
from kgen.spec import load_layouts
from kgen.testing import make_case


@triton.jit
def _proto_prefix(
    Q,
    K,
    V,
    Kv_Indptr,
    Kv_Indices,
    PO,
    PL,
    qk_scale,
    split_len,
    sq_tok,
    sq_head,
    sk_tok,
    sv_tok,
    spo_tok,
    spo_head,
    spo_split,
    spl_tok,
    spl_head,
    GROUP: tl.constexpr,
    L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    DPE: tl.constexpr,
    DV_PARTS: tl.constexpr,
    SEPARATE_V: tl.constexpr,
):
    ROWS: tl.constexpr = GROUP * L
    DVP: tl.constexpr = D // DV_PARTS
    part = tl.program_id(0)
    split = tl.program_id(1)
    batch = tl.program_id(2)
    kv_start = tl.load(Kv_Indptr + batch).to(tl.int64)
    prefix_len = tl.load(Kv_Indptr + batch + 1) - tl.load(Kv_Indptr + batch)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, prefix_len)
    rows = tl.arange(0, ROWS)
    head = rows // L
    q_tok = batch * L + rows % L
    q_ptr = Q + q_tok[:, None].to(tl.int64) * sq_tok + head[:, None] * sq_head
    own = part * DVP + tl.arange(0, DVP)
    if SEPARATE_V:
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + offs_d[None, :])
    else:
        q = tl.load(q_ptr + own[None, :])
        if DV_PARTS == 2:
            other = (1 - part) * DVP + tl.arange(0, DVP)
            q_other = tl.load(q_ptr + other[None, :])
    if DPE > 0:
        offs_pe = D + tl.arange(0, DPE)
        q_pe = tl.load(q_ptr + offs_pe[None, :])
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DVP], dtype=tl.float32)
    offs_next = split_start + tl.arange(0, BLOCK_N)
    page_next = tl.load(Kv_Indices + kv_start + offs_next, mask=offs_next < split_end, other=0)
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        page = page_next.to(tl.int64)
        offs_next = offs_n + BLOCK_N
        page_next = tl.load(Kv_Indices + kv_start + offs_next, mask=offs_next < split_end, other=0)
        k_ptr = K + page * sk_tok
        if SEPARATE_V:
            k = tl.load(k_ptr[:, None] + offs_d[None, :])
            qk = tl.dot(q, tl.trans(k))
        else:
            k = tl.load(k_ptr[:, None] + own[None, :])
            qk = tl.dot(q, tl.trans(k))
            if DV_PARTS == 2:
                k_other = tl.load(k_ptr[:, None] + other[None, :])
                qk += tl.dot(q_other, tl.trans(k_other))
        if DPE > 0:
            k_pe = tl.load(k_ptr[:, None] + offs_pe[None, :])
            qk += tl.dot(q_pe, tl.trans(k_pe))
        qk = qk * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if SEPARATE_V:
            v = tl.load(V + page[:, None] * sv_tok + own[None, :])
        else:
            v = k
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    po = PO + q_tok[:, None].to(tl.int64) * spo_tok + head[:, None] * spo_head + split * spo_split + own[None, :]
    tl.store(po, acc / l_i[:, None])
    if part == 0:
        tl.store(PL + q_tok * spl_tok + head * spl_head + split, m_i + tl.log2(l_i))


def launch(case, group, L, layout, splits, dv_parts, bn, warps, stages, po, pl):
    a = layout.attention
    batch = case.kv_indptr.numel() - 1
    prefix = case.kv_indices.numel() // batch
    split_len = triton.cdiv(triton.cdiv(prefix, splits), bn) * bn
    separate = a.v_source != "k_latent"
    k = case.k_buffer.view(case.k_buffer.shape[0], -1)
    v = case.v_buffer.reshape(case.v_buffer.shape[0], -1) if separate else k
    scale = (1.0 / a.qk_dim**0.5) * 1.4426950408889634
    _proto_prefix[(dv_parts, splits, batch)](
        case.q,
        k,
        v,
        case.kv_indptr,
        case.kv_indices,
        po,
        pl,
        scale,
        split_len,
        case.q.stride(0),
        case.q.stride(1),
        k.stride(0),
        v.stride(0),
        po.stride(0),
        po.stride(1),
        po.stride(2),
        pl.stride(0),
        pl.stride(1),
        GROUP=group,
        L=L,
        BLOCK_N=bn,
        D=a.nope_dim,
        DPE=a.pe_dim,
        DV_PARTS=dv_parts,
        SEPARATE_V=separate,
        num_warps=warps,
        num_stages=stages,
    )


def prefix_reference(case, layout, group, L):
    """Prefix-only attention (no draft) in float32, per request."""
    a = layout.attention
    batch = case.kv_indptr.numel() - 1
    out = []
    for b in range(batch):
        idx = case.kv_indices[case.kv_indptr[b] : case.kv_indptr[b + 1]].long()
        k = case.k_buffer[idx, 0].float()
        v = case.v_buffer[idx, 0].float()
        q = case.q[b * L : (b + 1) * L].float()  # L x H x D
        s = torch.einsum("lhd,nd->lhn", q, k) / a.qk_dim**0.5
        out.append(torch.einsum("lhn,nd->lhd", s.softmax(-1), v))
    return torch.cat(out)


def merge(po, pl, splits):
    w = torch.softmax(pl[..., :splits] * 0.6931471805599453, dim=-1)
    return (po[:, :, :splits] * w[..., None]).sum(2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    specs = load_layouts()
    results = []
    cases = [
        ("mla_absorbed_512_64", 16, 64, 16384),
        ("mla_absorbed_512_64", 16, 64, 4096),
        ("qwen3_5_gqa256", 16, 64, 16384),
    ]
    for name, group, batch, prefix in cases:
        spec, L = specs[name], 4
        a = spec.attention
        case = make_case(spec, [prefix] * batch, [L] * batch, group, device="cuda", seed=1)
        mod = kgen.load(name, "bfloat16")
        base = (
            triton.testing.do_bench_cudagraph(
                functools.partial(mod.launch, *case.launch_args()), rep=150, return_mode="median"
            )
            * 1e3
        )
        print(f"{name} g{group} b{batch} p{prefix}: kgen launch {base:.1f} us", flush=True)
        results.append(dict(case=f"{name} p{prefix}", variant="kgen", us=base))
        small = make_case(spec, [1024, 1024], [L, L], group, device="cuda", seed=2)
        ref = prefix_reference(small, spec, group, L)
        grid = itertools.product((1, 2), (32, 64), (4, 8), (2, 3), (1, 2))
        for dv_parts, bn, warps, stages, splits_per in grid:
            width = a.qk_dim + (a.v_head_dim // dv_parts if a.v_source != "k_latent" else 0)
            if 2 * (group * L * a.qk_dim + stages * bn * width) > 232448 or (
                dv_parts == 1 and warps == 4 and a.v_head_dim > 256
            ):
                continue  # over the shared memory, or a 64 x 512 accumulator in one warpgroup
            splits = max(1, (132 * splits_per) // (batch * dv_parts))
            po = torch.empty(batch * L, group, splits, a.v_head_dim, device="cuda")
            pl = torch.empty(batch * L, group, splits, device="cuda")
            tag = f"dv{dv_parts} bn{bn} w{warps} st{stages} splits{splits}"
            try:
                spo = torch.empty(2 * L, group, 2, a.v_head_dim, device="cuda")
                spl = torch.empty(2 * L, group, 2, device="cuda")
                launch(small, group, L, spec, 2, dv_parts, bn, warps, stages, spo, spl)
                err = ((merge(spo, spl, 2) - ref).norm() / ref.norm()).item()
                us = (
                    triton.testing.do_bench_cudagraph(
                        functools.partial(launch, case, group, L, spec, splits, dv_parts, bn, warps, stages, po, pl),
                        rep=100,
                        return_mode="median",
                    )
                    * 1e3
                )
            except Exception as exc:  # noqa: BLE001
                print(f"  {tag}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            print(f"  {tag}: {us:8.1f} us  err {err:.1e}", flush=True)
            results.append(dict(case=f"{name} p{prefix}", variant=tag, us=us, err=err))
        case = None
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "proto.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nBEST")
    for c in dict.fromkeys(r["case"] for r in results):
        rows = sorted((r for r in results if r["case"] == c), key=lambda r: r["us"])
        print(c, " | ".join(f"{r['variant']} {r['us']:.1f}" for r in rows[:6]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
