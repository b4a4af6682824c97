"""Scratch the launcher allocates: bounded by the split rule (issue bar: MLA, batch 128, L 4 <= 64 MiB)."""

import pytest

import kgen
from kgen.launcher.device import INTERPRETER_NUM_SMS


@pytest.mark.parametrize("batch", [1, 16, 64, 128])
def test_mla_scratch_stays_under_64_mib_on_h200(batch):
    module = kgen.load("mla_absorbed_512_64", "bfloat16")
    nbytes = module.scratch_bytes(batch * 4, 16, 1, batch, 4, "sm_90", 132)
    assert nbytes <= 64 << 20


def test_scratch_matches_what_the_launcher_allocates():
    from kernel_cases import build

    module = kgen.load("gqa64", "bfloat16")
    case = build("gqa64", [40, 9, 3], [4, 2, 1], 8, seed=1)
    module.LAUNCHER.scratch.clear()
    module.launch(*case.launch_args())
    allocated = sum(t.numel() * t.element_size() for bufs in module.LAUNCHER.scratch.values() for t in bufs)
    predicted = module.scratch_bytes(case.q.shape[0], 8, 1, 3, case.max_len_extend, "interpreter",
                                     INTERPRETER_NUM_SMS)
    assert allocated == predicted


def test_a_float_scale_made_during_graph_capture_is_not_cached(monkeypatch):
    """An FP8 module's float scale becomes a 1-element device tensor. One made while a
    CUDA graph captures is filled only by that graph's replay, so it must never be handed to a
    later call from the cache; one made outside a capture is cached (one address for graphs)."""
    import torch

    module = kgen.load("gqa64", "float8_e4m3fn")
    module.LAUNCHER.device_scales.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    during = module.LAUNCHER.device_scale(0.5, "cpu")
    assert during.item() == 0.5 and not module.LAUNCHER.device_scales
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    eager = module.LAUNCHER.device_scale(0.5, "cpu")
    assert eager is not during and module.LAUNCHER.device_scale(0.5, "cpu") is eager
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert module.LAUNCHER.device_scale(0.5, "cpu") is eager  # made eagerly, so filled: safe in a capture
