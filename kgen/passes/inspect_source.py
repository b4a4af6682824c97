"""inspect_source: the emitted module parses, compiles, imports only what engines have, and keeps
the specialization promises (no PE text without a PE part, no descale for bf16 KV)."""

from __future__ import annotations

import ast
import dataclasses
import re

from kgen.errors import BuildError
from kgen.passes.context import BuildContext
from kgen.plan import Decision, Plan

NAME = "inspect_source"
ALLOWED_IMPORTS = frozenset({"collections.abc",  # Mapping, for kgen/env.py's switch parser
                             "functools", "math", "os", "torch", "triton", "triton.language",
                             "triton.language.extra.cuda"})  # grid dependency control, import guarded
# Triton's Gluon, import guarded: only modules with a Gluon prefix stage (select_lowering).
GLUON_IMPORTS = frozenset({"triton.experimental", "triton.experimental.gluon",
                           "triton.experimental.gluon.language.nvidia.hopper"})
PE_TEXT = re.compile(r"(?i)\b\w*_pe\b|\bPE_DIM\b|\bBLOCK_DPE\b|\bdpe\b")
# A 16-bit pool's k_scale / v_scale are float kernel arguments: only FP8 modules read their
# scales from device tensors.
DEVICE_SCALE_TEXT = re.compile(r"tl\.load\((k|v)_scale\)")


def _imports(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def inspect_source(plan: Plan, ctx: BuildContext | None = None) -> Plan:
    output = plan.need("output", NAME)
    specialization = plan.need("specialization", NAME)
    source = output.source
    try:
        tree = ast.parse(source, filename=f"{plan.uri}.py")
        compile(tree, f"{plan.uri}.py", "exec")
    except SyntaxError as exc:
        raise BuildError(f"{plan.uri}: emitted source does not compile: line {exc.lineno}: {exc.msg}") from None
    lowering = plan.need("lowering", NAME)
    extra = _imports(tree) - ALLOWED_IMPORTS - (GLUON_IMPORTS if lowering.gluon_prefix else frozenset())
    if extra:
        raise BuildError(f"{plan.uri}: emitted source imports {sorted(extra)}; only torch, triton and the stdlib")
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    if not specialization.has_pe and PE_TEXT.search(code):
        raise BuildError(f"{plan.uri}: PE_DIM is 0 but the source mentions a PE part: "
                         f"{PE_TEXT.search(code).group(0)!r}")
    if not specialization.fp8_kv and DEVICE_SCALE_TEXT.search(code):
        raise BuildError(f"{plan.uri}: KV is {plan.kv_dtype} but the source reads KV scales on the device")
    return plan.with_([Decision(NAME, "source", "ok",
                                "parses, compiles, imports only torch/triton/stdlib, "
                                "specialization promises hold")],
                      output=dataclasses.replace(output, inspected=True))
