"""The batch-invariant launcher: a request's splits, program rows and merge order depend on its
own prefix and draft lengths only, never on the batch, the other requests or the GPU's size.

One program whatever the batch and the draft length (a longer draft adds row blocks), the
module's fixed splits; batch, max_len and num_sms change how many programs run (the grid),
never what one computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import rules
from .launches import LaunchSetup
from .verify import VerifyLauncher


class InvariantVerifyLauncher(VerifyLauncher):
    """VerifyLauncher with the batch-invariant split plan (identity.invariance)."""

    invariant = True

    def fitted_draft(self, max_len: int) -> int:
        """Programs are fitted for DRAFT_ROWS whatever max_len (a longer draft adds row blocks,
        a runtime argument, not ROW_BLOCKS)."""
        return self.identity.invariance.draft_rows

    def split_setup(self, prefix: Mapping[str, Any], split_config: Mapping[str, Any], head_blocks: int,
                    batch: int, max_len: int, num_sms: int, num_kv_heads: int) -> dict[str, Any]:
        """A draft longer than L_PAD runs in row blocks of L_PAD rows, one program each, in both
        stages (the merge too: its rows are the prefix stage's). The split grid comes from the
        call's index table (split_grid); max_splits is the split plan's cap, and the table row's
        split policy is not used. The merge is set up always: it runs when the call's split grid
        has more than one split."""
        invariance = self.identity.invariance
        return {"row_blocks": rules.draft_row_blocks(prefix["L_PAD"], max_len), "max_splits": invariance.max_splits,
                "split_tokens": invariance.tokens_per_split, "merge_l_pad": prefix["L_PAD"],
                "split_chunk": self.identity.merge_split_chunk, "needs_merge": True}

    def split_grid(self, setup: LaunchSetup, batch: int, prefix_bound: int, compact: bool) -> tuple[int, int, int]:
        """(split grid, slots_per_request, scratch slots) for a launch set-up, from shapes alone.
        prefix_bound is the longest prefix the index table can hold: len(kv_indices) for token
        slots, the block table's width x page size for pages. Request b's split k writes scratch
        slot first + k, where first is kv_indptr[b] // tokens_per_split + b (compact, token slots
        only: slots_per_request 0) or b x the grid's splits, whichever needs fewer slots. The
        compact count is rounded up to one of 8 sizes per power of two (at most 1/8 more), so that
        calls whose kv_indices lengths differ share a few buffers."""
        tokens_per_split = setup.split_tokens
        grid_splits = max(1, min(setup.max_splits, rules.cdiv(prefix_bound, tokens_per_split)))
        per_request = batch * grid_splits
        if compact:
            compact_slots = prefix_bound // tokens_per_split + batch
            step = max(1, rules.next_pow2(compact_slots) // 8)
            compact_slots = rules.cdiv(compact_slots, step) * step
            if compact_slots < per_request:
                return grid_splits, 0, compact_slots
        return grid_splits, grid_splits, per_request

    def grid_and_scratch(self, setup: LaunchSetup, q: torch.Tensor, num_kv_heads: int, batch: int,
                         kv_table: torch.Tensor, page_size: int | None) -> tuple[Any, ...]:
        """The split grid and the scratch slots come from the index table's shape (the longest
        prefix it can hold), never its values: graph-safe, and no program's result depends on them."""
        prefix_bound = kv_table.numel() if page_size is None else kv_table.shape[1] * page_size
        grid_splits, slots_per_request, num_slots = self.split_grid(setup, batch, prefix_bound,
                                                                    compact=page_size is None)
        split_ints = (setup.max_splits, setup.split_tokens, slots_per_request, setup.row_blocks)
        rows = setup.row_blocks * setup.prefix_constexprs["L_PAD"]
        partials = self.scratch_buffers(q.device, rows, q.shape[1], num_slots)
        grid = (num_kv_heads * setup.head_blocks * setup.row_blocks, grid_splits, batch)
        return grid, split_ints, partials, grid_splits

    def merge_grid(self, setup: LaunchSetup, num_q_heads: int, batch: int, merge_heads: int) -> tuple[int, ...]:
        return (rules.cdiv(num_q_heads, merge_heads) * setup.row_blocks, batch,
                rules.cdiv(self.identity.v_head_dim, self.identity.merge_block_dv))

    def merge_split_args(self, setup: LaunchSetup, split_ints: tuple[int, ...]) -> tuple[int, ...]:
        return split_ints

    def scratch_bytes(self, num_tokens: int, num_q_heads: int, num_kv_heads: int, batch: int, max_len: int,
                      arch: str, num_sms: int, config: Mapping[str, Any] | None = None,
                      kv_indices_len: int | None = None) -> int:
        """Bytes of scratch (fp32 partials + log2-sum-exp) the launcher allocates for these shapes.
        It depends on the index table's length: kv_indices_len (token slots); None gives the most
        a call of this batch can take, max_splits slots a request."""
        setup = self.launch_setup(arch, num_sms, num_q_heads // num_kv_heads, batch, max_len, None, config,
                                  num_kv_heads)
        rows = setup.row_blocks * setup.prefix_constexprs["L_PAD"]
        if kv_indices_len is None:
            _, _, slots = self.split_grid(setup, batch, setup.max_splits * setup.split_tokens, compact=False)
        else:
            _, _, slots = self.split_grid(setup, batch, kv_indices_len, compact=True)
        return 4 * rows * num_q_heads * slots * (self.identity.v_head_dim + 1)
