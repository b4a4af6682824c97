"""``TuneJob``: what one study tunes, the key of one table entry and the workloads it is timed on.

Its own module so that the GPU backend (``gpu``) can name it without importing the study, which
imports that backend: kgen's modules import each other without cycles (tests/test_import_cycles.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kgen.spec import LayoutSpec
from kgen.tuner.workloads import Bucket, Workload


@dataclass(frozen=True)
class TuneJob:
    """One study: everything that selects a table entry, plus the bucket's workloads."""

    arch: str
    layout: LayoutSpec
    kv_dtype: str
    q_dtype: str
    group_size: int
    bucket: Bucket
    workloads: tuple[Workload, ...]

    def label(self) -> str:
        return f"{self.layout.name} kv={self.kv_dtype} g={self.group_size} batch {self.bucket.label()}"
