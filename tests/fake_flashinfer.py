"""A stand-in for FlashInfer 0.7.2.post1 on the CPU: the two wrappers kgen bench uses, with
FlashInfer's documented semantics computed in torch, and a log of every plan() and run().

It follows what FlashInfer's source says (prefill.py, mla/_batch_mla/): plan() takes int32
CSR metadata (the prebuilt kernels are int32 only) and, in CUDA-graph mode, copies it into the
buffers given to the constructor, which run() then reads; run() reads pages through those
buffers. Batch prefill: query head h reads KV head h // group, causal is aligned to the end
of the KV (query i of a request sees key j <= kv_len - q_len + i), a custom mask is the
request's row-major [q_len, kv_len] bools with True = visible, k_scale multiplies sm_scale
and v_scale the output. MLA: the packed query and pages are [..., 512 + 64]; one ckv_scale
dequantizes the latent for both the scores and the output, kpe_scale the rope part.

``install(monkeypatch, tmp_path)`` puts it in sys.modules as ``flashinfer`` and
``flashinfer.mla``, with a package directory whose ``data/aot/`` holds the prebuilt module
names given (by default the ones the GPU machine's .fi-aot carries).
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

# The modules .fi-aot holds (tar tzf /work/shared/device/flashinfer/aot-sm90a-flashinfer-0.7.2.post1.tar.gz).
_PREFILL = ("batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_{kv}_dtype_o_bf16_dtype_idx_i32_head_dim_qk_256_"
            "head_dim_vo_256_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False")  # fmt: skip
_MLA = ("batch_mla_attention_dtype_q_bf16_dtype_kv_{kv}_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_"
        "profiler_False_planabi2")  # fmt: skip
PREBUILT = (
    _MLA.format(kv="bf16") + "_sm90",
    _PREFILL.format(kv="bf16") + "_sm90",
    "quantization",
    _PREFILL.format(kv="e4m3") + "_kv_stride_equal",
    _MLA.format(kv="bf16"),
    "eagle_verify_fp8kv_sm90",
    _PREFILL.format(kv="bf16") + "_kv_stride_equal",
    _MLA.format(kv="e4m3") + "_sm90",
)


@dataclass
class Log:
    """What the wrappers were given: one entry per constructor and plan() call, a run() count."""

    inits: list[dict[str, Any]] = field(default_factory=list)
    plans: list[dict[str, Any]] = field(default_factory=list)
    runs: int = 0
    # Test knob: ignore every mask (causal or custom), as a kernel with a broken mask would.
    ignore_mask: bool = False


LOG = Log()


def _rows(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """The first n token rows of ``pages`` of an NHD / MLA page pool, as float32."""
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    rows = raw[pages.long()].view(cache.dtype) if cache.element_size() == 1 else raw[pages.long()]
    return rows.reshape(-1, *cache.shape[2:])[:n].float()


def _require_int32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 (the prebuilt kernels' dtype_idx_i32), got {t.dtype}")


def _visible(custom: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor:
    if LOG.ignore_mask:
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    if custom is not None:
        return custom.view(q_len, kv_len)
    col, row = torch.arange(kv_len), torch.arange(q_len)
    return col[None, :] <= (kv_len - q_len + row)[:, None]


def _attend(scores: torch.Tensor, visible: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax over the visible keys of [H, L, N] scores, times [N, H, D] values -> [L, H, D]."""
    probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    return torch.einsum("hln,nhd->lhd", probs, values)


