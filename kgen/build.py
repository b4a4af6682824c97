"""Build drivers: every shipped specialization through the pipeline (``kgen build``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kgen.passes.context import BuildContext, load_context
from kgen.passes.pipeline import run_pipeline
from kgen.plan import URI_PREFIXES, Plan, Variant, new_plan
from kgen.spec import LayoutSpec, load_layouts


def specializations(specs: dict[str, LayoutSpec], layouts: list[str] | None = None,
                    kv_dtypes: list[str] | None = None) -> Iterator[Plan]:
    """Every (layout, KV dtype, query dtype, variant, batch-invariant or not) the specs ask for,
    as fresh plans: the grouped and per-head kernels, and the grouped kernel's batch-invariant
    mode."""
    for name, spec in sorted(specs.items()):
        if layouts and name not in layouts:
            continue
        for kv in spec.dtypes.kv:
            if kv_dtypes and kv not in kv_dtypes:
                continue
            for q in spec.dtypes.q:
                for variant, batch_invariant in URI_PREFIXES:
                    yield new_plan(spec, kv, q, variant, batch_invariant)


@dataclass(frozen=True)
class BuildResult:
    plans: list[Plan]
    orphans: list[Path]  # files in the output dir no spec produces any more

    @property
    def changed(self) -> list[Plan]:
        return [p for p in self.plans if p.output.written]


def build_all(out_dir: Path | None = None, check_only: bool = False, layout_dir: Path | None = None,
              progress: Callable[[Plan], None] | None = None) -> BuildResult:
    """Validate every spec first (nothing is written if one is bad), then run the pipeline."""
    specs = load_layouts(layout_dir)
    ctx = load_context(out_dir, check_only=check_only)
    plans = []
    for plan in specializations(specs):
        plans.append(run_pipeline(plan, ctx))
        if progress:
            progress(plans[-1])
    expected = {Path(p.output_path).name for p in plans}
    orphans = sorted(p for p in Path(ctx.out_dir).glob("verify*.py") if p.name not in expected)
    return BuildResult(plans, orphans)


def build_one(layout: str, kv_dtype: str, q_dtype: str, variant: Variant = "grouped",
              out_dir: Path | None = None, ctx: BuildContext | None = None, batch_invariant: bool = False) -> Plan:
    specs = load_layouts()
    if layout not in specs:
        raise KeyError(f"unknown layout {layout!r}; known: {', '.join(sorted(specs))} (see `kgen list`)")
    ctx = ctx or load_context(out_dir)
    return run_pipeline(new_plan(specs[layout], kv_dtype, q_dtype, variant, batch_invariant), ctx)
