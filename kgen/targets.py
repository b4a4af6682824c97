"""The targets a generated module is checked for and fits its programs into.

``kgen/tables/targets.json`` holds one row per arch: shared memory (LDS) per block, threads
per warp (wavefront), the matrix instruction Triton uses there and the FP8 formats its
tensor cores take. The launch rules (``kgen/launcher/rules.py``) read a row as a plain dict; the
build renders the rows into every module, and ``kgen check`` compiles for each of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kgen.blockconfig import TARGETS_FILE
from kgen.errors import TableError

TARGETS_SCHEMA = "kgen.targets/1"


class Target(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    family: Literal["cuda", "hip"]
    warp_size: Literal[32, 64]
    shared_bytes: int = Field(gt=0)
    mma: Literal["mma", "wgmma", "tcgen05", "mfma"]
    shared_estimate: Literal["measured", "upper_bound"]
    fp8: list[str] = Field(default_factory=list)
    # Programs one thread-block cluster may hold (1: no clusters). 8 is every sm_90+ part's
    # portable size; 16 a non-portable size the H100 / H200 launch (docs/perf-notes.md, "The
    # merge in a cluster").
    clusters: int = Field(default=1, ge=1, le=16)


class TargetsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    schema_: Literal["kgen.targets/1"] = Field(alias="schema")
    why: str = ""
    targets: dict[str, Target]


def read_targets(path: Path = TARGETS_FILE) -> dict[str, Target]:
    """Every target by arch name, in file order."""
    try:
        data = json.loads(Path(path).read_text())
        return dict(TargetsFile.model_validate(data).targets)
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        raise TableError(f"{path}: not a valid targets file ({TARGETS_SCHEMA}): {exc}") from None


def target_dicts(targets: dict[str, Target]) -> dict[str, dict]:
    """The rows as the plain dicts the launch rules take (and modules carry)."""
    return {arch: t.model_dump() for arch, t in targets.items()}
