"""Shared test set-up. Kernels run in Triton's interpreter on CPU unless a GPU test asks for CUDA."""

import os

from kgen.launcher.switches import env_flag  # standard library only: triton is not imported yet

# Must be set before triton is imported anywhere: CPU tensors then run through the interpreter.
if not env_flag("KGEN_TEST_ON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with KGEN_TEST_ON_GPU=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _drop_module_scratch() -> None:
    """Empty every generated module's scratch cache (``LAUNCHER.scratch``: split partials cached by shape
    so a CUDA graph replays one address). It only ever grows, one entry per (rows, heads,
    splits), so a worker that ran many shapes would keep all of them on the GPU."""
    import sys

    for module in list(sys.modules.values()):
        # The module's own dict, never getattr: some modules (torch.classes) answer any name
        # with an object whose attribute access raises.
        launcher = getattr(module, "__dict__", {}).get("LAUNCHER")
        scratch = getattr(launcher, "scratch", None)
        if isinstance(scratch, dict):
            scratch.clear()


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_gpu_tests(request):
    """After each gpu-marked test: drop the modules' scratch, collect what the test held and
    hand the caching allocator's free blocks back, so 16 workers sharing one GPU each keep only
    what their current test needs."""
    yield
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_initialized():
        return
    import gc

    _drop_module_scratch()
    gc.collect()
    torch.cuda.empty_cache()
