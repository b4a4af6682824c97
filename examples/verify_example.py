"""Target verification through kgen's runtime, checked against kgen.reference.

Builds a small KV cache twice (SGLang's flat token slots and vLLM's block tables), lets the
gate pick a path for the model, runs the chain through both engine adapters and compares
each output with the float32 reference. One call with a logit cap shows the fall-through
to the general path.

    TRITON_INTERPRET=1 python examples/verify_example.py        # CPU, Triton interpreter
    python examples/verify_example.py --model kimi_k3            # GPU, unchanged

Exits non-zero when an output differs from the reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    # The interpreter must be chosen before triton (and the generated kernels) load.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kgen.reference import reference_verify  # noqa: E402
from kgen.runtime import explain_gate, sglang_verify_for, vllm_verify_for  # noqa: E402

# model name -> (HF architecture, TP-local query heads, KV heads, qk width, pe width, v width)
MODELS = {
    "qwen3_5": ("Qwen3_5MoeForCausalLM", 8, 1, 256, 0, 256),  # TP4: 8 query heads per KV head
    "kimi_k3": ("KimiK3ForConditionalGeneration", 16, 1, 576, 64, 512),  # absorbed MLA, TP8
}
TOLERANCE = 2e-2  # bf16 inputs: max abs error against the float32 reference


def build_cache(args: argparse.Namespace, device: torch.device) -> dict:
    """Random prefixes in a shuffled slot pool plus the draft tokens of each request."""
    _, h_q, h_kv, qk, _, v = MODELS[args.model]
    gen = torch.Generator().manual_seed(0)
    prefix = [args.prefix + 37 * b for b in range(args.batch)]
    draft = [1 + b % args.draft for b in range(args.batch)]
    slots = sum(prefix) + 16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    k_buffer = randn(slots, h_kv, qk)
    mla = v < qk and args.model == "kimi_k3"
    v_buffer = k_buffer[..., :v] if mla else randn(slots, h_kv, v)  # MLA: V = latent columns
    tokens = sum(draft)
    k_extend = randn(tokens, h_kv, qk)
    cache = {
        "q": randn(tokens, h_q, qk),
        "k": k_extend,
        "v": k_extend[..., :v] if mla else randn(tokens, h_kv, v),
        "k_buffer": k_buffer,
        "v_buffer": v_buffer,
        "qo_indptr": torch.tensor([0, *torch.tensor(draft).cumsum(0).tolist()], dtype=torch.int32, device=device),
        "kv_indptr": torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32, device=device),
        "kv_indices": torch.randperm(slots, generator=gen)[: sum(prefix)].to(torch.int32).to(device),
        "prefix": prefix,
        "draft": draft,
        "mla": mla,
    }
    return cache


def to_block_table(cache: dict, page: int) -> dict:
    """The same prefixes as vLLM pages: block b of request r holds tokens b*page.. ."""
    prefix, device = cache["prefix"], cache["q"].device
    blocks = [-(-p // page) for p in prefix]
    _, h_kv, qk = cache["k_buffer"].shape
    v = cache["v_buffer"].shape[2]
    k_cache = torch.zeros(sum(blocks) + 1, page, h_kv, qk, dtype=torch.bfloat16, device=device)
    # Absorbed MLA keeps V inside K's cache (the latent columns), as it does in the pool.
    v_cache = k_cache[..., :v] if cache["mla"] else torch.zeros_like(k_cache[..., :v])
    table = torch.zeros(len(prefix), max(blocks) + 1, dtype=torch.int32)
    next_block, starts = 1, cache["kv_indptr"].tolist()
    for r, p in enumerate(prefix):
        slots = cache["kv_indices"][starts[r] : starts[r] + p].long()
        for b in range(blocks[r]):
            n = min(page, p - b * page)
            k_cache[next_block, :n] = cache["k_buffer"][slots[b * page : b * page + n]]
            if not cache["mla"]:
                v_cache[next_block, :n] = cache["v_buffer"][slots[b * page : b * page + n]]
            table[r, b] = next_block
            next_block += 1
    return {"k_cache": k_cache, "v_cache": v_cache, "block_table": table.to(device)}


def check(name: str, out: torch.Tensor, want: torch.Tensor, path: str) -> bool:
    err = (out.float() - want).abs().max().item()
    ok = err <= TOLERANCE
    print(f"  {name:<28} path={path:<9} max|err|={err:.2e} {'ok' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3_5")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=90, help="prefix length of the first request")
    parser.add_argument("--draft", type=int, default=3, help="longest draft chain")
    parser.add_argument("--page", type=int, default=16, help="vLLM page size")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arch, h_q, h_kv, qk, pe, v = MODELS[args.model]
    model = dict(model_arch=arch, num_q_heads=h_q, num_kv_heads=h_kv, qk_dim=qk, pe_dim=pe, v_dim=v)
    print(explain_gate(arch, group_size=h_q // h_kv, num_local_kv_heads=h_kv, qk_dim=qk, pe_dim=pe, v_dim=v))

    c = build_cache(args, device)
    want = reference_verify(c["q"], c["k"], c["v"], c["k_buffer"], c["v_buffer"], c["qo_indptr"],
                            c["kv_indptr"], c["kv_indices"])  # fmt: skip
    flat = (c["q"], c["k"], c["v"])
    pools = (c["k_buffer"], c["v_buffer"], c["qo_indptr"], c["kv_indptr"], c["kv_indices"])
    max_len = max(c["draft"])
    ok = True

    sglang = sglang_verify_for(**model)
    print(f"chain:\n  {sglang.chain.describe().replace(chr(10), chr(10) + '  ')}")
    o = torch.empty(c["q"].shape[0], h_q, v, dtype=torch.bfloat16, device=device)
    sglang(*flat, o, *pools, None, True, None, max_len, None, None)
    ok &= check("SGLang slots", o, want, sglang.chain.last_path)

    vllm = vllm_verify_for(**model)
    pages = to_block_table(c, args.page)
    seq_lens = torch.tensor(c["prefix"], dtype=torch.int32, device=device) + torch.tensor(c["draft"], device=device)
    o = torch.empty_like(o)
    path = vllm(*flat, o, pages["k_cache"], pages["v_cache"], pages["block_table"], seq_lens, c["qo_indptr"], max_len)
    ok &= check(f"vLLM pages (page {args.page})", o, want, path)

    # A logit cap is refused by the kernels: the chain falls through to the general path.
    o = torch.empty_like(o)
    sglang(*flat, o, *pools, None, True, None, max_len, None, None, logit_cap=1e4)
    ok &= check("SGLang slots + logit cap", o, want, sglang.chain.last_path)
    print("all outputs match the reference" if ok else "SOME OUTPUTS DIFFER FROM THE REFERENCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
