"""Which accelerator architecture this process runs on, as the name tables use.

The gate needs one short string per architecture (``gfx950``, ``gfx942``, ``sm_90``,
``sm_100``) because block-config tables are keyed by it (``kgen/tables/<arch>.json``).
Detection is split in two: ``arch_from_properties`` is pure (tests feed it mocked device
properties), ``detect_arch`` reads torch once per device and caches the answer so the hot
path never queries the driver.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


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


@functools.lru_cache(maxsize=16)
def _detect_cached(index: int) -> str | None:
    return arch_of(torch.cuda.get_device_properties(index))


def detect_arch(device: torch.device | int | None = None) -> str | None:
    """The arch of ``device`` (the current GPU by default), or None without a GPU.

    Cached per device index: the first call asks the driver, later calls cost a dict
    lookup, so adapters may call it at construction without a measurable cost.
    """
    if not torch.cuda.is_available():
        return None
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _detect_cached(index)
