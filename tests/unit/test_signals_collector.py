"""SignalCollector: kernel-log Xids put on the right GPU and container, health from them,
bounded retention of per-container Xid counters."""

from __future__ import annotations

import time
from pathlib import Path

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, ProcessIdentity, ProcessUsage
from gpuwatch.signals.kmsg import KmsgReader
from gpuwatch.signals.signal_collector import SignalCollector

GIB = 1024**3
POD_A = ContainerIdentity(runtime="containerd", cgroup_path="/kubepods/a", container_id="a" * 64,
                          container_name="train", pod_name="pod-a", pod_namespace="ml")
POD_B = ContainerIdentity(runtime="containerd", cgroup_path="/kubepods/b", container_id="b" * 64,
                          container_name="serve", pod_name="pod-b", pod_namespace="web")


def devices() -> list[DeviceInfo]:
    return [DeviceInfo(index=i, uuid=f"GPU-{i}", name="H100", pci_bus_id=f"00000000:{0x1B + i:02X}:00.0",
                       memory_total_bytes=80 * GIB, memory_used_bytes=0, memory_free_bytes=80 * GIB)
            for i in range(2)]


def usage(identity: ContainerIdentity, pid: int, gpu: int = 0) -> ContainerUsage:
    return ContainerUsage(identity=identity, gpu_index=gpu, gpu_uuid=f"GPU-{gpu}", memory_bytes=GIB,
                          sm_utilization_ratio=0.0, kernel_seconds_total=0.0,
                          processes=(ProcessUsage(pid, 1, "python3", GIB, 0.0),))


def xid_line(bus: int, xid: int, pid: int | None) -> str:
    who = f"pid={pid}, name=python3" if pid is not None else "pid='<unknown>', name=<unknown>"
    usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)  # logged now (older records are not charged)
    return f"3,1,{usec},-;NVRM: Xid (PCI:0000:{bus:02x}:00): {xid}, {who}, test\n"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_xids_land_on_the_container_and_gpu_that_caused_them(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    collector = SignalCollector(kmsg=KmsgReader(str(log)))
    identities = {100: ProcessIdentity(100, 1, "python3", POD_A), 200: ProcessIdentity(200, 1, "python3", POD_B)}
    containers = [usage(POD_A, 100, 0), usage(POD_B, 200, 1)]
    collector.collect(devices(), None, containers, identities)
    with log.open("a") as f:
        f.write(xid_line(0x1C, 31, 200) + xid_line(0x1C, 31, 200) + xid_line(0x1B, 79, 100)
                + xid_line(0x1B, 13, None) + xid_line(0x99, 79, 100))
    signals = collector.collect(devices(), None, containers, identities)
    got = sorted((x.identity.pod_name, x.gpu_index, x.xid, x.count) for x in signals.container_xids)
    assert got == [("pod-a", 0, 79, 1), ("pod-b", 1, 31, 2)]
    assert [(h.index, h.healthy, h.reason) for h in signals.health] == [(0, False, "xid"), (1, True, "ok")]
    errors = dict(signals.errors_total)
    assert errors["xid_unknown_gpu"] == 1 and errors["xid_unattributed"] == 0


def test_a_process_that_already_exited_is_found_in_last_cycles_identities(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    collector = SignalCollector(kmsg=KmsgReader(str(log)))
    collector.collect(devices(), None, [usage(POD_A, 100)], {100: ProcessIdentity(100, 1, "p", POD_A)})
    log.write_text(xid_line(0x1B, 43, 100))  # the Xid killed it: gone from this cycle's identities
    signals = collector.collect(devices(), None, [], {})
    assert [(x.identity.pod_name, x.xid) for x in signals.container_xids] == [("pod-a", 43)]


def test_a_pid_that_did_not_use_the_gpu_is_never_charged(tmp_path: Path) -> None:
    """Issue 20, item 3: a pid is charged only when it had that GPU open this cycle or the
    last; a resolver finding the pid's container is not enough (the line may be forged)."""
    log = tmp_path / "kmsg"
    log.write_text("")
    collector = SignalCollector(kmsg=KmsgReader(str(log)))
    log.write_text(xid_line(0x1B, 13, 300) + xid_line(0x1B, 13, 301))
    found = {300: ProcessIdentity(300, 1, "p", POD_B)}
    signals = collector.collect(devices(), None, [], {}, resolve=found.get)
    assert signals.container_xids == ()
    assert dict(signals.errors_total)["xid_unattributed"] == 2


def test_counters_of_gone_containers_expire_and_are_bounded(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("")
    clock = Clock()
    collector = SignalCollector(kmsg=KmsgReader(str(log)), xid_retention_s=60, max_xid_series=3, clock=clock)
    pods = [ContainerIdentity(runtime="containerd", cgroup_path=f"/p{i}", container_id=f"{i:064x}",
                              pod_name=f"p{i}") for i in range(5)]
    identities = {1000 + i: ProcessIdentity(1000 + i, 1, "p", pod) for i, pod in enumerate(pods)}
    collector.collect(devices(), None, [usage(pod, 1000 + i) for i, pod in enumerate(pods)], identities)
    with log.open("a") as f:  # each pid had GPU 0 open last cycle: charged
        for i in range(5):
            f.write(xid_line(0x1B, 13, 1000 + i))
    signals = collector.collect(devices(), None, [usage(pods[0], 1000)], identities)
    assert len(signals.container_xids) == 3  # bounded
    clock.now = 61
    signals = collector.collect(devices(), None, [usage(pods[0], 1000)], identities)
    assert [x.identity.pod_name for x in signals.container_xids] == ["p0"]  # still running: kept


def test_no_sweep_keeps_health_for_known_gpus(tmp_path: Path) -> None:
    collector = SignalCollector()
    collector.collect(devices(), None, [], {})
    for _ in range(3):
        signals = collector.collect(None, None, [], {})
    assert [h.reason for h in signals.health] == ["nvml-errors", "nvml-errors"]
