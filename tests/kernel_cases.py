"""Parity helpers shared by the CPU (interpreter) and GPU kernel tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import kgen
from kgen.build import build_one
from kgen.passes.context import load_context
from kgen.plan import Plan
from kgen.problems import VerifyCase, make_case
from kgen.reference import relative_error
from kgen.spec import load_layouts

SPECS = load_layouts()
# Many short splits (16-token tiles, up to 8 per request) so that small CPU cases merge.
SMALL_SPLITS = {"block_h": 16, "block_n": 16, "num_warps": 4, "num_stages": 1,
                "split": {"programs_per_sm": 8, "max_splits": 8, "min_tokens_per_split": 16}}


def tolerance(case: VerifyCase) -> float:
    """Three times the reference's own error when rounded to the output dtype.

    The float32 reference rounded to bf16/fp16 is as close as any kernel writing that dtype
    can be; the kernel also rounds P to the dot dtype once, which the factor 3 covers.
    """
    exact = case.reference(torch.float64)
    own = relative_error(exact.to(case.o.dtype), exact)
    return 3 * own


def check_parity(case: VerifyCase, layout: str, kv_dtype: str, q_dtype: str = "bfloat16",
                 variant: str = "grouped", config: dict | None = None) -> float:
    module = kgen.load(layout, kv_dtype, q_dtype, variant)
    if config is None:
        assert module.verify_shared_kv_fwd(*case.sglang_args()), module.why_not(*case.sglang_args())
    else:
        module.launch(*case.launch_args(), config=config, **case.mask_kwargs())
    ref = case.reference(torch.float64)
    err = relative_error(case.o, ref)
    tol = tolerance(case)
    assert err <= tol, f"relative error {err:.2e} > tolerance {tol:.2e}"
    return err


def build(layout: str, prefix, draft, group, **kw) -> VerifyCase:
    return make_case(SPECS[layout], prefix, draft, group, **kw)


def build_module(out_dir: Path, layout: str, kv_dtype: str, variant: str = "grouped"):
    """(plan, module) of one module built into out_dir and imported from there, not from generated/."""
    plan: Plan = build_one(layout, kv_dtype, "bfloat16", variant, ctx=load_context(out_dir))
    spec = importlib.util.spec_from_file_location(f"built_{plan.uri}", plan.output_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return plan, module


# The tests that hold pools past 2**31 elements share this xdist group: under `pytest -n N
# --dist loadgroup` they run one at a time in one worker (two at once, or one beside fifteen
# workers' caches, need more than one GPU holds).
LARGE_POOL_GROUP = "gpu_large_pool"


def wait_for_free_gpu_memory(nbytes: int, timeout_s: float = 120.0) -> None:
    """Return once ``nbytes`` of GPU memory are free (other workers' tests end and hand theirs
    back, tests/conftest.py); fail naming the shortfall after ``timeout_s``, rather than die
    out of memory halfway through a test."""
    import gc
    import time

    import pytest

    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        if free >= nbytes:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"this test needs {nbytes / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB of "
                        f"{total / 2**30:.1f} GiB stayed free for {timeout_s:.0f} s; run the gpu suite with "
                        "--dist loadgroup (one large-pool test at a time) or fewer workers")
        time.sleep(1.0)
