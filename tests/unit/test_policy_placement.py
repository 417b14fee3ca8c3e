"""gpuwatch/policy/placement.py: binpack (or spread) by declared demand; a job that fits
nowhere waits on the GPU where its context fits beside every promise, or at the node when
none does."""

from __future__ import annotations

import pytest

from gpuwatch.policy.placement import GpuLoad, choose_gpu

GIB = 1 << 30
CONTEXT = 518 << 20


def test_binpack_takes_the_fullest_gpu_that_fits_spread_the_emptiest() -> None:
    gpus = [GpuLoad(0, 8 * GIB, 5 * GIB, 1), GpuLoad(1, 8 * GIB, 2 * GIB, 1), GpuLoad(2, 8 * GIB, 2 * GIB, 0),
            GpuLoad(3, 8 * GIB, 6 * GIB, 1)]
    assert choose_gpu(3 * GIB, gpus, CONTEXT) == 0  # binpack (default): 3 GiB left exactly; GPU 3 is too full
    assert choose_gpu(3 * GIB, gpus, CONTEXT, policy="binpack") == 0
    assert choose_gpu(3 * GIB, gpus, CONTEXT, policy="spread") == 2  # tie on room: fewer jobs
    # a 5 GiB job still finds a whole 6 GiB hole after binpack put the 3 GiB job on GPU 0
    packed = [GpuLoad(0, 8 * GIB, 8 * GIB, 2), *gpus[1:]]
    assert choose_gpu(5 * GIB, packed, CONTEXT) == 2


def test_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'roundrobin': use one of binpack, spread"):
        choose_gpu(GIB, [GpuLoad(0, 8 * GIB, 0)], CONTEXT, policy="roundrobin")


def test_fits_nowhere_waits_where_its_context_fits_or_at_the_node() -> None:
    gpus = [GpuLoad(0, 8 * GIB, 7 * GIB, 2), GpuLoad(1, 8 * GIB, 8 * GIB - (100 << 20), 2)]
    assert choose_gpu(3 * GIB, gpus, CONTEXT) == 0  # 1 GiB unpromised holds the 518 MiB context
    assert choose_gpu(3 * GIB, gpus, CONTEXT, policy="spread") == 0
    assert choose_gpu(3 * GIB, [GpuLoad(0, 8 * GIB, 8 * GIB, 3)], CONTEXT) is None
    assert choose_gpu(GIB, [], CONTEXT) is None


def test_late_binding_waits_at_the_node_until_the_whole_demand_fits() -> None:
    gpus = [GpuLoad(0, 8 * GIB, 7 * GIB, 2), GpuLoad(1, 8 * GIB, 6 * GIB, 1)]
    assert choose_gpu(3 * GIB, gpus, CONTEXT) == 1  # queued on GPU 1, where its context fits
    assert choose_gpu(3 * GIB, gpus, CONTEXT, queue_on_gpu=False) is None  # pending at the node
    assert choose_gpu(2 * GIB, gpus, CONTEXT, queue_on_gpu=False) == 1  # fits whole: placed as usual
