"""GPU seconds from NVML process samples by the time they cover (gpu/samples.py), on sample
streams shaped like the real driver's: one process per sample (the process active on the
engine when the sample was taken), a fixed period, nothing while the GPU idles, processes
appearing and exiting mid-stream, and several processes on one timestamp."""

from __future__ import annotations

import pytest

from gpuwatch.core.model import ContainerIdentity, DeviceInfo, GpuProcess, GpuSweep, ProcessIdentity
from gpuwatch.gpu.samples import DEFAULT_SAMPLE_PERIOD_US, SampleTimeline, integrate
from gpuwatch.pipeline.attribution import AttributionState, attribute

P = 166_667  # us: a data-center GPU's sample period
T0 = 5_000_000_000


def _stream(pids_utils: list[tuple[int, int] | None], start_us: int = T0) -> list[tuple[int, int, int]]:
    """(pid, timestamp, sm%) per period; None: the GPU idled (no sample, as NVML drops them)."""
    return [(entry[0], start_us + i * P, entry[1]) for i, entry in enumerate(pids_utils) if entry is not None]


def _primed(periods: int = 4) -> SampleTimeline:
    """A timeline after its baseline read (which charges nothing) of `periods` samples."""
    timeline = SampleTimeline()
    read = integrate(_stream([(1, 50)] * periods, T0 - periods * P), timeline)
    assert read.seconds_by_pid == {} and read.covered_s == 0.0
    assert timeline.period_us == P
    return timeline


def test_the_first_read_is_a_baseline_that_learns_the_period() -> None:
    timeline = SampleTimeline()
    assert timeline.period_us == DEFAULT_SAMPLE_PERIOD_US
    read = integrate(_stream([(7, 100)] * 20), timeline)
    assert read.seconds_by_pid == {}  # history from before the reader started is not charged
    assert timeline.newest_us == T0 + 19 * P and timeline.period_us == P


def test_each_sample_covers_one_period_and_time_slicing_adds_up_to_busy_time() -> None:
    timeline = _primed()
    # A and B time-slice a GPU that is 90 % busy: each sample names whoever was active
    stream = _stream([(10, 90), (11, 90), (10, 90), (10, 90), (11, 90), (11, 90)])
    read = integrate(stream, timeline)
    assert read.seconds_by_pid[10] == pytest.approx(3 * P * 0.9 / 1e6)
    assert read.seconds_by_pid[11] == pytest.approx(3 * P * 0.9 / 1e6)
    assert read.covered_s == pytest.approx(6 * P / 1e6)
    assert sum(read.seconds_by_pid.values()) == pytest.approx(0.9 * read.covered_s)
    assert read.ratio(10) == pytest.approx(0.45) and read.ratio(99) == 0.0


def test_an_intermittent_process_is_charged_only_for_its_periods() -> None:
    """The old average-and-hold method charged this one its 100 % for the whole second."""
    timeline = _primed()
    read = integrate(_stream([(5, 100), None, None, None, None, None, (5, 100)]), timeline)
    # the second sample follows 5 idle periods: it covers its own period (+10 % jitter), not 6
    assert read.seconds_by_pid[5] == pytest.approx((P + 1.1 * P) / 1e6)


def test_a_process_that_appears_mid_stream_and_one_that_exits() -> None:
    timeline = _primed()
    read = integrate(_stream([(1, 80), (1, 80), (2, 60), (2, 60), (2, 60)]), timeline)
    assert read.seconds_by_pid == pytest.approx({1: 2 * P * 0.8 / 1e6, 2: 3 * P * 0.6 / 1e6})
    later = integrate(_stream([(2, 60)] * 3, T0 + 5 * P), timeline)
    assert set(later.seconds_by_pid) == {2}  # pid 1 exited: nothing more


def test_overlapping_samples_of_one_period_never_exceed_the_period() -> None:
    timeline = _primed()
    stream = [(1, T0, 80), (2, T0, 70), (3, T0 + P, 40), (4, T0 + P, 30)]
    read = integrate(stream, timeline)
    assert read.seconds_by_pid[1] == pytest.approx(P * 80 / 150 / 1e6)
    assert read.seconds_by_pid[2] == pytest.approx(P * 70 / 150 / 1e6)
    assert read.seconds_by_pid[3] == pytest.approx(P * 0.4 / 1e6)  # under 100 %: as sampled
    assert sum(read.seconds_by_pid.values()) <= read.covered_s + 1e-12


def test_a_first_read_of_an_idle_gpu_is_the_baseline_and_later_samples_are_charged() -> None:
    timeline = SampleTimeline()
    assert integrate([], timeline).seconds_by_pid == {}  # NOT_FOUND: nothing in the ring yet
    read = integrate(_stream([(3, 100), (3, 50)]), timeline)
    assert read.seconds_by_pid[3] == pytest.approx((P * 1.0 + P * 0.5) / 1e6)  # first one: one period


