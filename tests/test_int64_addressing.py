"""A pool with more than 2**31 elements: slot x stride overflows int32, so every address the
kernel forms must be int64. The pool is allocated lazily (untouched pages are never
committed), only the slots the page table names are written, and the kernel runs in a
subprocess: 32-bit address arithmetic reads far outside the pool and may crash it."""

import subprocess
import sys
import textwrap

import pytest
from kernel_cases import LARGE_POOL_GROUP

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch, kgen
    from kgen.spec import load_layouts
    from kgen.problems import make_case
    from kgen.reference import relative_error

    case = make_case(load_layouts()["gqa64"], [40, 25], [3, 2], 8, seed=3)
    slots = (1 << 31) // 64 + 4096  # 64 columns x slots > 2**31 elements per pool
    k_pool = torch.empty(slots, 1, 64, dtype=torch.bfloat16)
    v_pool = torch.empty(slots, 1, 64, dtype=torch.bfloat16)
    high = torch.arange(slots - case.k_buffer.shape[0], slots)
    k_pool[high], v_pool[high] = case.k_buffer, case.v_buffer
    case.kv_indices = (case.kv_indices.long() + int(high[0])).to(torch.int32)
    case.k_buffer, case.v_buffer = k_pool, v_pool
    assert kgen.load("gqa64", "bfloat16").verify_shared_kv_fwd(*case.sglang_args())
    ref = case.reference(torch.float64)
    own = relative_error(ref.to(torch.bfloat16), ref)
    err = relative_error(case.o, ref)
    assert err <= 3 * own, (err, own)
    print("ok", err)
    """
)


@pytest.mark.xdist_group(LARGE_POOL_GROUP)  # 8 GiB of host address space: one such test at a time
def test_pool_larger_than_2_pow_31_elements():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.startswith("ok")