def _snapshot(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None, custom_mask_buf: torch.Tensor | None = None,
                 mask_indptr_buf: torch.Tensor | None = None, backend: str = "auto") -> None:  # fmt: skip
        if kv_layout != "NHD":
            raise ValueError("the fake knows NHD only")
        self.workspace, self.graph, self.backend = float_workspace_buffer, use_cuda_graph, backend
        self.bufs = {"qo": qo_indptr_buf, "kvp": paged_kv_indptr_buf, "kvi": paged_kv_indices_buf,
                     "last": paged_kv_last_page_len_buf}  # fmt: skip
        if use_cuda_graph and any(b is None for b in self.bufs.values()):
            raise ValueError("CUDA graph mode needs the four metadata buffers")
        self.custom_mask_buf = custom_mask_buf
        LOG.inits.append({"kind": "prefill", "backend": backend, "use_cuda_graph": use_cuda_graph,
                          "workspace": float_workspace_buffer.data_ptr()})  # fmt: skip

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
             paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             page_size: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             causal: bool = False, sm_scale: float | None = None, q_data_type: torch.dtype = torch.float16,
             kv_data_type: torch.dtype | None = None, o_data_type: torch.dtype | None = None,
             uniform_q_len: int | None = None) -> None:  # fmt: skip
        _require_int32(qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr, paged_kv_indices=paged_kv_indices,
                       paged_kv_last_page_len=paged_kv_last_page_len)  # fmt: skip
        if custom_mask is not None and self.graph and self.custom_mask_buf is None:
            raise ValueError("custom_mask_buf must be given in CUDA graph mode to use a custom mask")
        for key, src in (("qo", qo_indptr), ("kvp", paged_kv_indptr), ("last", paged_kv_last_page_len)):
            self.bufs[key].copy_(src)
        if paged_kv_indices.numel() > self.bufs["kvi"].numel():
            raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
        self.bufs["kvi"][: paged_kv_indices.numel()].copy_(paged_kv_indices)
        self.page_size, self.heads = page_size, (num_qo_heads, num_kv_heads)
        self.mask = None if custom_mask is None else custom_mask.detach().clone().bool()
        self.causal, self.sm_scale = causal, sm_scale if sm_scale is not None else head_dim_qk**-0.5
        self.dtypes = (q_data_type, kv_data_type or q_data_type)
        LOG.plans.append({"kind": "prefill", "backend": self.backend, "jit_disabled":
                          os.environ.get("FLASHINFER_DISABLE_JIT"), **_snapshot(dict(
                              qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr,
                              paged_kv_indices=paged_kv_indices, paged_kv_last_page_len=paged_kv_last_page_len,
                              num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
                              page_size=page_size, head_dim_vo=head_dim_vo, custom_mask=custom_mask, causal=causal,
                              sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
                              o_data_type=o_data_type, uniform_q_len=uniform_q_len))})  # fmt: skip

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *,
            k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None
            ) -> torch.Tensor:  # fmt: skip
        k_cache, v_cache = paged_kv_cache
        if q.dtype != self.dtypes[0] or k_cache.dtype != self.dtypes[1]:
            raise ValueError(f"q/kv dtypes {q.dtype}/{k_cache.dtype} differ from the plan's {self.dtypes}")
        if k_cache.shape[1] != self.page_size:
            raise ValueError(f"pages of {k_cache.shape[1]} tokens, planned {self.page_size}")
        LOG.runs += 1
        qo, kvp, last = (self.bufs[k].tolist() for k in ("qo", "kvp", "last"))
        group = self.heads[0] // self.heads[1]
        sm = self.sm_scale * (k_scale if k_scale is not None else 1.0)
        out = torch.empty(*q.shape[:-1], v_cache.shape[-1], dtype=q.dtype) if out is None else out
        bit = 0
        for b in range(len(qo) - 1):
            pages = self.bufs["kvi"][kvp[b] : kvp[b + 1]]
            n = (pages.numel() - 1) * self.page_size + last[b]
            k = _rows(k_cache, pages, n).repeat_interleave(group, dim=1)
            v = _rows(v_cache, pages, n).repeat_interleave(group, dim=1)
            qb = q[qo[b] : qo[b + 1]].float()
            custom = None if self.mask is None else self.mask[bit : bit + qb.shape[0] * n]
            bit += qb.shape[0] * n
            o = _attend(torch.einsum("lhd,nhd->hln", qb, k) * sm, _visible(custom, qb.shape[0], n), v)
            out[qo[b] : qo[b + 1]] = (o * (v_scale if v_scale is not None else 1.0)).to(out.dtype)
        return out


