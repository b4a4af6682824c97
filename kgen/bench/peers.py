"""The four kernels of a case as ``KernelRun`` callables, and the device provider.

- ``grouped`` / ``per_head``: the generated modules' ``launch`` on the paged pool.
- ``flex``: ``torch.nn.attention.flex_attention`` compiled with ``torch.compile``, GQA
  through ``enable_gqa``, a block mask for the causal draft tail (none for L = 1, where
  every key is visible). Batch, heads and L stay static (FlexAttention's decode kernel,
  the one it uses for short queries, needs static batch and heads) while the KV length is
  dynamic, so one compile serves every prefix length of a (layout, batch, L).
- ``sdpa``: ``scaled_dot_product_attention`` in three forms (GQA with a lower-right
  causal bias, GQA with an explicit mask, query heads folded onto their KV head) times
  each backend; the fastest correct candidate wins and the report names it.

The peers run on dense gathered bf16 KV (``inputs.PeerInputs``); the gather is not timed.
FlashInfer (``flashinfer_*``, ``kgen.bench.flashinfer``) and the engines' Triton kernels
(``sglang_triton``, ``vllm_triton``: ``kgen.bench.engine_kernels``) read the case's own pool instead.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.util
import inspect
import itertools
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kgen.bench.cases import (
    BATCH_INVARIANT,
    ENGINE_KERNELS,
    FLASHINFER_KERNELS,
    HEADLINE_KERNEL,
    KGEN_KERNELS,
    Case,
    input_sets,
)
from kgen.bench.inputs import (
    CaseInputs,
    PeerInputs,
    build_inputs,
    build_peer_inputs,
    draft_mask,
    reference_subset,
    rows_from_folded,
    rows_from_heads,
)
from kgen.bench.measure import VARIANT_SEP, KernelRun, _short
from kgen.bench.timing import EagerTimer, Timer
from kgen.launcher.device import INTERPRETER, INTERPRETER_NUM_SMS
from kgen.reference import relative_error

# (layout, kv_dtype, variant) -> module; the variant BATCH_INVARIANT is the grouped kernel's batch-invariant module.
Loader = Callable[[str, str, str], ModuleType]

# The FlexAttention sweep: a small grid over the knobs its decode kernel reads.
FLEX_SWEEP_GRID: tuple[dict[str, int], ...] = tuple(
    {"BLOCK_N": bn, "num_warps": w, "num_stages": st} for bn, w, st in itertools.product((32, 64), (4, 8), (2, 3))
)
FLEX_SPARSE_BLOCK = 128
# SDPA's math backend materializes scores (and, for GQA, repeats K/V per query head):
# skipped past this many bytes, where it could only lose and might exhaust memory.
MATH_BYTES_LIMIT = 8 << 30


# ---------------------------------------------------------------------------- kgen kernels


def _default_loader(layout: str, kv_dtype: str, variant: str) -> ModuleType:
    import kgen

    if variant == BATCH_INVARIANT:
        return kgen.load(layout, kv_dtype, "bfloat16", batch_invariant=True)
    return kgen.load(layout, kv_dtype, "bfloat16", variant=variant)


def device_facts(device: torch.device) -> tuple[str, int]:
    """(arch, multiprocessor count) as the generated modules name them."""
    if device.type != "cuda":
        return INTERPRETER, INTERPRETER_NUM_SMS
    from kgen.runtime.device import arch_of

    props = torch.cuda.get_device_properties(device)
    return arch_of(props), props.multi_processor_count


def scratch_bytes_of(module: ModuleType, case: Case, arch: str, num_sms: int) -> int | None:
    """``module.scratch_bytes`` called by parameter name: the design note and the generated
    modules have spelled its signature differently, both are served."""
    fn = getattr(module, "scratch_bytes", None)
    if fn is None:
        return None
    known = {
        "num_tokens": case.num_tokens,
        "num_q_heads": case.num_q_heads,
        "num_kv_heads": case.kv_heads,
        "batch": case.batch,
        "max_len": case.draft,
        "max_len_extend": case.draft,
        "arch": arch,
        "num_sms": num_sms,
        "kv_indices_len": case.batch * case.prefix,  # a batch-invariant module's scratch depends on it
    }
    kwargs = {}
    for name, param in inspect.signature(fn).parameters.items():
        if name in known:
            kwargs[name] = known[name]
        elif param.default is inspect.Parameter.empty:
            return None
    return int(fn(**kwargs))


def config_label(module: ModuleType, case: Case, arch: str, num_sms: int) -> str:
    """What the module launches for this case (its table row or default): the Gluon prefix
    stage's section where the launcher picks that stage, else the Triton config."""
    try:
        cfg = module.select_config(arch, case.group, case.batch)
    except Exception:  # noqa: BLE001 - a label only
        return ""
    if _launches_gluon(module, case, arch, num_sms):
        gluon = cfg["gluon"]
        return (f"Gluon BLOCK_N={gluon['block_n']} stages={gluon['num_stages']} "
                f"ppsm={gluon.get('split', {}).get('programs_per_sm', 1)}")
    split = cfg.get("split", {})
    return (
        f"BLOCK_H={cfg.get('block_h')} BLOCK_N={cfg.get('block_n')} warps={cfg.get('num_warps')} "
        f"stages={cfg.get('num_stages')} ppsm={split.get('programs_per_sm', '-')}"
    )


