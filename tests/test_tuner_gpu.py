"""The real objective's code path without a GPU: the generated module runs in Triton's
interpreter on CPU tensors, timed with the host clock instead of CUDA graphs. Only the
CUDA-graph timer itself (kgen.bench.timing, shared with the benchmark) is left for the GPU."""

from __future__ import annotations

import os

# tests/conftest.py chooses Triton's interpreter before anything imports triton; these
# tests run the kernels on CPU tensors, so they only make sense there.
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from triton.runtime.errors import OutOfResources

import kgen
from kgen.bench.timing import EagerTimer
from kgen.blockconfig import BlockConfig
from kgen.spec import load_layouts
from kgen.tuner.errors import TuneError
from kgen.tuner.gpu import GpuBackend, geomean, input_bytes, rotation_count
from kgen.tuner.job import TuneJob
from kgen.tuner.objective import make_objective
from kgen.tuner.results import finalize
from kgen.tuner.space import default_config, load_spaces
from kgen.tuner.study import build_space, run_inprocess
from kgen.tuner.workloads import Bucket, Check, Timing, Workload

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels on CPU tensors in Triton's interpreter")

optuna.logging.set_verbosity(optuna.logging.WARNING)
LAYOUTS = load_layouts()
SMALL_SPACE = """
schema = "kgen.tune-space/1"
[arch_families]
"sm_" = "cpu"
[family.cpu]
kv_dtypes = ["bfloat16"]
[family.cpu.axes]
block_h = [2, 8]
block_n = [16, 32]
num_warps = [4]
num_stages = [1]
programs_per_sm = [1, 2]
max_splits = [4]
min_tokens_per_split = [64]
"""
CHECK = Check(prefixes=(1, 37, 70), atol=0.02, rtol=0.02)
TIMING = Timing(replays=2, min_input_sets=1, max_input_sets=2, repeats=2, top_k=2)
WORKLOAD = Workload(batch=2, prefix=40, draft=2)


@pytest.fixture(scope="module")
def module() -> Any:
    mod = kgen.load("gqa64", "bfloat16")
    if not mod.LAUNCHER.interpret:
        pytest.skip("generated modules were loaded for a GPU in this process: the GPU path covers this")
    return mod


def backend(mod: Any, workloads: list[Workload] | None = None, kv: str = "bfloat16") -> GpuBackend:
    return GpuBackend(
        mod,
        "interpreter",
        LAYOUTS["gqa64"],
        kv,
        "bfloat16",
        8,
        1,
        workloads or [WORKLOAD],
        CHECK,
        TIMING,
        device="cpu",
        timer=EagerTimer(iters=2),  # the host clock: torch sees no GPU here
    )


class Wrapped:
    """The real module, with chosen configs made wrong or made to fail at launch."""

    def __init__(self, mod: Any, wrong_block_n: int | None = None, oor_block_h: int | None = None) -> None:
        self.mod, self.wrong_block_n, self.oor_block_h = mod, wrong_block_n, oor_block_h

    def launch(self, *args: Any, config: dict[str, Any]) -> None:
        if config["block_h"] == self.oor_block_h:
            raise OutOfResources(300000, 101376, "shared memory")
        self.mod.launch(*args, config=config)
        if config["block_n"] == self.wrong_block_n:
            args[3].mul_(1.5)  # o_extend: a plausible-looking wrong answer


def test_real_kernel_passes_the_reference_check_and_is_timed(module: Any) -> None:
    be = backend(module)
    cfg = BlockConfig(block_h=8, block_n=16, num_warps=4, num_stages=1)
    assert be.parity_error(cfg) is None
    assert be.measure(cfg) > 0


def test_fp8_check_uses_scales_and_passes(module: Any) -> None:
    fp8 = kgen.load("gqa64", "float8_e4m3fn")
    be = backend(fp8, kv="float8_e4m3fn")
    assert be.parity_error(BlockConfig(block_h=8, block_n=32, num_warps=4, num_stages=1)) is None
    case, _ = be._reference_case()
    assert (case.k_scale, case.v_scale) == (CHECK.fp8_k_scale, CHECK.fp8_v_scale)


def test_wrong_output_is_caught_with_the_error_size(module: Any) -> None:
    be = backend(Wrapped(module, wrong_block_n=32))
    reason = be.parity_error(BlockConfig(block_h=8, block_n=32, num_warps=4, num_stages=1))
    assert reason and "reference_verify" in reason and "atol" in reason


