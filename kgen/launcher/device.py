"""What the launcher asks of a device: its arch, how many multiprocessors it has, and whether
it is ROCm. CPU tensors mean Triton's interpreter, which plays a small GPU."""

from __future__ import annotations

import functools
from typing import Any

import torch

# The interpreter has no limits; it plays a GPU of this many multiprocessors so that CPU runs
# still split prefixes over programs.
INTERPRETER_NUM_SMS = 4
INTERPRETER = "interpreter"


def arch_from_properties(*, is_hip: bool, gcn_arch_name: str | None = None, major: int = 0, minor: int = 0) -> str:
    """The table name of a device from its properties.

    ROCm reports ``gcnArchName`` such as ``"gfx950:sramecc+:xnack-"``: the feature flags
    after ``:`` do not change which kernels run, so they are dropped. CUDA reports a
    compute capability, written ``sm_<major><minor>`` (9.0 -> ``sm_90``, 10.0 -> ``sm_100``).
    """
    if is_hip:
        if not gcn_arch_name:
            raise ValueError("a ROCm device must report gcnArchName (e.g. 'gfx950:sramecc+:xnack-')")
        return gcn_arch_name.split(":", 1)[0].strip()
    if major <= 0 or minor < 0:
        raise ValueError(f"a CUDA device needs a compute capability, got {major}.{minor}")
    return f"sm_{major}{minor}"


def arch_of(props: Any, is_hip: bool | None = None) -> str:
    """The table name of a device from ``torch.cuda.get_device_properties(...)`` (or a
    stand-in with ``gcnArchName`` / ``major`` / ``minor``). ``is_hip`` defaults to this
    torch build's (``torch.version.hip``)."""
    if is_hip is None:
        is_hip = getattr(torch.version, "hip", None) is not None
    return arch_from_properties(
        is_hip=is_hip,
        gcn_arch_name=getattr(props, "gcnArchName", None),
        major=getattr(props, "major", 0),
        minor=getattr(props, "minor", 0),
    )


@functools.cache
def device_info(device_type: str, index: int | None) -> tuple[str, int, bool]:
    """(arch, multiprocessor count, is_rocm) of a device; CPU tensors mean the interpreter."""
    if device_type != "cuda":
        return INTERPRETER, INTERPRETER_NUM_SMS, False
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    is_hip = getattr(torch.version, "hip", None) is not None
    return arch_of(props, is_hip), props.multi_processor_count, is_hip


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never on a machine without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def stream_key(device: torch.device) -> int:
    """The current stream of ``device`` as a cache key: its CUDA handle (0 for a CPU tensor, the
    interpreter's, which has one stream)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream
