"""Kernel-variant experiments on a GPU (dev tool, not the benchmark of record).

Patches a generated module's text into variants, times each on a few cases, and writes a
table. Usage on the H200: python benchmarks/exp_variants.py --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch
import triton

import kgen
from kgen.bench.cases import Case
from kgen.bench.cases import min_bytes as bench_min_bytes
from kgen.build import build_one
from kgen.passes.context import load_context
from kgen.spec import load_layouts
from kgen.testing import make_case, relative_error

SPECS = load_layouts()

LOOP_HEAD = "        for start_n in range(split_start, split_end, BLOCK_N):\n"


def unmasked_full_tiles(text: str) -> str:
    """Two loops: tiles wholly inside the split without masks, then the partial last tile."""
    if "full_end = split_start" in text:
        raise ValueError("unmasked_full_tiles: this module already splits its loop (plan decision 'full tiles')")
    start = text.index(LOOP_HEAD)
    end = text.index("            m_i = m_new\n", start) + len("            m_i = m_new\n")
    masked = text[start:end]
    body = masked[len(LOOP_HEAD):]
    free = (body.replace("            n_ok = offs_n < split_end\n", "")
            .replace(", mask=n_ok[:, None], other=0.0)", ")")
            .replace(", mask=n_ok[:, None] & dpe_ok[None, :], other=0.0)", ", mask=dpe_ok[None, :], other=0.0)")
            .replace("qk = tl.where(n_ok[None, :], qk * score_scale, float(\"-inf\"))", "qk = qk * score_scale"))
    assert "n_ok" not in free.replace("d_ok", "").replace("dv_ok", ""), free
    new = ("        full_end = split_start + (split_end - split_start) // BLOCK_N * BLOCK_N\n"
           "        for start_n in range(split_start, full_end, BLOCK_N):\n" + free
           + "        for start_n in range(full_end, split_end, BLOCK_N):\n" + body)
    return text[:start] + new + text[end:]


# "lazy" in a variant list is the block-config switch lazy_rescale (in the template since
# session 3), not a text patch: lazy_configs() turns it into configs.
LAZY = "lazy"


def lazy_configs(module, variants: tuple[str, ...], configs: tuple, group: int, batch: int) -> tuple[tuple, tuple]:
    """Variants without "lazy", and the configs with lazy_rescale on when it was named."""
    if LAZY not in variants:
        return variants, configs
    arch = module._device_info("cuda", None)[0] if torch.cuda.is_available() else "interpreter"
    configs = tuple({**(c or module.select_config(arch, group, batch)), "lazy_rescale": True} for c in configs)
    return tuple(v for v in variants if v != LAZY), configs


QK_AHEAD_OLD = """        offs_first = tl.minimum(split_start + tl.arange(0, BLOCK_N), split_end - 1)
        page_next = tl.load(Kv_Table + table_start + offs_first // PAGE_SIZE, mask=offs_first >= 0, other=0)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < split_end
            # Rows past the split read its last token again: finite data, scored -inf below.
            tok = tl.minimum(offs_n, split_end - 1)
            page = page_next.to(tl.int64)
            page_next = tl.load(Kv_Table + table_start + tl.minimum(offs_n + BLOCK_N, split_end - 1) // PAGE_SIZE)
            # int64 addresses: a pool can hold more than 2**31 elements.
            k_row_ptr = K_Buffer + page * stride_k_page + (tok % PAGE_SIZE) * stride_k_slot + kv_head * stride_k_head
            k = tl.load(k_row_ptr[:, None] + offs_d[None, :])
            qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
            # Scores live in the log2 domain: exp2 is cheaper than exp.
            qk = tl.where(n_ok[None, :], qk * score_scale, float("-inf"))
"""
QK_AHEAD_NEW = """        # Software-pipelined by hand (FA3's intra-warpgroup overlap): tile i+1's q.k is issued
        # before tile i's softmax, so the tensor cores work while the softmax runs.
        tok_k = tl.minimum(split_start + tl.arange(0, BLOCK_N), split_end - 1)
        page_k = tl.load(Kv_Table + table_start + tok_k // PAGE_SIZE, mask=tok_k >= 0, other=0).to(tl.int64)
        k_row_ptr = K_Buffer + page_k * stride_k_page + (tok_k % PAGE_SIZE) * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_row_ptr[:, None] + offs_d[None, :], mask=(tok_k >= 0)[:, None], other=0.0)
        qk_next = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
        page_v = page_k
        tok_next = tl.minimum(split_start + BLOCK_N + tl.arange(0, BLOCK_N), split_end - 1)
        page_next = tl.load(Kv_Table + table_start + tok_next // PAGE_SIZE, mask=tok_next >= 0, other=0)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < split_end
            tok = tl.minimum(offs_n, split_end - 1)
            qk = qk_next
            # Tile i+1 (clamped: past the split it re-reads the last token, never used).
            page_k = page_next.to(tl.int64)
            tok_k = tl.minimum(offs_n + BLOCK_N, split_end - 1)
            page_next = tl.load(Kv_Table + table_start + tl.minimum(offs_n + 2 * BLOCK_N, split_end - 1) // PAGE_SIZE)
            k_row_ptr = (K_Buffer + page_k * stride_k_page + (tok_k % PAGE_SIZE) * stride_k_slot
                         + kv_head * stride_k_head)
            k = tl.load(k_row_ptr[:, None] + offs_d[None, :])
            qk_next = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
            page = page_v
            page_v = page_k
            # Scores live in the log2 domain: exp2 is cheaper than exp.
            qk = tl.where(n_ok[None, :], qk * score_scale, float("-inf"))
"""


def qk_ahead(text: str) -> str:
    """Issue tile i+1's q.k before tile i's softmax (hand software pipelining)."""
    assert QK_AHEAD_OLD in text, "qk_ahead: the loop's head changed"
    return text.replace(QK_AHEAD_OLD, QK_AHEAD_NEW)


def no_pdl(text: str) -> str:
    """Launch without programmatic dependent launch (the A/B for _launch_options)."""
    old = '    return {"launch_pdl": True} if use_pdl else {}\n'
    assert old in text, "no_pdl: _launch_options changed"
    return text.replace(old, "    return {}\n")


def pdl_early_trigger(text: str) -> str:
    """The prefix stage calls gdc_launch_dependents right after its gdc_wait (dropped: 9-10 us
    slower at batch 16, see docs/perf-notes.md; kept to reproduce)."""
    old = "        gdc_wait()\n\n    q_start, q_len, table_start, prefix_len"
    assert text.count(old) == 1, "pdl_early_trigger: the prefix stage's wait changed"
    text = text.replace("from triton.language.extra.cuda import gdc_wait",
                        "from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait")
    new = old.replace("gdc_wait()\n", "gdc_wait()\n        gdc_launch_dependents()\n")
    return text.replace(old, new)


def kq_transposed(text: str) -> str:
    """S^T = K.Q^T: the converted e4m3 K tile as wgmma's register A operand (dropped: see
    docs/perf-notes.md; kept to reproduce)."""
    old = "            qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))\n"
    assert old in text, "kq_transposed: the loop's q.k changed"
    return text.replace(old, "            qk = tl.trans(tl.dot(k.to(DOT_DTYPE), tl.trans(q)))\n")


def fp16_qk(text: str) -> str:
    """Experiment e4m3_qk built, its e4m3 q.k never taken (K converted to fp16 at every row count)."""
    old = "_E4M3_QK_MIN_ROWS = 64\n"
    assert old in text, "fp16_qk: the module has no e4m3 q.k threshold"
    return text.replace(old, "_E4M3_QK_MIN_ROWS = 1 << 30\n")


def precise_qk(text: str) -> str:
    """The e4m3 q.k with its wgmma accumulator promoted to fp32 every 64 products (Triton's
    max_num_imprecise_acc; by default Hopper's e4m3 wgmma keeps fewer than fp32's bits)."""
    old = "qk = tl.dot(q_hi, k_op, tl.dot(q_lo, k_op))"
    assert old in text, "precise_qk: the module has no e4m3 q.k"
    return text.replace(old, "qk = tl.dot(q_hi, k_op, tl.dot(q_lo, k_op, max_num_imprecise_acc=64), "
                             "max_num_imprecise_acc=64)")


def no_draft_probe(text: str) -> str:
    """TIMING PROBE, WRONG OUTPUT: the prefix stage without its draft tile. Bounds what moving
    the draft tile out of the prefix programs (into the merge, say) could gain: offline, MLA
    BF16 at 64-token tiles / 8 warps / 2 stages spills 584 B a thread with it, 92 without."""
    start = text.index("        if split == num_written - 1:\n            # Draft tile")
    end = text.index("            m_i = m_new\n", start) + len("            m_i = m_new\n")
    return text[:start] + text[end:]


def draft_after(text: str) -> str:
    """GQA: the draft tile after the prefix loop at every row count (the placement before
    session 6, when 32-row programs took it first)."""
    old = "_DRAFT_FIRST_ROWS = (32,)\n"
    assert old in text, "draft_after: the module has no row-dependent draft tile"
    return text.replace(old, "_DRAFT_FIRST_ROWS = ()\n")


def draft_first64(text: str) -> str:
    """GQA: 64-row programs (group 16 at L4) also take the draft tile before the loop."""
    old = "_DRAFT_FIRST_ROWS = (32,)\n"
    assert old in text, "draft_first64: the module has no row-dependent draft tile"
    return text.replace(old, "_DRAFT_FIRST_ROWS = (32, 64)\n")


def pdl_late_trigger(text: str) -> str:
    """Release the merge launch once a prefix program's loop and draft tile are done, before
    its partial stores (an early trigger at the start cost 9-10 us at batch 16)."""
    old = "        l_safe = tl.where(row_ok, l_i, 1.0)\n"
    assert text.count(old) == 1, "pdl_late_trigger: the prefix stage's epilogue changed"
    text = text.replace("from triton.language.extra.cuda import gdc_wait",
                        "from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait")
    return text.replace(old, "        if USE_PDL:\n            gdc_launch_dependents()\n" + old)


def no_merge_probe(text: str) -> str:
    """TIMING PROBE, WRONG OUTPUT: the merge launch skipped (the prefix stage alone)."""
    old = "    if max_splits == 1:\n"
    assert text.count(old) == 1, "no_merge_probe: the launcher's merge guard changed"
    return text.replace(old, "    if True:\n")


def no_prefix_loop_probe(text: str) -> str:
    """TIMING PROBE, WRONG OUTPUT: every split's prefix loop empty (no K/V tile read), the
    rest (launches, q, draft tile, partial stores, merge) as shipped."""
    old = "    split_end = tl.minimum(split_start + split_len, prefix_len)\n"
    assert text.count(old) == 1, "no_prefix_loop_probe: the split bounds changed"
    return text.replace(old, "    split_end = tl.minimum(split_start + split_len, prefix_len)\n"
                             "    loop_end = split_start\n").replace(
        "        for start_n in range(split_start, split_end, BLOCK_N):\n",
        "        for start_n in range(split_start, loop_end, BLOCK_N):\n")


TRANSPOSED_OLD = """            k = tl.load(k_row_ptr[:, None] + offs_d[None, :])
            qk = tl.dot(q, tl.trans(k.to(DOT_DTYPE)))
            # Scores live in the log2 domain: exp2 is cheaper than exp.
            qk = tl.where(n_ok[None, :], qk * score_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            if LAZY_RESCALE:
                # A row's max moves only when it grows by more than 2**8 (p stays <= 256,
                # exact in fp32), so most tiles skip the ROWS x D_v accumulator multiply.
                grow = m_new > m_i + 8.0
                m_new = tl.where(grow, m_new, m_i)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if LAZY_RESCALE:
                if tl.max(grow.to(tl.int32), 0) > 0:
                    acc = acc * alpha[:, None]
            v_row_ptr = V_Buffer + page * stride_v_page + (tok % PAGE_SIZE) * stride_v_slot + kv_head * stride_v_head
            v = tl.load(v_row_ptr[:, None] + offs_dv[None, :])
            pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE))
            if LAZY_RESCALE:
                acc += pv
            else:
                acc = acc * alpha[:, None] + pv
            m_i = m_new
"""
TRANSPOSED_NEW = """            k = tl.load(k_row_ptr[:, None] + offs_d[None, :])
            # Transposed: tokens are the wgmma's M (64), the ROWS its N, so a 32- or 16-row
            # program still runs wgmma and q^T waits in shared memory, not in registers.
            qk_t = tl.dot(k.to(DOT_DTYPE), q_t)
            qk_t = tl.where(n_ok[:, None], qk_t * score_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk_t, 0))
            if LAZY_RESCALE:
                grow = m_new > m_i + 8.0
                m_new = tl.where(grow, m_new, m_i)
            alpha = tl.exp2(m_i - m_new)
            p_t = tl.exp2(qk_t - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p_t, 0)
            if LAZY_RESCALE:
                if tl.max(grow.to(tl.int32), 0) > 0:
                    acc_t = acc_t * alpha[None, :]
            v_row_ptr = V_Buffer + page * stride_v_page + (tok % PAGE_SIZE) * stride_v_slot + kv_head * stride_v_head
            v = tl.load(v_row_ptr[:, None] + offs_dv[None, :])
            pv_t = tl.dot(tl.trans(v.to(DOT_DTYPE)), p_t.to(DOT_DTYPE))
            if LAZY_RESCALE:
                acc_t += pv_t
            else:
                acc_t = acc_t * alpha[None, :] + pv_t
            m_i = m_new
"""


def transposed_loop(text: str) -> str:
    """BF16 GQA: the prefix loop computes S^T = K q^T and O^T = V^T P^T (tokens as the
    wgmma's M), the accumulator transposed back after the loop."""
    assert text.count(TRANSPOSED_OLD) == 1, "transposed_loop: the BF16 loop body changed"
    text = text.replace(TRANSPOSED_OLD, TRANSPOSED_NEW)
    head = "        for start_n in range(split_start, split_end, BLOCK_N):\n"
    assert text.count(head) == 1
    text = text.replace(head, "        q_t = tl.trans(q)\n        acc_t = tl.trans(acc)\n" + head)
    tail = "        if not DRAFT_FIRST:\n"
    assert text.count(tail) == 1
    return text.replace(tail, "        acc = tl.trans(acc_t)\n" + tail)


# Text patches of a generated module; each fails loudly when the text it edits is gone, so a
# template change never turns a variant silently into the base kernel.
PATCHES = {"unmasked": unmasked_full_tiles, "kq_transposed": kq_transposed, "qk_ahead": qk_ahead,
           "no_pdl": no_pdl, "fp16_qk": fp16_qk, "precise_qk": precise_qk,
           "pdl_early_trigger": pdl_early_trigger, "no_draft_probe": no_draft_probe, "draft_after": draft_after,
           "draft_first64": draft_first64, "pdl_late_trigger": pdl_late_trigger,
           "no_merge_probe": no_merge_probe, "no_prefix_loop_probe": no_prefix_loop_probe,
           "transposed_loop": transposed_loop}


# Variant names that are build experiments (kgen/experiments.py), not text patches.
EXPERIMENT_VARIANTS = {"fused": "fused_merge", "half": "half_partials", "e4m3": "e4m3_qk"}


# "saved:TAG" in a variant list: the module text of SAVED_DIR/<URI>__TAG.py (e.g. the previous
# commit's generated module, carried to the device in an ignored folder).
SAVED = "saved:"
SAVED_DIR = os.environ.get("KGEN_SAVED_MODULES", ".prev")


def load_variant(layout: str, kv: str, names: tuple[str, ...], out: str):
    base = kgen.load(layout, kv)
    if not names:
        return base
    experiments = sorted(EXPERIMENT_VARIANTS[n] for n in names if n in EXPERIMENT_VARIANTS)
    if experiments:  # kgen/experiments.py options, built apart
        ctx = load_context(os.path.join(out, "_".join(experiments)), env={"KGEN_EXPERIMENTS": ",".join(experiments)})
        base = SimpleNamespace(URI=base.URI, __file__=build_one(layout, kv, "bfloat16", ctx=ctx).output_path)
    text = open(base.__file__).read()
    for name in names:
        if name.startswith(SAVED):  # a whole module saved beside the tree (an older build, say)
            text = open(os.path.join(SAVED_DIR, f"{base.URI}__{name[len(SAVED):]}.py")).read()
        elif name not in EXPERIMENT_VARIANTS:
            text = PATCHES[name](text)
    path = os.path.join(out, "variants", f"{base.URI}__{'_'.join(names).replace(':', '-')}.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(fn, rep=150, return_mode="median")
    return ms * 1e3


def floor_us(layout, kv, group, batch, prefix, draft, ceiling):
    a = SPECS[layout].attention
    c = Case(layout=layout, group=group, kv_dtype=kv, batch=batch, prefix=prefix, draft=draft,
             qk_dim=a.qk_dim, v_dim=a.v_head_dim, separate_v=a.v_source != "k_latent")
    return bench_min_bytes(c).total / (ceiling * 1e9) * 1e6


def cfg(bh, bn, w, st, ppsm=2, minsp=128, maxsp=64):
    return {"block_h": bh, "block_n": bn, "num_warps": w, "num_stages": st,
            "split": {"programs_per_sm": ppsm, "max_splits": maxsp, "min_tokens_per_split": minsp}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", nargs="*", default=[])
    args = ap.parse_args()
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    ceiling = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
    src = dst = None  # free before the cases
    print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
    log = open(os.path.join(args.out, "exp.log"), "w")
    # Variant modules go to a scratch directory: $OUT keeps only the log and the table.
    work_dir = tempfile.mkdtemp(prefix="kgen-exp-")
    results = []

    def record(tag, layout, kv, group, batch, prefix, L, us, extra=""):
        fl = floor_us(layout, kv, group, batch, prefix, L, ceiling)
        rec = dict(tag=tag, layout=layout, kv=kv, group=group, batch=batch, prefix=prefix, L=L, us=us,
                   pct=100 * fl / us if us else 0, extra=extra)
        results.append(rec)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(f"{tag:42s} {layout[:8]} {kv[:5]} g{group} b{batch} p{prefix} L{L}: {us:8.1f} us "
              f"{rec['pct']:5.1f}% {extra}", flush=True)

    def run(tag, layout, kv, group, batch, prefix, L, variants=(), configs=(None,)):
        try:
            base = load_variant(layout, kv, (), work_dir)
            variants, configs = lazy_configs(base, tuple(variants), tuple(configs), group, batch)
            mod = load_variant(layout, kv, variants, work_dir)
            fp8 = "float8" in kv
            case = make_case(SPECS[layout], [prefix] * batch, [L] * batch, group, kv_dtype=kv, device="cuda",
                             k_scale=0.7 if fp8 else 1.0, v_scale=1.3 if fp8 else 1.0, seed=batch + prefix)
            sub = make_case(SPECS[layout], [prefix, prefix // 3 + 5], [L, max(1, L - 1)], group, kv_dtype=kv,
                            device="cuda", k_scale=case.k_scale, v_scale=case.v_scale, seed=7)
            mod.launch(*sub.launch_args(), config=configs[0])
            err = relative_error(sub.o.float(), sub.reference())
            for c in configs:
                try:
                    us = time_us(lambda c=c: mod.launch(*case.launch_args(), config=c))
                    record(tag, layout, kv, group, batch, prefix, L, us, f"err={err:.1e} cfg={c}")
                except Exception as exc:  # noqa: BLE001
                    log.write(f"{tag} cfg={c} FAILED {exc!r}\n")
                    print(f"{tag} cfg={c} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            case = None
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            traceback.print_exc()

    G = "qwen3_5_gqa256"
    M = "mla_absorbed_512_64"
    t0 = time.time()
    sel = set(args.only)

    def want(name):
        return not sel or name in sel

    if want("gpu2"):
        P = itertools.product
        run("g16", G, "bfloat16", 16, 64, 16384, 4,
            configs=[None] + [cfg(bh, bn, 4, st) for bh, bn, st in P((16, 8, 4), (32, 64), (3, 4))])
        run("g8", G, "bfloat16", 8, 64, 16384, 4,
            configs=[None] + [cfg(bh, bn, 4, st) for bh, bn, st in P((8, 4), (32, 64), (3, 4))])
        run("g4", G, "bfloat16", 4, 64, 16384, 4,
            configs=[None] + [cfg(4, bn, 4, st, pp) for bn, st, pp in P((32, 64), (3, 4), (2, 3))])
        run("g16 p4K", G, "bfloat16", 16, 64, 4096, 4,
            configs=[None] + [cfg(bh, 32, 4, st, pp) for bh, st, pp in P((16, 8, 4), (3, 4), (2, 3))])
        run("g4 p4K", G, "bfloat16", 4, 64, 4096, 4,
            configs=[None] + [cfg(4, bn, 4, st, pp) for bn, st, pp in P((32, 64), (3, 4), (2, 3))])
        run("b16p1K", G, "bfloat16", 16, 16, 1024, 4,
            configs=[None] + [cfg(bh, 32, 4, 3, pp, mt) for bh, pp, mt in P((16, 4), (2, 4, 8), (64, 128, 256))])
        run("fp8 g16", G, "float8_e4m3fn", 16, 64, 16384, 4,
            configs=[None] + [cfg(bh, bn, 4, st) for bh, bn, st in P((16, 8), (32, 64), (2, 3, 4))])
        run("mla", M, "bfloat16", 16, 64, 16384, 4,
            configs=[None, cfg(16, 64, 8, 2, 2), cfg(16, 32, 8, 3, 2), cfg(16, 32, 8, 2, 2), cfg(16, 64, 8, 1, 2)])
    if want("leads"):
        run("g16 lead", G, "bfloat16", 16, 64, 16384, 4,
            configs=(cfg(16, 32, 4, 3, 1), cfg(16, 32, 4, 2, 2), cfg(16, 16, 4, 4, 2)))
        run("g16 p4K lead", G, "bfloat16", 16, 64, 4096, 4,
            configs=(cfg(16, 32, 4, 3, 1), cfg(16, 32, 4, 2, 2), cfg(16, 32, 4, 3, 1, 512)))
        run("b16p1K lead", G, "bfloat16", 16, 16, 1024, 4,
            configs=(cfg(16, 16, 4, 3, 2), cfg(16, 32, 4, 2, 2), cfg(16, 32, 8, 3, 2), cfg(16, 32, 4, 3, 1),
                     cfg(16, 32, 4, 3, 2, 512)))
        run("mla lead", M, "bfloat16", 16, 64, 16384, 4,
            configs=(cfg(16, 32, 8, 3, 1), cfg(16, 16, 8, 4, 2), cfg(16, 32, 8, 2, 1)))
    if want("next"):
        # Queued for the next device session (docs/perf-notes.md, "Where it stands").
        g16 = cfg(16, 32, 4, 3, 1)
        for prefix in (16384, 4096):
            run(f"g16 p{prefix // 1024}K base", G, "bfloat16", 16, 64, prefix, 4, configs=(g16,))
            for variants in (("unmasked",), ("lazy",), ("lazy", "unmasked")):
                run(f"g16 p{prefix // 1024}K {'+'.join(variants)}", G, "bfloat16", 16, 64, prefix, 4,
                    variants=variants, configs=(g16,))
        run("fp8 lazy", G, "float8_e4m3fn", 16, 64, 16384, 4, variants=("lazy",), configs=(cfg(16, 64, 4, 2),))
        run("mla lazy", M, "bfloat16", 16, 64, 16384, 4, variants=("lazy",), configs=(cfg(16, 32, 8, 3, 1),))
        run("g8 unmasked", G, "bfloat16", 8, 64, 16384, 4, variants=("unmasked",), configs=(cfg(8, 32, 4, 3),))
        run("fp8 unmasked", G, "float8_e4m3fn", 16, 64, 16384, 4, variants=("unmasked",),
            configs=(cfg(16, 64, 4, 2), cfg(16, 64, 4, 2, 1)))
        run("mla draft-first", M, "bfloat16", 16, 64, 16384, 4,
            configs=(None, cfg(16, 32, 8, 3, 1), cfg(16, 64, 8, 2, 1)))
        run("mla fp8 draft-first", M, "float8_e4m3fn", 16, 64, 16384, 4,
            configs=(None, cfg(16, 32, 8, 3, 1), cfg(16, 64, 8, 2, 1), cfg(16, 64, 8, 2, 3)))
        for variants in (("unmasked",), ("fused",), ("fused", "unmasked")):
            run(f"b16p1K {'+'.join(variants)}", G, "bfloat16", 16, 16, 1024, 4, variants=variants,
                configs=(cfg(16, 32, 4, 3, 1), cfg(16, 32, 4, 3, 1, 256), cfg(16, 32, 4, 3, 2, 64)))
        run("g16 p4K fused", G, "bfloat16", 16, 64, 4096, 4, variants=("fused",), configs=(g16, cfg(16, 32, 4, 3, 2)))
        run("g16 p16K fused", G, "bfloat16", 16, 64, 16384, 4, variants=("fused",), configs=(g16,))
    if want("ahead"):
        # Tile i+1's q.k issued before tile i's softmax (qk_ahead): does the overlap ptxas
        # shows offline pay on the H200, alone and with the lazy rescale?
        g16 = cfg(16, 32, 4, 3, 1)
        for prefix in (16384, 4096):
            run(f"g16 p{prefix // 1024}K base", G, "bfloat16", 16, 64, prefix, 4, configs=(g16,))
            for variants in (("qk_ahead",), ("qk_ahead", "lazy"), ("lazy",)):
                run(f"g16 p{prefix // 1024}K {'+'.join(variants)}", G, "bfloat16", 16, 64, prefix, 4,
                    variants=variants, configs=(g16,) if prefix == 4096 else (g16, cfg(16, 32, 4, 2, 1),
                                                                               cfg(16, 32, 4, 4, 1)))
        for group in (8, 4):
            run(f"g{group} base", G, "bfloat16", group, 64, 16384, 4, configs=(None, cfg(group, 32, 4, 3, 1)))
            run(f"g{group} qk_ahead", G, "bfloat16", group, 64, 16384, 4, variants=("qk_ahead",),
                configs=(None, cfg(group, 32, 4, 3, 1)))
        fp8 = (cfg(16, 64, 4, 2), cfg(16, 32, 4, 3, 1), cfg(16, 32, 4, 3))
        run("fp8 base", G, "float8_e4m3fn", 16, 64, 16384, 4, configs=fp8)
        run("fp8 qk_ahead", G, "float8_e4m3fn", 16, 64, 16384, 4, variants=("qk_ahead",), configs=fp8)
        b16 = (cfg(16, 32, 4, 3, 1), cfg(16, 32, 4, 2, 2))
        run("b16p1K base", G, "bfloat16", 16, 16, 1024, 4, configs=b16)
        run("b16p1K qk_ahead", G, "bfloat16", 16, 16, 1024, 4, variants=("qk_ahead",), configs=b16)
        run("mla fp8", M, "float8_e4m3fn", 16, 64, 16384, 4,
            configs=(cfg(16, 64, 8, 2, 1), cfg(16, 32, 4, 2, 1), cfg(16, 16, 4, 3, 1), cfg(16, 16, 8, 4, 1)))
        run("mla bf16", M, "bfloat16", 16, 64, 16384, 4,
            configs=(cfg(16, 32, 8, 3, 1), cfg(16, 16, 4, 3, 1), cfg(16, 16, 8, 4, 1)))
    if want("adopt"):
        # Base against the unmasked / lazy patches, every case in one run (the runs before
        # were on different machines, ~4% apart on the same base kernel).
        g16 = cfg(16, 32, 4, 3, 1)
        for prefix in (16384, 4096):
            for variants in ((), ("unmasked",), ("lazy",)):
                run(f"g16 p{prefix // 1024}K {'+'.join(variants) or 'base'}", G, "bfloat16", 16, 64, prefix, 4,
                    variants=variants, configs=(g16,))
        for variants in ((), ("unmasked",), ("lazy",)):
            name = "+".join(variants) or "base"
            for group in (8, 4):
                run(f"g{group} {name}", G, "bfloat16", group, 64, 16384, 4, variants=variants)
            run(f"fp8 {name}", G, "float8_e4m3fn", 16, 64, 16384, 4, variants=variants, configs=(cfg(16, 64, 4, 2),))
            run(f"mla {name}", M, "bfloat16", 16, 64, 16384, 4, variants=variants, configs=(cfg(16, 32, 8, 3, 1),))
            run(f"mla fp8 {name}", M, "float8_e4m3fn", 16, 64, 16384, 4, variants=variants,
                configs=(cfg(16, 64, 8, 2, 1),))
            run(f"b16p1K {name}", G, "bfloat16", 16, 16, 1024, 4, variants=variants, configs=(g16,))
            run(f"gqa128 {name}", "gqa128", "bfloat16", 8, 64, 16384, 4, variants=variants)
    if want("pdl"):
        # Programmatic dependent launch on (the shipped module) against off, where launch
        # latency counts most; then the MLA modules as shipped (unmasked whole tiles).
        for variants in ((), ("no_pdl",)):
            name = "+".join(variants) or "pdl"
            run(f"b16p1K {name}", G, "bfloat16", 16, 16, 1024, 4, variants=variants)
            run(f"b16p1K L2 {name}", G, "bfloat16", 16, 16, 1024, 2, variants=variants)
            run(f"b1p4K {name}", G, "bfloat16", 16, 1, 4096, 4, variants=variants)
            run(f"g16 p4K {name}", G, "bfloat16", 16, 64, 4096, 4, variants=variants)
        run("mla shipped", M, "bfloat16", 16, 64, 16384, 4)
        run("mla fp8 shipped", M, "float8_e4m3fn", 16, 64, 16384, 4)
    if want("bn64"):
        # FlexAttention's best headline config in the 2026-11-29 run was 64-token tiles, one
        # warpgroup, 3 stages (288 us): the same tiles here, one program per SM (224 KiB smem).
        for prefix in (16384, 4096):
            for variants in ((), ("lazy",)):
                run(f"g16 p{prefix // 1024}K bn64 {'+'.join(variants)}", G, "bfloat16", 16, 64, prefix, 4,
                    variants=variants, configs=(cfg(16, 32, 4, 3, 1), cfg(16, 64, 4, 3, 1), cfg(16, 64, 8, 3, 1)))
    if want("small"):
        # Batch-16 cases that lost 10-20% between the 11:35 and 13:24 matrices: PDL or not?
        for variants in ((), ("no_pdl",), ("pdl_early_trigger",)):
            name = "+".join(variants) or "pdl"
            run(f"b1p4K {name}", G, "bfloat16", 16, 1, 4096, 4, variants=variants)
            run(f"g8 b16p4K {name}", G, "bfloat16", 8, 16, 4096, 4, variants=variants)
            run(f"g4 fp8 b16p4K {name}", G, "float8_e4m3fn", 4, 16, 4096, 4, variants=variants)
            run(f"mla b16p4K {name}", M, "bfloat16", 16, 16, 4096, 4, variants=variants)
    if want("session4"):
        # Queued for the next device session: half-precision partials (the experiment
        # half_partials) where the partial round trip is largest, alone and with the fused merge.
        for variants in ((), ("half",), ("half", "fused")):
            name = "+".join(variants) or "base"
            run(f"b16p1K {name}", G, "bfloat16", 16, 16, 1024, 4, variants=variants)
            run(f"b16p4K g8 {name}", G, "bfloat16", 8, 16, 4096, 4, variants=variants)
            run(f"b1p4K {name}", G, "bfloat16", 16, 1, 4096, 4, variants=variants)
            run(f"g16 p4K {name}", G, "bfloat16", 16, 64, 4096, 4, variants=variants)
            run(f"mla b16p4K {name}", M, "bfloat16", 16, 16, 4096, 4, variants=variants)
            run(f"mla fp8 b64p16K {name}", M, "float8_e4m3fn", 16, 64, 16384, 4, variants=variants)
    if want("session5"):
        # Clamped gather indices (no row masks on the K/V loads) against the previous build
        # ("saved:prev"), at the shipped tiles and at 64-token tiles, which ptxas now
        # compiles for group 16 without spills; MLA also as one clamped loop ("saved:single").
        prev = ("saved:prev",)
        for prefix in (16384, 4096):
            for c in (cfg(16, 32, 4, 3, 1), cfg(16, 64, 4, 3, 1)):
                run(f"g16 p{prefix // 1024}K prev", G, "bfloat16", 16, 64, prefix, 4, variants=prev, configs=(c,))
                run(f"g16 p{prefix // 1024}K clamp", G, "bfloat16", 16, 64, prefix, 4, configs=(c,))
                run(f"g16 p{prefix // 1024}K clamp+lazy", G, "bfloat16", 16, 64, prefix, 4, variants=("lazy",),
                    configs=(c,))
        for group in (8, 4):
            run(f"g{group} prev", G, "bfloat16", group, 64, 16384, 4, variants=prev)
            run(f"g{group} clamp", G, "bfloat16", group, 64, 16384, 4,
                configs=(None, cfg(group, 64, 4, 3, 1), cfg(group, 64, 4, 3, 2)))
        fp8 = (cfg(16, 64, 4, 2), cfg(16, 64, 4, 3, 1), cfg(16, 32, 4, 3, 1))
        run("fp8 prev", G, "float8_e4m3fn", 16, 64, 16384, 4, variants=prev, configs=fp8[:1])
        run("fp8 clamp", G, "float8_e4m3fn", 16, 64, 16384, 4, configs=fp8)
        mla = (cfg(16, 32, 8, 3, 1), cfg(16, 64, 8, 2, 1))
        for kv in ("bfloat16", "float8_e4m3fn"):
            run(f"mla {kv[:4]} prev", M, kv, 16, 64, 16384, 4, variants=prev, configs=mla)
            run(f"mla {kv[:4]} clamp", M, kv, 16, 64, 16384, 4, configs=mla)
            run(f"mla {kv[:4]} clamp single", M, kv, 16, 64, 16384, 4, variants=("saved:single",), configs=mla)
        run("b16p1K prev", G, "bfloat16", 16, 16, 1024, 4, variants=prev)
        run("b16p1K clamp", G, "bfloat16", 16, 16, 1024, 4)
    if want("session5b"):
        # On the re-tuned 64-token configs: does the fused merge (the last split to arrive
        # merges) pay where each request has 2 splits (batch 64), and does lazy help group 8?
        g16 = {**cfg(16, 64, 4, 3, 1), "lazy_rescale": True}
        g8 = cfg(8, 64, 4, 3, 1)
        for variants in ((), ("fused",), ("half",), ("fused", "half")):
            name = "+".join(variants) or "base"
            run(f"g16 p4K {name}", G, "bfloat16", 16, 64, 4096, 4, variants=variants, configs=(g16,))
            if len(variants) < 2:
                run(f"g16 p16K {name}", G, "bfloat16", 16, 64, 16384, 4, variants=variants, configs=(g16,))
                run(f"g8 p16K {name}", G, "bfloat16", 8, 64, 16384, 4, variants=variants,
                    configs=(g8, {**g8, "lazy_rescale": True}))
                run(f"g8 p4K {name}", G, "bfloat16", 8, 64, 4096, 4, variants=variants, configs=(g8,))
        for variants in ((), ("fused",)):
            name = "+".join(variants) or "base"
            run(f"g4 p16K {name}", G, "bfloat16", 4, 64, 16384, 4, variants=variants)
            run(f"mla p16K {name}", M, "bfloat16", 16, 64, 16384, 4, variants=variants)
            run(f"b16p1K {name}", G, "bfloat16", 16, 16, 1024, 4, variants=variants)
    if want("session5c"):
        # min_rows 64: group 8 (and 4) programs padded to 64 rows run the prefix dots on
        # wgmma instead of mma.sync. Against the shipped row and 64-token tiles without it.
        for group in (8, 4):
            c64 = cfg(group, 64, 4, 3, 1)
            pads = (c64, {**c64, "min_rows": 64}, {**c64, "min_rows": 64, "lazy_rescale": True},
                    {**cfg(group, 32, 4, 3, 2), "min_rows": 64})
            for prefix in (16384, 4096):
                run(f"g{group} p{prefix // 1024}K", G, "bfloat16", group, 64, prefix, 4, configs=(None, *pads))
    if want("session5d"):
        # Group 8 / 4 (32- and 16-row programs on mma.sync): ptxas finds no spills with 8 warps
        # (group 8, 64-token tiles: 4 warps spill 208 B a thread, 8 warps none).
        for group in (8, 4):
            confs = (None, cfg(group, 64, 4, 3, 1), cfg(group, 64, 8, 3, 1), cfg(group, 64, 8, 2, 1),
                     cfg(group, 32, 8, 3, 1), cfg(group, 64, 8, 3, 2), cfg(group, 128, 8, 2, 1))
            for prefix in (16384, 4096):
                run(f"g{group} p{prefix // 1024}K", G, "bfloat16", group, 64, prefix, 4, configs=confs)
    if want("session6"):
        # Queued for the next device session. The latency bar (batch 16, prefix 1K, <= 12 us):
        # the batch 9-32 row was tuned on prefixes 4K and 16K and cuts a 1K prefix into 8
        # splits of 128 tokens (2 tiles each, then an 8-way merge); min_tokens_per_split
        # decides that in-kernel, so a larger value costs the long prefixes nothing.
        g16 = {**cfg(16, 64, 4, 3, 1), "lazy_rescale": True}
        confs = (None, *({**g16, "split": {**g16["split"], "min_tokens_per_split": m}} for m in (256, 512, 1024)),
                 cfg(16, 32, 4, 3, 2, 256))
        for batch, prefix in ((16, 1024), (16, 4096), (32, 16384), (1, 4096)):
            run(f"b{batch}p{prefix // 1024}K", G, "bfloat16", 16, batch, prefix, 4, configs=confs)
    if want("session6b"):
        # The e4m3 q.k (experiment e4m3_qk; measured in session 6 first as fp8_qk_dot, commit
        # fd34681) against the fp16 q.k of the same module, and with its accumulator promoted.
        # An e4m3 p.V (V transposed in shared memory by Triton) gave wrong results: dropped.
        for variants in (("e4m3",), ("e4m3", "fp16_qk"), ("e4m3", "precise_qk")):
            name = "+".join(variants)
            run(f"fp8 g16 p16K {name}", G, "float8_e4m3fn", 16, 64, 16384, 4, variants=variants,
                configs=(None, cfg(16, 64, 4, 3, 1), cfg(16, 64, 4, 2, 1), cfg(16, 32, 4, 3, 1)))
            run(f"fp8 g16 p4K {name}", G, "float8_e4m3fn", 16, 64, 4096, 4, variants=variants,
                configs=(None, cfg(16, 64, 4, 3, 1)))
            run(f"mla fp8 p16K {name}", M, "float8_e4m3fn", 16, 64, 16384, 4, variants=variants,
                configs=(None, cfg(16, 64, 8, 2, 1)))
    if want("session6c"):
        # The latency case's partial traffic: 8 splits x 64 rows x 256 fp32 columns per request.
        g16 = {**cfg(16, 64, 4, 3, 1), "lazy_rescale": True}
        for variants in ((), ("half",)):
            run(f"b16p1K {'+'.join(variants) or 'fp32 partials'}", G, "bfloat16", 16, 16, 1024, 4,
                variants=variants, configs=(None, cfg(16, 64, 4, 3, 2, 64), cfg(16, 32, 4, 3, 2, 64),
                                            {**g16, "split": {**g16["split"], "programs_per_sm": 2}}))
    if want("session6e"):
        # Upper bound of a draft tile moved out of the prefix programs (timing only: the
        # no_draft_probe variant's output is wrong, its err column says so).
        for variants in ((), ("no_draft_probe",)):
            name = "+".join(variants) or "shipped"
            run(f"mla p16K {name}", M, "bfloat16", 16, 64, 16384, 4, variants=variants)
            run(f"mla fp8 p16K {name}", M, "float8_e4m3fn", 16, 64, 16384, 4, variants=variants)
            run(f"g16 p16K {name}", G, "bfloat16", 16, 64, 16384, 4, variants=variants)
            run(f"g8 p16K {name}", G, "bfloat16", 8, 64, 16384, 4, variants=variants)
    if want("session6f"):
        # Draft tile before the loop against draft_after. Measured at b709dd7, when every
        # program under 64 rows drafted first: group 8 (32 rows) gained, group 4 (16) lost, so
        # the launcher now drafts first at 32 rows only (_DRAFT_FIRST_ROWS).
        for variants in ((), ("draft_after",)):
            name = "+".join(variants) or "draft first"
            for group in (8, 4):
                for kv in ("bfloat16", "float8_e4m3fn"):
                    for prefix in (16384, 4096):
                        run(f"g{group} p{prefix // 1024}K {name}", G, kv, group, 64, prefix, 4, variants=variants)
            run(f"g8 b16p1K {name}", G, "bfloat16", 8, 16, 1024, 4, variants=variants)
    if want("session7"):
        # The merge with a chunk of splits in flight together: unrolled (shipped) and as one
        # [SPLIT_CHUNK, ...] block (saved:block3d), against the loop over single splits
        # (saved:loopmerge, the build before). Then, at the latency cases, fp16 partials,
        # 64-row programs drafting first and a late PDL trigger; the headline cases last.
        g16 = {**cfg(16, 64, 4, 3, 2, 64), "lazy_rescale": True}
        b16 = (None, g16, cfg(16, 32, 4, 3, 2, 64), cfg(16, 32, 4, 3, 1, 64))
        for variants in (("saved:loopmerge",), (), ("saved:block3d",)):
            name = "+".join(variants) or "unrolled"
            run(f"b16p1K {name}", G, "bfloat16", 16, 16, 1024, 4, variants=variants, configs=b16)
            run(f"g8 b16p1K {name}", G, "bfloat16", 8, 16, 1024, 4, variants=variants)
            run(f"b1p4K {name}", G, "bfloat16", 16, 1, 4096, 4, variants=variants)
            run(f"mla b16p4K {name}", M, "bfloat16", 16, 16, 4096, 4, variants=variants)
        for variants in (("half",), ("draft_first64",), ("pdl_late_trigger",)):
            run(f"b16p1K {variants[0]}", G, "bfloat16", 16, 16, 1024, 4, variants=variants)
            run(f"g8 b16p1K {variants[0]}", G, "bfloat16", 8, 16, 1024, 4, variants=variants)
        for variants in (("saved:loopmerge",), (), ("pdl_late_trigger",)):
            name = "+".join(variants) or "unrolled"
            for group in (16, 8, 4):
                run(f"g{group} p16K {name}", G, "bfloat16", group, 64, 16384, 4, variants=variants)
            run(f"g16 p4K {name}", G, "bfloat16", 16, 64, 4096, 4, variants=variants)
    if want("session7b"):
        # Where the latency case's time goes (timing probes, wrong output on purpose): the
        # prefix stage alone, and everything but the K/V tiles.
        for variants in ((), ("no_merge_probe",), ("no_prefix_loop_probe",),
                         ("no_prefix_loop_probe", "no_merge_probe")):
            name = "+".join(variants) or "shipped"
            run(f"b16p1K {name}", G, "bfloat16", 16, 16, 1024, 4, variants=variants)
            run(f"b16p4K {name}", G, "bfloat16", 16, 16, 4096, 4, variants=variants)
    if want("session7c"):
        # The transposed prefix loop (tokens as the wgmma's M) for groups 8 and 4, whose 32-
        # and 16-row programs otherwise run mma.sync (offline, 64-token tiles: HGMMA 32, no
        # spills, 217 / 215 KB of shared memory), against the shipped loop.
        for group in (8, 4):
            base = cfg(group, 64, 4, 3, 1)
            confs = (None, {**base, "draft_tile": "first"}, {**base, "draft_tile": "after"}, cfg(group, 32, 4, 3, 1),
                     {**base, "lazy_rescale": True})
            for variants in ((), ("transposed_loop",)):
                name = "+".join(variants) or "shipped"
                run(f"g{group} p16K {name}", G, "bfloat16", group, 64, 16384, 4, variants=variants, configs=confs)
                run(f"g{group} p4K {name}", G, "bfloat16", group, 64, 4096, 4, variants=variants, configs=confs[:3])
                run(f"g{group} b16p1K {name}", G, "bfloat16", group, 16, 1024, 4, variants=variants)
    if want("session7e"):
        # One split a request at batch 64 (64 programs, no merge, no partials): the tuner's
        # max_splits axis starts at 8 and programs_per_sm 1 already gives 2 splits, so this
        # was never timed. Against the table row (2 splits) and 3-4 splits.
        for group in (16, 8, 4):
            row = None
            for prefix in (16384, 4096):
                mod = kgen.load(G, "bfloat16")
                row = mod.select_config("sm_90", group, 64)
                confs = (None, *({**row, "split": {**row["split"], "max_splits": n}} for n in (1,)),
                         {**row, "split": {**row["split"], "programs_per_sm": 2}})
                run(f"g{group} p{prefix // 1024}K splits", G, "bfloat16", group, 64, prefix, 4, configs=confs)
        mod = kgen.load(M, "bfloat16")
        row = mod.select_config("sm_90", 16, 64)
        run("mla p16K splits", M, "bfloat16", 16, 64, 16384, 4,
            configs=(None, {**row, "split": {**row["split"], "max_splits": 1}}))
    if want("session7f"):
        # Two co-resident programs per SM for groups 8 and 4 (Nsight Compute, session 7e: one
        # program per SM reads at most ~36-45 GB/s, so 128 of them leave DRAM at 83-88%):
        # 32-token tiles, 3 stages = 112 KB of shared memory, two fit in 228 KB.
        for group in (8, 4, 16):
            confs = (None, cfg(group, 32, 4, 3, 2), cfg(group, 32, 4, 2, 2), cfg(group, 32, 4, 4, 2),
                     cfg(group, 16, 4, 4, 2))
            for prefix in (16384, 4096):
                run(f"g{group} p{prefix // 1024}K 2/SM", G, "bfloat16", group, 64, prefix, 4, configs=confs)
    print(f"total {time.time() - t0:.0f}s")
    with open(os.path.join(args.out, "exp.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nSUMMARY")
    for r in results:
        print(f"{r['tag']:28s} g{r['group']} b{r['batch']} p{r['prefix']} {r['kv'][:5]} {r['us']:8.1f} us "
              f"{r['pct']:5.1f}%  {r['extra'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
