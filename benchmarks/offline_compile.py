"""Compile a generated kernel for sm_90 on a machine without a GPU and report what ptxas
says (registers, spills, shared memory) and which MMA instructions the SASS uses.

Costs no device time: Triton's wheel ships ptxas and nvdisasm. Usage:
  python benchmarks/offline_compile.py --layout qwen3_5_gqa256 --kv bf16 --group 16 --draft 4 \
      --block-n 32 --warps 4 --stages 4

Besides the totals it counts the spill loads and stores (LDL/STL) inside the program's
longest loop, the prefix loop: spills there are paid every tile, spills outside it once.
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
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kgen  # noqa: E402
from kgen import check  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _module_from(path: str):
    """A module file outside generated/ (e.g. a hand-edited variant of a generated module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_prefix(args) -> None:
    """The program the module's own launch rules pick for this config on sm_90 (launch_params,
    with the fit applied), typed and specialized as `kgen check` types it."""
    module = kgen.load(args.layout, args.kv) if not args.module else _module_from(args.module)
    config = {"block_h": args.block_h, "block_n": args.block_n, "num_warps": args.warps, "num_stages": args.stages,
              "lazy_rescale": args.lazy}
    if args.draft_first:
        config["draft_tile"] = "first"
    name, constexprs, options = module.launch_params("sm_90", 132, args.group, 64, args.draft, None, config,
                                                     has_mask=args.mask)[0]
    constexprs = check.complete_launch(module, name, constexprs)
    signature, constants, divisible = check.kernel_signature(module, name, constexprs, "int64", {})
    kernel = getattr(module, name)
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    block_h, l_pad = constexprs["BLOCK_H"], constexprs["L_PAD"]
    args.block_n, args.warps, args.stages = constexprs["BLOCK_N"], options["num_warps"], options["num_stages"]
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
    loop = longest_loop(sass)
    if loop:
        print(f"  longest loop ({len(loop)} instructions): LDL {sum(' LDL' in i for i in loop)}, "
              f"STL {sum(' STL' in i for i in loop)}")
    if args.dump:
        Path(args.dump).write_text(sass)
    if args.dump_ttgir:
        Path(args.dump_ttgir).write_text(kernel.asm["ttgir"])


_ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
_LABEL = re.compile(r"^\s*\.L_x_(\d+):")
_BACK_BRANCH = re.compile(r"\bBRA\b.*`\(\.L_x_(\d+)\)")


def longest_loop(sass: str) -> list[str]:
    """The instructions between the label and the backward branch of the widest loop in the
    SASS (nvdisasm marks branch targets .L_x_N), or [] when there is no loop."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        address = _ADDRESS.search(line)
        if address:
            for name in pending:
                labels[name] = len(instructions)
            pending = []
            instructions.append(line)
    loops = [(labels[m.group(1)], end) for end, line in enumerate(instructions)
             if (m := _BACK_BRANCH.search(line)) and labels.get(m.group(1), end + 1) <= end]
    if not loops:
        return []
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return instructions[start:end + 1]


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
    ap.add_argument("--mask", action="store_true", help="the custom-mask (tree) program (HAS_MASK)")
    ap.add_argument("--module", help="compile this module file instead of the generated one (a variant)")
    ap.add_argument("--dump", help="write the SASS here")
    ap.add_argument("--dump-ttgir", help="write Triton's GPU IR (layouts, where values live) here")
    compile_prefix(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
