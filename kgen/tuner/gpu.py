"""The real objective: time a generated module's kernels on the GPU with a trial's config.

``GpuBackend`` follows the contract in docs/design.md: the module comes from
``kgen.load(layout, kv_dtype, q_dtype)`` and ``module.launch(..., config=cfg_dict)`` runs
both stages with an explicit block config, with no checks (graph safe).

Timing: for each workload of the bucket, several input sets are built so that together
they exceed ``l2_rotate_factor`` x the L2 size (each launch then reads K/V from HBM, as
serving does); the benchmark's timer (``kgen.bench.timing.CudaGraphTimer``) captures
launches rotating over them in one CUDA graph, replays it ``replays`` times between CUDA
events and keeps the median per launch. The bucket's cost is the geometric mean over its
workloads.

Lowering: a config with a ``gluon`` section must launch the Gluon prefix stage on every
workload; the backend asks the module's ``launch_params`` (the function ``launch`` runs
from) on the device the module sees, and refuses to time a config whose launch would fall
back to the Triton kernel (another arch or Triton, a draft the Gluon program does not fit).

Correctness: before any timing, the config runs a small case (one request per prefix in
``[check].prefixes``) and its output is compared with ``kgen.reference.reference_verify``.
Problems come from ``kgen.problems.make_case``, the builder the tests and the benchmark use.

Everything that touches torch is imported lazily: the rest of the tuner runs without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kgen.bench.timing import Timer
from kgen.blockconfig import BlockConfig
from kgen.launcher.launches import GLUON_PREFIX_KERNEL, PREFIX_KERNEL
from kgen.spec import FP8_DTYPES
from kgen.tuner.errors import TuneError
from kgen.tuner.objective import FatalDeviceError

# The prefix-stage kernel a launch names (launch_params) for a config without / with a gluon section.
PREFIX_KERNELS = {"triton": PREFIX_KERNEL, "gluon": GLUON_PREFIX_KERNEL}

if TYPE_CHECKING:
    from kgen.spec import LayoutSpec
    from kgen.tuner.job import TuneJob
    from kgen.tuner.workloads import Check, Timing, Workload, WorkloadsFile



@dataclass(frozen=True)
class DeviceInfo:
    """What the tuner needs to know about the GPU (mocked in tests)."""

    arch: str
    name: str
    num_sms: int
    l2_bytes: int
    total_memory: int
    uuid: str | None = None  # tells two physical GPUs apart (``kgen tune --report``)


def device_info_from_props(props: Any, hip: bool) -> DeviceInfo:
    """Map torch's device properties to an arch name: CUDA compute capability 9.0 ->
    ``sm_90``, 10.0 -> ``sm_100``; ROCm ``gcnArchName`` ``gfx942:sramecc+:xnack-`` -> ``gfx942``."""
    from kgen.runtime.device import arch_of  # the one probe; imports torch, as props already did

    try:
        arch = arch_of(props, is_hip=hip)
    except ValueError as exc:
        raise TuneError(f"cannot read the arch of {props.name!r} ({exc}); pass --arch (gfxNNN or sm_NN)") from None
    return DeviceInfo(
        arch=arch,
        name=str(props.name),
        num_sms=int(props.multi_processor_count),
        l2_bytes=int(getattr(props, "L2_cache_size", 0) or 50 << 20),
        total_memory=int(props.total_memory),
        uuid=str(getattr(props, "uuid", "") or "") or None,
    )


def detect_device(index: int = 0) -> DeviceInfo:
    """The current GPU's DeviceInfo; a clear error when there is none."""
    import torch

    if not torch.cuda.is_available():
        raise TuneError(
            "no CUDA or ROCm GPU is visible to torch: tuning times kernels on a GPU. "
            "Use --dry-run (with --arch) to see the space without one."
        )
    props = torch.cuda.get_device_properties(index)
    return device_info_from_props(props, hip=torch.version.hip is not None)


