"""The fallback chain: grouped-head kernel -> per-head split-KV kernel -> general path.

Each kernel level is a generated module (``kgen.load(layout, kv, q, variant=...)``) whose
``verify_shared_kv_fwd`` / ``verify_paged_fwd`` returns False, touching nothing, when its
``can_handle`` refuses the call; the chain then asks the next level. The general path
(``kgen.runtime.general``) takes every valid input, so correctness never depends on a
kernel accepting.

Modules are looked up once, when the chain is built: a call does no file I/O, and for the
kernel levels no host sync (only tensor metadata is checked). Index values are checked
only when asked (``check_indices=True`` or ``KGEN_CHECK_INDICES=1``), because that syncs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kgen.runtime.gate import PATHS, PathName
from kgen.runtime.general import (
    PLAIN,
    Features,
    GeneralPath,
    Scale,
    check_chain_mask,
    check_flat_indices,
    check_paged_indices,
    validate_flat,
    validate_paged,
)

CHECK_INDICES_ENV = "KGEN_CHECK_INDICES"
KERNEL_PATHS: tuple[PathName, ...] = ("grouped", "per_head")
Loader = Callable[[str, str, str, str], Any]


def kgen_loader(layout: str, kv_dtype: str, q_dtype: str, variant: str) -> Any:
    """The default loader: ``kgen.load`` (imported late so the runtime imports without it)."""
    import kgen

    load = getattr(kgen, "load", None)
    if load is None:
        raise LookupError("kgen.load is not available in this checkout")
    return load(layout, kv_dtype, q_dtype, variant=variant)


@dataclass(frozen=True)
class Level:
    """One kernel level: its module, or None and why it could not be loaded."""

    name: PathName
    module: ModuleType | Any | None
    missing: str = ""


def _load_level(name: PathName, layout: str | None, kv: str, q: str, loader: Loader) -> Level:
    if layout is None:
        return Level(name, None, "no layout for this model")
    try:
        return Level(name, loader(layout, kv, q, name))
    except Exception as exc:  # noqa: BLE001 - any load failure only removes this level
        return Level(name, None, f"{type(exc).__name__}: {exc}")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class VerifyChain:
    """Runs the first level that accepts a verify call, starting at ``start``.

    ``layout``/``kv_dtype``/``q_dtype`` name the generated modules to use; ``start`` is
    usually the gate's ``GateDecision.path``. ``loader`` replaces ``kgen.load`` (tests pass
    fake modules that follow the module contract). ``topk`` is EAGLE's: at 1 a custom mask
    is SGLang's chain mask and kernels may ignore it (``check_indices`` verifies that); above
    1 masked calls go to the general path. ``last_path`` records which level ran the
    latest call, ``counts`` how often each did.
    """

    def __init__(
        self,
        layout: str | None,
        kv_dtype: str = "bfloat16",
        q_dtype: str = "bfloat16",
        *,
        start: PathName = "grouped",
        loader: Loader | None = None,
        general: GeneralPath | None = None,
        check_indices: bool | None = None,
        topk: int = 1,
    ) -> None:
        if start not in PATHS:
            raise ValueError(f"start must be one of {', '.join(PATHS)}, got {start!r}")
        loader = loader or kgen_loader
        first = PATHS.index(start)
        self.layout, self.kv_dtype, self.q_dtype = layout, kv_dtype, q_dtype
        self.levels: tuple[Level, ...] = tuple(
            _load_level(name, layout, kv_dtype, q_dtype, loader) for name in KERNEL_PATHS if PATHS.index(name) >= first
        )
        self._kernels = tuple(lv for lv in self.levels if lv.module is not None)
        self.general = general or GeneralPath()
        self.check_indices = _env_flag(CHECK_INDICES_ENV) if check_indices is None else check_indices
        # SGLang's convention: at topk == 1 the custom mask it passes encodes the causal
        # chain, and kernels do not read it (reading it would need a host sync). At
        # topk > 1 the mask is a tree, so calls that carry one skip the kernels.
        self.topk = topk
        self.last_path: PathName | None = None
        self.counts: dict[str, int] = dict.fromkeys(PATHS, 0)

    def describe(self) -> str:
        """One line per level: loaded module or why it is missing."""
        lines = []
        for lv in self.levels:
            state = getattr(lv.module, "URI", "loaded") if lv.module is not None else f"missing ({lv.missing})"
            lines.append(f"{lv.name}: {state}")
        lines.append("general: torch, chunked online softmax (takes every valid input)")
        return "\n".join(lines)

    def _ran(self, path: PathName) -> PathName:
        self.last_path = path
        self.counts[path] += 1
        return path

    def _validate_flat(self, args: tuple, k_scale: Scale, v_scale: Scale, f: Features, max_len: int | None) -> None:
        validate_flat(*args, k_scale, v_scale, f)
        if self.check_indices:
            q_extend, k_buffer, qo_indptr, kv_indptr = args[0], args[4], args[6], args[7]
            check_flat_indices(q_extend, k_buffer, qo_indptr, kv_indptr, args[8], max_len, f)
            if self._kernels_may_run(f):
                check_chain_mask(qo_indptr, kv_indptr[1:] - kv_indptr[:-1], f)

    def _kernels_may_run(self, f: Features) -> bool:
        return bool(self._kernels) and (f.custom_mask is None or self.topk == 1)

    def _kernels_flat(
        self,
        args: tuple,
        f: Features,
        max_len_extend: int,
        k_scale: Scale,
        v_scale: Scale,
        sm_scale: float | None,
        max_bs: int | None,
    ) -> PathName | None:
        if not self._kernels_may_run(f):
            return None
        for lv in self._kernels:
            if lv.module.verify_shared_kv_fwd(
                *args,
                f.custom_mask,
                f.is_causal,
                f.mask_indptr,
                max_len_extend,
                k_scale,
                v_scale,
                sm_scale=sm_scale,
                logit_cap=f.logit_cap,
                skip_prefix_custom_mask=f.skip_prefix_custom_mask,
                sliding_window_size=f.sliding_window_size,
                sinks=f.sinks,
                window_kv_offsets=f.window_kv_offsets,
                xai_temperature_len=f.xai_temperature_len,
                max_bs=max_bs,
            ):
                return self._ran(lv.name)
        return None

    def try_kernels(
        self,
        q_extend: torch.Tensor,
        k_extend: torch.Tensor,
        v_extend: torch.Tensor,
        o_extend: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        custom_mask: torch.Tensor | None,
        is_causal: bool,
        mask_indptr: torch.Tensor | None,
        max_len_extend: int,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        sm_scale: float | None = None,
        logit_cap: float = 0.0,
        skip_prefix_custom_mask: bool = True,
        sliding_window_size: int = -1,
        sinks: torch.Tensor | None = None,
        window_kv_offsets: torch.Tensor | None = None,
        xai_temperature_len: int = -1,
        max_bs: int | None = None,
    ) -> PathName | None:
        """Validate, then run the first kernel level that accepts; None when none does.

        For engines that keep their own fallback (SGLang's ``extend_attention_fwd``).
        Raises ValueError for input no path can take.
        """
        args = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
        f = Features(
            custom_mask,
            mask_indptr,
            is_causal,
            skip_prefix_custom_mask,
            sliding_window_size,
            sinks,
            window_kv_offsets,
            logit_cap,
            xai_temperature_len,
        )
        self._validate_flat(args, k_scale, v_scale, f, max_len_extend)
        return self._kernels_flat(args, f, max_len_extend, k_scale, v_scale, sm_scale, max_bs)

    def __call__(
        self,
        q_extend: torch.Tensor,
        k_extend: torch.Tensor,
        v_extend: torch.Tensor,
        o_extend: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        custom_mask: torch.Tensor | None = None,
        is_causal: bool = True,
        mask_indptr: torch.Tensor | None = None,
        max_len_extend: int | None = None,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        sm_scale: float | None = None,
        logit_cap: float = 0.0,
        skip_prefix_custom_mask: bool = True,
        sliding_window_size: int = -1,
        sinks: torch.Tensor | None = None,
        window_kv_offsets: torch.Tensor | None = None,
        xai_temperature_len: int = -1,
        max_bs: int | None = None,
    ) -> PathName:
        """Write ``o_extend`` through the first level that accepts; return its name.

        SGLang's argument list. ``max_len_extend`` (the longest draft) lets the kernels
        size their grid without a host sync; when None only the general path runs.
        """
        args = (q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices)
        f = Features(
            custom_mask,
            mask_indptr,
            is_causal,
            skip_prefix_custom_mask,
            sliding_window_size,
            sinks,
            window_kv_offsets,
            logit_cap,
            xai_temperature_len,
        )
        self._validate_flat(args, k_scale, v_scale, f, max_len_extend)
        if max_len_extend is not None:
            ran = self._kernels_flat(args, f, max_len_extend, k_scale, v_scale, sm_scale, max_bs)
            if ran is not None:
                return ran
        self.general.run_flat(*args, k_scale, v_scale, sm_scale, f)
        return self._ran("general")

    def paged(
        self,
        q_extend: torch.Tensor,
        k_extend: torch.Tensor,
        v_extend: torch.Tensor,
        o_extend: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        qo_indptr: torch.Tensor,
        max_len_extend: int | None,
        k_scale: Scale = 1.0,
        v_scale: Scale = 1.0,
        sm_scale: float | None = None,
        *,
        features: Features = PLAIN,
        config: dict | None = None,
    ) -> PathName:
        """vLLM-style pages (``k_cache [blocks, page, H_kv, D]``, ``block_table [bs, max_blocks]``,
        ``prefix_lens`` = committed prefix). Kernels take only plain causal calls (their
        ``verify_paged_fwd`` has no mask/cap/window/sink arguments); anything else goes
        straight to the general path, which gathers pages chunk by chunk."""
        args = (q_extend, k_extend, v_extend, o_extend, k_cache, v_cache, block_table, prefix_lens, qo_indptr)
        validate_paged(*args, k_scale, v_scale, features)
        if self.check_indices:
            check_paged_indices(q_extend, k_cache, block_table, prefix_lens, qo_indptr, max_len_extend, features)
        if features.plain and max_len_extend is not None:
            for lv in self._kernels:
                if lv.module.verify_paged_fwd(
                    *args, max_len_extend, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale, config=config
                ):
                    return self._ran(lv.name)
        self.general.run_paged(*args, k_scale, v_scale, sm_scale, features)
        return self._ran("general")
