"""Forged Xids: only lines as NVIDIA's driver prints them count (issue 20, item 3).

Any text a user gets into the kernel log -- a USB product string, a filesystem label --
marked a GPU unhealthy (Xid 48 clears only after a reset), set the NFD label that taints the
node and blamed the pods it named; the tail of an over-long dropped line was parsed as a
line; an Xid was charged to a pid that never used that GPU, or read 123 s late.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuwatch.core.model import (
    ContainerIdentity,
    ContainerUsage,
    DeviceInfo,
    NodeSignals,
    ProcessIdentity,
    ProcessUsage,
)
from gpuwatch.signals.kmsg import KmsgReader, misplaced, parse_xid_line
from gpuwatch.signals.signal_collector import SignalCollector

GIB = 1 << 30
POD = ContainerIdentity(runtime="containerd", cgroup_path="/kubepods/a", container_id="a" * 64, pod_name="victim",
                        pod_namespace="ml")


def now_usec(ago_s: float = 0.0) -> int:
    return int((time.clock_gettime(time.CLOCK_MONOTONIC) - ago_s) * 1e6)


def record(message: str, ago_s: float = 0.0) -> str:
    return f"6,1,{now_usec(ago_s)},-;{message}\n"


GENUINE = "NVRM: Xid (PCI:0000:1b:00): 48, pid=2126, name=python3, DBE (double bit error)"
FORGED = [
    "usb 1-1: Product: NVRM: Xid (PCI:0000:1b:00): 48, pid=2126",
    "EXT4-fs (sdb1): mounted filesystem NVRM: Xid (PCI:0000:1b:00): 79, pid=2126 with ordered data mode",
    "audit: type=1400 msg=NVRM: Xid (PCI:0000:1b:00): 48, pid=2126",
    " NVRM: Xid (PCI:0000:1b:00): 48, pid=2126",
]


@pytest.mark.parametrize("message", FORGED)
def test_xid_text_inside_another_message_is_no_xid(message: str) -> None:
    assert parse_xid_line(message) is None
    assert misplaced(record(message))


def test_the_driver_shapes_still_parse() -> None:
    assert parse_xid_line(GENUINE) is not None
    assert parse_xid_line("[ 1234.567890] " + GENUINE) is not None
    assert parse_xid_line("Nov 26 10:00:00 host kernel: " + GENUINE) is not None


def devices() -> list[DeviceInfo]:
    return [DeviceInfo(index=i, uuid=f"GPU-{i}", name="H100", pci_bus_id=f"00000000:{0x1B + i:02X}:00.0",
                       memory_total_bytes=80 * GIB, memory_used_bytes=0, memory_free_bytes=80 * GIB)
            for i in range(2)]


def usage(pid: int, gpu: int) -> ContainerUsage:
    return ContainerUsage(identity=POD, gpu_index=gpu, gpu_uuid=f"GPU-{gpu}", memory_bytes=GIB,
                          sm_utilization_ratio=0.0, kernel_seconds_total=0.0,
                          processes=(ProcessUsage(pid, 1, "python3", GIB, 0.0),))


def collect_after(tmp_path: Path, text: str, containers: list[ContainerUsage]) -> tuple[SignalCollector, NodeSignals]:
    log = tmp_path / "kmsg"
    log.write_text("")
    collector = SignalCollector(kmsg=KmsgReader(str(log)))
    identities = {2126: ProcessIdentity(2126, 1, "python3", POD)}
    collector.collect(devices(), None, containers, identities)
    log.write_text(text)
    return collector, collector.collect(devices(), None, containers, identities)


def test_a_forged_usb_product_string_marks_nothing_unhealthy_and_blames_nobody(tmp_path: Path) -> None:
    _, signals = collect_after(tmp_path, "".join(record(m) for m in FORGED), [usage(2126, 0)])
    assert all(h.healthy for h in signals.health)
    assert signals.container_xids == ()
    assert dict(signals.errors_total)["kmsg_misplaced_xid"] == len(FORGED)


def test_the_tail_of_an_over_long_line_is_not_a_line(tmp_path: Path) -> None:
    filler = "usb 1-1: Product: " + "x" * 9000  # longer than the reader's line limit
    _, signals = collect_after(tmp_path, record(filler + GENUINE.replace("\n", "")), [usage(2126, 0)])
    assert all(h.healthy for h in signals.health) and signals.container_xids == ()


def test_a_pid_is_charged_only_on_a_gpu_it_had_open(tmp_path: Path) -> None:
    _, signals = collect_after(tmp_path, record(GENUINE), [usage(2126, 1)])  # Xid on GPU 0, pid on GPU 1
    assert signals.container_xids == ()
    assert [h.healthy for h in signals.health] == [False, True]  # still the GPU's
    assert dict(signals.errors_total)["xid_unattributed"] == 1
    _, signals = collect_after(tmp_path, record(GENUINE), [usage(2126, 0)])
    assert [(x.identity.pod_name, x.xid) for x in signals.container_xids] == [("victim", 48)]


def test_an_xid_read_long_after_it_was_logged_is_not_charged_to_a_pid(tmp_path: Path) -> None:
    _, signals = collect_after(tmp_path, record(GENUINE, ago_s=123.5), [usage(2126, 0)])
    assert signals.container_xids == ()
    assert not signals.health[0].healthy  # the GPU did have it
    assert dict(signals.errors_total)["xid_stale"] == 1