def select_gpu(worker: int, env: dict[str, str] | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES value for worker ``worker``: its index into the devices
    the parent was given (so ``CUDA_VISIBLE_DEVICES=4,5 kgen tune --workers 2`` uses 4 and 5)."""
    env = os.environ if env is None else env
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible:
        if worker >= len(visible):
            raise TuneError(f"worker {worker} has no GPU: CUDA_VISIBLE_DEVICES lists only {visible}")
        return visible[worker]
    return str(worker)


# --------------------------------------------------------------------------- inputs


def input_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for value in tensors:
        if hasattr(value, "untyped_storage"):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def rotation_count(set_bytes: int, l2_bytes: int, free_bytes: int, timing: Timing) -> int:
    """How many input sets to rotate through: enough to exceed ``l2_rotate_factor`` x L2,
    within [min_input_sets, max_input_sets] and ``max_memory_fraction`` of free memory."""
    want = math.ceil(timing.l2_rotate_factor * l2_bytes / max(1, set_bytes))
    want = max(timing.min_input_sets, min(timing.max_input_sets, want))
    fits = int(timing.max_memory_fraction * free_bytes // max(1, set_bytes))
    if fits < 1:
        raise TuneError(
            f"one input set needs {set_bytes / 2**30:.1f} GiB but only "
            f"{free_bytes / 2**30:.1f} GiB are free: shrink the bucket's batches or prefixes"
        )
    return max(1, min(want, fits))


# --------------------------------------------------------------------------- timing


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# --------------------------------------------------------------------------- the backend


class GpuBackend:
    """Check and time one (module, arch, group, bucket) on the current device."""

    def __init__(
        self,
        module: Any,
        arch: str,
        layout: LayoutSpec,
        kv_dtype: str,
        q_dtype: str,
        group_size: int,
        num_kv_heads: int,
        workloads: list[Workload],
        check: Check,
        timing: Timing,
        device: str = "cuda",
        l2_bytes: int = 50 << 20,
        timer: Timer | None = None,
    ) -> None:
        from kgen.bench.timing import CudaGraphTimer

        self.module = module
        self.arch = arch
        self.layout = layout
        self.kv_dtype, self.q_dtype = kv_dtype, q_dtype
        self.group_size, self.num_kv_heads = group_size, num_kv_heads
        self.workloads = workloads
        self.check_spec, self.timing = check, timing
        self.device, self.l2_bytes = device, l2_bytes
        self.timer = timer or CudaGraphTimer(replays=timing.replays)
        self._check_case: tuple[Any, Any] | None = None
        self._sets: dict[Workload, list[Any]] = {}

    @classmethod
    def for_job(cls, module: Any, job: TuneJob, workloads: WorkloadsFile, l2_bytes: int) -> GpuBackend:
        """The backend of one study: the job's arch, layout, dtypes, group and workloads, and
        the workloads file's KV heads, check and timing."""
        return cls(module, job.arch, job.layout, job.kv_dtype, job.q_dtype, job.group_size, workloads.num_kv_heads,
                   list(job.workloads), workloads.check, workloads.timing, l2_bytes=l2_bytes)  # fmt: skip

    def _cfg(self, config: BlockConfig) -> dict[str, Any]:
        return config.for_arch(self.arch).model_dump(exclude_none=True)

    def _case(self, prefixes: list[int], draft: int, seed: int, scales: tuple[float, float] = (1.0, 1.0)) -> Any:
        """A random problem from kgen.problems (the tests' and the benchmark's generator)."""
        from kgen.problems import make_case

        return make_case(
            self.layout,
            prefixes,
            [draft] * len(prefixes),
            self.group_size,
            num_kv_heads=self.num_kv_heads,
            kv_dtype=self.kv_dtype,
            q_dtype=self.q_dtype,
            k_scale=scales[0],
            v_scale=scales[1],
            device=self.device,
            shuffle=self.timing.shuffle_slots,
            seed=seed,
        )

    def _fail(self, exc: BaseException) -> BaseException:
        """After a failed launch: a dead CUDA context is fatal, anything else is the config's."""
        if not self.device.startswith("cuda"):
            return exc
        import torch

        try:
            torch.cuda.synchronize()
        except Exception as sync_exc:  # the context is poisoned (illegal address, ...)
            return FatalDeviceError(f"the device failed after a launch ({exc}); then: {sync_exc}")
        return exc

    def _launch(self, case: Any, config: BlockConfig) -> None:
        try:
            self.module.launch(*case.launch_args(), config=self._cfg(config))
        except Exception as exc:
            raise self._fail(exc) from exc

    def _reference_case(self) -> tuple[Any, Any]:
        """The small check case and its float32 reference output, built once."""
        if self._check_case is None:
            spec = self.check_spec
            fp8 = self.kv_dtype in FP8_DTYPES
            scales = (spec.fp8_k_scale, spec.fp8_v_scale) if fp8 else (1.0, 1.0)
            case = self._case(list(spec.prefixes), self.workloads[0].draft, spec.seed, scales)
            self._check_case = (case, case.reference())
        return self._check_case

    def prefix_kernels(self, config: BlockConfig) -> dict[Workload, str]:
        """The prefix-stage kernel ``launch`` runs for ``config`` on each workload, from the
        module's ``launch_params`` on the device as the module sees it (its launcher's ``device_info``)."""
        import torch

        device = torch.device(self.device)
        arch, num_sms, _ = self.module.LAUNCHER.device_info(device.type, device.index)
        cfg = self._cfg(config)
        return {w: self.module.launch_params(arch, num_sms, self.group_size, w.batch, w.draft, None, cfg,
                                             self.num_kv_heads)[0][0]
                for w in self.workloads}

    def _require_lowering(self, config: BlockConfig) -> None:
        """A Gluon config must launch the Gluon prefix stage on every workload: timing the
        Triton kernel under its name would put a row in the table that never runs as timed."""
        if config.gluon is None:
            return
        wanted = PREFIX_KERNELS["gluon"]
        other = {w.label(): k for w, k in self.prefix_kernels(config).items() if k != wanted}
        if other:
            raise TuneError(
                f"the config has a gluon section, but launch_params runs {sorted(set(other.values()))} at "
                f"{sorted(other)}, not {wanted}: the Gluon prefix stage does not apply here (arch, Triton "
                f"version, or a draft its program does not fit)"
            )

    def parity_error(self, config: BlockConfig) -> str | None:
        """None when the config's output on the small case matches the reference
        elementwise (``torch.allclose``: ``|out - ref| <= atol + rtol * |ref|``; NaN fills
        catch unwritten rows). A Gluon config that would not launch the Gluon kernel raises
        TuneError first (the trial is pruned with the reason)."""
        import torch

        from kgen.reference import relative_error

        self._require_lowering(config)
        case, expected = self._reference_case()
        case.o.fill_(float("nan"))
        self._launch(case, config)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        got = case.o.float()
        err = relative_error(got, expected, "max")
        if math.isinf(err):
            return "output has NaN or Inf (rows left unwritten or overflow)"
        if not torch.allclose(got, expected, rtol=self.check_spec.rtol, atol=self.check_spec.atol):
            return (
                f"error vs reference_verify exceeds atol {self.check_spec.atol} + rtol {self.check_spec.rtol} "
                f"x |ref| (max |out - ref| / max |ref| = {err:.3g})"
            )
        return None

    def _input_sets(self, w: Workload) -> list[Any]:
        """Rotated input sets for ``w``, built on first use and kept for later trials."""
        if w not in self._sets:
            prefixes = [w.prefix] * w.batch
            first = self._case(prefixes, w.draft, seed=1)
            size = input_bytes(list(vars(first).values()))
            count = rotation_count(size, self.l2_bytes, self._free_bytes(), self.timing)
            self._sets[w] = [first] + [self._case(prefixes, w.draft, seed=2 + i) for i in range(count - 1)]
        return self._sets[w]

    def _free_bytes(self) -> int:
        if not self.device.startswith("cuda"):
            return 1 << 40
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free)

    def time_workload(self, w: Workload, config: BlockConfig) -> float:
        """Median microseconds per launch of ``config`` on workload ``w``."""
        sets = self._input_sets(w)
        return self.timer(lambda i: self._launch(sets[i], config), len(sets)).median_us

    def measure(self, config: BlockConfig) -> float:
        """The bucket's cost: geometric mean of the workloads' medians (microseconds)."""
        return geomean([self.time_workload(w, config) for w in self.workloads])


def load_module(layout: str, kv_dtype: str, q_dtype: str) -> Any:
    """The generated module through ``kgen.load`` (docs/design.md), with a clear error."""
    import kgen

    loader = getattr(kgen, "load", None)
    if loader is None:
        raise TuneError("kgen.load is not available in this checkout: the generator must be installed")
    return loader(layout, kv_dtype, q_dtype)
