"""Scratch the launcher allocates: bounded by the split rule (issue bar: MLA, batch 128, L 4 <= 64 MiB)."""

import pytest
import torch

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


def _partials_ptrs(module) -> set[int]:
    return {bufs[0].data_ptr() for bufs in module.LAUNCHER.scratch.values()}


def test_two_streams_get_partials_of_their_own(monkeypatch):
    """Eager calls on two streams (the stream key patched: the interpreter has one) each get
    their own cached partials; a second call on the first stream finds its buffers again, and
    every answer is right."""
    from kernel_cases import build, tolerance

    from kgen.launcher import verify
    from kgen.reference import relative_error

    module = kgen.load("gqa64", "bfloat16")
    module.LAUNCHER.scratch.clear()
    seen = []
    for stream in (1, 2, 1):
        monkeypatch.setattr(verify, "stream_key", lambda device, s=stream: s)
        case = build("gqa64", [40, 9, 3], [4, 2, 1], 8, seed=stream)
        module.launch(*case.launch_args())
        assert relative_error(case.o, case.reference()) <= tolerance(case)
        seen.append(_partials_ptrs(module))
    assert len(module.LAUNCHER.scratch) == 2 and len(seen[1] - seen[0]) == 1 and seen[2] == seen[1]
    assert {key[1] for key in module.LAUNCHER.scratch} == {1, 2}


def test_a_graph_capture_gets_fresh_partials_that_are_never_cached(monkeypatch):
    """While a CUDA graph captures, each call gets new partials that stay out of the cache: a
    graph owns its own, and no eager call (or other graph) is handed memory only a replay fills."""
    from kgen.launcher import verify

    module = kgen.load("gqa64", "bfloat16")
    module.LAUNCHER.scratch.clear()
    monkeypatch.setattr(verify, "capturing", lambda: True)
    first = module.LAUNCHER.scratch_buffers(torch.device("cpu"), 8, 8, 4)
    second = module.LAUNCHER.scratch_buffers(torch.device("cpu"), 8, 8, 4)
    assert first[0].data_ptr() != second[0].data_ptr() and not module.LAUNCHER.scratch
    assert first[0].shape == (8, 8, 4, 64) and first[1].shape == (8, 8, 4)
    monkeypatch.setattr(verify, "capturing", lambda: False)
    eager = module.LAUNCHER.scratch_buffers(torch.device("cpu"), 8, 8, 4)
    assert module.LAUNCHER.scratch_buffers(torch.device("cpu"), 8, 8, 4)[0] is eager[0]