def _launches_gluon(module: ModuleType, case: Case, arch: str, num_sms: int) -> bool:
    """Whether the module's launcher picks its Gluon prefix stage for this case (a module
    without launch_params, a stand-in, launches none)."""
    try:
        launches = module.launch_params(arch, num_sms, case.group, case.batch, case.draft, None, None,
                                        has_mask=case.mask != "none")
    except Exception:  # noqa: BLE001 - a label only
        return False
    return bool(launches) and launches[0][0] == "_gluon_prefix_stage"


@functools.cache
def module_from_file(path: Path) -> ModuleType:
    """A generated module imported from its file (an earlier build's copy), under a name of
    its own so it never replaces the current build's module of the same name."""
    name = f"kgen_baseline_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and triton.jit look their module up by name
    spec.loader.exec_module(module)
    return module


def baseline_run(case: Case, inputs: CaseInputs, variant: str, current: ModuleType, modules: Path) -> KernelRun:
    """The module named like ``current`` in ``modules`` (a copy of an earlier build's
    generated/), as a ``KernelRun`` on the same inputs with the case's kv_indices dtype."""
    path = Path(modules) / Path(str(getattr(current, "__file__", ""))).name
    if not path.is_file():
        return KernelRun(error=f"baseline: {modules} has no {path.name} (copy an earlier build's generated/ there)")
    return kgen_run(replace(case, index_dtype_ab=None, mask_ab=None), inputs, variant,
                    loader=lambda *a: module_from_file(path))


