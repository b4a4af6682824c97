"""Compile a generated kernel for sm_90 on a machine without a GPU and report what ptxas
says (registers, spills, shared memory) and which MMA instructions the SASS uses.

Costs no device time: Triton's wheel ships ptxas and nvdisasm. Usage:
  python benchmarks/offline_compile.py --layout qwen3_5_gqa256 --kv bf16 --group 16 --draft 4 \
      --block-n 32 --warps 4 --stages 4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kgen  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TL = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8e4nv"}


def _prefix_signature(module, kv: str) -> tuple[dict, list[str]]:
    """Argument types of _verify_prefix_stage, read from its parameter names."""
    names = module._verify_prefix_stage.arg_names
    kvt = TL[str(module.KV_DTYPE).replace("torch.", "")]
    sig = {}
    for n in names:
        if n in ("Q", "K_Extend", "V_Extend", "O"):
            sig[n] = "*bf16"
        elif n in ("K_Buffer", "V_Buffer"):
            sig[n] = f"*{kvt}"
        elif n in ("Qo_Indptr", "Kv_Bounds", "Kv_Table", "Split_Counters"):
            sig[n] = "*i32"
        elif n in ("Partial_O", "Partial_Lse"):
            sig[n] = "*fp32"
        elif n in ("qk_scale", "k_scale", "v_scale"):
            sig[n] = "fp32"
        elif n.startswith("stride_") or n == "max_splits":
            sig[n] = "i32"
    return sig, names


def _module_from(path: str):
    """A module file outside generated/ (e.g. a hand-edited variant of a generated module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_prefix(args) -> None:
    module = kgen.load(args.layout, args.kv) if not args.module else _module_from(args.module)
    sig, names = _prefix_signature(module, args.kv)
    block_h, l_pad = module._rows(args.block_h, args.group, args.draft)
    dot = tl.float16 if "float8" in str(module.KV_DTYPE) else tl.bfloat16
    constexprs = {"GROUP": args.group, "BLOCK_H": block_h, "L_PAD": l_pad, "DRAFT_N": max(16, l_pad),
                  "BLOCK_N": args.block_n, "MIN_TOKENS_PER_SPLIT": 128, "PAGE_SIZE": 1, "BLOCK_TABLE": False,
                  "DOT_DTYPE": dot, "SCALES_ON_DEVICE": False, "USE_PDL": True,
                  "LAZY_RESCALE": args.lazy, "KV_DOT_DTYPE": tl.float8e4nv, "SOFTWARE_E4M3": False,
                  "E4M3_QK": True, "DRAFT_FIRST": args.draft_first}
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    for k in constexprs:
        sig[k] = "constexpr"
    # Strides of contiguous tensors are multiples of 16 in practice: tell the compiler, as the JIT would.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
             if (n.startswith("stride_") and not n.endswith("slot")) or sig[n].startswith("*")}
    src = ASTSource(fn=module._verify_prefix_stage, signature=sig, constexprs={(names.index(k),): v
                    for k, v in constexprs.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": args.warps, "num_stages": args.stages})
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = Path(tmp) / "k.ptx"
        ptx_path.write_text(ptx)
        out = subprocess.run([str(BIN / "ptxas"), "-v", "--gpu-name", "sm_90a", str(ptx_path), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
        report = out.stderr.strip().splitlines()
        sass = subprocess.run([str(BIN / "nvdisasm"), str(Path(tmp) / "k.cubin")], capture_output=True,
                              text=True).stdout
    ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "QGMMA", "HMMA", "LDGSTS", "LDG", "STL", "LDL",
                                                              "F2FP", "MUFU")}
    print(f"{args.layout} kv={args.kv} group={args.group} L={args.draft} BLOCK_H={block_h} L_PAD={l_pad} "
          f"BLOCK_N={args.block_n} warps={args.warps} stages={args.stages} shared={kernel.metadata.shared} B")
    for line in report:
        if "registers" in line or "spill" in line or "stack" in line:
            print("  ptxas:", line.split("info    :")[-1].strip())
    print("  SASS:", ", ".join(f"{k} {v}" for k, v in ops.items()))
    if args.dump:
        Path(args.dump).write_text(sass)
    if args.dump_ttgir:
        Path(args.dump_ttgir).write_text(kernel.asm["ttgir"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="qwen3_5_gqa256")
    ap.add_argument("--kv", default="bfloat16")
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--draft", type=int, default=4)
    ap.add_argument("--block-h", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=32)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--lazy", action="store_true", help="compile with LAZY_RESCALE (the block-config knob)")
    ap.add_argument("--draft-first", action="store_true", help="GQA: the draft tile before the loop (DRAFT_FIRST)")
    ap.add_argument("--module", help="compile this module file instead of the generated one (a variant)")
    ap.add_argument("--dump", help="write the SASS here")
    ap.add_argument("--dump-ttgir", help="write Triton's GPU IR (layouts, where values live) here")
    compile_prefix(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
