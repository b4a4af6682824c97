"""The benchmark's case matrix and the minimum bytes each case must move.

A case is one problem size: layout and group (query heads per KV head), KV dtype, batch,
prefix length and draft length L (every request the same sizes so the peers can run it as
one dense batch), and how the draft tokens see each other: the causal chain (``none``, EAGLE
topk = 1), the same chain handed to the kernels as a custom mask (``chain``, what SGLang
sends at topk = 1), or a random EAGLE-like tree of L tokens per request (``tree``, topk > 1).
Everything here is plain Python, no torch, so the matrix and the byte counts are tested on
any machine.

Bytes are counted as the least any kernel must move (``min_bytes``): the prefix KV read
once (V only where the layout stores it apart from K: absorbed MLA reads V from K's
latent columns), the queries, the draft K/V and the output. A kernel that re-reads the
prefix per query head moves more and so shows a lower "achieved GB/s". A masked case
also reads each request's L x L draft bits (one byte each).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kgen.errors import KgenError
from kgen.spec import FP8_DTYPES, KV_DTYPES, LayoutSpec, canonical_dtype

KGEN_KERNELS = ("grouped", "per_head")
# Peers that read dense bf16 KV whatever the pool holds: one measurement serves a shape's BF16
# and FP8 case.
PEER_KERNELS = ("flex", "sdpa")
KERNELS = KGEN_KERNELS + PEER_KERNELS
# FlashInfer (kgen/bench/flashinfer.py), named ``flashinfer_<backend>[_page16]``: its FA2 or FA3
# backend reading the case's pool with page size 1 (the token-slot pool itself) or 16 (a copy).
# It reads the case's own KV dtype, so it is measured per case, never shared between dtypes.
FLASHINFER_KERNELS = ("flashinfer_fa2", "flashinfer_fa3", "flashinfer_fa2_page16", "flashinfer_fa3_page16")
FLASHINFER_ALIAS = "flashinfer"  # --kernels flashinfer: all four
# The engines' own Triton verify kernels (kgen/bench/engine_kernels.py): SGLang's Triton backend
# and vLLM's. Asked for by name (or ENGINE_ALIAS), never by default: each needs its engine
# installed, and they read their pools as the engine does (per case, like FlashInfer).
ENGINE_KERNELS = ("sglang_triton", "vllm_triton")
ENGINE_ALIAS = "engines"  # --kernels engines: both
# Every kernel --kernels knows, in report order.
ALL_KERNELS = KERNELS + FLASHINFER_KERNELS + ENGINE_KERNELS
# Speed-ups and --compare verdicts are about this kernel: the one kgen exists to make.
HEADLINE_KERNEL = "grouped"
# The grouped kernel's batch-invariant module (--batch-invariant), as a loader's variant name.
BATCH_INVARIANT = "batch_invariant"

# The full matrix (issue 5): Qwen3.5 GQA 256 at TP2 and TP8, absorbed MLA, GQA 128.
DEFAULT_LAYOUT_GROUPS: tuple[tuple[str, int], ...] = (
    ("qwen3_5_gqa256", 16),
    ("qwen3_5_gqa256", 4),
    ("mla_absorbed_512_64", 16),
    ("gqa128", 8),
)
DEFAULT_KV_DTYPES = ("bfloat16", "float8_e4m3fn")
FULL_BATCHES = (1, 16, 64, 128)
FULL_PREFIXES = (1024, 4096, 16384, 32768)
FULL_DRAFTS = (1, 2, 4)
# --quick: the two headline shapes' batches and prefixes at L = 4 (32 cases).
QUICK_BATCHES = (16, 64)
QUICK_PREFIXES = (1024, 16384)
QUICK_DRAFTS = (4,)
# (batch, prefix, draft) of the cases the FlexAttention kernel-option sweep runs on.
HEADLINE_SHAPES = ((64, 16384, 4), (16, 1024, 4))

Q_BYTES = 2  # queries, draft K/V and the output are bfloat16 in every case

# The page table's dtype: SGLang passes kv_indices as int64, so that is what a case times
# unless told otherwise. Results written before the dtype was recorded used int32.
INDEX_DTYPES = ("int64", "int32")
DEFAULT_INDEX_DTYPE = "int64"
LEGACY_INDEX_DTYPE = "int32"

# How the draft tokens see each other (``--mask``): the causal chain with no mask, the chain
# written as SGLang's custom mask, a random EAGLE-like tree (topk 4) per request.
MASKS = ("none", "chain", "tree")
DEFAULT_MASK = "none"
TREE_TOPK = 4


class BenchUsageError(KgenError, ValueError):
    """A bench option names an unknown layout, group, dtype or size."""


@dataclass(frozen=True)
class Case:
    """One benchmark problem; the head widths are copied from the layout spec so a case
    (and a JSON result) is self-contained."""

    layout: str
    group: int
    kv_dtype: str
    batch: int
    prefix: int
    draft: int
    qk_dim: int
    v_dim: int
    separate_v: bool
    kv_heads: int = 1
    # kv_indices dtype of the kgen kernels' figures; None: a result written before it was
    # recorded (those used int32, see ``indices``).
    index_dtype: str | None = None
    # The other dtype, timed in alternation with ``index_dtype`` (``--index-dtype a,b``).
    index_dtype_ab: str | None = None
    # The draft's mask (``MASKS``), and another one timed in alternation with it (``--mask a,b``).
    mask: str = DEFAULT_MASK
    mask_ab: str | None = None

    @property
    def indices(self) -> str:
        """The kv_indices dtype the case's kgen figures were measured with."""
        return self.index_dtype or LEGACY_INDEX_DTYPE

    @property
    def num_q_heads(self) -> int:
        return self.group * self.kv_heads

    @property
    def num_tokens(self) -> int:
        return self.batch * self.draft

    @property
    def kv_elem_bytes(self) -> int:
        return 1 if self.kv_dtype in FP8_DTYPES else 2

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype in FP8_DTYPES

    @property
    def masked(self) -> bool:
        """The kernels get a custom mask (a chain written as one, or a tree)."""
        return self.mask != "none"

    @property
    def _extra(self) -> str:
        return (f"/hkv{self.kv_heads}" if self.kv_heads != 1 else "") + (f"/mask-{self.mask}" if self.masked else "")

    @property
    def peer_key(self) -> str:
        """The key without the KV dtype: the peers read bf16 KV whatever the pool holds,
        so one peer measurement serves the BF16 and the FP8 case of the same shape."""
        return f"{self.layout}/g{self.group}/bs{self.batch}/p{self.prefix}/L{self.draft}{self._extra}"

    @property
    def key(self) -> str:
        """Stable name used to match a case against a baseline."""
        tag = KV_DTYPES.get(self.kv_dtype, self.kv_dtype)
        return f"{self.layout}/g{self.group}/{tag}/bs{self.batch}/p{self.prefix}/L{self.draft}{self._extra}"

    @property
    def is_headline(self) -> bool:
        return (self.batch, self.prefix, self.draft) in HEADLINE_SHAPES

    @property
    def peers_refusal(self) -> str | None:
        """Why the peers (``PEER_KERNELS``) are not timed on this case, or None: they run the
        causal chain only, on dense KV, so a case with a custom mask is theirs to refuse."""
        return f"the peers are timed on the causal chain, not a {self.mask} mask" if self.masked else None


