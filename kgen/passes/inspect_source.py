"""inspect_source: the emitted module parses, compiles, imports only what engines have, holds no
host code, and keeps the specialization promises (no PE text without a PE part, no descale for
bf16 KV)."""

from __future__ import annotations

import ast
import dataclasses
import re

from kgen.errors import BuildError
from kgen.passes.context import BuildContext
from kgen.plan import Decision, Plan

NAME = "inspect_source"
ALLOWED_IMPORTS = frozenset({"torch", "triton", "triton.language"})
# The host side every module shares (written once, imports only torch and triton).
LAUNCHER_PACKAGE = "kgen.launcher."
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


# Decorators of kernel code: @triton.jit / @gluon.jit functions, and @gluon.constexpr_function
# ones, which the kernel compiler runs at compile time (a layout, say), never the host.
KERNEL_DECORATORS = ("jit", "constexpr_function")


def _is_kernel_code(node: ast.FunctionDef) -> bool:
    """A function with a kernel decorator (called with options or not)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr in KERNEL_DECORATORS:
            return True
    return False


def host_code(body: list[ast.stmt]) -> list[ast.stmt]:
    """Module-level statements that are host code: anything but imports, assignments of
    constants and of the module's declaration, kernel functions (KERNEL_DECORATORS), import guards (try) and blocks
    under a flag (if). A function, class, loop or lambda on the host belongs in kgen/launcher/."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Assign | ast.AnnAssign):
            if any(isinstance(n, ast.Lambda | ast.ListComp | ast.DictComp | ast.SetComp | ast.GeneratorExp)
                   for n in ast.walk(node)):
                found.append(node)
        elif isinstance(node, ast.FunctionDef):
            if not _is_kernel_code(node):
                found.append(node)
        elif isinstance(node, ast.Try):
            found += host_code(node.body + node.orelse + [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name):
            found += host_code(node.body + node.orelse)
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            found.append(node)
    return found


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
    extra = {name for name in _imports(tree) - ALLOWED_IMPORTS - (GLUON_IMPORTS if lowering.gluon_prefix else set())
             if not name.startswith(LAUNCHER_PACKAGE)}
    if extra:
        raise BuildError(f"{plan.uri}: emitted source imports {sorted(extra)}; only torch, triton and kgen.launcher")
    host = host_code(tree.body)
    if host:
        raise BuildError(f"{plan.uri}: emitted source has host code at line {host[0].lineno} "
                         f"({type(host[0]).__name__}); host code is written once in kgen/launcher/")
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    if not specialization.has_pe and PE_TEXT.search(code):
        raise BuildError(f"{plan.uri}: PE_DIM is 0 but the source mentions a PE part: "
                         f"{PE_TEXT.search(code).group(0)!r}")
    if not specialization.fp8_kv and DEVICE_SCALE_TEXT.search(code):
        raise BuildError(f"{plan.uri}: KV is {plan.kv_dtype} but the source reads KV scales on the device")
    return plan.with_([Decision(NAME, "source", "ok",
                                "parses, compiles, imports only torch/triton/kgen.launcher, no host code, "
                                "specialization promises hold", "it compiles and keeps its promises")],
                      output=dataclasses.replace(output, inspected=True))
