"""pytest plugin (`-p spike_plugin`, with benchmarks/experiments on PYTHONPATH): every default-mode
BF16 absorbed-MLA module that kgen.load returns launches the spike of gluon_mla_ws.py in place of
its Gluon prefix stage, so the gpu-marked tests check the spike. KGEN_SPIKE_QK_AHEAD=1 picks that
variant."""

from __future__ import annotations

import os

import gluon_mla_ws

import kgen

_load = kgen.load


def _spiked_load(*args, **kwargs):
    module = _load(*args, **kwargs)
    identity = module.LAUNCHER.identity
    if (identity.layout == "mla_absorbed_512_64" and identity.gluon_arch and identity.invariance is None
            and not getattr(module, "_spike_installed", False)):
        gluon_mla_ws.install(module, qk_ahead=os.environ.get("KGEN_SPIKE_QK_AHEAD") == "1")
        module._spike_installed = True
    return module


kgen.load = _spiked_load
