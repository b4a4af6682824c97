"""Compile a generated kernel for sm_90 on a machine without a GPU and report what ptxas
says (registers, spills, shared memory) and which MMA instructions the SASS uses.

Costs no device time: Triton's wheel ships ptxas and nvdisasm. Usage:
  python benchmarks/offline_compile.py --layout qwen3_5_gqa256 --kv bf16 --group 16 --draft 4 \
      --block-n 32 --warps 4 --stages 4
  python benchmarks/offline_compile.py --layout mla_absorbed_512_64 --kv fp8 --as-launched --page-size 16
(the second: what a call launches, the Gluon stage under Triton 3.6).

Besides the totals it counts the spill loads and stores (LDL/STL) inside the program's
longest loop, the prefix loop: spills there are paid every tile, spills outside it once. A
warp-specialized program's longest loop spans its partitions, so it also lists the innermost
loops of 100 instructions or more, each partition's loop over the tiles, with what each
issues a tile: MMAs, conversions (F2FP), cp.async copies, barriers of its warps (BAR) and spills.
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


def chosen_program(module, args) -> tuple[str, dict, dict]:
    """(kernel name, constexprs, compile options) of the prefix stage one call launches on sm_90:
    with --as-launched the module's own choice at --batch (its table row or default, the Gluon
    stage where that row launches it), else this config through the launch rules (the fit
    applied)."""
    if args.as_launched:
        config = None
    else:
        config = {"block_h": args.block_h, "block_n": args.block_n, "num_warps": args.warps,
                  "num_stages": args.stages, "lazy_rescale": args.lazy}
        if args.draft_first:
            config["draft_tile"] = "first"
        if args.gluon:
            block_n, stages = (int(x) for x in args.gluon.split(","))
            config["gluon"] = {"block_n": block_n, "num_stages": stages, "lazy_rescale": args.lazy}
            if args.gluon_converters:
                config["gluon"]["converters"] = args.gluon_converters
            if args.gluon_landing:
                config["gluon"]["landing_stages"] = args.gluon_landing
    launches = module.launch_params("sm_90", 132, args.group, args.batch, args.draft, args.page_size, config,
                                    has_mask=args.mask)
    if not launches:
        raise SystemExit(f"no {args.layout} program fits sm_90 for this call (launch_params returned none)")
    return launches[0]


def compile_for_sm90(module, name: str, constexprs: dict, options: dict):
    """Triton's compile of one program, typed, specialized and sourced as `kgen check` compiles
    it (int64 indices; a Gluon kernel from Gluon's AST source)."""
    constexprs = check.complete_launch(module, name, constexprs)
    signature, constants, divisible = check.kernel_signature(module, name, constexprs, "int64", {})
    src = check.ast_source(getattr(module, name), signature, constants, divisible)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_and_sass(ptx: str) -> tuple[list[str], str]:
    """ptxas -v's report lines and the SASS (nvdisasm) of a PTX module, for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = Path(tmp) / "k.ptx"
        ptx_path.write_text(ptx)
        out = subprocess.run([str(BIN / "ptxas"), "-v", "--gpu-name", "sm_90a", str(ptx_path), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
        sass = subprocess.run([str(BIN / "nvdisasm"), str(Path(tmp) / "k.cubin")], capture_output=True,
                              text=True).stdout
    return out.stderr.strip().splitlines(), sass


def compile_prefix(args) -> None:
    """Compile the chosen prefix-stage program for sm_90 and print what ptxas and the SASS say."""
    module = kgen.load(args.layout, args.kv) if not args.module else _module_from(args.module)
    name, constexprs, options = chosen_program(module, args)
    kernel = compile_for_sm90(module, name, constexprs, options)
    report, sass = ptxas_and_sass(kernel.asm["ptx"])
    ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "QGMMA", "HMMA", "LDGSTS", "LDG", "STL", "LDL",
                                                              "F2FP", "MUFU")}
    stages = constexprs.get("NUM_STAGES", options["num_stages"])  # a Gluon stage's ring is a constexpr
    print(f"{name}: {args.layout} kv={args.kv} group={args.group} L={args.draft} batch={args.batch} "
          f"page_size={args.page_size} BLOCK_H={constexprs['BLOCK_H']} L_PAD={constexprs['L_PAD']} "
          f"BLOCK_N={constexprs['BLOCK_N']} warps={options['num_warps']} stages={stages} "
          f"shared={kernel.metadata.shared} B")
    for line in report:
        if "registers" in line or "spill" in line or "stack" in line:
            print("  ptxas:", line.split("info    :")[-1].strip())
    print("  SASS:", ", ".join(f"{k} {v}" for k, v in ops.items()))
    code = code_instructions(sass)
    print(f"  code: {code} instructions ({code * 16 / 1024:.1f} KB)")
    loop = longest_loop(sass)
    if loop:
        print(f"  longest loop ({len(loop)} instructions): LDL {_count('LDL', loop)}, STL {_count('STL', loop)}")
    for inner in innermost_loops(sass):
        counts = ", ".join(f"{op} {_count(op, inner)}" for op in _PER_TILE)
        print(f"  loop at {_ADDRESS.search(inner[0]).group(1)} ({len(inner)} instructions): {counts}")
    if args.dump:
        Path(args.dump).write_text(sass)
    if args.dump_ttgir:
        Path(args.dump_ttgir).write_text(kernel.asm["ttgir"])


_ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
_LABEL = re.compile(r"^\s*\.L_x_(\d+):")
_BACK_BRANCH = re.compile(r"\bBRA\b.*`\(\.L_x_(\d+)\)")


_PER_TILE = ("HGMMA", "F2FP", "LDGSTS", "BAR", "LDL", "STL")


def _count(op: str, instructions: list[str]) -> int:
    """Instructions of opcode ``op`` (any modifiers: BAR.SYNC is a BAR, LDGSTS not an LDG)."""
    pattern = re.compile(rf"\s{op}(\.|\s)")
    return sum(bool(pattern.search(line)) for line in instructions)


def code_instructions(sass: str) -> int:
    """The program's instructions (16 bytes each on sm_90), not the data nvdisasm lists as
    ``.byte`` lines after them."""
    return sum(1 for line in sass.splitlines() if _INSTRUCTION.search(line))


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+[^.\s]")


def longest_loop(sass: str) -> list[str]:
    """The instructions between the label and the backward branch of the widest loop in the
    SASS (nvdisasm marks branch targets .L_x_N), or [] when there is no loop."""
    instructions, spans = _loops(sass)
    if not spans:
        return []
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return instructions[start:end + 1]


def innermost_loops(sass: str, min_instructions: int = 100) -> list[list[str]]:
    """The loops of at least ``min_instructions`` that hold no other such loop, in address
    order: in a warp-specialized program, each partition's loop over the tiles (the retry
    loops of its mbarrier waits are shorter)."""
    instructions, spans = _loops(sass)
    big = sorted({span for span in spans if span[1] - span[0] + 1 >= min_instructions})
    inner = [(a, b) for a, b in big if not any((c, d) != (a, b) and a <= c and d <= b for c, d in big)]
    return [instructions[a:b + 1] for a, b in inner]


def _loops(sass: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The SASS's instruction lines and each loop's (first, last) instruction index: from a
    .L_x_N label to a branch back to it."""
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
    spans = [(labels[m.group(1)], end) for end, line in enumerate(instructions)
             if (m := _BACK_BRANCH.search(line)) and labels.get(m.group(1), end + 1) <= end]
    return instructions, spans


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
    ap.add_argument("--gluon", metavar="BLOCK_N,STAGES",
                    help="the Gluon prefix stage with this gluon section (where the module has one, under Triton 3.6)")
    ap.add_argument("--gluon-converters", type=int, choices=(1, 2),
                    help="the gluon section's converters (FP8 GQA: 2 beside two consumers is a fourth warpgroup)")
    ap.add_argument("--gluon-landing", type=int, choices=(2, 3, 4),
                    help="the gluon section's landing_stages (FP8 GQA: one converter lands the rows in a ring of this "
                         "many tiles)")
    ap.add_argument("--mask", action="store_true", help="the custom-mask (tree) program (HAS_MASK)")
    ap.add_argument("--as-launched", action="store_true",
                    help="the module's own choice (its table row or default) instead of the config flags: "
                         "the Gluon stage where that row launches it (Triton 3.6)")
    ap.add_argument("--batch", type=int, default=64, help="the call's batch (picks the table row)")
    ap.add_argument("--page-size", type=int, help="the paged entry with pages of this many tokens (default: "
                                                  "token slots)")
    ap.add_argument("--module", help="compile this module file instead of the generated one (a variant)")
    ap.add_argument("--dump", help="write the SASS here")
    ap.add_argument("--dump-ttgir", help="write Triton's GPU IR (layouts, where values live) here")
    compile_prefix(ap.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