def case_for(
    spec: LayoutSpec,
    group: int,
    kv_dtype: str,
    batch: int,
    prefix: int,
    draft: int,
    kv_heads: int = 1,
    index_dtype: str = DEFAULT_INDEX_DTYPE,
    index_dtype_ab: str | None = None,
    mask: str = DEFAULT_MASK,
    mask_ab: str | None = None,
) -> Case:
    """The benchmark case of one layout at one size (its head widths copied from ``spec``)."""
    shape = spec.attention
    widths = {"qk_dim": shape.qk_dim, "v_dim": shape.v_head_dim, "separate_v": shape.v_source == "v_buffer"}
    return Case(spec.name, group, kv_dtype, batch, prefix, draft, **widths, kv_heads=kv_heads,
                index_dtype=index_dtype, index_dtype_ab=index_dtype_ab, mask=mask, mask_ab=mask_ab)  # fmt: skip


@dataclass(frozen=True)
class MinBytes:
    """The least traffic of one launch, by part (bytes)."""

    prefix_kv: int
    q: int
    draft_kv: int
    o: int
    mask: int = 0

    @property
    def total(self) -> int:
        return self.prefix_kv + self.q + self.draft_kv + self.o + self.mask


def min_bytes(case: Case) -> MinBytes:
    """Prefix KV read once, plus q, draft K/V and o, and a masked case's L x L draft bits per
    request (the page table is not counted: the peers read gathered KV and have none)."""
    kv_width = case.qk_dim + (case.v_dim if case.separate_v else 0)
    return MinBytes(
        prefix_kv=case.batch * case.prefix * case.kv_heads * kv_width * case.kv_elem_bytes,
        q=case.num_tokens * case.num_q_heads * case.qk_dim * Q_BYTES,
        draft_kv=case.num_tokens * case.kv_heads * kv_width * Q_BYTES,
        o=case.num_tokens * case.num_q_heads * case.v_dim * Q_BYTES,
        mask=case.num_tokens * case.draft if case.masked else 0,
    )


