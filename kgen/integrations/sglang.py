"""kgen in SGLang 0.5.23: one switch routes ``TritonAttnBackend``'s target verification
through kgen's modules, and everything kgen refuses to SGLang's own kernel.

**The switch.** ``KGEN_SGLANG=1`` in the environment SGLang is launched with, kgen installed
in its environment. kgen declares the entry point ``kgen = kgen.integrations.sglang:plugin``
in SGLang's general-plugin group ``sglang.srt.plugins``; SGLang 0.5.23 loads that group in
every process it starts (``sglang.srt.plugins.load_plugins``, called by the engine, the
scheduler and the detokenizer), and ``plugin`` registers an AFTER hook on
``TritonAttnBackend.__init__`` with SGLang's ``HookRegistry`` only when the switch is on.
In a process that builds the backend itself, ``enable()`` does the same at once.

**What it changes.** When a ``TritonAttnBackend`` is built (sglang/srt/layers/attention/
triton_backend.py in sglang 0.5.23), ``route`` reads the model from the backend and its
model runner and asks ``decide`` (pure). Where kgen takes the model, it sets the backend's
``verify_shared_kv_fwd`` to kgen's chain (``SGLangVerify(defer_general=True)``) and
``use_verify_shared_kv = True``: ``forward_extend``'s own target-verify branch then calls
kgen first, in the seed's order (grouped-head module, then the per-head split-KV module),
and where both refuse the call (False, output untouched) it goes on to SGLang's own
``extend_attention_fwd``, as it does for SGLang's verify kernels. Nothing else in SGLang
changes; a backend kgen does not take keeps what SGLang's own gate chose.

**CUDA graphs.** kgen's part of a call checks tensor metadata only (no host sync) and
launches the module's kernels, whose scratch is cached by shape (one address from capture
to every replay); the launch plan depends on shapes and host ints (batch, longest draft),
never on values, so a replay repeats what was captured.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from kgen.launcher.switches import env_flag
from kgen.runtime.adapters import SGLangVerify, dtype_name, get_chain
from kgen.runtime.call import sglang_signature
from kgen.runtime.gate import (
    DETECT,
    GateDecision,
    GateQuery,
    Inventory,
    PathName,
    Switches,
    cached_inventory,
    decide_path,
    env_switches,
)
from kgen.spec import LayoutSpec, layouts_for_architecture

logger = logging.getLogger(__name__)

SUPPORTED_VERSION = "0.5.23"
SWITCH_ENV = "KGEN_SGLANG"
HOOK_TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"
_DEFAULT_SWITCHES = Switches()

# The architectures SGLang 0.5.23's own gate sends to its grouped-head verify kernel
# (``_should_use_verify_shared_kv`` in sglang/srt/layers/attention/triton_backend.py, through
# ``is_kimi_k3``, ``is_dspark_draft`` and ``is_qwen3_5`` in sglang/srt/configs/model_config.py).
# SGLang's gate also requires gfx950, topk 1, SGLANG_ENABLE_SPLITKV_VERIFY for DSpark drafts and
# Qwen3.5, and one TP-local KV head for Qwen3.5; kgen's gate replaces those with its targets,
# trees and any number of KV heads. A name no kgen layout lists is routed by its widths.
SGLANG_VERIFY_FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "KimiK3ForConditionalGeneration": "Kimi-K3 (MLA)",
        "KimiK3LinearForCausalLM": "Kimi-K3 (MLA)",
        "DSparkDraftModel": "DSpark draft",
        "DSparkMiniMaxDraftModel": "DSpark draft",
        "Qwen3_5ForConditionalGeneration": "Qwen3.5",
        "Qwen3_5MoeForConditionalGeneration": "Qwen3.5",
        "Qwen3_5ForCausalLM": "Qwen3.5",
        "Qwen3_5MoeForCausalLM": "Qwen3.5",
    }
)


@dataclass(frozen=True)
class SGLangModel:
    """What ``route`` reads from one ``TritonAttnBackend`` and its model runner (TP-local heads).

    ``qk_dim`` is the cache's K width (absorbed MLA: latent + RoPE, 576), ``v_dim`` its V width;
    ``dcp_size``, ``deterministic`` and ``skip_prefill`` are the backend's own fields, which
    decide whether ``forward_extend`` reaches its verify call at all.
    """

    model_arch: str
    use_mla: bool
    topk: int
    num_q_heads: int
    num_kv_heads: int
    qk_dim: int
    pe_dim: int
    v_dim: int
    kv_dtype: str = "bfloat16"
    q_dtype: str = "bfloat16"
    dcp_size: int = 1
    deterministic: bool = False
    skip_prefill: bool = False
    sglang_version: str = SUPPORTED_VERSION


@dataclass(frozen=True)
class SGLangRoute:
    """``decide``'s answer: whether kgen takes the backend's target verification, where its
    chain starts (``grouped`` or ``per_head``), the layout, and why."""

    use_kgen: bool
    start: PathName | None
    layout: str | None
    reason: str
    gate: GateDecision | None = None


def _off(reason: str, gate: GateDecision | None = None) -> SGLangRoute:
    return SGLangRoute(False, None, gate.layout if gate else None, reason, gate)


def _backend_refusal(model: SGLangModel) -> str:
    """Why ``forward_extend`` would never call the verify function (or kgen must not), '' if it may."""
    if model.sglang_version != SUPPORTED_VERSION:
        return (
            f"sglang {model.sglang_version} is not {SUPPORTED_VERSION}, the release whose "
            "TritonAttnBackend.forward_extend this switch was written and tested against"
        )
    if model.skip_prefill:
        return "a backend built with skip_prefill=True (draft decode) never runs target verification"
    if model.dcp_size > 1:
        return f"decode context parallelism (dcp_size {model.dcp_size}) sends forward_extend to _forward_extend_dcp"
    if model.deterministic:
        return (
            "deterministic inference sends forward_extend to _forward_extend_unified, and kgen's "
            "default modules are not batch invariant"
        )
    return ""


def _widths_match(spec: LayoutSpec, model: SGLangModel) -> bool:
    a = spec.attention
    return (a.qk_dim, a.pe_dim, a.v_head_dim) == (model.qk_dim, model.pe_dim, model.v_dim) and (
        (a.kind == "mla") == model.use_mla
    )


def with_sglang_families(inventory: Inventory, model: SGLangModel) -> tuple[Inventory, str]:
    """The inventory in which an architecture that SGLang's gate routes but no layout lists
    is listed by every layout whose widths (and MLA-ness) match, and a note saying so."""
    arch = model.model_arch
    family = SGLANG_VERIFY_FAMILIES.get(arch)
    if family is None or layouts_for_architecture(arch, dict(inventory.layouts)):
        return inventory, ""
    matched = sorted(name for name, spec in inventory.layouts.items() if _widths_match(spec, model))
    if not matched:
        return inventory, f"SGLang's gate routes {arch!r} ({family}); no kgen layout has its widths"
    layouts = dict(inventory.layouts)
    for name in matched:
        layouts[name] = layouts[name].model_copy(update={"architectures": (*layouts[name].architectures, arch)})
    note = f"SGLang's gate routes {arch!r} ({family}); kgen takes it by its widths ({', '.join(matched)})"
    return dataclasses.replace(inventory, layouts=MappingProxyType(layouts)), note


def decide(
    model: SGLangModel, *, device_arch: str | None, inventory: Inventory, switches: Switches = _DEFAULT_SWITCHES
) -> SGLangRoute:
    """Pure: whether kgen takes this backend's target verification, and where its chain starts.

    SGLang's preconditions first (the supported release, a backend that verifies, no DCP, not
    deterministic), then kgen's gate (``decide_path``) on the model, with SGLang's own verify
    families routed by their widths. A gate decision of ``general`` leaves SGLang's path as
    SGLang chose it: kgen's general path is not used here, SGLang's kernel is the fallback.
    """
    refusal = _backend_refusal(model)
    if refusal:
        return _off(refusal)
    if model.num_kv_heads < 1 or model.num_q_heads < 1 or model.num_q_heads % model.num_kv_heads:
        return _off(f"{model.num_q_heads} query heads are not a multiple of {model.num_kv_heads} KV heads")
    inv, note = with_sglang_families(inventory, model)
    # The backend's topk is 0 when speculative_eagle_topk is unset (drafters without EAGLE's tree):
    # the gate counts it as a chain, and the modules read whatever mask the call brings.
    query = GateQuery(
        model_arch=model.model_arch, topk=max(model.topk, 1), qk_dim=model.qk_dim, pe_dim=model.pe_dim,
        v_dim=model.v_dim, group_size=model.num_q_heads // model.num_kv_heads,
        num_local_kv_heads=model.num_kv_heads, kv_dtype=model.kv_dtype, q_dtype=model.q_dtype,
    )  # fmt: skip
    gate = decide_path(query, device_arch=device_arch, inventory=inv, switches=switches)
    reason = f"{note}; {gate.reason}" if note else gate.reason
    if gate.path == "general":
        return _off(f"SGLang's own path: {reason}", gate)
    return SGLangRoute(True, gate.path, gate.layout, reason, gate)


class KgenVerify:
    """SGLang's verify-function contract over kgen's chain: True when kgen wrote ``o_extend``,
    False (``o_extend`` untouched) when no kgen module takes the call, which sends
    ``forward_extend`` on to ``extend_attention_fwd``. Input kgen's validation rejects is
    SGLang's to run too: False, never an error; ``last_refusal`` says why."""

    def __init__(self, verify: SGLangVerify, route: SGLangRoute) -> None:
        self.verify = verify
        self.route = route
        self.last_refusal = ""

    @property
    def chain(self) -> Any:
        """The kgen chain (``last_path``, ``counts``, ``describe()``)."""
        return self.verify.chain

    @sglang_signature
    def __call__(self, *args: Any, **kwargs: Any) -> bool:
        """SGLang's verify arguments, as ``forward_extend`` passes them (``VerifyCall``'s fields)."""
        try:
            ran = self.verify(*args, **kwargs)
        except ValueError as exc:
            self._refused(str(exc))
            return False
        if not ran:
            self._refused(self.chain.last_refusal or "no kgen module takes this call (its why_not says why)")
        return ran

    def _refused(self, reason: str) -> None:
        if reason != self.last_refusal:
            logger.debug("kgen refused a target-verify call, SGLang's kernel runs it: %s", reason)
        self.last_refusal = reason


