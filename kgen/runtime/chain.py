"""The fallback chain: grouped-head kernel -> per-head split-KV kernel -> general path.

Each kernel level is a generated module (``kgen.load(layout, kv, q, variant=...)``) whose
``verify_shared_kv_fwd`` / ``verify_paged_fwd`` returns False, touching nothing, when its
``can_handle`` refuses the call; the chain then asks the next level. The general path
(``kgen.runtime.attend``) takes every valid input, so correctness never depends on a
kernel accepting.

Modules are looked up once, when the chain is built: a call does no file I/O, and for the
kernel levels no host sync (only tensor metadata is checked). Index values are checked
only when asked (``check_indices=True`` or ``KGEN_CHECK_INDICES=1``), because that syncs.

A valid call that no level computes correctly (``kgen.runtime.call_checks.unserved_reason``:
an FP8 query, a scale tensor of separate values, ``kv_len_adjust`` with a custom mask) is
refused before any level runs, ``o_extend`` untouched: ``try_call`` / ``try_paged`` return
None (the engine runs its own kernel), ``run`` / ``run_paged`` raise ValueError with the
reason; ``last_refusal`` keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, TypeVar

from kgen.launcher.switches import env_flag
from kgen.runtime.attend import GeneralPath
from kgen.runtime.call import PagedCall, VerifyCall, sglang_signature
from kgen.runtime.call_checks import (
    check_flat_indices,
    check_paged_indices,
    single_scale,
    unserved_reason,
    validate_flat,
    validate_paged,
)
from kgen.runtime.gate import PATHS, PathName

CHECK_INDICES_ENV = "KGEN_CHECK_INDICES"
KERNEL_PATHS: tuple[PathName, ...] = ("grouped", "per_head")
Loader = Callable[[str, str, str, str], Any]
_Call = TypeVar("_Call", VerifyCall, PagedCall)


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


class VerifyChain:
    """Runs the first level that accepts a verify call, starting at ``start``.

    ``layout``/``kv_dtype``/``q_dtype`` name the generated modules to use; ``start`` is
    usually the gate's ``GateDecision.path``. ``loader`` replaces ``kgen.load`` (tests pass
    fake modules that follow the module contract). Calls with a custom mask (EAGLE trees, or
    SGLang's chain written as a mask at topk = 1) go to the kernels like any other: the
    modules read the mask on the device, and one they cannot read they refuse. ``last_path``
    records which level ran the latest call, ``counts`` how often each did, ``last_refusal``
    why the latest refused call was refused.
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
        self.check_indices = env_flag(CHECK_INDICES_ENV) if check_indices is None else check_indices
        self.last_path: PathName | None = None
        self.last_refusal = ""
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

    def _validate_flat(self, call: VerifyCall) -> str:
        """Raise for invalid input; return why no level serves it ('' when one may)."""
        validate_flat(call)
        if self.check_indices:
            check_flat_indices(call)
        return self._refusal(call)

    def _validate_paged(self, call: PagedCall) -> str:
        validate_paged(call)
        if self.check_indices:
            check_paged_indices(call)
        return self._refusal(call)

    def _refusal(self, call: VerifyCall | PagedCall) -> str:
        reason = unserved_reason(call)
        if reason:
            self.last_refusal = reason
        return reason

    @staticmethod
    def _single_scales(call: _Call) -> _Call:
        """The call with a broadcast scale tensor (vLLM's ``[batch, H_kv]`` expand of one value)
        as the 1-element view every level takes; ``unserved_reason`` refused any other."""
        k_scale, v_scale = single_scale(call.k_scale), single_scale(call.v_scale)
        if k_scale is call.k_scale and v_scale is call.v_scale:
            return call
        return replace(call, k_scale=k_scale, v_scale=v_scale)

    def _kernels_flat(self, call: VerifyCall) -> PathName | None:
        if call.max_len_extend is None:
            return None
        args = call.as_sglang_args()
        for lv in self._kernels:
            if lv.module.verify_shared_kv_fwd(*args, kv_len_adjust=call.kv_len_adjust):
                return self._ran(lv.name)
        return None

    def try_call(self, call: VerifyCall) -> PathName | None:
        """Validate, then run the first kernel level that accepts; None when none does.

        For engines that keep their own fallback (SGLang's ``extend_attention_fwd``); a call
        no level serves (``last_refusal`` says why) returns None too. Raises ValueError for
        invalid input.
        """
        if self._validate_flat(call):
            return None
        return self._kernels_flat(self._single_scales(call))

    def run(self, call: VerifyCall) -> PathName:
        """Write ``call.o_extend`` through the first level that accepts; return its name.

        Without ``max_len_extend`` (the longest draft, which lets the kernels size their
        grid without a host sync) only the general path runs. A call no level serves raises
        ValueError with the reason, ``o_extend`` untouched.
        """
        reason = self._validate_flat(call)
        if reason:
            raise ValueError(reason)
        call = self._single_scales(call)
        ran = self._kernels_flat(call)
        if ran is not None:
            return ran
        self.general.run(call)
        return self._ran("general")

    @sglang_signature
    def __call__(self, *args: Any, **kwargs: Any) -> PathName:
        """``run`` with SGLang's arguments (``VerifyCall``'s fields, positional or by name)."""
        return self.run(VerifyCall.from_sglang(*args, **kwargs))

    def run_paged(self, call: PagedCall) -> PathName:
        """vLLM-style pages. Kernels take causal chains, whole draft blocks (``is_causal=False``
        without a mask) and trees (a custom mask in the paged entry's rows); their
        ``verify_paged_fwd`` has no cap/window/sink arguments, so calls with those go straight
        to the general path, which gathers pages chunk by chunk. A
        call no level serves raises ValueError with the reason, ``o_extend`` untouched."""
        reason = self._validate_paged(call)
        if reason:
            raise ValueError(reason)
        return self._run_paged_levels(call)

    def try_paged(self, call: PagedCall) -> PathName | None:
        """``run_paged``, but a call no level serves returns None (``last_refusal`` says why),
        ``o_extend`` untouched, so the engine runs its own kernel."""
        if self._validate_paged(call):
            return None
        return self._run_paged_levels(call)

    def try_paged_kernels(self, call: PagedCall) -> PathName | None:
        """``try_paged`` without the general path: validate, then run the first kernel level that
        accepts; None, ``o_extend`` untouched, when none does (or no level serves the call). For
        engines that keep their own kernel as the fallback (vLLM's, under CUDA graphs: the
        general path syncs the host). Raises ValueError for invalid input."""
        if self._validate_paged(call):
            return None
        return self._paged_kernels(self._single_scales(call))

    def _paged_kernels(self, call: PagedCall) -> PathName | None:
        mask = call.features.paged_kernel_mask()
        if mask is None or call.max_len_extend is None:
            return None
        for lv in self._kernels:
            if lv.module.verify_paged_fwd(
                *call.tensors, call.max_len_extend, k_scale=call.k_scale, v_scale=call.v_scale,
                sm_scale=call.sm_scale, config=call.config, **mask,
            ):  # fmt: skip
                return self._ran(lv.name)
        return None

    def _run_paged_levels(self, call: PagedCall) -> PathName:
        call = self._single_scales(call)
        ran = self._paged_kernels(call)
        if ran is not None:
            return ran
        self.general.run(call)
        return self._ran("general")

    def paged(self, *args: Any, **kwargs: Any) -> PathName:
        """``run_paged`` with ``PagedCall``'s arguments: ``(q_extend, k_extend, v_extend, o_extend,
        k_cache, v_cache, block_table, prefix_lens, qo_indptr, max_len_extend, k_scale, v_scale,
        sm_scale, *, features, config)``."""
        return self.run_paged(PagedCall(*args, **kwargs))