def test_a_short_study_on_the_real_kernel_prunes_wrong_and_failing_configs(module: Any, tmp_path: Path) -> None:
    spaces_path = tmp_path / "spaces.toml"
    spaces_path.write_text(SMALL_SPACE)
    spaces = load_spaces(spaces_path)
    bucket = Bucket(name="tiny", batch_min=1, batch_max=4, batches=(2,), prefixes=(40,))
    job = TuneJob("sm_90", LAYOUTS["gqa64"], "bfloat16", "bfloat16", 8, bucket, (WORKLOAD,))
    space = build_space(job, spaces)
    be = backend(Wrapped(module, wrong_block_n=32, oor_block_h=2))
    default = BlockConfig(block_h=8, block_n=16, num_warps=4, num_stages=1)
    wrong = default.model_copy(update={"block_n": 32})
    failing = default.model_copy(update={"block_h": 2})
    storage = optuna.storages.InMemoryStorage()
    study = run_inprocess(job, space, be, storage, 6, enqueue=(default, wrong, failing), progress=False)
    reasons = [t.user_attrs["pruned_reason"] for t in study.trials if t.state.name == "PRUNED"]
    assert any(r.startswith("wrong output") for r in reasons)
    assert any("OutOfResources" in r for r in reasons)
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert complete and all(t.params["block_n"] == 16 and t.params["block_h"] == 8 for t in complete)
    result = finalize(job, study, default, be, TIMING)
    # Only block_n 16 / block_h 8 configs are right and run; which of them wins is timing
    # (the interpreter ignores warps and stages), so the test asserts no more than that.
    assert result.default_us
    assert (result.chosen.block_n, result.chosen.block_h) == (16, 8)


def test_rotation_exceeds_l2_within_memory() -> None:
    t = Timing(l2_rotate_factor=2.0, min_input_sets=2, max_input_sets=64, max_memory_fraction=0.5)
    assert rotation_count(10 << 20, 50 << 20, 1 << 40, t) == 10  # 2 x 50 MiB / 10 MiB
    assert rotation_count(1 << 30, 50 << 20, 1 << 40, t) == 2  # at least min_input_sets
    assert rotation_count(1 << 10, 50 << 20, 1 << 40, t) == 64  # capped
    assert rotation_count(10 << 20, 50 << 20, 30 << 20, t) == 1  # memory-bound
    with pytest.raises(TuneError, match="GiB"):
        rotation_count(8 << 30, 50 << 20, 4 << 30, t)


def test_input_bytes_count_views_once() -> None:
    k = torch.zeros(10, 4)
    assert input_bytes([k, k[:, :2], torch.zeros(3)]) == 10 * 4 * 4 + 3 * 4


def test_geomean() -> None:
    assert geomean([1.0, 4.0, 16.0]) == pytest.approx(4.0)


def test_objective_on_the_real_backend_records_the_config(module: Any) -> None:
    spaces = load_spaces()
    bucket = Bucket(name="tiny", batch_min=1, batch_max=4, batches=(2,), prefixes=(40,))
    job = TuneJob("sm_90", LAYOUTS["gqa64"], "bfloat16", "bfloat16", 8, bucket, (WORKLOAD,))
    space = build_space(job, spaces)
    study = optuna.create_study()
    params, _ = space.params_of(default_config(job.layout, 8).model_copy(update={"num_stages": 1}))
    study.enqueue_trial(params)
    study.optimize(make_objective(space, backend(module)), n_trials=1)
    assert study.trials[0].state.name == "COMPLETE"
    assert study.trials[0].user_attrs["config"]["block_h"] == 8


def test_workloads_are_timed_by_the_benchmarks_timer_over_every_input_set(module: Any) -> None:
    """One CUDA-graph timer for the tuner and the bench: the backend's default is
    kgen.bench.timing.CudaGraphTimer with the bucket's replays, handed a launch per input set."""
    from kgen.bench.timing import CudaGraphTimer, Timing

    assert backend(module).timer == EagerTimer(iters=2)
    default = GpuBackend(module, "interpreter", LAYOUTS["gqa64"], "bfloat16", "bfloat16", 8, 1, [WORKLOAD], CHECK,
                         TIMING, device="cpu")
    assert default.timer == CudaGraphTimer(replays=TIMING.replays)
    seen: list[int] = []

    def fake(fn: Any, n_sets: int) -> Timing:
        for i in range(n_sets):
            fn(i)
            seen.append(i)
        return Timing.from_samples([7.0, 5.0, 6.0], n_sets, "fake")

    be = backend(module)
    be.timer = fake
    cfg = BlockConfig(block_h=8, block_n=16, num_warps=4, num_stages=1)
    assert be.time_workload(WORKLOAD, cfg) == 6.0
    assert seen == list(range(len(be._input_sets(WORKLOAD)))) and len(seen) == TIMING.max_input_sets


def test_a_jobs_backend_takes_the_job_and_the_workloads_file(module: Any) -> None:
    from kgen.tuner.workloads import load_workloads

    workloads = load_workloads()
    bucket = workloads.bucket_named("b2-8")
    job = TuneJob("sm_90", LAYOUTS["gqa64"], "bfloat16", "bfloat16", 8, bucket, tuple(workloads.workloads(bucket)))
    be = GpuBackend.for_job(module, job, workloads, 60 << 20)
    assert (be.arch, be.layout, be.group_size, be.num_kv_heads) == ("sm_90", job.layout, 8, workloads.num_kv_heads)
    assert be.workloads == list(job.workloads) and be.check_spec == workloads.check and be.l2_bytes == 60 << 20
    assert be.timer.replays == workloads.timing.replays
