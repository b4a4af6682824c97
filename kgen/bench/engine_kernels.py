"""SGLang's and vLLM's own Triton verify kernels as ``kgen bench`` peers: what those engines run
on an NVIDIA GPU when their FlashInfer backend is not the one chosen.

- ``sglang_triton``: SGLang's Triton backend (``SUPPORTED_VERSION`` of
  ``kgen.integrations.sglang``). On NVIDIA its target-verify step runs ``extend_attention_fwd``
  (``sglang/kernels/ops/attention/extend_attention.py``); the split-KV and grouped verify kernels
  beside it run on gfx95 only (``triton_backend.py``: ``use_verify_splitkv``,
  ``_should_use_verify_shared_kv``). Its call is the call kgen's SGLang entry takes, so it reads
  the case's own pool and inputs unchanged: the int64 kv_indices, the draft K/V apart
  (``k_extend``), a masked case's custom mask. On an FP8 pool it casts q to the pool's type for
  the prefix's q·k (``q.to(k.dtype)``, no scale of its own): the bench's check reports that
  error as it is.
- ``vllm_triton``: vLLM's Triton backends (``VLLM_VERSION`` of ``kgen.integrations.vllm``).
  GQA: ``TRITON_ATTN``'s ``unified_attention`` over a cache of 16-token pages (vLLM's default
  block size) holding the draft tokens, K and V of a token side by side in one tensor as its
  backend splits them, int32 block table and lengths, per-request descale tensors with the
  backend's KV quantization mode for its cache dtype (``get_kv_quant_mode``), and the
  split-K scratch its metadata builder reserves (sized from vLLM's own constants). MLA:
  ``TRITON_MLA``'s ``decode_attention_fwd``, a request's L queries as L decode rows whose KV
  extents end at their own token, what ``TritonMLAImpl.forward_mqa`` does for a verify batch
  (the per-call block-table repeat and extents are in the timed launch, as there), with vLLM's
  split count for the prefix. vLLM's Triton kernels take no custom mask: a masked case is refused.

vLLM's MLA kernel takes one scale for K's latent and V (its backend passes ``layer._k_scale`` for
both), so an FP8 case's pair becomes the same function as for FlashInfer's MLA wrapper
(``kgen.bench.pools.one_latent_scale``).

An engine is imported only when its kernel is asked for; a missing one makes that peer
unsupported, with the install command.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kgen.bench.cases import ENGINE_KERNELS, Case
from kgen.bench.inputs import CaseInputs, reference_subset
from kgen.bench.measure import KernelRun, _short
from kgen.bench.pools import Launch, PagedKV, as_bytes, one_latent_scale, paged_copy, pool_reference, token_pool
from kgen.integrations.sglang import SUPPORTED_VERSION as SGLANG_VERSION
from kgen.integrations.vllm import VLLM_VERSION
from kgen.launcher.device import INTERPRETER_NUM_SMS
from kgen.reference import relative_error

SGLANG_EXTEND = "sglang.kernels.ops.attention.extend_attention"
VLLM_UNIFIED = "vllm.v1.attention.ops.triton_unified_attention"
VLLM_TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
VLLM_DECODE = "vllm.v1.attention.ops.triton_decode_attention"
VLLM_TRITON_MLA = "vllm.v1.attention.backends.mla.triton_mla"
VLLM_KV_CACHE = "vllm.v1.kv_cache_interface"
# vLLM's default KV block size on CUDA; TRITON_ATTN takes multiples of 16.
VLLM_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Engine:
    """An engine's pinned release: its package and the command that installs it."""

    package: str
    version: str

    @property
    def install(self) -> str:
        return f"pip install {self.package}=={self.version}"

    def missing(self) -> bool:
        """Whether the package is not installed, without importing it (a cheap check for the CLI)."""
        if self.package in sys.modules:
            return sys.modules[self.package] is None
        try:
            return importlib.util.find_spec(self.package) is None
        except (ImportError, ValueError):
            return True

    def load(self, *modules: str) -> list[ModuleType]:
        """``modules`` of the installed release; ImportError naming the install command."""
        try:
            installed = getattr(importlib.import_module(self.package), "__version__", None)
            found = [importlib.import_module(m) for m in modules]
        except ImportError as exc:
            raise ImportError(f"{self.package} is not importable ({_short(exc, 200)}); {self.install}") from exc
        if installed != self.version:
            raise ImportError(f"{self.package} {installed} is installed; this peer follows {self.version}: "
                              f"{self.install}")  # fmt: skip
        return found


SGLANG = Engine("sglang", SGLANG_VERSION)
VLLM = Engine("vllm", VLLM_VERSION)
ENGINE_OF = {"sglang_triton": SGLANG, "vllm_triton": VLLM}


def _nan_outputs(inputs: CaseInputs) -> list[torch.Tensor]:
    return [torch.full_like(s.o, float("nan")) for s in inputs.sets]


