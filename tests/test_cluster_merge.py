"""The merge in a thread-block cluster, without a GPU: when the launcher chooses it (mocked device
properties), what one call launches then, and how the compiled kernel is set to launch in
clusters. The kernels run on a GPU in tests/test_gpu_cluster_merge.py."""

from types import SimpleNamespace

import pytest
from case_tools import patch_kernels

import kgen
from kgen.launcher import cluster
from kgen.launcher.launches import MERGE_KERNEL, PREFIX_KERNEL

MODULE = kgen.load("qwen3_5_gqa256", "bfloat16")
INVARIANT = kgen.load("qwen3_5_gqa256", "bfloat16", batch_invariant=True)
# A Triton-stage config whose grid has `max_splits` splits on 132 multiprocessors, its splits
# merged in a cluster where the launcher can.
CONFIG = {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2,
          "split": {"programs_per_sm": 64, "max_splits": 8, "min_tokens_per_split": 64, "merge": "cluster"}}


@pytest.fixture
def on_gpu(monkeypatch):
    """The launcher as on a GPU (the CPU tests run the interpreter, which has no clusters)."""
    monkeypatch.setattr(MODULE.LAUNCHER, "interpret", False)
    monkeypatch.setattr(MODULE.LAUNCHER, "cluster_launch", True)
    MODULE.LAUNCHER.cached_setup.cache_clear()
    yield MODULE.LAUNCHER
    MODULE.LAUNCHER.cached_setup.cache_clear()


def with_splits(max_splits: int, merge: str | None = "cluster") -> dict:
    split = {**CONFIG["split"], "max_splits": max_splits}
    if merge is None:
        del split["merge"]
    return {**CONFIG, "split": split}


def launched(arch: str, config: dict, batch: int = 2) -> list[tuple[str, int | None]]:
    return [(name, constexprs.get("CLUSTER_SPLITS"))
            for name, constexprs, _ in MODULE.launch_params(arch, 132, 16, batch, 4, None, config)]


@pytest.mark.parametrize(("splits", "cluster"), [(2, 2), (3, 2), (8, 8), (12, 8), (16, 16)])
def test_a_grid_of_2_to_16_splits_merges_in_a_power_of_two_cluster(on_gpu, splits, cluster):
    assert launched("sm_90", with_splits(splits)) == [(PREFIX_KERNEL, cluster)]


@pytest.mark.parametrize(("arch", "splits", "merge"), [
    ("sm_90", 1, "cluster"),  # one split: nothing to merge
    ("sm_90", 17, "cluster"),  # more splits than a cluster holds
    ("sm_100", 16, "cluster"),  # sm_100's limit is the portable 8
    ("sm_80", 8, "cluster"),  # no clusters before sm_90
    ("gfx950", 8, "cluster"),
    ("sm_90", 8, None),  # the table row does not ask for it
])
def test_elsewhere_the_merge_launch_merges(on_gpu, arch, splits, merge):
    launches = launched(arch, with_splits(splits, merge))
    assert launches[0] == (PREFIX_KERNEL, 1)
    assert launches[1:] == ([(MERGE_KERNEL, None)] if splits > 1 else [])


@pytest.mark.parametrize(("pipelined", "splits", "stages"), [(True, 8, 2), (None, 8, 1), (True, 17, 1)])
def test_a_row_pipelines_the_merge_in_its_clusters(on_gpu, pipelined, splits, stages):
    """split.merge_pipelined stages the cluster's merge through shared memory (CLUSTER_MERGE_STAGES
    2); absent, register loads; a call that does not merge in clusters never pipelines it."""
    config = with_splits(splits)
    config["split"] = {**config["split"], "merge_pipelined": pipelined}
    prefix = MODULE.launch_params("sm_90", 132, 16, 2, 4, None, config)[0][1]
    assert prefix["CLUSTER_MERGE_STAGES"] == stages