def _architecture(hf_config: Any) -> str:
    archs = hf_config.get("architectures") if isinstance(hf_config, dict) else getattr(hf_config, "architectures", None)
    return archs[0] if archs else ""


def _installed_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def model_facts(backend: Any, model_runner: Any, *, sglang_version: str | None = None) -> SGLangModel:
    """Read the model as one ``TritonAttnBackend`` sees it (sglang 0.5.23's field names)."""
    cfg = model_runner.model_config
    use_mla = bool(backend.use_mla)
    if use_mla:
        rank, rope = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
        qk, pe, v, kv_heads = rank + rope, rope, rank, 1  # the latent cache: one head, V its first columns
    else:
        qk, pe, v, kv_heads = int(cfg.head_dim), 0, int(cfg.v_head_dim), int(backend.num_kv_head)
    return SGLangModel(
        model_arch=_architecture(cfg.hf_config), use_mla=use_mla, topk=int(backend.topk or 0),
        num_q_heads=int(backend.num_head), num_kv_heads=kv_heads, qk_dim=qk, pe_dim=pe, v_dim=v,
        kv_dtype=dtype_name(model_runner.kv_cache_dtype), q_dtype=dtype_name(model_runner.dtype),
        dcp_size=int(backend.dcp_size), deterministic=bool(backend.enable_deterministic),
        skip_prefill=bool(backend.skip_prefill),
        sglang_version=_installed_version() if sglang_version is None else sglang_version,
    )  # fmt: skip


