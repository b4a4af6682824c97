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
}


def parse_experiments(text: str | None) -> frozenset[str]:
    """The experiment names of a comma-separated list; unknown names are an error."""
    names = frozenset(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = sorted(names - EXPERIMENTS.keys())
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in EXPERIMENTS.items())
        raise BuildError(f"KGEN_EXPERIMENTS: unknown experiment(s) {', '.join(unknown)}; known: {known}")
    return names
