"""gpuwatch/policy/placement.py: spread by declared demand; a job that fits nowhere waits on
the GPU where its context fits beside every promise, or at the node when none does."""

from __future__ import annotations

from gpuwatch.policy.placement import GpuLoad, choose_gpu

GIB = 1 << 30
CONTEXT = 518 << 20


def test_fits_goes_to_the_gpu_with_the_most_unpromised_memory() -> None:
    gpus = [GpuLoad(0, 8 * GIB, 5 * GIB, 1), GpuLoad(1, 8 * GIB, 2 * GIB, 1), GpuLoad(2, 8 * GIB, 2 * GIB, 0)]
    assert choose_gpu(3 * GIB, gpus, CONTEXT) == 2  # tie on room: fewer jobs


def test_fits_nowhere_waits_where_its_context_fits_or_at_the_node() -> None:
    gpus = [GpuLoad(0, 8 * GIB, 7 * GIB, 2), GpuLoad(1, 8 * GIB, 8 * GIB - (100 << 20), 2)]
    assert choose_gpu(3 * GIB, gpus, CONTEXT) == 0  # 1 GiB unpromised holds the 518 MiB context
    assert choose_gpu(3 * GIB, [GpuLoad(0, 8 * GIB, 8 * GIB, 3)], CONTEXT) is None
    assert choose_gpu(GIB, [], CONTEXT) is None


def test_late_binding_waits_at_the_node_until_the_whole_demand_fits() -> None:
    gpus = [GpuLoad(0, 8 * GIB, 7 * GIB, 2), GpuLoad(1, 8 * GIB, 6 * GIB, 1)]
    assert choose_gpu(3 * GIB, gpus, CONTEXT) == 1  # queued on GPU 1, where its context fits
    assert choose_gpu(3 * GIB, gpus, CONTEXT, queue_on_gpu=False) is None  # pending at the node
    assert choose_gpu(2 * GIB, gpus, CONTEXT, queue_on_gpu=False) == 1  # fits whole: placed as usual
