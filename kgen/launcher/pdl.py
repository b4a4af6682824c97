"""Programmatic dependent launch (PDL): on NVIDIA sm_90+ each kernel's launch overlaps the end
of the one before it, and its programs wait in ``gdc_wait`` for that kernel's results
(docs/perf-notes.md, "Programmatic dependent launch").

Generated kernels import ``gdc_wait`` from here. On a Triton without grid dependency control it
is None: the kernels then take their ``USE_PDL=False`` branch, which never names it.
"""

from __future__ import annotations

try:
    from triton.language.extra.cuda import gdc_wait

    HAS_GRID_DEPENDENCY_CONTROL = True
except ImportError:
    gdc_wait = None
    HAS_GRID_DEPENDENCY_CONTROL = False

__all__ = ["HAS_GRID_DEPENDENCY_CONTROL", "gdc_wait", "pdl_applies"]


def pdl_applies(arch: str, is_rocm: bool) -> bool:
    """Whether an arch launches with PDL: NVIDIA sm_90 and later. The launcher adds the rest
    (a Triton with grid dependency control, not the interpreter, KGEN_NO_PDL off)."""
    return not is_rocm and arch.startswith("sm_") and int(arch[3:].rstrip("a")) >= 90
