"""``kgen bench``: the generated kernels against their peers, on the same inputs, in one run.

Four kernels run on every case (layout, KV dtype, group, batch, prefix, draft length):
the generated grouped-head kernel, the generated per-head split-KV kernel, PyTorch
FlexAttention and ``scaled_dot_product_attention``. Times are medians of CUDA-graph
replays over input sets rotated beyond the L2; bandwidth is counted over the minimum bytes
(prefix KV read once) and set against a device-to-device copy measured in the same run.

Module map (the measurement core is pure Python so CPU tests drive it with fakes):
- ``cases``: the case matrix and the minimum byte counts (no torch);
- ``measure``: the loop over cases, taking kernels as callables and an injected timer;
- ``timing``: the ``Timer`` protocol, the CUDA-graph timer and the copy ceiling;
- ``inputs`` / ``peers``: tensors on the GPU and the four kernels as callables;
- ``report``: JSON, Markdown, PNG plots and the ``--compare`` verdict;
- ``cli``: ``add_bench_parser`` / ``run_bench`` for ``kgen bench``.
"""

from __future__ import annotations

SCHEMA = "kgen.bench/1"

__all__ = ["SCHEMA"]