def route(
    backend: Any,
    model_runner: Any,
    *,
    device_arch: str | None | object = DETECT,
    env: Mapping[str, str] | None = None,
    inventory: Inventory | None = None,
) -> SGLangRoute:
    """Decide for one built ``TritonAttnBackend`` and, where kgen takes it, install kgen's chain
    as its grouped-head verify function (``backend.kgen_route`` keeps the decision).

    ``device_arch``, ``env`` and ``inventory`` replace the detected GPU, ``os.environ`` (kgen's
    switches: ``KGEN_DISABLE``, ``KGEN_FORCE_PATH``, ``TRITON_INTERPRET``) and the scanned
    modules (tests)."""
    from kgen.runtime.device import detect_arch

    model = model_facts(backend, model_runner)
    arch = detect_arch() if device_arch is DETECT else device_arch
    decision = decide(
        model, device_arch=arch, inventory=cached_inventory() if inventory is None else inventory,  # type: ignore[arg-type]
        switches=env_switches(env),
    )  # fmt: skip
    backend.kgen_route = decision
    if not decision.use_kgen:
        logger.info("kgen leaves %s's target verification to SGLang: %s", model.model_arch, decision.reason)
        return decision
    chain = get_chain(decision.layout, model.kv_dtype, model.q_dtype, decision.start)
    verify = KgenVerify(SGLangVerify(chain, defer_general=True, decision=decision.gate), decision)
    backend.kgen_verify = verify
    # As SGLang wraps its own verify kernels: torch.compile does not trace into the launcher.
    backend.verify_shared_kv_fwd = torch.compiler.disable(verify.__call__)
    backend.use_verify_shared_kv = True
    logger.info("kgen serves %s's target verification: %s", model.model_arch, decision.reason)
    return decision


