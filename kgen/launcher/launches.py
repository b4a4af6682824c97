"""What one call launches, decided from Python scalars alone (arch, multiprocessors, group,
batch, draft length, page size, block config): no tensor values, so it is graph-safe and
cacheable. ``kgen check`` compiles exactly what ``launch_params`` lists."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The prefix stage's mask arguments when there is no mask: None makes them constexprs, so
# the chain kernel is compiled without them (kgen check compiles launch_params' constexprs).
NO_MASK = {"Custom_Mask": None, "Mask_Indptr": None, "stride_mask_row": None}
PREFIX_KERNEL = "_verify_prefix_stage"
GLUON_PREFIX_KERNEL = "_gluon_prefix_stage"
MERGE_KERNEL = "_verify_merge_stage"


@dataclass(frozen=True)
class LaunchSetup:
    """Everything one call launches. A row is a (head, draft position) pair; a program owns
    BLOCK_H x L_PAD rows of one KV head."""

    head_blocks: int  # programs over one KV head's query heads
    row_blocks: int  # programs over one head block's draft rows
    max_splits: int  # the split axis of the grid (a cap per request in the batch-invariant mode)
    # The split plan's token count: a floor on split length in the default mode, the exact
    # split length in the batch-invariant one (the kernels' min_tokens_per_split / tokens_per_split).
    split_tokens: int
    block_n: int
    page_shift: int  # log2 of the page size (0 for token slots)
    prefix_kernel: str  # PREFIX_KERNEL or GLUON_PREFIX_KERNEL
    prefix_constexprs: Mapping[str, Any]
    prefix_options: Mapping[str, Any]
    prefix_pdl: Mapping[str, Any]  # {"launch_pdl": True} when the prefix stage launches early
    # The merge stage's (constexprs, options); None when no request can need a second split.
    merge: tuple[Mapping[str, Any], Mapping[str, Any]] | None
    merge_pdl: Mapping[str, Any]

    @property
    def cluster_splits(self) -> int:
        """Splits of a head block launched as one thread-block cluster that merges them (1: none;
        the merge stage's launch merges, where a request has more than one split): the Triton
        prefix stage's CLUSTER_SPLITS."""
        return self.prefix_constexprs.get("CLUSTER_SPLITS", 1)

    def launches(self, has_mask: bool) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        """(kernel name, constexpr arguments, compile options) of each launch, as kgen check
        compiles them: without a mask its arguments are None constexprs."""
        constexprs = dict(self.prefix_constexprs)
        if not has_mask:
            constexprs.update(NO_MASK)
        launches = [(self.prefix_kernel, constexprs, dict(self.prefix_options))]
        if self.merge is not None:
            merge_constexprs, merge_options = self.merge
            launches.append((MERGE_KERNEL, dict(merge_constexprs), dict(merge_options)))
        return launches


def backend_knobs(config: Mapping[str, Any], is_rocm: bool) -> dict[str, Any]:
    """AMD compiler knobs go to ROCm launches only; CUDA never sees them."""
    if not is_rocm:
        return {}
    return {name: config[name] for name in ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
            if config.get(name) is not None}


def pdl_options(on: bool) -> dict[str, Any]:
    return {"launch_pdl": True} if on else {}
