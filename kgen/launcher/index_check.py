"""Opt-in checks of index values (``check_indices=True``, ``KGEN_CHECK_INDICES=1``): the kernels
do not check them, so a bad index reads out of bounds. The comparisons run on the device; reading
their verdict syncs the host once, so these checks are for debugging, never under graph capture."""

from __future__ import annotations

import torch


def check_index_values(num_tokens: int, qo_indptr: torch.Tensor, max_len: int, kv_indptr: torch.Tensor | None = None,
                       kv_indices: torch.Tensor | None = None, pool_slots: int = 0,
                       block_table: torch.Tensor | None = None, prefix_lens: torch.Tensor | None = None,
                       page_size: int = 1, num_blocks: int = 0, custom_mask: torch.Tensor | None = None,
                       mask_indptr: torch.Tensor | None = None, prefix_trim_len: int = 0) -> None:
    """Raise ValueError naming the tensor, the request and the value when an index would read
    outside the KV pool or the custom mask, or a length is negative (the kernels do not check:
    such input reads out of bounds). Flat pools pass kv_indptr/kv_indices/pool_slots, paged
    caches block_table/prefix_lens/page_size/num_blocks; a call with a tree mask custom_mask
    and mask_indptr.

    The comparisons run on the device, but reading their verdict syncs the host (once when
    all is well): the check is opt-in and cannot run inside CUDA-graph capture."""
    checks = []  # (ok flags on the device, message for the first bad flag's position)

    def indptr(name, ptr, what):
        ptr = ptr.to(torch.int64)
        checks.append((ptr[:1] == 0, lambda i: f"{name}[0] must be 0, got {int(ptr[0])}"))
        checks.append((ptr[1:] >= ptr[:-1], lambda b: (
            f"{name} decreases at request {b}: {name}[{b}] = {int(ptr[b])} > {name}[{b + 1}] = "
            f"{int(ptr[b + 1])}, a negative {what} length")))
        return ptr

    qo = indptr("qo_indptr", qo_indptr, "draft")
    checks.append((qo[-1:] == num_tokens,
                   lambda i: f"qo_indptr[-1] = {int(qo[-1])} but q_extend has {num_tokens} tokens"))
    checks.append((qo[1:] - qo[:-1] <= max_len, lambda b: (
        f"request {b} has {int(qo[b + 1] - qo[b])} draft tokens (qo_indptr[{b + 1}] - qo_indptr[{b}]) "
        f"but max_len_extend = {max_len}")))
    if kv_indptr is not None:
        kv = indptr("kv_indptr", kv_indptr, "prefix")
        checks.append((kv[-1:] <= kv_indices.numel(), lambda i: (
            f"kv_indptr[-1] = {int(kv[-1])} exceeds len(kv_indices) = {kv_indices.numel()}")))
        used = torch.arange(kv_indices.numel(), device=kv.device) < kv[-1:]
        in_pool = (kv_indices >= 0) & (kv_indices < pool_slots)

        def slot_message(i):
            b = int(torch.searchsorted(kv, torch.tensor(i, device=kv.device), right=True)) - 1
            return (f"kv_indices[{i}] = {int(kv_indices[i])} (request {b}, prefix token {i - int(kv[b])}) is "
                    f"outside the pool's slots 0..{pool_slots - 1} (k_buffer.shape[0] = {pool_slots})")

        checks.append((~used | in_pool, slot_message))
        if prefix_trim_len:
            slice_lens = kv[1:] - kv[:-1]
            checks.append((slice_lens >= prefix_trim_len, lambda b: (
                f"request {b}'s kv_indptr slice holds {int(slice_lens[b])} slots, fewer than kv_len_adjust = "
                f"{-prefix_trim_len} trims: its prefix would be negative")))
    else:
        width = block_table.shape[1]
        capacity = width * page_size
        plens = prefix_lens.to(torch.int64)
        checks.append(((plens >= 0) & (plens <= capacity), lambda b: (
            f"prefix_lens[{b}] = {int(plens[b])} is outside 0..{capacity} (block_table width {width} "
            f"x page size {page_size})")))
        pages_used = (plens.clamp(0, capacity) + page_size - 1) // page_size
        used = torch.arange(width, device=plens.device)[None, :] < pages_used[:, None]
        in_cache = (block_table >= 0) & (block_table < num_blocks)
        checks.append(((~used | in_cache).reshape(-1), lambda i: (
            f"block_table[{i // width}, {i % width}] = {int(block_table[i // width, i % width])} (request "
            f"{i // width}) is outside the cache's blocks 0..{num_blocks - 1} (k_cache.shape[0] = {num_blocks})")))
    if custom_mask is not None:
        bs = qo.shape[0] - 1
        drafts = qo[1:] - qo[:-1]
        starts = mask_indptr[:bs].to(torch.int64)
        if kv_indptr is not None:  # SGLang: [L, P + L] bytes from mask_indptr[b]
            prefixes = kv[1:] - kv[:-1]
            end, limit, unit = starts + drafts * (prefixes + drafts), custom_mask.numel(), "entries"
        else:  # paged: rows mask_indptr[b] .. + L of a [rows, W] mask
            end, limit, unit = starts + drafts, custom_mask.shape[0], "rows"
        checks.append(((drafts == 0) | ((starts >= 0) & (end <= limit)), lambda b: (
            f"request {b}'s mask reads custom_mask {unit} {int(starts[b])}..{int(end[b]) - 1} (mask_indptr[{b}] = "
            f"{int(starts[b])}, draft {int(drafts[b])}), outside its {limit} {unit}")))
    verdicts = torch.stack([ok.all() for ok, _ in checks]).cpu()  # the one host sync
    for (ok, message), passed in zip(checks, verdicts.tolist(), strict=True):
        if not passed:
            raise ValueError(message(int((~ok).nonzero()[0, 0])))