class MLAPlanMetadata:
    def __init__(self, **fields: torch.Tensor) -> None:
        self.__dict__.update(fields)

    @classmethod
    def csr(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_len_arr: torch.Tensor) -> MLAPlanMetadata:  # fmt: skip
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:  # fmt: skip
        self.graph, self.backend = use_cuda_graph, backend
        self.bufs = {"qo": qo_indptr, "kvp": kv_indptr, "kvi": kv_indices, "len": kv_len_arr}
        LOG.inits.append({"kind": "mla", "backend": backend, "use_cuda_graph": use_cuda_graph,
                          "workspace": float_workspace_buffer.data_ptr()})  # fmt: skip

    def plan(self, *, metadata: MLAPlanMetadata, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type: torch.dtype) -> None:  # fmt: skip
        src = {"qo": metadata.qo_indptr, "kvp": metadata.kv_indptr, "kvi": metadata.kv_indices,
               "len": metadata.kv_len_arr}  # fmt: skip
        _require_int32(**src)
        if self.graph and any(b is None for b in self.bufs.values()):
            raise ValueError("fa CUDA graph mode requires reserved qo_indptr, kv_indptr, kv_indices, kv_len_arr")
        for key, t in src.items():
            self.bufs[key][: t.numel()].copy_(t)
        self.page_size, self.widths = page_size, (head_dim_ckv, head_dim_kpe)
        self.causal, self.sm_scale = causal, sm_scale
        self.dtypes = (q_data_type, kv_data_type)
        LOG.plans.append({"kind": "mla", "backend": self.backend, "jit_disabled":
                          os.environ.get("FLASHINFER_DISABLE_JIT"), **_snapshot(dict(
                              qo_indptr=metadata.qo_indptr, kv_indptr=metadata.kv_indptr,
                              kv_indices=metadata.kv_indices, kv_len_arr=metadata.kv_len_arr, num_heads=num_heads,
                              head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=page_size,
                              causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
                              kv_data_type=kv_data_type))})  # fmt: skip

    def run(self, *, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None,
            ckv_scale: float | None = None, kpe_scale: float | None = None) -> torch.Tensor:  # fmt: skip
        if kv_cache.dtype != self.dtypes[1] or query.dtype != self.dtypes[0]:
            raise ValueError("dtypes differ from the plan's")
        fp8 = kv_cache.element_size() == 1
        if fp8 and (ckv_scale is None or kpe_scale is None):
            raise ValueError("kpe_scale and ckv_scale are required when kv_data_type is FP8.")
        if not fp8 and (ckv_scale is not None or kpe_scale is not None):
            raise ValueError("ckv_scale / kpe_scale are only valid when kv_data_type is FP8.")
        if kv_cache.dim() != 3 or kv_cache.shape[1] != self.page_size:
            raise ValueError(f"kv_cache must be [pages, {self.page_size}, ckv + kpe], got {tuple(kv_cache.shape)}")
        LOG.runs += 1
        ckv_w = self.widths[0]
        cs, ks = (ckv_scale, kpe_scale) if fp8 else (1.0, 1.0)
        qo, kvp, lens = (self.bufs[k].tolist() for k in ("qo", "kvp", "len"))
        out = torch.empty(*query.shape[:-1], ckv_w, dtype=query.dtype) if out is None else out
        for b in range(len(qo) - 1):
            rows = _rows(kv_cache, self.bufs["kvi"][kvp[b] : kvp[b + 1]], lens[b])  # [N, 576]
            ckv, kpe = rows[:, :ckv_w] * cs, rows[:, ckv_w:] * ks
            qb = query[qo[b] : qo[b + 1]].float()  # [L, H, 576]
            scores = (torch.einsum("lhd,nd->hln", qb[..., :ckv_w], ckv)
                      + torch.einsum("lhd,nd->hln", qb[..., ckv_w:], kpe)) * self.sm_scale  # fmt: skip
            visible = _visible(None, qb.shape[0], lens[b]) if self.causal else torch.ones(qb.shape[0], lens[b]).bool()
            heads = qb.shape[1]
            out[qo[b] : qo[b + 1]] = _attend(scores, visible, ckv[:, None].expand(-1, heads, -1)).to(out.dtype)
        return out


def install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, prebuilt: tuple[str, ...] = PREBUILT) -> Log:
    """Put the fake in sys.modules (``flashinfer``, ``flashinfer.mla``) with ``prebuilt`` as
    the .so files of its data/aot/; a fresh log."""
    package = tmp_path / "flashinfer"
    for name in prebuilt:
        (package / "data" / "aot" / name).mkdir(parents=True, exist_ok=True)
        (package / "data" / "aot" / name / f"{name}.so").write_bytes(b"")
    (package / "__init__.py").write_text("")
    fi = types.ModuleType("flashinfer")
    fi.__file__ = str(package / "__init__.py")
    fi.__version__ = "0.7.2.post1"
    fi.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    mla.MLAPlanMetadata = MLAPlanMetadata
    fi.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    fresh = Log()
    monkeypatch.setattr(sys.modules[__name__], "LOG", fresh)
    return fresh
