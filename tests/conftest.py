"""Shared test set-up. Kernels run in Triton's interpreter on CPU unless a GPU test asks for CUDA."""

import os

# Must be set before triton is imported anywhere: CPU tensors then run through the interpreter.
if not os.environ.get("KGEN_TEST_ON_GPU"):
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
