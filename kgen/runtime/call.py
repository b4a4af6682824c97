"""One verify call as a value: SGLang's 23 arguments (``VerifyCall``), vLLM-style pages
(``PagedCall``), and the extras beyond a plain causal chain (``Features``).

SGLang's target-verify signature is written here once; the chain, the adapters and the
general path take these objects, so an argument added upstream is added in one place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch

Scale = float | torch.Tensor | None
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Features:
    """Everything beyond a plain causal chain; the fast kernels take a custom mask (a tree) and
    refuse the rest.

    ``custom_mask``/``mask_indptr``: in a ``VerifyCall`` SGLang's layout (request b's row-major
    [L, P + L] block from ``mask_indptr[b]``); in a ``PagedCall`` the paged entry's rows (draft
    token i of request b reads row ``mask_indptr[b] + i`` of a 2-D [rows, W] mask, columns
    0..L-1: draft columns only, every draft token sees the whole prefix)."""

    custom_mask: torch.Tensor | None = None
    mask_indptr: torch.Tensor | None = None
    is_causal: bool = True
    skip_prefix_custom_mask: bool = True
    sliding_window_size: int = -1
    sinks: torch.Tensor | None = None
    window_kv_offsets: torch.Tensor | None = None
    logit_cap: float = 0.0
    xai_temperature_len: int = -1

    @property
    def plain(self) -> bool:
        """True for a causal chain with none of the extras (what the paged kernels take)."""
        return (
            self.custom_mask is None
            and self.is_causal
            and self.sliding_window_size <= 0
            and self.sinks is None
            and not self.logit_cap
            and self.xai_temperature_len <= 0
        )

    def paged_kernel_mask(self) -> dict[str, Any] | None:
        """The draft-visibility keywords of a module's ``verify_paged_fwd`` for these features
        (``is_causal``, and the tree's mask when there is one: a mask governs whatever
        ``is_causal`` says, so ``is_causal=False`` without one is a whole draft block), or None
        when it has no argument for one of them (window, cap, sinks, temperature)."""
        if self.sliding_window_size > 0 or self.sinks is not None or self.logit_cap or self.xai_temperature_len > 0:
            return None
        if self.custom_mask is None:
            return {"is_causal": self.is_causal}
        return {"custom_mask": self.custom_mask, "mask_indptr": self.mask_indptr, "is_causal": self.is_causal}

    def describe(self) -> str:
        """The extras in words (``"plain causal"`` when there are none)."""
        parts = []
        if self.custom_mask is not None:
            parts.append("custom mask" + ("" if self.skip_prefix_custom_mask else " (prefix too)"))
        if not self.is_causal:
            parts.append("non-causal")
        if self.sliding_window_size > 0:
            parts.append(f"sliding window {self.sliding_window_size}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.logit_cap:
            parts.append(f"logit cap {self.logit_cap}")
        if self.xai_temperature_len > 0:
            parts.append(f"xai temperature {self.xai_temperature_len}")
        return ", ".join(parts) or "plain causal"

    def window_offsets(self, bs: int, device: torch.device) -> torch.Tensor:
        """Per-request column offset into the custom mask (``window_kv_offsets`` only counts
        with a custom mask and a sliding window; otherwise zeros)."""
        if self.custom_mask is not None and self.sliding_window_size > 0 and self.window_kv_offsets is not None:
            return self.window_kv_offsets[:bs].to(device=device, dtype=torch.int64)
        return torch.zeros(bs, dtype=torch.int64, device=device)


PLAIN = Features()


@dataclass(frozen=True)
class VerifyCall:
    """SGLang's target-verify arguments, in ``forward_extend``'s order.

    ``q_extend``/``o_extend`` are ``[T, H_q, D]``; ``k_buffer``/``v_buffer`` the token pool
    ``[slots, H_kv, D]``, request b's prefix slots being ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    ``max_len_extend`` (the longest draft) lets kernels size their grid without a host sync;
    None sends the call to the general path. ``k_scale``/``v_scale`` scale the pool's scores and
    values (FP8's descales, or a 16-bit pool's scales; None or 1.0: none). ``kv_len_adjust``
    (keyword-only, as SGLang passes it) is an int <= 0 added to each request's kv_indptr length:
    request b's prefix is its slice less the last ``-kv_len_adjust`` slots (SGLang decodes
    through the verify entry with -1, the new token already the slice's last slot).
    """

    q_extend: torch.Tensor
    k_extend: torch.Tensor
    v_extend: torch.Tensor
    o_extend: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor | None = None
    is_causal: bool = True
    mask_indptr: torch.Tensor | None = None
    max_len_extend: int | None = None
    k_scale: Scale = 1.0
    v_scale: Scale = 1.0
    sm_scale: float | None = None
    logit_cap: float = 0.0
    skip_prefix_custom_mask: bool = True
    sliding_window_size: int = -1
    sinks: torch.Tensor | None = None
    window_kv_offsets: torch.Tensor | None = None
    xai_temperature_len: int = -1
    max_bs: int | None = None
    kv_len_adjust: int = field(default=0, kw_only=True)

    @classmethod
    def from_sglang(cls, *args: Any, **kwargs: Any) -> VerifyCall:
        """The call from SGLang's positional and keyword arguments (the same names)."""
        positional = _positional_fields(cls)
        if len(args) > len(positional):
            raise TypeError(
                f"SGLang's verify call takes at most {len(positional)} positional arguments, got {len(args)} "
                "(kv_len_adjust is keyword-only)"
            )
        try:
            return cls(*args, **kwargs)
        except TypeError as exc:
            names = ", ".join(f.name for f in fields(cls))
            raise TypeError(f"{exc}; SGLang's verify arguments are ({names})") from None

    def as_sglang_args(self) -> tuple[Any, ...]:
        """The 23 positional arguments for a module's ``verify_shared_kv_fwd`` / ``why_not``
        (``kv_len_adjust`` goes by name)."""
        return tuple(getattr(self, f.name) for f in _positional_fields(type(self)))

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The nine leading tensors: draft q/k/v/o, the pool, and the offsets and slots."""
        return _values(self)[:9]

    @property
    def features(self) -> Features:
        """The extras of this call (mask, window, cap, sinks, temperature): Features' fields are
        named as SGLang's arguments."""
        return Features(**{f.name: getattr(self, f.name) for f in fields(Features)})

    def prefix_lens(self) -> torch.Tensor:
        """Each request's prefix length (its kv_indptr slice plus ``kv_len_adjust``), on the
        device (no sync)."""
        return self.kv_indptr[1:] - self.kv_indptr[:-1] + self.kv_len_adjust