def kgen_run(
    case: Case, inputs: CaseInputs, variant: str, loader: Loader | None = None, baseline_modules: Path | None = None,
    batch_invariant: bool = False,
) -> KernelRun:
    """The generated module's ``launch`` on set ``i`` with the case's kv_indices dtype and
    mask; the check NaN-fills o first. A case with ``index_dtype_ab`` also gets ``alt``: the
    same launch on the other dtype's page table, timed in alternation with this one; one with
    ``mask_ab`` gets ``mask_alt``: the same launch with the other mask. With
    ``baseline_modules`` the grouped kernel also gets ``baseline``: the same-named module of
    that directory (an earlier build), timed in alternation with this one. With
    ``batch_invariant`` the grouped kernel is the batch-invariant module and gets
    ``default_mode``: the default grouped module, timed in alternation with it."""
    if batch_invariant and variant == HEADLINE_KERNEL:
        run = kgen_run(case, inputs, BATCH_INVARIANT, loader)
        if run.fn is not None:
            run.default_mode = kgen_run(case, inputs, HEADLINE_KERNEL, loader)
        return run
    try:
        module = (loader or _default_loader)(case.layout, case.kv_dtype, variant)
    except Exception as exc:  # noqa: BLE001
        return KernelRun(error=f"load {variant}: {_short(exc)}")
    arch, num_sms = device_facts(inputs.k_buffer.device)

    def launcher(dtype: str, mask: str) -> tuple[Callable[[int], None], Callable[[], float]]:
        mask_kwargs = inputs.mask_kwargs(mask)

        def fn(i: int) -> None:
            s = inputs.sets[i]
            module.launch(
                s.q, s.k_extend, s.v_extend, s.o, inputs.k_buffer, inputs.v_buffer,
                inputs.qo_indptr, inputs.kv_indptr, s.indices(dtype), case.draft,
                inputs.k_scale, inputs.v_scale, **mask_kwargs,
            )  # fmt: skip

        def check() -> float:
            s0 = inputs.sets[0]
            s0.o.fill_(float("nan"))
            fn(0)
            # A tree gives other outputs than a chain: the other side of a mask A/B is
            # checked against its own reference.
            reference = inputs.reference() if mask == case.mask else reference_subset(inputs, mask)
            return _check_rows(s0.o, inputs, reference)

        return fn, check

    try:
        scratch = scratch_bytes_of(module, case, arch, num_sms)
    except Exception:  # noqa: BLE001 - reported as unknown
        scratch = None
    fn, check = launcher(case.indices, case.mask)
    alt = mask_alt = None
    if case.index_dtype_ab:
        fn_ab, check_ab = launcher(case.index_dtype_ab, case.mask)
        alt = KernelRun(fn=fn_ab, n_sets=inputs.n_sets, check=check_ab, index_dtype=case.index_dtype_ab)
    if case.mask_ab:
        fn_ab, check_ab = launcher(case.indices, case.mask_ab)
        mask_alt = KernelRun(fn=fn_ab, n_sets=inputs.n_sets, check=check_ab, mask=case.mask_ab)
    run = KernelRun(
        fn=fn,
        n_sets=inputs.n_sets,
        check=check,
        choice=config_label(module, case, arch, num_sms),
        scratch_bytes=scratch,
        index_dtype=case.indices,
        alt=alt,
        mask_alt=mask_alt,
        module=str(getattr(module, "URI", "")),
    )
    if baseline_modules is not None and variant == HEADLINE_KERNEL:
        run.baseline = baseline_run(case, inputs, variant, module, baseline_modules)
        run.baseline_modules = str(baseline_modules)
    return run


def _check_rows(out_rows: torch.Tensor, inputs: CaseInputs, reference: torch.Tensor | None = None) -> float:
    """The max-norm relative error of the first checked rows against the reference."""
    rows = inputs.check_requests * inputs.case.draft
    return relative_error(out_rows[:rows], inputs.reference() if reference is None else reference, "max")


# ---------------------------------------------------------------------------- FlexAttention


def flex_label(options: Mapping[str, Any] | None) -> str:
    if not options:
        return "default"
    return ",".join(f"{k}={v}" for k, v in options.items())


def parse_flex_label(label: str) -> dict[str, Any] | None:
    """Inverse of ``flex_label``: ``BLOCK_N=32,num_warps=4`` -> dict (ints and bools)."""
    if not label or label == "default":
        return None
    out: dict[str, Any] = {}
    for part in label.split(","):
        name, _, text = part.partition("=")
        value: Any = text
        if text in ("True", "False"):
            value = text == "True"
        elif text.lstrip("-").isdigit():
            value = int(text)
        out[name.strip()] = value
    return out


def _flex_forward(q, k, v, kv_num_blocks, kv_indices, full_num_blocks, full_indices, prefix, scale, options):  # noqa: ANN001, ANN202, E501
    """The FlexAttention call; the block mask is rebuilt from its tensors inside the
    compiled region so its KV length is a symbol, not a constant (no recompile per P)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    block_mask = None
    if kv_num_blocks is not None:

        def causal_tail(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            return kv_idx <= prefix + q_idx

        block_mask = BlockMask.from_kv_blocks(
            kv_num_blocks, kv_indices, full_num_blocks, full_indices,
            BLOCK_SIZE=FLEX_SPARSE_BLOCK, mask_mod=causal_tail,
            seq_lengths=(q.size(-2), k.size(-2)),
        )  # fmt: skip
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=options)


_COMPILED_FLEX: list[Callable[..., torch.Tensor]] = []
# Errors that come from the dynamic KV length rather than from the shape itself.
_DYNAMIC_TROUBLE = re.compile(r"symbolic|dynamic|SymInt|Constraint|guard|speciali", re.IGNORECASE)


def _raise_recompile_limits(limit: int = 4096) -> None:
    """Each (layout, batch, L, options) is one compiled entry of the same function: the
    default limit (8) would silently fall back to the unfused eager path."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):  # fmt: skip
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


