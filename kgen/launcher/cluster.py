"""Thread-block clusters: the prefix stage's splits of one head block launched as one cluster,
so that they merge their partials in the same launch (docs/perf-notes.md, "The merge in a
cluster").

A cluster's programs are co-scheduled on one GPC (sm_90 and later), and a cluster barrier orders
their partial stores before the merge's reads: no atomic, no arrival counter to reset, nothing a
CUDA graph must replay beside the kernel, and a fixed merge order.

Triton compiles the kernel for one CTA per program (``num_ctas`` 1: a program's tensors are not
spread over a cluster); its launcher launches ``grid[0] x num_ctas`` blocks along axis 0 in
clusters of ``num_ctas`` when the compiled kernel's packed launch metadata says so. A kernel
compiled with ``CLUSTER_SPLITS`` > 1 is only ever launched in clusters, so ``launch_in_clusters``
sets that field on its compiled form before the launch that runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import triton

# The launch metadata Triton's CUDA launcher takes: (num_warps, num_ctas, shared bytes).
PACKED_METADATA_FIELDS = 3
CLUSTER_METADATA_FIELD = 1


class ClusterLaunchUnsupported(RuntimeError):
    """This Triton's compiled kernels do not carry the launch metadata the cluster launch sets."""


def triton_launches_clusters() -> bool:
    """Whether this Triton's CUDA launcher takes the cluster size from the compiled kernel's
    packed metadata (num_warps, num_ctas, shared): Triton 3.6 and later."""
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 6)


def clustered(compiled: Any, cluster: int) -> Any:
    """The compiled kernel, its launch metadata set to launch in clusters of ``cluster``
    programs (idempotent). Refuses a compiled form that is not a one-CTA program."""
    packed = getattr(compiled, "packed_metadata", None)
    if not isinstance(packed, tuple) or len(packed) != PACKED_METADATA_FIELDS:
        raise ClusterLaunchUnsupported(
            f"Triton {triton.__version__}: a compiled kernel's packed_metadata is {packed!r}, not "
            "(num_warps, num_ctas, shared); launch without clusters (KGEN_NO_CLUSTER_MERGE=1)")
    if packed[CLUSTER_METADATA_FIELD] == cluster:
        return compiled
    if getattr(compiled.metadata, "num_ctas", 1) != 1:
        raise ClusterLaunchUnsupported(f"{compiled.name} was compiled for {compiled.metadata.num_ctas} CTAs a "
                                       "program; only one-CTA programs launch in clusters of their own")
    compiled.packed_metadata = (*packed[:CLUSTER_METADATA_FIELD], cluster, *packed[CLUSTER_METADATA_FIELD + 1:])
    return compiled


@functools.cache
def max_active_clusters(function: int, shared: int, cluster: int) -> int:
    """How many clusters of ``cluster`` programs of a compiled kernel (its CUfunction and shared
    bytes) the device holds at once: a cluster's programs share one GPC, so it depends on how
    many multiprocessors each GPC of this very chip has, not on the arch alone. Triton's driver
    asks the CUDA driver (cuOccupancyMaxActiveClusters, for 128-thread programs)."""
    from triton.runtime import driver

    return int(driver.active.utils.cuOccupancyMaxActiveClusters(function, shared, cluster))


# The program size Triton's occupancy query assumes (its driver asks for 128-thread blocks).
OCCUPANCY_QUERY_WARPS = 4


def clusters_fit(compiled: Any, cluster: int, clusters: int) -> bool:
    """Whether ``clusters`` clusters of the compiled kernel run in one wave: past it, the clusters
    left wait for whole clusters to finish (measured on an H100: 16 clusters of 8 where 14 fit,
    1.6x the merge launch's time; docs/perf-notes.md, "The merge in a cluster"). A program of
    other than 4 warps is never taken to fit: the occupancy query would count it as 4."""
    if getattr(compiled.metadata, "num_warps", None) != OCCUPANCY_QUERY_WARPS:
        return False
    compiled._init_handles()
    return clusters <= max_active_clusters(compiled.function, compiled.metadata.shared, cluster)


def launch_in_clusters(kernel: Any, grid: tuple[int, int, int], cluster: int, args: Sequence[Any],
                       kwargs: Mapping[str, Any]) -> bool:
    """Launch ``kernel`` (a @triton.jit function compiled with CLUSTER_SPLITS == cluster) over
    ``grid[0] x cluster`` programs along axis 0, in clusters of ``cluster``, where they all fit
    the device at once; returns False, having launched nothing, where they do not.

    The compiled form is fetched (compiled if new) before the launch, so no launch of it ever
    runs unclustered: its merge would read partials its cluster has not written."""
    compiled = clustered(kernel.warmup(*args, grid=grid, **kwargs), cluster)
    if not clusters_fit(compiled, cluster, grid[0] * grid[1] * grid[2]):
        return False
    kernel[grid](*args, **kwargs)
    return True