@dataclass(frozen=True)
class PagedCall:
    """A verify call over vLLM-style pages: ``k_cache``/``v_cache [num_blocks, page, H_kv, D]``,
    request b's token t at ``cache[block_table[b, t // page], t % page]``, ``prefix_lens``
    the committed prefix of each request. A tree's ``features.custom_mask`` is in the paged
    entry's rows (see ``Features``). Kernels take it when ``features.paged_kernel_mask()``
    is not None."""

    q_extend: torch.Tensor
    k_extend: torch.Tensor
    v_extend: torch.Tensor
    o_extend: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    qo_indptr: torch.Tensor
    max_len_extend: int | None = None
    k_scale: Scale = 1.0
    v_scale: Scale = 1.0
    sm_scale: float | None = None
    features: Features = field(default=PLAIN, kw_only=True)
    config: dict | None = field(default=None, kw_only=True)
    # vLLM's FP8 query descale; every path refuses a call that would need it (``unserved_reason``).
    q_descale: Scale = field(default=None, kw_only=True)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The nine leading tensors, in ``verify_paged_fwd``'s order."""
        return _values(self)[:9]


def _positional_fields(cls: type) -> tuple[Any, ...]:
    return tuple(f for f in fields(cls) if not f.kw_only)


def _values(call: VerifyCall | PagedCall) -> tuple[Any, ...]:
    """The fields in order, not copied (``dataclasses.astuple`` would deep-copy the tensors)."""
    return tuple(getattr(call, f.name) for f in fields(call))


def sglang_signature(fn: _F) -> _F:
    """Show ``VerifyCall``'s parameters in place of ``fn``'s ``*args, **kwargs`` (for
    ``help()``, ``inspect`` and engines that check the call shape): SGLang's 23, then its
    keyword-only ``kv_len_adjust``; ``self`` and keyword-only parameters of ``fn`` stay. Calls
    still go through ``VerifyCall.from_sglang``."""
    own = inspect.signature(fn)
    call_params = list(inspect.signature(VerifyCall).parameters.values())
    params: list[inspect.Parameter] = []
    for p in own.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            params += call_params
        elif p.kind != p.VAR_KEYWORD:
            params.append(p)
    fn.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
    return fn
