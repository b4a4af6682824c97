"""The tensors of one case: a paged KV pool, a shuffled page table and rotated input sets,
all built by ``kgen.problems.make_case`` (the tests' and the tuner's builder too).

The generated kernels read SGLang's token-slot pool: ``k_buffer [slots, H_kv, D_qk]``,
``v_buffer [slots, H_kv, D_v]`` (absorbed MLA: a view of K's first D_v columns),
``kv_indices`` into it, in the case's index dtype (int64 unless asked: SGLang's), plus
the same indices in the other dtype when the case times both in alternation. The page
table is a random permutation of the slots, as in a long-running server, not ``arange``
(which would flatter any kernel with perfectly sequential reads). Each input set owns its
own slots, queries and outputs; together the sets exceed twice the L2 so a replayed graph
reads K/V from HBM every launch.

The peers read the same values gathered into dense ``[bs, H, S, D]`` bf16 tensors (FP8
pool values dequantized with the case's scales), built outside any timed region.

Inputs are made to be *checkable*: each request's draft queries and keys share a random
direction whose score stands ~ln(prefix) above the prefix keys' (``make_case``'s
``draft_affinity``), so the draft block carries a visible share of the softmax mass and a
wrong causal mask on the draft tail shows in the output instead of drowning in a 32K-token
average.

A masked case (``--mask chain|tree``) hands the kernels SGLang's custom mask: one [L, P + L]
block per request (its P prefix columns never read), the chain or a random EAGLE-like tree
per request, shared by the input sets (the kernels read only its L x L draft bits).
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field

import torch

from kgen.bench.cases import TREE_TOPK, Case
from kgen.problems import chain_mask, draft_affinity_for, eagle_tree, make_case, sglang_mask
from kgen.reference import reference_verify
from kgen.spec import LayoutSpec, load_layouts

FP8_K_SCALE = 0.75
FP8_V_SCALE = 1.25
CHECK_REQUESTS = 2  # requests compared with the reference (the reference is slow)


@dataclass
class InputSet:
    q: torch.Tensor  # [bs*L, H_q, D_qk] bf16
    k_extend: torch.Tensor  # [bs*L, H_kv, D_qk] bf16
    v_extend: torch.Tensor  # [bs*L, H_kv, D_v] bf16 (MLA: view of k_extend)
    o: torch.Tensor  # [bs*L, H_q, D_v] bf16
    kv_indices: torch.Tensor  # [bs*P] in case.indices' dtype, this set's slots in shuffled order
    kv_indices_ab: torch.Tensor | None = None  # the same slots in case.index_dtype_ab

    def indices(self, dtype: str) -> torch.Tensor:
        """This set's page table in ``dtype`` (the case's or its A/B's)."""
        for table in (self.kv_indices, self.kv_indices_ab):
            if table is not None and table.dtype == getattr(torch, dtype):
                return table
        raise ValueError(f"this input set has no {dtype} kv_indices (built for {self.kv_indices.dtype})")


@dataclass
class CaseInputs:
    case: Case
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    sets: list[InputSet]
    k_scale: float
    v_scale: float
    sm_scale: float
    # (custom_mask, mask_indptr) in SGLang's layout of each mask the case times ("none": None).
    masks: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)
    _reference: torch.Tensor | None = field(default=None, repr=False)

    def mask_kwargs(self, mask: str) -> dict[str, torch.Tensor]:
        """A module's ``launch`` keywords for ``mask`` (empty for the unmasked chain)."""
        built = self.masks.get(mask)
        return {} if built is None else {"custom_mask": built[0], "mask_indptr": built[1]}

    @property
    def n_sets(self) -> int:
        return len(self.sets)

    @property
    def check_requests(self) -> int:
        return min(CHECK_REQUESTS, self.case.batch)

    def reference(self) -> torch.Tensor:
        """fp32 output of the first requests of set 0, computed once per case."""
        if self._reference is None:
            self._reference = reference_subset(self)
        return self._reference


@functools.cache
def _layout(name: str) -> LayoutSpec:
    return load_layouts()[name]


def case_seed(case: Case, seed: int) -> int:
    """The seed of one case's inputs: the run's seed and the case's key."""
    return seed * 1_000_003 + zlib.crc32(case.key.encode())