def test_no_clusters_under_the_interpreter_the_switch_or_the_invariant_mode(on_gpu, monkeypatch):
    monkeypatch.setattr(on_gpu, "no_cluster_merge", True)
    assert launched("sm_90", with_splits(8))[0] == (PREFIX_KERNEL, 1)
    monkeypatch.setattr(on_gpu, "no_cluster_merge", False)
    monkeypatch.setattr(on_gpu, "interpret", True)
    assert launched("sm_90", with_splits(8))[0] == (PREFIX_KERNEL, 1)
    monkeypatch.setattr(on_gpu, "interpret", False)
    monkeypatch.setattr(on_gpu, "cluster_launch", False)
    assert launched("sm_90", with_splits(8))[0] == (PREFIX_KERNEL, 1)
    monkeypatch.setattr(INVARIANT.LAUNCHER, "interpret", False)
    names = [name for name, _, _ in INVARIANT.launch_params("sm_90", 132, 16, 2, 4, None, with_splits(8))]
    assert names == [PREFIX_KERNEL, MERGE_KERNEL]
    assert all("CLUSTER_SPLITS" not in c for _, c, _ in INVARIANT.launch_params("sm_90", 132, 16, 2, 4))


def fake_compiled(num_ctas: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name="k", packed_metadata=(4, num_ctas, 1024), function=7, _init_handles=lambda: None,
                           metadata=SimpleNamespace(num_ctas=num_ctas, shared=1024, num_warps=4))


def test_the_compiled_kernel_is_set_to_launch_in_clusters():
    compiled = fake_compiled()
    assert cluster.clustered(compiled, 8).packed_metadata == (4, 8, 1024)
    assert cluster.clustered(compiled, 8).packed_metadata == (4, 8, 1024)  # idempotent
    with pytest.raises(cluster.ClusterLaunchUnsupported, match="compiled for 2 CTAs"):
        cluster.clustered(fake_compiled(num_ctas=2), 8)
    odd = SimpleNamespace(name="k", packed_metadata=(4, 1), metadata=SimpleNamespace(num_ctas=1))
    with pytest.raises(cluster.ClusterLaunchUnsupported, match="KGEN_NO_CLUSTER_MERGE"):
        cluster.clustered(odd, 8)


class Recorder:
    """A @triton.jit stand-in: records warm-ups and launches."""

    def __init__(self) -> None:
        self.compiled = fake_compiled()
        self.launches: list[tuple] = []

    def warmup(self, *args, grid, **kwargs):
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs.get("CLUSTER_SPLITS")))


@pytest.mark.parametrize(("fits", "expected"), [(16, "clustered"), (3, "two launches")])
def test_clusters_that_do_not_fit_the_device_fall_back_to_the_merge_launch(on_gpu, monkeypatch, fits, expected):
    """4 requests x 1 head block: 4 clusters of 8. Where the device holds fewer at once, the same
    call runs unclustered (a second wave of clusters cost 1.6x on an H100)."""
    from kernel_cases import build

    case = build("qwen3_5_gqa256", [500] * 4, [4] * 4, 16)
    prefix, merge = Recorder(), Recorder()
    patch_kernels(monkeypatch, MODULE, prefix=prefix, merge=merge)
    monkeypatch.setattr(on_gpu, "device_info", lambda *_: ("sm_90", 132, False))
    monkeypatch.setattr(cluster, "max_active_clusters", lambda function, shared, size: fits)
    MODULE.launch(*case.launch_args(), config=with_splits(8))
    if expected == "clustered":
        assert prefix.launches == [((1, 1, 4), 8)] and merge.launches == []
        assert prefix.compiled.packed_metadata[1] == 8
    else:
        assert prefix.launches == [((1, 8, 4), 1)] and len(merge.launches) == 1


def test_programs_of_other_than_four_warps_never_count_as_fitting(monkeypatch):
    """Triton's occupancy query assumes 128-thread programs: an 8-warp one would be counted half
    its size, so it runs unclustered rather than risk a second wave."""
    monkeypatch.setattr(cluster, "max_active_clusters", lambda function, shared, size: 1000)
    compiled = fake_compiled()
    assert cluster.clusters_fit(compiled, 8, 4)
    compiled.metadata.num_warps = 8
    assert not cluster.clusters_fit(compiled, 8, 4)
