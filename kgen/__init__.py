"""kgen: a compiler-pass generator and autotuner for grouped-head shared-KV verify kernels.

``kgen.load(layout, kv_dtype)`` returns the generated module for one specialization; see
docs/design.md for what the module exposes.
"""

from __future__ import annotations

from kgen.loader import generated_dir, load
from kgen.version import __version__

__all__ = ["__version__", "generated_dir", "load"]
