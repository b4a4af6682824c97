"""Importing a real engine (SGLang, vLLM) in a test, as CI installs it: the pinned release,
without its GPU-only dependencies, from the pins in ``.ci/engines/<engine>.txt``.

CI sets ``KGEN_REQUIRE_ENGINES=1``, so there a missing engine fails the test instead of
skipping it: the integration tests must run against the engines' real code.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kgen.launcher.switches import env_flag

PINS_DIR = Path(__file__).resolve().parents[1] / ".ci" / "engines"


def import_engine(engine: str, module: str) -> ModuleType:
    """``module`` of ``engine``'s installed release; a skip (a failure under CI) naming the
    install command when it is not importable."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        how = f"pip install --no-deps -r {PINS_DIR / (engine + '.txt')}"
        why = f"{engine} is not importable ({exc}); install its pinned release: {how}"
        if env_flag("KGEN_REQUIRE_ENGINES"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)


def import_vllm(*modules: str) -> ModuleType:
    """vLLM and ``modules`` of it as a CPU machine runs its kernels in the interpreter:
    ``vllm.triton_utils`` turns Triton off when it finds no active GPU driver, except with empty
    visible devices (its Ray case), so ``CUDA_VISIBLE_DEVICES=""`` while vLLM is first imported
    (when no GPU is there; unset again after). Fails when vLLM turned Triton off anyway."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if saved is None and not torch.cuda.is_available():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read once, when vllm.triton_utils is imported
    try:
        module = import_engine("vllm", "vllm")
        for name in modules:
            import_engine("vllm", name)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    from vllm.triton_utils import HAS_TRITON

    assert HAS_TRITON, "vLLM turned Triton off: its kernels would not run"
    return module