def compiled_flex() -> Callable[..., torch.Tensor]:
    if not _COMPILED_FLEX:
        _raise_recompile_limits()
        _COMPILED_FLEX.append(torch.compile(_flex_forward, dynamic=False))
    return _COMPILED_FLEX[0]


def _flex_mask_tensors(case: Case, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    if case.draft == 1:
        return (None, None, None, None)
    from torch.nn.attention.flex_attention import create_block_mask

    P = case.prefix

    def causal_tail(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return kv_idx <= P + q_idx

    bm = create_block_mask(causal_tail, None, None, case.draft, P + case.draft, device=device,
                           BLOCK_SIZE=FLEX_SPARSE_BLOCK)  # fmt: skip
    return (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)


def _mark_kv_dynamic(pin: PeerInputs, masks: tuple[torch.Tensor | None, ...]) -> None:
    """KV length dynamic (K, V dim 2; the block-index tensors' last dim), the rest static."""
    for t in [*pin.k, *pin.v]:
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for t in (masks[1], masks[3]):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 3)


def flex_run(
    case: Case, pin: PeerInputs, inputs: CaseInputs, options: Mapping[str, Any] | None = None,
    compile: bool = True,
) -> KernelRun:  # fmt: skip
    """FlexAttention on set ``i``; a shape it refuses (at compile or first run) is
    reported as unsupported with its reason."""
    device = pin.k[0].device
    masks = _flex_mask_tensors(case, device)
    prefix_t = torch.tensor(case.prefix, dtype=torch.int32, device=device)
    opts = dict(options) if options else None
    forward = compiled_flex() if compile else _flex_forward
    if compile:
        _mark_kv_dynamic(pin, masks)

    note = "" if compile else "eager (not compiled)"

    def fn(i: int) -> torch.Tensor:
        return forward(pin.q[i], pin.k[i], pin.v[i], *masks, prefix_t, pin.sm_scale, opts)

    first = _first_call(fn)
    if first is not None and compile and _DYNAMIC_TROUBLE.search(first):
        # A torch that refuses a symbolic KV length: compile this shape statically.
        _unmark_dynamic([*pin.k, *pin.v, *(m for m in masks if m is not None)])
        note = f"static shapes (dynamic KV length refused: {first})"
        first = _first_call(fn)
    if first is not None:
        return KernelRun(unsupported=f"flex ({flex_label(opts)}): {first}")
    return KernelRun(
        fn=fn,
        n_sets=pin.n_sets,
        check=lambda: _check_rows(rows_from_heads(fn(0), case), inputs),
        choice=flex_label(opts),
        note=note,
    )


def _first_call(fn: Callable[[int], torch.Tensor]) -> str | None:
    """Run set 0 once (compiles); the error text, or None when it ran."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(0)
    except Exception as exc:  # noqa: BLE001 - a refused shape is a result, not a crash
        return _short(exc, 200)
    return None


def _unmark_dynamic(tensors: list[torch.Tensor]) -> None:
    """Drop ``maybe_mark_dynamic`` marks (dynamo keeps them as tensor attributes)."""
    for t in tensors:
        for attr in ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_has_dynamo_dim_marking"):
            if hasattr(t, attr):
                delattr(t, attr)


# ---------------------------------------------------------------------------- SDPA


def _backends() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION", "math": "MATH"}  # fmt: skip
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


def sdpa_forms(case: Case) -> list[str]:
    """``gqa``: [bs, H_q, L, D] queries, enable_gqa, lower-right causal bias (none at L=1);
    ``gqa_mask``: the same with an explicit additive mask; ``folded``: the G query heads of
    a KV head as G*L query rows of one head (no K/V repeat), explicit mask."""
    return ["gqa", "folded"] if case.draft == 1 else ["gqa", "gqa_mask", "folded"]


def _math_bytes(case: Case, form: str) -> int:
    S = case.prefix + case.draft
    scores = case.batch * case.num_q_heads * case.draft * S * 4 * 3
    repeat = 0
    if form.startswith("gqa"):
        repeat = case.batch * case.num_q_heads * S * (case.qk_dim + case.v_dim) * 2
    return scores + repeat


def sdpa_fn(case: Case, pin: PeerInputs, form: str, backend: Any) -> Callable[[int], torch.Tensor]:
    """The SDPA call of one form under one backend (``sdpa_kernel`` restricts to it)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    device = str(pin.k[0].device)
    mask: Any = None
    if form == "gqa" and case.draft > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(case.draft, case.prefix + case.draft)
    elif form == "gqa_mask":
        mask = draft_mask(case.prefix, case.draft, 1, device)
    elif form == "folded" and case.draft > 1:
        mask = draft_mask(case.prefix, case.draft, case.group, device)
    queries = pin.q_folded if form == "folded" else pin.q
    gqa = form != "folded"

    def fn(i: int) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(
                queries[i], pin.k[i], pin.v[i], attn_mask=mask, scale=pin.sm_scale, enable_gqa=gqa
            )

    return fn


def _sdpa_rows(out: torch.Tensor, case: Case, form: str) -> torch.Tensor:
    return rows_from_folded(out, case) if form == "folded" else rows_from_heads(out, case)


def sdpa_run(case: Case, pin: PeerInputs, inputs: CaseInputs, select_timer: Timer) -> KernelRun:
    """Try every (form, backend); time those that run with ``select_timer``; keep the fastest
    whose output is right. The note lists what was tried."""
    tried: list[tuple[float, str, Callable[[int], torch.Tensor], str]] = []
    refused: list[str] = []
    for form in sdpa_forms(case):
        for bname, backend in _backends().items():
            label = f"{form}/{bname}"
            if bname == "math" and _math_bytes(case, form) > MATH_BYTES_LIMIT:
                refused.append(f"{label}: skipped (memory)")
                continue
            fn = sdpa_fn(case, pin, form, backend)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    err = _check_rows(_sdpa_rows(fn(0), case, form), inputs)
                    if err > 0.1:
                        refused.append(f"{label}: wrong (err {err:.2g})")
                        continue
                    us = select_timer(fn, pin.n_sets).median_us
            except Exception as exc:  # noqa: BLE001 - the backend refused this shape
                refused.append(f"{label}: {_short(exc, 80)}")
                _free_device_memory(pin.k[0].device)
                continue
            tried.append((us, label, fn, form))
    if not tried:
        return KernelRun(unsupported="sdpa: no backend ran: " + "; ".join(refused))
    tried.sort(key=lambda t: t[0])
    _, label, fn, form = tried[0]
    timed = ", ".join(f"{lab} {us:.1f}us" for us, lab, _, _ in tried)
    return KernelRun(
        fn=fn,
        n_sets=pin.n_sets,
        check=lambda: _check_rows(_sdpa_rows(fn(0), case, form), inputs),
        choice=label,
        note=f"selected (eager) from: {timed}" + (f"; refused: {len(refused)}" if refused else ""),
    )


# ---------------------------------------------------------------------------- provider


def _free_device_memory(device: torch.device | str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class DeviceProvider:
    """Builds one case's inputs and kernels on ``device`` for ``measure.run_matrix``.

    Kernel names: ``grouped``, ``per_head``, ``flex``, ``sdpa``, ``flex@<options>`` for a
    FlexAttention kernel-options variant (the sweep), ``flashinfer_<backend>[_page16]``
    (``kgen.bench.flashinfer``) and ``sglang_triton`` / ``vllm_triton``
    (``kgen.bench.engine_kernels``), each imported only when asked for. Everything is freed on exit.
    """

    device: str = "cuda"
    l2_bytes: int = 50 << 20
    seed: int = 0
    max_sets: int = 512
    compile_flex: bool = True
    select_timer: Timer = field(default_factory=EagerTimer)
    loader: Loader | None = None
    # A copy of an earlier build's generated/: its grouped modules are timed in alternation
    # with the current ones (``--baseline-modules``).
    baseline_modules: Path | None = None
    # The grouped kernel is the batch-invariant module, timed in alternation with the default
    # one (``--batch-invariant``).
    batch_invariant: bool = False
    # (layout, group, L == 1, options) -> why FlexAttention refused it: a refusal of a head
    # width holds for every batch and prefix, and each attempt costs a compile.
    flex_refused: dict[tuple[str, int, bool, str], str] = field(default_factory=dict)
    # FlashInfer may compile kernels that are not prebuilt (--flashinfer-jit; minutes each).
    flashinfer_jit: bool = False

    @contextlib.contextmanager
    def __call__(self, case: Case, names: frozenset[str]) -> Iterator[dict[str, KernelRun]]:
        n_sets = input_sets(case, self.l2_bytes, max_sets=self.max_sets)
        inputs = build_inputs(case, self.device, n_sets, self.seed)
        runs: dict[str, KernelRun] = {}
        try:
            for name in sorted(names):
                if name in KGEN_KERNELS:
                    runs[name] = kgen_run(case, inputs, name, self.loader, self.baseline_modules,
                                          self.batch_invariant)
            flashinfer_names = sorted(n for n in names if n in FLASHINFER_KERNELS)
            if flashinfer_names:
                runs.update(self._flashinfer(case, inputs, flashinfer_names))
            engine_names = sorted(n for n in names if n in ENGINE_KERNELS)
            if engine_names:
                runs.update(self._engines(inputs, engine_names))
            own_pool = (*KGEN_KERNELS, *FLASHINFER_KERNELS, *ENGINE_KERNELS)
            peer_names = sorted(n for n in names if n not in own_pool)
            if peer_names:
                runs.update(self._peers(case, inputs, peer_names))
            yield runs
        finally:
            runs.clear()
            del inputs
            _free_device_memory(self.device)

    def _flex(self, case: Case, pin: PeerInputs, inputs: CaseInputs, label: str) -> KernelRun:
        key = (case.layout, case.group, case.draft == 1, label or "default")
        if key in self.flex_refused:
            return KernelRun(unsupported=self.flex_refused[key])
        run = flex_run(case, pin, inputs, parse_flex_label(label), self.compile_flex)
        if run.unsupported and "out of memory" not in run.unsupported.lower():
            self.flex_refused[key] = f"{run.unsupported} (first refused at {case.key})"
        return run

    def _flashinfer(self, case: Case, inputs: CaseInputs, names: list[str]) -> dict[str, KernelRun]:
        """FlashInfer reads the case's own pool (and masks), not the dense peer inputs."""
        from kgen.bench.flashinfer import flashinfer_runs

        return flashinfer_runs(case, inputs, names, allow_jit=self.flashinfer_jit, seed=self.seed)

    def _engines(self, inputs: CaseInputs, names: list[str]) -> dict[str, KernelRun]:
        """The engines' Triton kernels read the case's own pool (and masks), as the engines do."""
        from kgen.bench.engine_kernels import engine_runs

        return engine_runs(inputs, names, seed=self.seed)

    def _peers(self, case: Case, inputs: CaseInputs, names: list[str]) -> dict[str, KernelRun]:
        if case.peers_refusal:
            return {name: KernelRun(unsupported=case.peers_refusal) for name in names}
        pin = build_peer_inputs(inputs)
        runs: dict[str, KernelRun] = {}
        for name in names:
            base, _, label = name.partition(VARIANT_SEP)
            if base == "flex":
                runs[name] = self._flex(case, pin, inputs, label)
            elif base == "sdpa":
                runs[name] = sdpa_run(case, pin, inputs, self.select_timer)
            else:
                runs[name] = KernelRun(error=f"unknown kernel {name!r}")
        return runs