def draft_masks(case: Case, mask: str, seed: int = 0) -> list[torch.Tensor] | None:
    """Each request's [L, L] draft mask for ``mask``: None (no mask), the chain, or a random
    EAGLE-like tree of topk TREE_TOPK (a different one per request)."""
    if mask == "none":
        return None
    if mask == "chain":
        return [chain_mask(case.draft)] * case.batch
    return [eagle_tree(case.draft, TREE_TOPK, seed=case_seed(case, seed) + b) for b in range(case.batch)]


def build_inputs(case: Case, device: str | torch.device, n_sets: int = 1, seed: int = 0) -> CaseInputs:
    """``n_sets`` x batch requests of one ``make_case`` problem, set ``s`` being requests
    ``s * batch`` onwards: one pool, each set's slots a disjoint slice of one random
    permutation (the same permutation whatever the index dtype, so two dtypes time the
    same reads), and each set its own queries, draft K/V and NaN-filled outputs."""
    k_scale, v_scale = (FP8_K_SCALE, FP8_V_SCALE) if case.is_fp8 else (1.0, 1.0)
    requests = n_sets * case.batch
    full = make_case(
        _layout(case.layout), [case.prefix] * requests, [case.draft] * requests, case.group,
        num_kv_heads=case.kv_heads, kv_dtype=case.kv_dtype, k_scale=k_scale, v_scale=v_scale, device=device,
        spare_slots=0, index_dtype=getattr(torch, case.indices), seed=case_seed(case, seed),
        draft_affinity=draft_affinity_for(case.prefix, case.qk_dim),
    )  # fmt: skip
    ab = full.kv_indices.to(getattr(torch, case.index_dtype_ab)) if case.index_dtype_ab else None
    per_set, rows = case.batch * case.prefix, case.batch * case.draft

    def part(t: torch.Tensor | None, s: int, n: int) -> torch.Tensor | None:
        return None if t is None else t[s * n : (s + 1) * n]

    sets = [
        InputSet(q=part(full.q, s, rows), k_extend=part(full.k_extend, s, rows),
                 v_extend=part(full.v_extend, s, rows), o=part(full.o, s, rows),
                 kv_indices=part(full.kv_indices, s, per_set), kv_indices_ab=part(ab, s, per_set))
        for s in range(n_sets)
    ]  # fmt: skip
    masks = {}
    for mask in dict.fromkeys(m for m in (case.mask, case.mask_ab) if m):
        blocks = draft_masks(case, mask, seed)
        masks[mask] = None if blocks is None else sglang_mask(blocks, [case.prefix] * case.batch, device=device)
    return CaseInputs(
        case=case,
        k_buffer=full.k_buffer,
        v_buffer=full.v_buffer,
        qo_indptr=full.qo_indptr[: case.batch + 1],
        kv_indptr=full.kv_indptr[: case.batch + 1],
        sets=sets,
        k_scale=k_scale,
        v_scale=v_scale,
        sm_scale=1.0 / math.sqrt(case.qk_dim),
        masks=masks,
    )


