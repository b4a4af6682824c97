"""Experiments: generation-time options that stay off until a GPU measurement turns them on.

``KGEN_EXPERIMENTS=name[,name...]`` is read once by the build context; a module built with
an experiment says so in its header, and ``kgen build --check`` (run without it) flags such
a module as stale. Build experiments into their own directory (``kgen build --out DIR``).
"""

from __future__ import annotations

from kgen.errors import BuildError

EXPERIMENTS: dict[str, str] = {
    "fused_merge": (
        "one launch: the last split of a request to finish (an atomic counter per request and "
        "head block) merges the request's partials, instead of a second merge kernel"
    ),
    "half_partials": (
        "split partials stored in fp16 instead of fp32: half the partial traffic and scratch; the "
        "log-sum-exp stays fp32 and the merge sums in fp32. fp16, not bf16: bf16 partials measured "
        "6.1e-3 relative error against a 5.0e-3 bound (MLA FP8, interpreter). A partial is a convex "
        "combination of V rows, so V (times v_scale) must stay inside fp16's range (65504)"
    ),
    "e4m3_qk": (
        "FP8 KV (e4m3fn), bf16 q, programs of 64+ rows: the prefix q.k on e4m3 tensor cores against K as "
        "stored, q split exactly into two e4m3 terms, no per-tile K conversion. H200: 10% faster (group 16, "
        "batch 64, prefix 16K: 267.7 -> 242.1 us), but Hopper's e4m3 wgmma accumulates with ~14 bits, so scores "
        "lose precision in proportion to their size (MLA with 10x queries: 6.3e-3 against a 5.0e-3 bound)"
    ),
}


def parse_experiments(text: str | None) -> frozenset[str]:
    """The experiment names of a comma-separated list; unknown names are an error."""
    names = frozenset(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = sorted(names - EXPERIMENTS.keys())
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in EXPERIMENTS.items())
        raise BuildError(f"KGEN_EXPERIMENTS: unknown experiment(s) {', '.join(unknown)}; known: {known}")
    return names