def _num_sms(device: torch.device) -> int:
    """The SM count vLLM's MLA split rule reads (on the CPU, the interpreter's stand-in GPU's)."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------- SGLang


def sglang_launch(inputs: CaseInputs, mask: str) -> Launch:
    """``extend_attention_fwd`` on set i, with the case's mask as SGLang's custom mask."""
    (extend,) = SGLANG.load(SGLANG_EXTEND)
    case = inputs.case
    built = inputs.masks.get(mask)
    custom_mask, mask_indptr = built if built is not None else (None, None)
    outs = _nan_outputs(inputs)

    def fn(i: int) -> object:
        s = inputs.sets[i]
        return extend.extend_attention_fwd(
            s.q, s.k_extend, s.v_extend, outs[i], inputs.k_buffer, inputs.v_buffer, inputs.qo_indptr,
            inputs.kv_indptr, s.indices(case.indices), custom_mask, True, mask_indptr, case.draft,
            inputs.k_scale, inputs.v_scale, sm_scale=inputs.sm_scale,
        )  # fmt: skip

    return Launch(fn, outs)


# ---------------------------------------------------------------------------- vLLM


def _side_by_side(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One [pages, page_size, H_kv, D_k + D_v] cache holding each token's K then V, and its two
    views: the layout ``TritonAttentionImpl.forward`` splits (FP8 rows move as bytes)."""
    kv = torch.cat([as_bytes(k), as_bytes(v)], dim=-1).view(k.dtype)
    return kv[..., : k.shape[-1]], kv[..., k.shape[-1] :]


def _split_k_scratch(case: Case, device: torch.device) -> dict[str, object]:
    """The 3D (split-K) path's scratch as ``TritonAttentionMetadataBuilder`` reserves it under
    CUDA graphs: its sequence threshold (the capture size nearest MIN_LAUNCH_GRID_SIZE_2D / H_kv;
    with one KV head that quotient is itself a default capture size), NUM_PAR_SOFTMAX_SEGMENTS
    segments, and rows for that many sequences of min(L, MAX_3D_QUERY_LEN) tokens (vLLM's
    default max_num_seqs is larger than the threshold)."""
    (attn,) = VLLM.load(VLLM_TRITON_ATTN)
    threshold = attn.MIN_LAUNCH_GRID_SIZE_2D // case.kv_heads
    segments = attn.NUM_PAR_SOFTMAX_SEGMENTS
    rows = threshold * min(case.draft, attn.MAX_3D_QUERY_LEN)
    heads, width = case.num_q_heads, 1 << (case.v_dim - 1).bit_length()
    f32 = {"dtype": torch.float32, "device": device}
    return {
        "seq_threshold_3D": threshold,
        "num_par_softmax_segments": segments,
        "softmax_segm_output": torch.empty(rows, heads, segments, width, **f32),
        "softmax_segm_max": torch.empty(rows, heads, segments, **f32),
        "softmax_segm_expsum": torch.empty(rows, heads, segments, **f32),
    }


def vllm_gqa_launch(inputs: CaseInputs, paged: PagedKV) -> Launch:
    """``unified_attention`` on set i: the draft tokens in the cache, causal over each request."""
    unified, kv_cache = VLLM.load(VLLM_UNIFIED, VLLM_KV_CACHE)
    case = inputs.case
    device = paged.k.device
    # The backend's mode for its kv_cache_dtype: FP8 per-tensor dequantizes with the descales.
    mode = kv_cache.get_kv_quant_mode("fp8" if case.is_fp8 else "auto")
    key_cache, value_cache = _side_by_side(paged.k, paged.v)
    tables = [paged.pages[i].to(torch.int32) for i in range(inputs.n_sets)]
    descale = {name: torch.tensor([scale], dtype=torch.float32, device=device).expand(case.batch, case.kv_heads)
               for name, scale in (("k_descale", inputs.k_scale), ("v_descale", inputs.v_scale))}  # fmt: skip
    scratch = _split_k_scratch(case, device)
    outs = _nan_outputs(inputs)

    def fn(i: int) -> object:
        return unified.unified_attention(
            q=inputs.sets[i].q, k=key_cache, v=value_cache, out=outs[i], cu_seqlens_q=paged.qo_indptr,
            max_seqlen_q=case.draft, seqused_k=paged.kv_len, max_seqlen_k=case.prefix + case.draft,
            softmax_scale=inputs.sm_scale, causal=True, window_size=(-1, -1), block_table=tables[i], softcap=0.0,
            q_descale=None, **descale, **scratch, kv_quant_mode=mode,
        )  # fmt: skip

    return Launch(fn, outs)