def gather_rows(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buffer[slots]`` for any dtype: FP8 rows move as bytes (indexing kernels for FP8
    types are not on every torch build)."""
    if buffer.element_size() == 1 and buffer.is_floating_point():
        return buffer.view(torch.uint8)[slots].view(buffer.dtype)
    return buffer[slots]


def reference_subset(inputs: CaseInputs, mask: str | None = None) -> torch.Tensor:
    """``kgen.reference.reference_verify`` on the first requests of set 0, over a compact
    copy of just their slots (fp32 holds FP8 values exactly), with ``mask`` (default: the
    case's)."""
    case, s0 = inputs.case, inputs.sets[0]
    n = inputs.check_requests
    rows, toks = n * case.draft, n * case.prefix
    slots = s0.kv_indices[:toks].long()
    k_c = gather_rows(inputs.k_buffer, slots).float()
    v_c = gather_rows(inputs.v_buffer, slots).float() if case.separate_v else k_c[..., : case.v_dim]
    return reference_verify(
        s0.q[:rows],
        s0.k_extend[:rows],
        s0.v_extend[:rows],
        k_c,
        v_c,
        inputs.qo_indptr[: n + 1],
        inputs.kv_indptr[: n + 1],
        torch.arange(toks, dtype=torch.int32, device=slots.device),
        inputs.k_scale,
        inputs.v_scale,
        inputs.sm_scale,
        **inputs.mask_kwargs(mask or case.mask),
    )


@dataclass
class PeerInputs:
    """Dense bf16 views of the same problem for FlexAttention and SDPA (one per input set)."""

    case: Case
    q: list[torch.Tensor]  # [bs, H_q, L, D_qk]
    q_folded: list[torch.Tensor]  # [bs, H_kv, G*L, D_qk], row g*L + l
    k: list[torch.Tensor]  # [bs, H_kv, P+L, D_qk]
    v: list[torch.Tensor]  # [bs, H_kv, P+L, D_v], contiguous (MLA: a copy of K's columns)
    sm_scale: float

    @property
    def n_sets(self) -> int:
        return len(self.q)


def _dense(buffer: torch.Tensor, slots: torch.Tensor, draft: torch.Tensor, case: Case, scale: float) -> torch.Tensor:
    """[bs, H_kv, P + L, D] bf16: the prefix rows in page-table order, then the draft rows."""
    bs, P, L, hkv = case.batch, case.prefix, case.draft, case.kv_heads
    prefix = gather_rows(buffer, slots.long()).to(torch.bfloat16)
    if scale != 1.0:
        prefix.mul_(scale)
    width = prefix.shape[-1]
    full = torch.cat([prefix.view(bs, P, hkv, width), draft.reshape(bs, L, hkv, width)], dim=1)
    del prefix
    return full.permute(0, 2, 1, 3).contiguous()


def build_peer_inputs(inputs: CaseInputs) -> PeerInputs:
    case = inputs.case
    bs, L, G, hkv = case.batch, case.draft, case.group, case.kv_heads
    qs, folded, ks, vs = [], [], [], []
    for s in inputs.sets:
        q = s.q.view(bs, L, hkv, G, case.qk_dim)
        qs.append(q.permute(0, 2, 3, 1, 4).reshape(bs, hkv * G, L, case.qk_dim).contiguous())
        folded.append(q.permute(0, 2, 3, 1, 4).reshape(bs, hkv, G * L, case.qk_dim).contiguous())
        k = _dense(inputs.k_buffer, s.kv_indices, s.k_extend, case, inputs.k_scale)
        if case.separate_v:
            v = _dense(inputs.v_buffer, s.kv_indices, s.v_extend, case, inputs.v_scale)
        else:
            # V is K's latent columns, dequantized with v_scale (the kernel's V path).
            v = k[..., : case.v_dim].contiguous()
            if inputs.v_scale != inputs.k_scale:
                v[:, :, : case.prefix].mul_(inputs.v_scale / inputs.k_scale)
        ks.append(k)
        vs.append(v)
    return PeerInputs(case=case, q=qs, q_folded=folded, k=ks, v=vs, sm_scale=inputs.sm_scale)


def rows_from_heads(out: torch.Tensor, case: Case) -> torch.Tensor:
    """[bs, H_q, L, D_v] (GQA form) -> [bs*L, H_q, D_v], kgen's row order."""
    bs, hq, L, dv = out.shape
    return out.permute(0, 2, 1, 3).reshape(bs * L, hq, dv)


def rows_from_folded(out: torch.Tensor, case: Case) -> torch.Tensor:
    """[bs, H_kv, G*L, D_v] (heads folded into query rows) -> [bs*L, H_q, D_v]."""
    bs, hkv, _, dv = out.shape
    folded = out.view(bs, hkv, case.group, case.draft, dv).permute(0, 3, 1, 2, 4)
    return folded.reshape(bs * case.draft, hkv * case.group, dv)


@functools.lru_cache(maxsize=64)
def draft_mask(prefix: int, draft: int, repeat: int, device: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Additive mask [1, 1, repeat*L, P+L]: row r (draft position r % L) sees the prefix and
    draft 0..(r % L). Stored inside a 16-column-aligned buffer so SDPA's mem-efficient
    kernel takes it as is instead of padding a copy on every call."""
    total = prefix + draft
    padded = -(-total // 16) * 16
    col = torch.arange(padded, device=device)
    pos = torch.arange(draft, device=device).repeat(repeat)
    visible = col[None, :] <= (prefix + pos)[:, None]
    mask = torch.zeros(repeat * draft, padded, dtype=dtype, device=device)
    mask.masked_fill_(~visible, float("-inf"))
    return mask[None, None, :, :total]