def test_samples_already_charged_are_not_charged_again() -> None:
    timeline = _primed()
    stream = _stream([(1, 100)] * 3)
    first = integrate(stream, timeline)
    again = integrate(stream, timeline)  # a driver repeating samples at or before lastSeen
    assert first.seconds_by_pid[1] > 0 and again.seconds_by_pid == {} and again.covered_s == 0.0


def _sweep(t_s: float, util: float | None, seconds: dict[int, float]) -> GpuSweep:
    device = DeviceInfo(index=0, uuid="GPU-0", name="gpu", pci_bus_id=None, memory_total_bytes=None,
                        memory_used_bytes=None, memory_free_bytes=None, utilization_gpu_ratio=util)
    procs = tuple(GpuProcess(pid=pid, gpu_uuid="GPU-0", gpu_index=0, memory_bytes=0, sm_utilization_ratio=0.5,
                             kernel_seconds=s) for pid, s in seconds.items())
    return GpuSweep(timestamp_s=t_s, devices=(device,), processes=procs)


def _identities(*pids: int) -> dict[int, ProcessIdentity]:
    return {pid: ProcessIdentity(pid=pid, container_pid=None, comm="w",
                                 identity=ContainerIdentity(runtime="docker", cgroup_path=f"/c{pid}",
                                                            container_id=f"c{pid}"))
            for pid in pids}


def test_containers_never_exceed_the_gpus_busy_time_and_scaling_is_counted() -> None:
    ids = _identities(1, 2)
    state = attribute(_sweep(100.0, 0.5, {1: 0.0, 2: 0.0}), ids, AttributionState(), "n").state
    # 1 s later the samples say 0.6 + 0.3 s, but the GPU was busy 0.6 s: scaled by 2/3
    result = attribute(_sweep(101.0, 0.6, {1: 0.6, 2: 0.3}), ids, state, "n")
    by_key = {c.identity.container_id: c for c in result.containers}
    assert by_key["c1"].kernel_seconds_total == pytest.approx(0.4)
    assert by_key["c2"].kernel_seconds_total == pytest.approx(0.2)
    assert by_key["c1"].sm_utilization_ratio == pytest.approx(0.5)  # its process's share of its samples
    assert dict(result.state.kernel_time_scaled) == {"GPU-0": 1}
    # within the busy time: added as sampled, nothing counted
    again = attribute(_sweep(102.0, 0.9, {1: 0.5, 2: 0.3}), ids, result.state, "n")
    by_key = {c.identity.container_id: c for c in again.containers}
    assert by_key["c1"].kernel_seconds_total == pytest.approx(0.9)
    assert dict(again.state.kernel_time_scaled) == {"GPU-0": 1}


def test_a_process_without_samples_falls_back_to_share_times_interval() -> None:
    ids = _identities(1)
    state = attribute(_sweep(10.0, None, {}), ids, AttributionState(), "n").state
    proc = GpuProcess(pid=1, gpu_uuid="GPU-0", gpu_index=0, memory_bytes=0, sm_utilization_ratio=0.25)
    sweep = GpuSweep(timestamp_s=12.0, devices=_sweep(0, None, {}).devices, processes=(proc,))
    result = attribute(sweep, ids, state, "n")
    assert result.containers[0].kernel_seconds_total == pytest.approx(0.5)


def test_seconds_read_every_few_sweeps_spend_the_busy_time_of_those_sweeps() -> None:
    """A backend that reads process samples every third sweep charges three sweeps' seconds at
    once: the busy time of the sweeps in between carries over, so nothing is scaled."""
    ids = _identities(1)
    state = attribute(_sweep(0.0, 0.5, {1: 0.0}), ids, AttributionState(), "n").state
    total = 0.0
    for k in range(1, 10):
        seconds = 1.5 if k % 3 == 0 else 0.0  # 3 sweeps x 0.5 busy
        result = attribute(_sweep(float(k), 0.5, {1: seconds}), ids, state, "n")
        state = result.state
        total = result.containers[0].kernel_seconds_total
    assert total == pytest.approx(4.5) and dict(state.kernel_time_scaled) == {}
    # the carried busy time is bounded: a long idle stretch cannot pay for a later burst
    for k in range(10, 40):
        state = attribute(_sweep(float(k), 1.0, {1: 0.0}), ids, state, "n").state
    burst = attribute(_sweep(40.0, 1.0, {1: 30.0}), ids, state, "n")
    assert burst.containers[0].kernel_seconds_total == pytest.approx(4.5 + 6.0)
    assert dict(burst.state.kernel_time_scaled) == {"GPU-0": 1}
