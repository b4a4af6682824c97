"""Scratch the launcher allocates: bounded by the split rule (issue bar: MLA, batch 128, L 4 <= 64 MiB)."""

import pytest

import kgen


@pytest.mark.parametrize("batch", [1, 16, 64, 128])
def test_mla_scratch_stays_under_64_mib_on_h200(batch):
    module = kgen.load("mla_absorbed_512_64", "bfloat16")
    nbytes = module.scratch_bytes(batch * 4, 16, 1, batch, 4, "sm_90", 132)
    assert nbytes <= 64 << 20


def test_scratch_matches_what_the_launcher_allocates():
    from kernel_cases import build

    module = kgen.load("gqa64", "bfloat16")
    case = build("gqa64", [40, 9, 3], [4, 2, 1], 8, seed=1)
    module._SCRATCH.clear()
    module.launch(*case.launch_args())
    allocated = sum(t.numel() * t.element_size() for bufs in module._SCRATCH.values() for t in bufs)
    predicted = module.scratch_bytes(case.q.shape[0], 8, 1, 3, case.max_len_extend, "interpreter",
                                     module._INTERPRETER_NUM_SMS)
    assert allocated == predicted
