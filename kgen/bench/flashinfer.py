"""FlashInfer 0.7.2.post1 as a ``kgen bench`` peer, on the case's own paged KV.

Names: ``flashinfer_<backend>`` reads the case's token-slot pool as pages of one token, and
``flashinfer_<backend>_page16`` a copy of the same KV in 16-token pages; ``<backend>`` is fa2
or fa3, FlashInfer's ``backend=`` argument. The wrapper follows the layout: a layout that stores
V apart from K runs ``BatchPrefillWithPagedKVCacheWrapper``, absorbed MLA (V is K's latent
columns) runs ``flashinfer.mla.BatchMLAPagedAttentionWrapper``.

What an engine hands FlashInfer, built in set-up, untimed (the pools: ``kgen.bench.pools``):

- the pool: the case's pool with every request's draft K/V appended (an engine writes the draft
  tokens into its pool before the verify step; kgen's kernels take them apart, as ``k_extend``).
  An FP8 pool stores them as an engine's quantizer does (``x / scale`` in e4m3), so the check's
  reference reads the draft values as stored;
- page size 1: that pool itself, the case's shuffled slots (then the draft slots) as page ids,
  last-page lengths 1; page size 16: the same rows copied into 16-token pages laid out in a
  shuffled page order;
- int32 ``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` / last-page lengths: FlashInfer's
  prebuilt kernels take int32, so the case's int64 page table is converted here, once;
- one wrapper per input set (a plan binds one page table), built with ``use_cuda_graph=True``
  and its own metadata buffers as engines capture it, sharing one float workspace (launches are
  serialized on one stream). ``plan()`` runs here; ``fn(i)`` is ``run()`` alone, so the timer's
  CUDA graph replays ``run()`` only.

Scales: batch prefill takes FP8 KV with ``k_scale`` / ``v_scale`` in ``run()``. The MLA wrapper
dequantizes the shared latent with one ``ckv_scale`` for the scores and the output alike, while
kgen's MLA cases scale K and V differently (K by k_scale, V by v_scale, to catch a swapped
scale); ``ckv_scale = kpe_scale = v_scale`` with ``sm_scale * k_scale / v_scale`` is the same
function exactly, and needs no extra kernel.

Refused, with the reason in the result: custom masks on the MLA wrapper (it has none) and on
FA3 batch prefill (FlashInfer's FA3 takes none), FP8 KV on FA3 batch prefill (FlashInfer's FA3
takes FP8 KV only with FP8 queries), and any kernel with no prebuilt sm_90a module in
FlashInfer's ``data/aot/`` (compiling one takes minutes on the GPU machine) unless
``KGEN_FLASHINFER_JIT=1`` (``kgen bench --flashinfer-jit``) allows it. Without that switch
``FLASHINFER_DISABLE_JIT=1`` is set around every FlashInfer call that may load a module, so a
kernel this module did not foresee fails fast instead of compiling.

FlashInfer is imported here only, lazily: without it the peer reports itself unsupported with
the install hint and nothing else changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch

from kgen.bench.cases import FLASHINFER_KERNELS, Case
from kgen.bench.inputs import CaseInputs
from kgen.bench.measure import KernelRun, _short
from kgen.bench.pools import Launch, PagedKV, TokenPool, one_latent_scale, page1, paged_copy, pool_reference, token_pool
from kgen.launcher.switches import env_flag
from kgen.reference import relative_error

FLASHINFER_VERSION = "0.7.2.post1"
INSTALL_HINT = (
    f"install it with `pip install 'kgen[flashinfer]'` (flashinfer-python=={FLASHINFER_VERSION}); on the GPU "
    "machine carry .whl and .fi-aot (benchmarks/README.md, \"FlashInfer\")"
)
# On: FlashInfer may compile kernels that are not prebuilt (minutes each on the GPU machine).
JIT_ENV = "KGEN_FLASHINFER_JIT"
PREFILL_WRAPPER = "BatchPrefillWithPagedKVCacheWrapper"
MLA_WRAPPER = "BatchMLAPagedAttentionWrapper"
# FlashInfer's recommended workspace is 128 MiB; one is shared by all of a case's wrappers.
WORKSPACE_BYTES = 256 << 20
# Each wrapper holds 8 MiB of device and 8 MiB of pinned host workspace of its own: the smallest
# cases (hundreds of input sets) rotate over at most this many sets, and say so in their note.
MAX_WRAPPER_SETS = 64
PAGE_SUFFIX = "_page"


class FlashInferUnavailable(ImportError):
    """FlashInfer cannot be imported; the message says how to install it."""


@dataclass(frozen=True)
class Variant:
    """One FlashInfer kernel name: its backend and the page size it reads."""

    name: str
    backend: str
    page_size: int


def variant_of(name: str) -> Variant:
    """``flashinfer_fa2`` -> (fa2, page 1); ``flashinfer_fa3_page16`` -> (fa3, page 16)."""
    if name not in FLASHINFER_KERNELS:
        raise ValueError(f"{name!r} is not a FlashInfer kernel; known: {', '.join(FLASHINFER_KERNELS)}")
    body, _, pages = name.removeprefix("flashinfer_").partition(PAGE_SUFFIX)
    return Variant(name, body, int(pages) if pages else 1)


def is_mla(case: Case) -> bool:
    """Absorbed MLA: V is K's latent columns, so FlashInfer's MLA wrapper serves it."""
    return not case.separate_v


def wrapper_name(case: Case) -> str:
    return MLA_WRAPPER if is_mla(case) else PREFILL_WRAPPER


def flashinfer_missing() -> str | None:
    """Why FlashInfer cannot be imported, without importing it (a cheap check for the CLI);
    None when it is installed."""
    if "flashinfer" in sys.modules:
        return None if sys.modules["flashinfer"] is not None else f"flashinfer is blocked; {INSTALL_HINT}"
    try:
        found = importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"flashinfer is not installed; {INSTALL_HINT}"


def load_flashinfer() -> ModuleType:
    """``import flashinfer``, or FlashInferUnavailable naming the install."""
    try:
        return importlib.import_module("flashinfer")
    except Exception as exc:  # ImportError, or a broken install (a missing tvm-ffi raises elsewhere)
        raise FlashInferUnavailable(f"flashinfer is not importable ({_short(exc, 160)}); {INSTALL_HINT}") from exc


def jit_allowed(flag: bool = False) -> bool:
    return flag or env_flag(JIT_ENV)


@contextlib.contextmanager
def no_jit(allowed: bool) -> Iterator[None]:
    """FlashInfer refuses to compile inside this block unless ``allowed``: a module with no
    prebuilt .so raises (FlashInfer's own ``FLASHINFER_DISABLE_JIT``) instead of compiling."""
    if allowed:
        yield
        return
    with mock.patch.dict(os.environ, {"FLASHINFER_DISABLE_JIT": "1"}):
        yield


# ---------------------------------------------------------------------------- which kernels


# FlashInfer's names of the pool dtypes the bench's cases hold (its JIT module names use them).
_KV_TAGS = {"bfloat16": "bf16", "float16": "f16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _dtype_tag(case: Case) -> str:
    return _KV_TAGS[case.kv_dtype]


def module_names(case: Case, v: Variant) -> tuple[str, ...]:
    """The FlashInfer JIT modules ``plan()`` loads for this case, named as FlashInfer names them
    (``flashinfer/jit/attention/modules.py``): the attention kernels, and for a custom mask the
    mask packer. FA2 batch prefill loads its equal-K/V-stride form (K and V pools here have one
    layout)."""
    kv = _dtype_tag(case)
    if is_mla(case):
        name = (f"batch_mla_attention_dtype_q_bf16_dtype_kv_{kv}_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_{case.v_dim}_"
                f"head_dim_kpe_{case.qk_dim - case.v_dim}_profiler_False_planabi2")  # fmt: skip
        return (name + ("_sm90" if v.backend == "fa3" else ""),)
    name = (f"batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_{kv}_dtype_o_bf16_dtype_idx_i32_"
            f"head_dim_qk_{case.qk_dim}_head_dim_vo_{case.v_dim}_posenc_0_use_swa_False_use_logits_cap_False_"
            "f16qk_False")  # fmt: skip
    name += "_sm90" if v.backend == "fa3" else "_kv_stride_equal"
    return (name, "quantization") if case.masked else (name,)


def aot_dir(fi: ModuleType) -> Path:
    """Where FlashInfer looks for prebuilt modules: ``<package>/data/aot/<name>/<name>.so``."""
    return Path(fi.__file__).resolve().parent / "data" / "aot"


def missing_modules(case: Case, v: Variant, fi: ModuleType) -> list[str]:
    root = aot_dir(fi)
    return [n for n in module_names(case, v) if not (root / n / f"{n}.so").is_file()]


def refusal(case: Case, v: Variant, fi: ModuleType | None, allow_jit: bool, mask: str | None = None) -> str | None:
    """Why ``v`` cannot run ``case`` (with ``mask``, default the case's), or None. FlashInfer's
    own limits first (they hold whatever is compiled), then the prebuilt kernels."""
    mask = case.mask if mask is None else mask
    if case.kv_dtype not in _KV_TAGS:
        return f"FlashInfer has no {case.kv_dtype} pool (its KV dtypes: {', '.join(_KV_TAGS)})"
    if not case.is_fp8 and case.kv_dtype != "bfloat16":
        return (f"the bench's queries are bfloat16 and FlashInfer's prefill takes a 16-bit pool in the query "
                f"dtype, not {case.kv_dtype}")
    if is_mla(case):
        if mask != "none":
            return f"{MLA_WRAPPER} takes no custom mask, so a {mask} draft mask cannot be given to it"
        if case.kv_heads != 1:
            return f"{MLA_WRAPPER} reads one latent KV head, the case has {case.kv_heads}"
    elif v.backend == "fa3" and mask != "none":
        return "FlashInfer's FA3 batch prefill takes no custom mask (is_fa3_backend_supported); FA2 does"
    elif v.backend == "fa3" and case.is_fp8:
        return "FlashInfer's FA3 batch prefill takes FP8 KV only with FP8 queries; the case's queries are BF16"
    if allow_jit or fi is None:
        return None
    masked = dataclasses.replace(case, mask=mask)
    missing = missing_modules(masked, v, fi)
    if missing:
        return (f"no prebuilt sm_90a kernel {missing[0]} in {aot_dir(fi)}: FlashInfer would compile it for "
                f"minutes (set {JIT_ENV}=1 or pass --flashinfer-jit to allow that)")  # fmt: skip
    return None


# ---------------------------------------------------------------------------- masks


def flashinfer_mask(inputs: CaseInputs, mask: str) -> torch.Tensor | None:
    """FlashInfer's ``custom_mask`` for ``mask``: request b's row-major [L, P + L] bools, the
    prefix columns True (FlashInfer has no skip-prefix rule: SGLang's layout writes them 0 and
    its kernels skip them), the draft columns the case's draft mask. None for the causal chain."""
    built = inputs.masks.get(mask)
    if built is None:
        return None
    case = inputs.case
    flat, indptr = built
    width = case.prefix + case.draft
    block = case.draft * width
    expected = torch.arange(case.batch + 1, device=indptr.device) * block
    if not torch.equal(indptr.long(), expected.long()):
        raise ValueError("the case's mask blocks are not back to back: cannot hand them to FlashInfer as one mask")
    out = flat.to(torch.bool).clone().view(case.batch, case.draft, width)
    out[:, :, : case.prefix] = True
    return out.reshape(-1)


# ---------------------------------------------------------------------------- launches


def _int32(n: int, device: torch.device) -> torch.Tensor:
    return torch.empty(n, dtype=torch.int32, device=device)


def _packed_mask_bytes(case: Case) -> int:
    """Room for FlashInfer's packed mask (each request's L x (P + L) bits rounded up to bytes)
    plus the tail slack its SM90 FP8 verify kernel reads past the end."""
    return case.batch * -(-case.draft * (case.prefix + case.draft) // 8) + 64


def prefill_launch(fi: ModuleType, inputs: CaseInputs, paged: PagedKV, v: Variant, workspace: torch.Tensor,
                   n_sets: int, mask: torch.Tensor | None) -> Launch:
    """One planned ``BatchPrefillWithPagedKVCacheWrapper`` per set (CUDA-graph mode, its own
    buffers); ``fn(i)`` is ``run()`` on set i with the case's scales (FP8)."""
    case = inputs.case
    device = paged.k.device
    scales = {"k_scale": inputs.k_scale, "v_scale": inputs.v_scale} if case.is_fp8 else {}
    wrappers = []
    for i in range(n_sets):
        indices = paged.kv_indices(i)
        buffers = {}
        if mask is not None:
            buffers = {"custom_mask_buf": torch.empty(_packed_mask_bytes(case), dtype=torch.uint8, device=device),
                       "mask_indptr_buf": _int32(case.batch + 1, device)}  # fmt: skip
        w = fi.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=_int32(case.batch + 1, device),
            paged_kv_indptr_buf=_int32(case.batch + 1, device), paged_kv_indices_buf=_int32(indices.numel(), device),
            paged_kv_last_page_len_buf=_int32(case.batch, device), backend=v.backend, **buffers,
        )  # fmt: skip
        w.plan(
            qo_indptr=paged.qo_indptr, paged_kv_indptr=paged.kv_indptr, paged_kv_indices=indices,
            paged_kv_last_page_len=paged.last_page_len, num_qo_heads=case.num_q_heads, num_kv_heads=case.kv_heads,
            head_dim_qk=case.qk_dim, page_size=paged.page_size, head_dim_vo=case.v_dim, custom_mask=mask,
            causal=mask is None, sm_scale=inputs.sm_scale, q_data_type=torch.bfloat16, kv_data_type=paged.k.dtype,
            o_data_type=torch.bfloat16, uniform_q_len=case.draft,
        )  # fmt: skip
        wrappers.append(w)
    outs = [torch.full_like(inputs.sets[i].o, float("nan")) for i in range(n_sets)]
    kv = (paged.k, paged.v)

    def fn(i: int) -> object:
        return wrappers[i].run(inputs.sets[i].q, kv, out=outs[i], **scales)

    return Launch(fn, outs)


def mla_scales(inputs: CaseInputs) -> tuple[float, dict[str, float]]:
    """(sm_scale, run scales) for the MLA wrapper, whose one ``ckv_scale`` (and ``kpe_scale``)
    serves K's latent and V alike: ``one_latent_scale``."""
    if not inputs.case.is_fp8:
        return inputs.sm_scale, {}
    sm_scale, scale = one_latent_scale(inputs)
    return sm_scale, {"ckv_scale": scale, "kpe_scale": scale}


def mla_launch(fi: ModuleType, inputs: CaseInputs, paged: PagedKV, v: Variant, workspace: torch.Tensor,
               n_sets: int) -> Launch:
    """One planned ``BatchMLAPagedAttentionWrapper`` per set (CUDA-graph mode, its reserved
    int32 buffers), packed query [T, H, 512 + 64] and packed pages [pages, page_size, 576]."""
    case = inputs.case
    mla = importlib.import_module("flashinfer.mla")
    device = paged.k.device
    sm_scale, scales = mla_scales(inputs)
    wrappers = []
    for i in range(n_sets):
        indices = paged.kv_indices(i)
        w = mla.BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True, qo_indptr=_int32(case.batch + 1, device),
            kv_indptr=_int32(case.batch + 1, device), kv_indices=_int32(indices.numel(), device),
            kv_len_arr=_int32(case.batch, device), backend=v.backend,
        )  # fmt: skip
        w.plan(
            metadata=mla.MLAPlanMetadata.csr(paged.qo_indptr, paged.kv_indptr, indices, paged.kv_len),
            num_heads=case.num_q_heads, head_dim_ckv=case.v_dim, head_dim_kpe=case.qk_dim - case.v_dim,
            page_size=paged.page_size, causal=True, sm_scale=sm_scale, q_data_type=torch.bfloat16,
            kv_data_type=paged.k.dtype,
        )  # fmt: skip
        wrappers.append(w)
    outs = [torch.full_like(inputs.sets[i].o, float("nan")) for i in range(n_sets)]

    def fn(i: int) -> object:
        return wrappers[i].run(query=inputs.sets[i].q, kv_cache=paged.k, out=outs[i], **scales)

    return Launch(fn, outs)


# ---------------------------------------------------------------------------- the check


# ---------------------------------------------------------------------------- runs


@dataclass
class _Build:
    """What every variant of one case shares."""

    fi: ModuleType
    inputs: CaseInputs
    pool: TokenPool
    paged: dict[int, PagedKV]
    workspace: torch.Tensor
    allow_jit: bool

    @property
    def n_sets(self) -> int:
        return min(self.inputs.n_sets, MAX_WRAPPER_SETS)


def _launch(b: _Build, v: Variant, mask: str) -> tuple[Launch, Callable[[], float]]:
    """Plan every set (FlashInfer may load its modules here) and run set 0 once, under the
    compile guard; the check NaN-fills set 0's output, runs it and compares with the reference."""
    paged = b.paged[v.page_size]
    with no_jit(b.allow_jit):
        if is_mla(b.inputs.case):
            launch = mla_launch(b.fi, b.inputs, paged, v, b.workspace, b.n_sets)
        else:
            launch = prefill_launch(b.fi, b.inputs, paged, v, b.workspace, b.n_sets, flashinfer_mask(b.inputs, mask))
        launch.fn(0)

    def check() -> float:
        out = launch.outs[0]
        out.fill_(float("nan"))
        with no_jit(b.allow_jit):
            launch.fn(0)
        reference = pool_reference(b.inputs, b.pool, mask)
        return relative_error(out[: reference.shape[0]], reference, "max")

    return launch, check


def _note(b: _Build, v: Variant) -> str:
    case = b.inputs.case
    parts = [f"plan() per input set in set-up, int32 page table converted from {case.indices}; run() timed"]
    if v.page_size != 1:
        parts.append(f"a page-{v.page_size} copy of the pool in shuffled page order")
    if case.is_fp8:
        parts.append("draft K/V stored in the FP8 pool (reference reads them as stored)")
        if is_mla(case):
            parts.append("ckv_scale = kpe_scale = v_scale, sm_scale * k_scale / v_scale")
    if b.n_sets < b.inputs.n_sets:
        parts.append(f"rotates {b.n_sets} of {b.inputs.n_sets} input sets")
    return "; ".join(parts)


def variant_run(b: _Build, v: Variant) -> KernelRun:
    """``v`` on the case as a KernelRun; with ``--mask a,b`` also the other mask's run (mask_alt)
    where FlashInfer takes it. A FlashInfer refusal (plan or first run) is ``unsupported``."""
    case = b.inputs.case
    try:
        launch, check = _launch(b, v, case.mask)
    except Exception as exc:  # noqa: BLE001 - a refused shape is a result, not a crash
        return KernelRun(unsupported=f"{v.name}: {_short(exc, 300)}")
    note = _note(b, v)
    mask_alt = None
    if case.mask_ab:
        why = refusal(case, v, b.fi, b.allow_jit, case.mask_ab)
        try:
            if why is None:
                alt, alt_check = _launch(b, v, case.mask_ab)
                mask_alt = KernelRun(fn=alt.fn, n_sets=b.n_sets, check=alt_check, mask=case.mask_ab)
        except Exception as exc:  # noqa: BLE001
            why = _short(exc, 200)
        if why is not None:
            note += f"; no {case.mask_ab} side of the mask A/B: {why}"
    return KernelRun(
        fn=launch.fn,
        n_sets=b.n_sets,
        check=check,
        choice=f"{wrapper_name(case)} {v.backend}, page {v.page_size}",
        note=note,
        index_dtype="int32",
        mask=case.mask,
        mask_alt=mask_alt,
    )


def flashinfer_runs(
    case: Case, inputs: CaseInputs, names: Sequence[str], allow_jit: bool = False, seed: int = 0,
    workspace_bytes: int = WORKSPACE_BYTES,
) -> dict[str, KernelRun]:  # fmt: skip
    """The FlashInfer kernels ``names`` on ``inputs``: refused ones with their reason, the rest
    planned (shared pool copies and workspace) and ready to time."""
    variants = [variant_of(n) for n in names]
    try:
        fi = load_flashinfer()
    except FlashInferUnavailable as exc:
        return {v.name: KernelRun(unsupported=str(exc)) for v in variants}
    allow_jit = jit_allowed(allow_jit)
    runs: dict[str, KernelRun] = {}
    todo = []
    for v in variants:
        why = refusal(case, v, fi, allow_jit)
        if why is None:
            todo.append(v)
        else:
            runs[v.name] = KernelRun(unsupported=why)
    if not todo:
        return runs
    pool = token_pool(inputs)
    paged = {ps: page1(case, pool) if ps == 1 else paged_copy(case, pool, ps, seed)
             for ps in sorted({v.page_size for v in todo})}  # fmt: skip
    workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=inputs.k_buffer.device)
    build = _Build(fi, inputs, pool, paged, workspace, allow_jit)
    for v in todo:
        runs[v.name] = variant_run(build, v)
    return runs