def input_sets(case: Case, l2_bytes: int, factor: float = 2.0, max_sets: int = 512) -> int:
    """How many input sets to rotate so that together they exceed ``factor`` x the L2.

    Each launch then reads its K/V from HBM as in serving, not from a cache the previous
    replay warmed. A big case is far beyond the L2 on its own and needs one set.
    """
    per_set = max(1, min_bytes(case).total)
    return max(1, min(max_sets, math.ceil(factor * l2_bytes / per_set)))


_SIZE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


def parse_size(text: str) -> int:
    """``1024``, ``1K``/``1k`` (1024), ``2M`` (2097152): binary multiples, as token counts
    are quoted."""
    match = _SIZE.match(text)
    if not match:
        raise BenchUsageError(f"{text!r} is not a size: use a number with an optional K or M suffix")
    value = int(match.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[match.group(2).lower()]
    if value <= 0:
        raise BenchUsageError(f"{text!r}: sizes must be positive")
    return value


def split_list(values: Iterable[str] | None) -> list[str]:
    """Flatten repeated and comma-separated option values: ``["a,b", "c"]`` -> a, b, c."""
    out: list[str] = []
    for value in values or ():
        out.extend(part.strip() for part in value.split(",") if part.strip())
    return out


def parse_sizes(values: Iterable[str] | None) -> list[int]:
    return sorted(dict.fromkeys(parse_size(v) for v in split_list(values)))


def _default_groups(name: str, spec: LayoutSpec) -> list[int]:
    """The matrix's groups for a layout; a layout outside the matrix gets its largest group
    of at most 16 (one tensor-parallel rank's view), else its smallest."""
    groups = [g for layout, g in DEFAULT_LAYOUT_GROUPS if layout == name]
    if groups:
        return groups
    small = [g for g in spec.attention.group_sizes if g <= 16]
    return [max(small)] if small else [min(spec.attention.group_sizes)]


def parse_layout_groups(values: Iterable[str] | None, specs: Mapping[str, LayoutSpec]) -> list[tuple[str, int]]:
    """``NAME`` or ``NAME:GROUP`` entries; none given means the default matrix."""
    entries = split_list(values)
    if not entries:
        return list(DEFAULT_LAYOUT_GROUPS)
    out: list[tuple[str, int]] = []
    for entry in entries:
        name, _, group_text = entry.partition(":")
        spec = specs.get(name)
        if spec is None:
            raise BenchUsageError(f"unknown layout {name!r}; known: {', '.join(sorted(specs))}")
        if not group_text:
            out.extend((name, g) for g in _default_groups(name, spec))
            continue
        if not group_text.isdigit() or int(group_text) not in spec.attention.group_sizes:
            raise BenchUsageError(
                f"{entry!r}: layout {name} is generated for groups "
                f"{list(spec.attention.group_sizes)}, not {group_text!r}"
            )
        out.append((name, int(group_text)))
    return list(dict.fromkeys(out))


def parse_kv_dtypes(values: Iterable[str] | None) -> list[str]:
    entries = split_list(values)
    if not entries:
        return list(DEFAULT_KV_DTYPES)
    try:
        return list(dict.fromkeys(canonical_dtype(v, KV_DTYPES, "KV") for v in entries))
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None


def parse_index_dtypes(values: Iterable[str] | None) -> tuple[str, str | None]:
    """``--index-dtype``: one dtype (the figures), or two (the first's figures, and both
    timed in alternation for their ratio). Default: int64, what SGLang sends."""
    entries = list(dict.fromkeys(split_list(values)))
    unknown = [e for e in entries if e not in INDEX_DTYPES]
    if unknown:
        raise BenchUsageError(f"--index-dtype {unknown}: choose from {', '.join(INDEX_DTYPES)}")
    if not entries:
        return DEFAULT_INDEX_DTYPE, None
    if len(entries) > 2:
        raise BenchUsageError(f"--index-dtype takes one or two dtypes, got {entries}")
    return entries[0], (entries[1] if len(entries) == 2 else None)


def parse_masks(values: Iterable[str] | None) -> tuple[str, str | None]:
    """``--mask``: one of ``MASKS`` (the figures), or two (the first's figures, and both timed
    in alternation for their ratio, e.g. ``tree,none``). Default: none (the causal chain)."""
    entries = list(dict.fromkeys(split_list(values)))
    unknown = [e for e in entries if e not in MASKS]
    if unknown:
        raise BenchUsageError(f"--mask {unknown}: choose from {', '.join(MASKS)}")
    if not entries:
        return DEFAULT_MASK, None
    if len(entries) > 2:
        raise BenchUsageError(f"--mask takes one or two masks, got {entries}")
    return entries[0], (entries[1] if len(entries) == 2 else None)


def build_matrix(
    specs: Mapping[str, LayoutSpec],
    layout_groups: Sequence[tuple[str, int]] = DEFAULT_LAYOUT_GROUPS,
    kv_dtypes: Sequence[str] = DEFAULT_KV_DTYPES,
    batches: Sequence[int] | None = None,
    prefixes: Sequence[int] | None = None,
    drafts: Sequence[int] | None = None,
    quick: bool = False,
    kv_heads: int = 1,
    index_dtypes: tuple[str, str | None] = (DEFAULT_INDEX_DTYPE, None),
    masks: tuple[str, str | None] = (DEFAULT_MASK, None),
) -> list[Case]:
    """Every combination, ordered layout, group, dtype, batch, prefix, draft: cases that
    share compiled kernels run back to back, and the BF16 case of a shape runs before its
    FP8 twin (which reuses the peers' measurement)."""
    batches = batches or (QUICK_BATCHES if quick else FULL_BATCHES)
    prefixes = prefixes or (QUICK_PREFIXES if quick else FULL_PREFIXES)
    drafts = drafts or (QUICK_DRAFTS if quick else FULL_DRAFTS)
    if kv_heads < 1:
        raise BenchUsageError(f"--kv-heads must be at least 1, got {kv_heads}")
    cases: list[Case] = []
    for name, group in layout_groups:
        spec = specs[name]
        for kv_dtype in kv_dtypes:
            if kv_dtype not in spec.dtypes.kv:
                raise BenchUsageError(f"layout {name} is not generated for KV dtype {kv_dtype}")
            for batch in batches:
                for prefix in prefixes:
                    for draft in drafts:
                        cases.append(case_for(spec, group, kv_dtype, batch, prefix, draft, kv_heads,
                                               *index_dtypes, *masks))  # fmt: skip
    return cases


def format_case_list(cases: Sequence[Case]) -> str:
    """One line per case (``kgen bench --list``) with its minimum bytes."""
    lines = [f"{len(cases)} cases"]
    for case in cases:
        mb = min_bytes(case).total / 1e6
        flag = "  (headline)" if case.is_headline else ""
        lines.append(f"  {case.key:58s} {mb:10.1f} MB{flag}")
    return "\n".join(lines)
