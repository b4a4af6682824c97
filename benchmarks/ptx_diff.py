"""Whether two builds of a generated module compile a launch to the same code, without a GPU.

Compiles what each build's ``launch_params`` returns for one input (the chain: no custom
mask) with Triton's offline compiler, as ``kgen check`` does, and compares the PTX (NVIDIA)
or amdgcn (AMD) with the debug sections, ``.loc``/``.file`` lines and comments dropped (they
name source lines and paths). Identical code runs at identical speed, which is how a change
that only adds a constexpr-specialized branch (the tree mask) is shown to leave the chain
kernel alone. Usage:

  git archive main generated | tar -x -C /tmp/before
  python benchmarks/ptx_diff.py --before /tmp/before/generated --module verify_qwen3_5_gqa256__kv_bf16__q_bf16 \\
      --arch sm_90 --group 16 --batch 64 --draft 4 [--page 16]

Exit status 0 when every kernel of the launch is identical, 1 when one differs (both texts
are written next to each other in --out for a diff).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kgen import check  # noqa: E402

GENERATED = Path(__file__).resolve().parents[1] / "generated"
_DROPPED = re.compile(r"^\s*(\.loc|\.file|//|;)")


def compiled_code(module_path: Path, arch: str, group: int, batch: int, draft: int, page: int | None,
                  scalars_from: Path) -> dict[str, str]:
    """Kernel name -> its PTX or amdgcn for the chain launch of this input. The JIT's int
    specialization comes from ``scalars_from`` (this build's module), so both builds compile
    the same signature."""
    module = check.load_module_file(module_path)
    current = check.load_module_file(scalars_from)
    target = check.ARCHS[arch]
    point = check.Point(group, draft, batch, page, "int64", False)
    scalars = check.runtime_scalars(current, arch, target.num_sms, point)
    code = {}
    for name, constexprs, options in module.launch_params(arch, target.num_sms, group, batch, draft, page):
        full = check.complete_launch(module, name, constexprs)[0]
        signature, constants, divisible = check.kernel_signature(module, name, full, "int64", scalars)
        kernel = getattr(module, name)
        names = kernel.arg_names
        source_type = ASTSource
        if getattr(kernel, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource

            source_type = GluonASTSource
        source = source_type(fn=kernel, signature=signature,
                             constexprs={(names.index(n),): v for n, v in constants.items()},
                             attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
        compiled = triton.compile(source, target=GPUTarget(target.backend, target.target_arch, target.warp_size),
                                  options=dict(options))
        code[name] = compiled.asm["ptx" if target.backend == "cuda" else "amdgcn"]
    return code


def normalized(text: str) -> str:
    """The code without its debug information and comments."""
    text = re.split(r"\.section\s+\.debug", text, maxsplit=1)[0]
    return "\n".join(line for line in text.splitlines() if not _DROPPED.match(line))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the earlier build's generated/ directory")
    parser.add_argument("--after", default=str(GENERATED), help="this build's generated/ (default: the checkout's)")
    parser.add_argument("--module", required=True, help="module name (file stem), e.g. verify_gqa64__kv_bf16__q_bf16")
    parser.add_argument("--arch", default="sm_90", choices=sorted(check.ARCHS))
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--page", type=int, default=None, help="page size: the paged entry (default: token slots)")
    parser.add_argument("--out", default="ptx-diff", help="where differing texts are written")
    args = parser.parse_args(argv)
    after = Path(args.after) / f"{args.module}.py"
    before = Path(args.before) / f"{args.module}.py"
    new = compiled_code(after, args.arch, args.group, args.batch, args.draft, args.page, after)
    old = compiled_code(before, args.arch, args.group, args.batch, args.draft, args.page, after)
    differ = 0
    for name in sorted(set(new) | set(old)):
        a, b = normalized(old.get(name, "")), normalized(new.get(name, ""))
        same = a == b and a != ""
        print(f"{args.module} {args.arch} {name}: {'identical' if same else 'DIFFERENT'}")
        if not same:
            differ += 1
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.before.txt").write_text(a)
            (out / f"{name}.after.txt").write_text(b)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
