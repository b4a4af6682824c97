"""Whether a module's Gluon prefix stage may run in this process."""

from __future__ import annotations

import triton

from .switches import env_flag


def gluon_stage_runs(written_for: str) -> bool:
    """True when this Triton is the release the stage is written for (``written_for``.x) and
    KGEN_NO_GLUON is off when the module is imported (an engine's switch; kgen bench runs under
    it to time the Triton chain). Elsewhere the Triton prefix stage serves every call."""
    return triton.__version__.startswith(f"{written_for}.") and not env_flag("KGEN_NO_GLUON")
