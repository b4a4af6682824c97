"""Batch buckets and their timed workloads, read from ``workloads.toml`` (data, not code).

The table is keyed by batch range only (graph safety: the launcher sees shapes, not
prefix lengths), so each bucket is timed over several (batch, prefix, draft) points.
"""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kgen.errors import read_validated
from kgen.tuner.errors import TuneError

WORKLOADS_FILE = Path(__file__).parent / "workloads.toml"


class Workload(BaseModel):
    """One timed problem: ``batch`` requests, each with ``prefix`` cached tokens and
    ``draft`` draft tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: int = Field(ge=1)
    prefix: int = Field(ge=1)
    draft: int = Field(ge=1, le=64)

    def label(self) -> str:
        return f"bs{self.batch}/P{self.prefix}/L{self.draft}"


class Bucket(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_+\-]{1,32}$")
    batch_min: int = Field(ge=1)
    batch_max: int = Field(ge=1)
    batches: tuple[int, ...] = Field(min_length=1)
    prefixes: tuple[int, ...] = Field(min_length=1)
    draft_tokens: tuple[int, ...] | None = None

    @model_validator(mode="after")
    def _batches_inside(self) -> Bucket:
        if self.batch_max < self.batch_min:
            raise ValueError(f"batch_max {self.batch_max} < batch_min {self.batch_min}")
        outside = [b for b in self.batches if not self.batch_min <= b <= self.batch_max]
        if outside:
            raise ValueError(f"timed batches {outside} lie outside the bucket {self.batch_min}..{self.batch_max}")
        if any(p < 1 for p in self.prefixes):
            raise ValueError(f"prefix lengths must be >= 1, got {list(self.prefixes)}")
        return self

    def workloads(self, default_draft: tuple[int, ...]) -> list[Workload]:
        drafts = self.draft_tokens or default_draft
        return [
            Workload(batch=b, prefix=p, draft=d) for b, p, d in itertools.product(self.batches, self.prefixes, drafts)
        ]

    def label(self) -> str:
        hi = "+" if self.batch_max >= 1 << 30 else f"-{self.batch_max}"
        return f"{self.batch_min}{hi}"


class Timing(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    l2_rotate_factor: float = Field(default=2.0, ge=0)
    min_input_sets: int = Field(default=2, ge=1)
    max_input_sets: int = Field(default=64, ge=1)
    max_memory_fraction: float = Field(default=0.25, gt=0, le=0.9)
    shuffle_slots: bool = True
    replays: int = Field(default=20, ge=1)
    repeats: int = Field(default=5, ge=2)
    top_k: int = Field(default=3, ge=1)
    min_gain_pct: float = Field(default=1.0, ge=0)


class Check(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefixes: tuple[int, ...] = Field(min_length=1)
    atol: float = Field(gt=0)
    rtol: float = Field(ge=0)
    seed: int = 0
    fp8_k_scale: float = Field(default=0.7, gt=0)
    fp8_v_scale: float = Field(default=1.3, gt=0)


class WorkloadsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["kgen.tune-workloads/1"] = Field(alias="schema")
    num_kv_heads: int = Field(default=1, ge=1)
    draft_tokens: tuple[int, ...] = Field(min_length=1)
    timing: Timing = Timing()
    check: Check
    bucket: tuple[Bucket, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _disjoint(self) -> WorkloadsFile:
        names = [b.name for b in self.bucket]
        if len(set(names)) != len(names):
            raise ValueError(f"bucket names repeat: {names}")
        ranges = sorted((b.batch_min, b.batch_max, b.name) for b in self.bucket)
        for (_, hi, a), (lo, _, b) in itertools.pairwise(ranges):
            if lo <= hi:
                raise ValueError(f"buckets {a!r} and {b!r} overlap: a batch must fall in one bucket")
        return self

    def workloads(self, bucket: Bucket) -> list[Workload]:
        return bucket.workloads(self.draft_tokens)

    def bucket_named(self, name: str) -> Bucket:
        for b in self.bucket:
            if b.name == name:
                return b
        known = ", ".join(b.name for b in self.bucket)
        raise TuneError(f"unknown bucket {name!r}; the workloads file defines: {known}")


def load_workloads(path: Path | None = None) -> WorkloadsFile:
    """Read and validate the workloads file; errors name the file and the field."""
    return read_validated(path or WORKLOADS_FILE, WorkloadsFile, TuneError, "workloads file", tomllib.loads, "TOML")
