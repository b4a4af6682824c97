"""AMD-specific paths of a generated module with mocked device properties (no AMD GPU here):
arch detection from gcnArchName, the gfx950 seed table, and the AMD compiler knobs, which
reach ROCm launches only and never CUDA ones."""

from types import SimpleNamespace

import pytest
import torch
from case_tools import patch_kernels
from kernel_cases import build

import kgen
from kgen.launcher.launches import backend_knobs

MODULE = kgen.load("qwen3_5_gqa256", "bfloat16")
ROCM_CONFIG = {"block_h": 4, "block_n": 64, "num_warps": 8, "num_stages": 1, "waves_per_eu": 2,
               "matrix_instr_nonkdim": 16, "kpack": 2}


@pytest.fixture(autouse=True)
def _fresh_device_cache():
    MODULE.LAUNCHER.device_info.cache_clear()
    yield
    MODULE.LAUNCHER.device_info.cache_clear()


@pytest.mark.parametrize(
    ("hip", "props", "arch"),
    [
        ("6.4", SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-", multi_processor_count=256, major=9, minor=5),
         "gfx950"),
        ("6.2", SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-", multi_processor_count=304, major=9, minor=4),
         "gfx942"),
        (None, SimpleNamespace(gcnArchName="", multi_processor_count=132, major=9, minor=0), "sm_90"),
        (None, SimpleNamespace(gcnArchName="", multi_processor_count=148, major=10, minor=0), "sm_100"),
    ],
)
def test_arch_detection_from_device_properties(monkeypatch, hip, props, arch):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert MODULE.LAUNCHER.device_info("cuda", 0) == (arch, props.multi_processor_count, hip is not None)


def test_no_gpu_means_the_interpreter():
    assert MODULE.LAUNCHER.device_info("cpu", None)[0] == "interpreter"


def test_amd_targets_use_the_default_until_a_table_passes_kgen_check():
    """The gfx950 table ships no rows (its hand-picked ones spilled in `kgen check`)."""
    assert MODULE.select_config("gfx950", 16, 64) == MODULE.LAUNCHER.default_config
    assert MODULE.select_config("gfx942", 16, 64) == MODULE.LAUNCHER.default_config


def test_amd_knobs_only_for_rocm():
    assert backend_knobs(ROCM_CONFIG, is_rocm=True) == {"waves_per_eu": 2, "matrix_instr_nonkdim": 16,
                                                                "kpack": 2}
    assert backend_knobs(ROCM_CONFIG, is_rocm=False) == {}


class _Recorder:
    """Stands in for a @triton.jit kernel: records the launch options."""

    def __init__(self):
        self.kwargs = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


@pytest.mark.parametrize(("arch", "rocm"), [("gfx950", True), ("sm_90", False)])
def test_launch_passes_amd_knobs_on_rocm_and_never_on_cuda(monkeypatch, arch, rocm):
    prefix, merge = _Recorder(), _Recorder()
    patch_kernels(monkeypatch, MODULE, prefix=prefix)
    patch_kernels(monkeypatch, MODULE, merge=merge)
    monkeypatch.setattr(MODULE.LAUNCHER, "device_info", lambda device_type, index: (arch, 8, rocm))
    case = build("qwen3_5_gqa256", [30], [2], 16, seed=1)
    MODULE.launch(*case.launch_args(), config=ROCM_CONFIG)
    for kwargs in prefix.kwargs + merge.kwargs:
        has = {k for k in ("waves_per_eu", "matrix_instr_nonkdim", "kpack") if k in kwargs}
        assert has == ({"waves_per_eu", "matrix_instr_nonkdim", "kpack"} if rocm else set())


@pytest.mark.parametrize(("arch", "rocm", "num_sms", "stages"),
                         [("gfx950", True, 132, 1), ("gfx942", True, 132, 1), ("sm_90", False, 132, 2),
                          ("sm_80", False, 132, 2), ("sm_90", False, 8, 1)])
def test_the_merge_pipelines_its_chunks_on_cuda_only(monkeypatch, arch, rocm, num_sms, stages):
    """The merge stage's chunk loop goes through shared memory by cp.async on CUDA targets when
    the grid has more than one chunk of splits (SPLIT_STAGES 2, rules.MERGE_SPLIT_STAGES: batch 1
    on 132 SMs); a grid of one chunk (8 SMs) and HIP targets keep register loads."""
    merge = _Recorder()
    # The prefix stage is recorded, not run, on either lowering: sm_90's batch-1 row of this layout
    # has a gluon section, which a Triton that runs the Gluon stage takes.
    patch_kernels(monkeypatch, MODULE, prefix=_Recorder(), gluon_prefix=_Recorder())
    patch_kernels(monkeypatch, MODULE, merge=merge)
    monkeypatch.setattr(MODULE.LAUNCHER, "device_info", lambda device_type, index: (arch, num_sms, rocm))
    case = build("qwen3_5_gqa256", [300], [2], 16, seed=1)
    MODULE.launch(*case.launch_args())
    assert merge.kwargs, "a prefix of 300 tokens runs splits, so the merge launches"
    assert {kwargs["SPLIT_STAGES"] for kwargs in merge.kwargs} == {stages}