_state = {"registered": False, "routing": False}


def _after_init(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """SGLang's AFTER hook on ``TritonAttnBackend.__init__(model_runner, ...)``: route the
    backend just built. A model whose fields kgen cannot read or describe keeps SGLang's path,
    with the reason logged: the switch never stops SGLang from starting."""
    if not _state["routing"]:
        return None
    model_runner = args[0] if args else kwargs.get("model_runner")
    try:
        route(backend, model_runner)
    except (ValueError, AttributeError, TypeError) as exc:
        logger.warning("kgen leaves target verification to SGLang (%s: %s)", type(exc).__name__, exc)
    return None


def _register(registry: Any, hook_type: Any) -> None:
    if not _state["registered"]:
        registry.register(HOOK_TARGET, _after_init, hook_type.AFTER)
        _state["registered"] = True
    _state["routing"] = True


def plugin(env: Mapping[str, str] | None = None) -> None:
    """SGLang's general-plugin entry point (group ``sglang.srt.plugins``, name ``kgen``): with
    ``KGEN_SGLANG=1`` register the hook; ``load_plugins`` applies it. Off: nothing changes."""
    if not env_flag(SWITCH_ENV, env):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _register(HookRegistry, HookType)


def enable() -> None:
    """Route every ``TritonAttnBackend`` built from now on in this process through kgen (the
    in-process form of ``KGEN_SGLANG=1``; idempotent). Needs sglang importable."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _register(HookRegistry, HookType)
    HookRegistry.apply_hooks()


def disable() -> None:
    """Backends built from now on keep SGLang's own path (those already built keep theirs)."""
    _state["routing"] = False


def is_enabled() -> bool:
    """Whether backends built now are routed."""
    return _state["routing"]


__all__: list[str] = [
    "SGLANG_VERIFY_FAMILIES", "SUPPORTED_VERSION", "SWITCH_ENV", "KgenVerify", "SGLangModel", "SGLangRoute",
    "decide", "disable", "enable", "is_enabled", "model_facts", "plugin", "route", "with_sglang_families",
]  # fmt: skip
