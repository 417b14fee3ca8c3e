"""GPU health verdicts: reasons, what heals and what does not, transitions."""

from __future__ import annotations

import dataclasses

from gpuwatch.core.model import DeviceInfo
from gpuwatch.signals.health import DEFAULT_IGNORED_XIDS, HealthTracker, apply_health

GIB = 1024**3


def dev(index: int = 0, **kw: object) -> DeviceInfo:
    base = DeviceInfo(index=index, uuid=f"GPU-{index}", name="H100", pci_bus_id=f"00000000:{0x1B + index:02X}:00.0",
                      memory_total_bytes=80 * GIB, memory_used_bytes=0, memory_free_bytes=80 * GIB)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_all_healthy() -> None:
    verdicts = HealthTracker().update([dev(0), dev(1)])
    assert [(v.index, v.healthy, v.reason, v.transitions_total) for v in verdicts] == [
        (0, True, "ok", 0), (1, True, "ok", 0)]


def test_critical_xid_sticks_until_reset() -> None:
    tracker = HealthTracker()
    tracker.update([dev(0)])
    (v,) = tracker.update([dev(0, xid_events=(79,))])
    assert (v.healthy, v.reason, v.xid, v.transitions_total) == (False, "xid", 79, 1)
    assert "XID 79 (fallen off the bus)" in v.detail
    for _ in range(5):  # no new events: still unhealthy
        (v,) = tracker.update([dev(0)])
        assert not v.healthy
    (v,) = tracker.update([dev(0, lost=True)])
    assert v.reason == "lost"
    (v,) = tracker.update([dev(0)])  # back from lost = it was reset
    assert (v.healthy, v.reason, v.transitions_total) == (True, "ok", 2)


def test_application_xids_keep_the_gpu_healthy() -> None:
    tracker = HealthTracker()
    for xid in sorted(DEFAULT_IGNORED_XIDS):
        (v,) = tracker.update([dev(0, xid_events=(xid,))])
        assert v.healthy, xid


def test_ignored_set_is_configurable() -> None:
    tracker = HealthTracker(ignored_xids=frozenset({79}))
    (v,) = tracker.update([dev(0, xid_events=(79,))])
    assert v.healthy
    (v,) = tracker.update([dev(0, xid_events=(13,))])
    assert (v.healthy, v.xid) == (False, 13)


def test_kernel_log_xids_count_for_health_too() -> None:
    tracker = HealthTracker()
    v0, v1 = tracker.update([dev(0), dev(1)], kernel_xids=[(1, 48), (0, 13)])
    assert v0.healthy and (v1.healthy, v1.xid) == (False, 48)


def test_driver_reload_clears_fatal_xid() -> None:
    tracker = HealthTracker()
    tracker.update([dev(0, xid_events=(95,))])
    tracker.update(None)  # NVML gone for a cycle: the backend is re-created
    (v,) = tracker.update([dev(0)])
    assert v.healthy


def test_ecc_and_row_remap_heal_when_nvml_stops_reporting() -> None:
    tracker = HealthTracker()
    (v,) = tracker.update([dev(0, ecc_uncorrected_volatile=2)])
    assert v.reason == "ecc-uncorrectable" and "2 uncorrectable" in v.detail
    (v,) = tracker.update([dev(0, ecc_uncorrected_volatile=2, row_remap_failure=True)])
    assert v.reason == "row-remap-failure"
    (v,) = tracker.update([dev(0, ecc_uncorrected_volatile=0, row_remap_failure=False)])
    assert v.healthy and v.transitions_total == 2


def test_nvml_errors_after_n_bad_sweeps() -> None:
    tracker = HealthTracker(nvml_error_sweeps=3)
    for expected in (True, True, False, False):
        (v,) = tracker.update([dev(0, memory_total_bytes=None)])
        assert v.healthy is expected
    assert v.reason == "nvml-errors"
    (v,) = tracker.update([dev(0)])
    assert v.healthy


def test_no_sweep_at_all_marks_known_gpus_after_n_cycles() -> None:
    tracker = HealthTracker(nvml_error_sweeps=2)
    tracker.update([dev(0), dev(1)])
    assert all(v.healthy for v in tracker.update(None))
    verdicts = tracker.update(None)
    assert [(v.index, v.healthy, v.reason) for v in verdicts] == [(0, False, "nvml-errors"), (1, False, "nvml-errors")]
    assert [d.index for d in tracker.last_devices()] == [0, 1]


def test_new_uuid_at_an_index_starts_fresh() -> None:
    tracker = HealthTracker()
    tracker.update([dev(0, xid_events=(79,))])
    (v,) = tracker.update([dev(0, uuid="GPU-replaced")])
    assert v.healthy and v.uuid == "GPU-replaced"


def test_mig_instances_follow_their_parent() -> None:
    tracker = HealthTracker()
    parent = dev(0, xid_events=(79,))
    mig = dev(0, uuid="MIG-0", is_mig=True, mig_index=1)
    verdicts = tracker.update([parent, mig])
    assert len(verdicts) == 1
    assert [d.healthy for d in apply_health([parent, mig], verdicts)] == [False, False]