def vllm_mla_launch(inputs: CaseInputs, paged: PagedKV) -> Launch:
    """``decode_attention_fwd`` on set i as ``TritonMLAImpl.forward_mqa`` calls it for a uniform
    verify batch: each request's block-table row repeated per query row, row t's extent P + t + 1."""
    decode, mla = VLLM.load(VLLM_DECODE, VLLM_TRITON_MLA)
    case = inputs.case
    device = paged.k.device
    rows, latent = case.batch * case.draft, case.v_dim
    cache = paged.k.unsqueeze(2)  # [pages, page_size, 1, 576], as forward_mqa adds the head dim
    splits = mla._compute_num_kv_splits(case.prefix + case.draft, _num_sms(device))
    sm_scale, scale = one_latent_scale(inputs)
    scale_t = torch.tensor(scale, dtype=torch.float32, device=device)
    tables = [paged.pages[i].to(torch.int32) for i in range(inputs.n_sets)]
    offsets = torch.arange(1 - case.draft, 1, dtype=torch.int32, device=device)
    logits = torch.empty(rows, case.num_q_heads, splits, latent + 1, dtype=torch.float32, device=device)
    lse = torch.empty(rows, case.num_q_heads, dtype=inputs.sets[0].q.dtype, device=device)
    outs = _nan_outputs(inputs)

    def fn(i: int) -> object:
        outs[i].zero_()
        lse.zero_()
        block_table = tables[i].repeat_interleave(case.draft, dim=0)
        seq_lens = (paged.kv_len.unsqueeze(1) + offsets).flatten().clamp(min=0)
        return decode.decode_attention_fwd(
            inputs.sets[i].q, cache, cache[..., :latent], outs[i], lse, block_table, seq_lens, logits, splits,
            sm_scale, paged.page_size, k_scale=scale_t, v_scale=scale_t, is_mla=True,
        )  # fmt: skip

    return Launch(fn, outs)


# ---------------------------------------------------------------------------- runs


def _checked(launch: Launch, reference: Callable[[], torch.Tensor]) -> Callable[[], float]:
    def check() -> float:
        out = launch.outs[0]
        out.fill_(float("nan"))
        launch.fn(0)
        ref = reference()
        return relative_error(out[: ref.shape[0]], ref, "max")

    return check


def sglang_run(inputs: CaseInputs) -> KernelRun:
    """SGLang's Triton verify kernel on the case's own inputs, and on the other mask of a mask A/B."""
    case = inputs.case

    def built(mask: str) -> tuple[Launch, Callable[[], float]]:
        launch = sglang_launch(inputs, mask)
        launch.fn(0)
        reference = inputs.reference if mask == case.mask else (lambda: reference_subset(inputs, mask))
        return launch, _checked(launch, reference)

    try:
        launch, check = built(case.mask)
        mask_alt = None
        if case.mask_ab:
            alt, alt_check = built(case.mask_ab)
            mask_alt = KernelRun(fn=alt.fn, n_sets=inputs.n_sets, check=alt_check, mask=case.mask_ab)
    except ImportError as exc:
        return KernelRun(unsupported=str(exc))
    except Exception as exc:  # noqa: BLE001 - a refused shape is a result, not a crash
        return KernelRun(unsupported=f"sglang_triton: {_short(exc, 300)}")
    return KernelRun(fn=launch.fn, n_sets=inputs.n_sets, check=check, index_dtype=case.indices, mask=case.mask,
                     mask_alt=mask_alt, choice=f"SGLang {SGLANG.version} extend_attention_fwd")  # fmt: skip


def vllm_run(inputs: CaseInputs, seed: int = 0) -> KernelRun:
    """vLLM's Triton kernel for the case's layout on a 16-token-page copy of its pool."""
    case = inputs.case
    if case.masked:
        return KernelRun(unsupported=f"vllm_triton: vLLM's Triton kernels take no custom mask ({case.mask})")
    try:
        pool = token_pool(inputs)
        paged = paged_copy(case, pool, VLLM_BLOCK_SIZE, seed)
        launch = vllm_gqa_launch(inputs, paged) if case.separate_v else vllm_mla_launch(inputs, paged)
        launch.fn(0)
    except ImportError as exc:
        return KernelRun(unsupported=str(exc))
    except Exception as exc:  # noqa: BLE001
        return KernelRun(unsupported=f"vllm_triton: {_short(exc, 300)}")
    kernel = "unified_attention (TRITON_ATTN)" if case.separate_v else "decode_attention_fwd (TRITON_MLA)"
    note = f"no {case.mask_ab} side of the mask A/B: vLLM's Triton kernels take no custom mask" if case.mask_ab else ""
    return KernelRun(fn=launch.fn, n_sets=inputs.n_sets, check=_checked(launch, lambda: pool_reference(inputs, pool,
                     case.mask)), index_dtype="int32", mask=case.mask, note=note,
                     choice=f"vLLM {VLLM.version} {kernel}, page {VLLM_BLOCK_SIZE}")  # fmt: skip


def engine_runs(inputs: CaseInputs, names: Sequence[str], seed: int = 0) -> dict[str, KernelRun]:
    """The engine kernels ``names`` on ``inputs``, each ready to time or refused with its reason."""
    runs: dict[str, KernelRun] = {}
    for name in names:
        if name == "sglang_triton":
            runs[name] = sglang_run(inputs)
        elif name == "vllm_triton":
            runs[name] = vllm_run(inputs, seed)
        else:
            raise ValueError(f"{name!r} is not an engine kernel; known: {', '.join(ENGINE_KERNELS)}")
    return runs
