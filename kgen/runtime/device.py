"""Which accelerator architecture this process runs on, as the name tables use.

The gate needs one short string per architecture (``gfx950``, ``gfx942``, ``sm_90``,
``sm_100``) because block-config tables are keyed by it (``kgen/tables/<arch>.json``).
Detection is split in two: ``arch_from_properties`` is pure (tests feed it mocked device
properties; it lives in kgen/launcher/device.py, which every module's launcher asks too),
``detect_arch`` reads torch once per device and caches the answer so the hot path never
queries the driver.
"""

from __future__ import annotations

import functools

import torch

from kgen.launcher.device import arch_from_properties, arch_of

__all__ = ["arch_from_properties", "arch_of", "detect_arch"]


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
