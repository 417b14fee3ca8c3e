"""NFD feature file: labels from Snapshots, the file NFD reads, and the atomic writer."""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import os
import random
import re
import shutil
import stat
import struct
import subprocess
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpuwatch.core.model import (
    DeviceInfo,
    GpuHealth,
    GpuLink,
    GpuTopology,
    NicStats,
    NodeSignals,
    RdmaPort,
    Snapshot,
    TopologyLevel,
)
from gpuwatch.signals import nfd
from gpuwatch.signals.nfd import (
    MAX_FEATURE_FILE_SIZE,
    FeatureFileWriter,
    node_labels,
    nvlink_island_size,
    render_features,
    sanitize_label_value,
)
from tests.nfd_rules import check_feature_file, label_key_errors, label_value_errors

GIB = 1024**3
MIB = 1024**2
A100 = "NVIDIA A100-SXM4-80GB"
P = "gpuwatch.io/"
NOW = 1_790_000_000.0  # 2026-09-21T14:13:20Z


def dev(index: int, name: str = A100, memory_gib: float | None = 80, *, mig: bool = False, healthy: bool = True,
        cc: tuple[int, int] | None = (8, 0)) -> DeviceInfo:
    return DeviceInfo(index=index, uuid=f"GPU-{index}{'-mig' if mig else ''}", name=name, pci_bus_id=None,
                      memory_total_bytes=None if memory_gib is None else int(memory_gib * GIB),
                      memory_used_bytes=None, memory_free_bytes=None, is_mig=mig, healthy=healthy,
                      compute_capability=cc)


def snap(devices: Sequence[DeviceInfo], signals: NodeSignals | None = None, **kw: object) -> Snapshot:
    return Snapshot(timestamp_s=NOW, node="node-1", devices=tuple(devices), containers=(), signals=signals,
                    **kw)  # type: ignore[arg-type]


def topo(n: int, level: TopologyLevel | None, nvlinked: set[frozenset[int]] | None = None,
         nvswitch: bool = False, overrides: dict[frozenset[int], TopologyLevel | None] | None = None) -> GpuTopology:
    """Both orders of every pair; `nvlinked` pairs get 12 NVLinks, `overrides` change a pair's level."""
    links = []
    for a, b in itertools.permutations(range(n), 2):
        pair = frozenset((a, b))
        lvl = (overrides or {}).get(pair, level)
        links.append(GpuLink(a, b, lvl, 12 if nvlinked and pair in nvlinked else 0))
    return GpuTopology(links=tuple(links), nvswitch=nvswitch, nvlink_supported=bool(nvlinked))


def write_checked(tmp_path: Path, labels: dict[str, str]) -> dict[str, str]:
    path = tmp_path / "features.d" / "gpuwatch"
    writer = FeatureFileWriter(path, interval_s=1.0, clock=lambda: NOW)
    assert writer.update(labels)
    return check_feature_file(path, now=NOW)


# --- labels ------------------------------------------------------------------------------------


def test_mixed_sizes_mig_not_counted_no_signals() -> None:
    devices = [dev(0), dev(1), dev(2, "NVIDIA A10", 24, cc=(8, 6)),
               dev(3, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10, mig=True)]
    labels = node_labels(snap(devices, driver_version="550.54.15", cuda_driver_version=12040))
    assert labels == {
        P + "gpu.count": "3", P + "gpu.healthy-count": "3", P + "gpu.unhealthy-count": "0",
        P + "gpu.product": "NVIDIA-A100-SXM4-80GB",
        P + "gpu.memory-mib": str(24 * 1024), P + "gpu.memory-mib.max": str(80 * 1024),
        P + "gpu.family": "ampere", P + "gpu.compute.major": "8", P + "gpu.compute.minor": "0",
        P + "driver.version": "550.54.15", P + "cuda.driver.major": "12", P + "cuda.driver.minor": "4",
    }  # no signals: no topology, island or network labels (unknown, not made up)


def test_product_is_the_most_common_model_ties_to_lowest_index() -> None:
    assert node_labels(snap([dev(0, "B"), dev(1, "A")]))[P + "gpu.product"] == "B"
    assert node_labels(snap([dev(0, "A"), dev(1, "B"), dev(2, "B")]))[P + "gpu.product"] == "B"
    assert node_labels(snap([dev(5, "A"), dev(2, "B")]))[P + "gpu.product"] == "B"  # index 2 < 5


def test_compute_capability_follows_the_product_and_unknown_family_is_omitted() -> None:
    labels = node_labels(snap([dev(0, "old", cc=(4, 1)), dev(1, "new", cc=(9, 0)), dev(2, "new", cc=(9, 0))]))
    assert (labels[P + "gpu.family"], labels[P + "gpu.compute.major"]) == ("hopper", "9")
    labels = node_labels(snap([dev(0, "odd", cc=(4, 1))]))
    assert P + "gpu.family" not in labels and labels[P + "gpu.compute.minor"] == "1"
    labels = node_labels(snap([dev(0, cc=None)]))
    assert not {P + "gpu.family", P + "gpu.compute.major", P + "gpu.compute.minor"} & labels.keys()


@pytest.mark.parametrize(("cc", "family"), [
    ((3, 7), "kepler"), ((5, 2), "maxwell"), ((6, 1), "pascal"), ((7, 0), "volta"), ((7, 2), "volta"),
    ((7, 5), "turing"), ((8, 0), "ampere"), ((8, 6), "ampere"), ((8, 7), "ampere"), ((8, 9), "ada-lovelace"),
    ((9, 0), "hopper"), ((10, 0), "blackwell"), ((12, 0), "blackwell"), ((7, 1), None), ((8, 8), None),
    ((2, 0), None),
])
def test_family(cc: tuple[int, int], family: str | None) -> None:
    assert node_labels(snap([dev(0, cc=cc)])).get(P + "gpu.family") == family


def test_unknown_memory_and_versions_give_no_label() -> None:
    labels = node_labels(snap([dev(0, memory_gib=None), dev(1, memory_gib=40)]))
    assert labels[P + "gpu.memory-mib"] == labels[P + "gpu.memory-mib.max"] == str(40 * 1024)
    labels = node_labels(snap([dev(0, memory_gib=None)], driver_version=None, cuda_driver_version=None))
    assert not [k for k in labels if "memory" in k or "driver" in k]
    assert P + "cuda.driver.major" not in node_labels(snap([dev(0)], cuda_driver_version=0))


def test_unhealthy_from_health_verdicts_else_device_flag() -> None:
    health = (GpuHealth(0, "GPU-0", True, "ok"), GpuHealth(1, "GPU-1", False, "xid", xid=79))
    labels = node_labels(snap([dev(0), dev(1), dev(2, healthy=False)], NodeSignals(health=health)))
    assert (labels[P + "gpu.healthy-count"], labels[P + "gpu.unhealthy-count"]) == ("1", "2")
    labels = node_labels(snap([dev(0, healthy=False), dev(1)]))
    assert (labels[P + "gpu.count"], labels[P + "gpu.unhealthy-count"]) == ("2", "1")


def test_nvml_down_counts_come_from_the_health_tracker() -> None:
    health = (GpuHealth(0, "GPU-0", False, "nvml-errors"), GpuHealth(1, "GPU-1", False, "nvml-errors"))
    labels = node_labels(snap([], NodeSignals(health=health), gpu_up=False))
    assert labels == {P + "gpu.count": "2", P + "gpu.healthy-count": "0", P + "gpu.unhealthy-count": "2"}
    assert node_labels(snap([], gpu_up=False)) == {}  # nothing known: nothing said
    assert node_labels(snap([], gpu_up=True))[P + "gpu.count"] == "0"  # NVML works and sees no GPU


def test_single_gpu_island_one_no_topology() -> None:
    labels = node_labels(snap([dev(0)], NodeSignals(topology=GpuTopology())))
    assert labels[P + "gpu.nvlink-island"] == "1" and P + "gpu.topology" not in labels
    assert node_labels(snap([dev(0)], NodeSignals()))[P + "gpu.nvlink-island"] == "1"


def test_pcie_pairs_worst_level_wins() -> None:
    t = topo(4, TopologyLevel.SYSTEM, overrides={frozenset((0, 1)): TopologyLevel.SINGLE,
                                                 frozenset((2, 3)): TopologyLevel.SINGLE})
    labels = node_labels(snap([dev(i) for i in range(4)], NodeSignals(topology=t)))
    assert (labels[P + "gpu.topology"], labels[P + "gpu.nvlink-island"]) == ("system", "1")
    for level, name in [(TopologyLevel.INTERNAL, "same-board"), (TopologyLevel.SINGLE, "single-switch"),
                        (TopologyLevel.MULTIPLE, "multi-switch"), (TopologyLevel.HOSTBRIDGE, "host-bridge"),
                        (TopologyLevel.NODE, "numa"), (TopologyLevel.SYSTEM, "system")]:
        labels = node_labels(snap([dev(0), dev(1)], NodeSignals(topology=topo(2, level))))
        assert labels[P + "gpu.topology"] == name


def test_nvlink_pairs_and_full_mesh() -> None:
    pairs = {frozenset((0, 1)), frozenset((2, 3))}
    labels = node_labels(snap([dev(i) for i in range(4)],
                              NodeSignals(topology=topo(4, TopologyLevel.HOSTBRIDGE, pairs))))
    assert (labels[P + "gpu.topology"], labels[P + "gpu.nvlink-island"]) == ("host-bridge", "2")
    mesh = {frozenset(p) for p in itertools.combinations(range(4), 2)}
    labels = node_labels(snap([dev(i) for i in range(4)], NodeSignals(topology=topo(4, TopologyLevel.SYSTEM, mesh))))
    assert (labels[P + "gpu.topology"], labels[P + "gpu.nvlink-island"]) == ("nvlink", "4")


def test_nvswitch() -> None:
    mesh = {frozenset(p) for p in itertools.combinations(range(8), 2)}
    t = topo(8, TopologyLevel.SYSTEM, mesh, nvswitch=True)
    labels = node_labels(snap([dev(i) for i in range(8)], NodeSignals(topology=t)))
    assert (labels[P + "gpu.topology"], labels[P + "gpu.nvlink-island"]) == ("nvswitch", "8")
    t = GpuTopology(links=(), nvswitch=True)  # NVSwitch node whose per-pair links NVML did not give
    labels = node_labels(snap([dev(i) for i in range(8)], NodeSignals(topology=t)))
    assert labels[P + "gpu.nvlink-island"] == "8" and P + "gpu.topology" not in labels


def test_unknown_pair_level_omits_topology_but_not_island() -> None:
    t = topo(3, TopologyLevel.NODE, {frozenset((0, 1))}, overrides={frozenset((1, 2)): None})
    labels = node_labels(snap([dev(i) for i in range(3)], NodeSignals(topology=t)))
    assert P + "gpu.topology" not in labels and labels[P + "gpu.nvlink-island"] == "2"
    t = GpuTopology(links=(GpuLink(0, 1, TopologyLevel.NODE, 0),))  # pair (0, 2) and (1, 2) not listed
    labels = node_labels(snap([dev(i) for i in range(3)], NodeSignals(topology=t)))
    assert P + "gpu.topology" not in labels
    assert P + "gpu.topology" not in node_labels(snap([dev(0), dev(1)], NodeSignals()))  # topology None


def test_island_is_a_clique_not_a_component() -> None:
    ring = {frozenset((i, (i + 1) % 6)) for i in range(6)}
    assert nvlink_island_size(range(6), topo(6, TopologyLevel.SYSTEM, ring)) == 2
    # DGX-1 hybrid cube-mesh: two fully linked quads plus i <-> i+4
    cube = ({frozenset(p) for p in itertools.combinations(range(4), 2)}
            | {frozenset(p) for p in itertools.combinations(range(4, 8), 2)}
            | {frozenset((i, i + 4)) for i in range(4)})
    assert nvlink_island_size(range(8), topo(8, TopologyLevel.SYSTEM, cube)) == 4


def test_island_matches_brute_force_on_random_graphs() -> None:
    rng = random.Random(7)
    for _ in range(150):
        n = rng.randint(2, 9)
        edges = {frozenset(p) for p in itertools.combinations(range(n), 2) if rng.random() < 0.5}
        expected = max(k for k in range(1, n + 1) for group in itertools.combinations(range(n), k)
                       if all(frozenset(p) in edges for p in itertools.combinations(group, 2)))
        assert nvlink_island_size(range(n), topo(n, TopologyLevel.SYSTEM, edges)) == expected


def test_island_on_sixteen_gpus_is_quick() -> None:
    edges = {frozenset(p) for p in itertools.combinations(range(16), 2) if (p[0] + p[1]) % 5}
    assert nvlink_island_size(range(16), topo(16, TopologyLevel.SYSTEM, edges)) >= 2


def nic(device: str, state: str, gbit: float | None, rdma: bool = False) -> NicStats:
    return NicStats(device, state, None if gbit is None else gbit * 1e9 / 8, 0, 0, rdma=rdma)


def test_network_labels() -> None:
    nics = (nic("eth0", "up", 25), nic("ib0", "down", 400), nic("eth1", "up", 100), nic("veth1", "up", None))
    labels = node_labels(snap([dev(0)], NodeSignals(nics=nics)))
    assert (labels[P + "network.rdma"], labels[P + "network.max-speed-mbps"]) == ("false", "100000")
    labels = node_labels(snap([dev(0)], NodeSignals(nics=(nic("eth0", "up", 100, rdma=True),))))
    assert labels[P + "network.rdma"] == "true"
    port = RdmaPort("mlx5_0", 1, "ACTIVE", 50e9, 0, 0)
    assert node_labels(snap([dev(0)], NodeSignals(rdma_ports=(port,))))[P + "network.rdma"] == "true"
    labels = node_labels(snap([dev(0)], NodeSignals()))  # no NIC read: unknown, not "false"
    assert not [k for k in labels if "network" in k]
    labels = node_labels(snap([dev(0)], NodeSignals(nics=(nic("eth0", "down", 10),))))
    assert P + "network.max-speed-mbps" not in labels


def test_simulated_and_namespace() -> None:
    labels = node_labels(snap([dev(0)], simulated=True))
    assert labels[P + "gpu.simulated"] == "true"
    assert P + "gpu.simulated" not in node_labels(snap([dev(0)]))
    assert all(k.startswith(P) and not k.startswith("nvidia.com/") for k in labels)
    assert all(not label_key_errors(k) and not label_value_errors(v) for k, v in labels.items())


# --- hostile input -----------------------------------------------------------------------------

HOSTILE_NAMES = [
    "X" * 300, "Tesla V100 " + "ü" * 80, "NVIDIA  GeForce   RTX 4090", "A100/SXM4/80GB", "!!!///...---",
    "---leading dashes", "trailing dots...", "名字 GPU", "A100\ngpuwatch.io/gpu.unhealthy-count=0",
    "name=with=equals", "# +expiry-time=2000-01-01T00:00:00Z", "\t tab\tseparated \t", "", " ", "-",
    "a" * 62 + " b", "\x00\x1b[31mred", "Quadro\u00a0RTX\u2003 8000",
]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=range(len(HOSTILE_NAMES)))
def test_hostile_model_names_give_files_nfd_accepts(tmp_path: Path, name: str) -> None:
    devices = [dev(0, name), dev(1, name, mig=True)]
    labels = node_labels(snap(devices, driver_version=name))
    published = write_checked(tmp_path, labels)
    assert published == labels
    product = labels.get(P + "gpu.product")
    assert product == (sanitize_label_value(name) or None)
    assert labels[P + "gpu.count"] == "1" and labels[P + "gpu.unhealthy-count"] == "0"


@pytest.mark.parametrize(("text", "expected"), [
    ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"), ("Tesla K80/SXM", "Tesla-K80SXM"),
    ("  --x--  ", "x"), ("ünïcode", "ncode"), ("...", ""), ("", ""), ("a_b.c-d", "a_b.c-d"),
    ("a" * 62 + ".b", "a" * 62), ("-" + "a" * 70, "a" * 63),
])
def test_sanitize_label_value(text: str, expected: str) -> None:
    assert sanitize_label_value(text) == expected


def test_sanitize_always_valid() -> None:
    rng = random.Random(3)
    alphabet = "aZ09 -_./=#:\n\tü名\u00a0"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 90)))
        value = sanitize_label_value(text)
        assert not label_value_errors(value), (text, value)


# --- the file ----------------------------------------------------------------------------------


def test_render_format() -> None:
    text = render_features({P + "b": "2", P + "a": "1"}, datetime(2026, 11, 26, 10, 0, tzinfo=UTC))
    lines = text.splitlines()
    assert lines[0].startswith("#") and "gpuwatch" in lines[0]
    assert lines[-3:] == ["# +expiry-time=2026-11-26T10:00:00Z", P + "a=1", P + "b=2"]
    assert render_features({}, 0.0).endswith("# +expiry-time=1970-01-01T00:00:00Z\n")


def test_render_drops_invalid_labels(caplog: pytest.LogCaptureFixture) -> None:
    text = render_features({P + "ok": "1", P + "bad value": "1", P + "v": "no spaces"}, NOW)
    assert P + "ok=1" in text and "bad" not in text and "no spaces" not in text
    assert caplog.text.count("not a valid Kubernetes label") == 2


def test_render_stays_under_nfds_size_limit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    labels = {f"{P}label-{i:05d}": "v" * 60 for i in range(2000)}  # ~160 KB
    text = render_features(labels, NOW)
    assert len(text.encode()) <= MAX_FEATURE_FILE_SIZE
    assert "left out" in caplog.text
    path = tmp_path / "big"
    path.write_text(text)
    published = check_feature_file(path, now=NOW)
    assert 500 < len(published) < 2000 and f"{P}label-00000" in published  # the first labels survive


def test_written_file_round_trips(tmp_path: Path) -> None:
    t = topo(2, TopologyLevel.NODE, {frozenset((0, 1))})
    labels = node_labels(snap([dev(0), dev(1)], NodeSignals(topology=t, nics=(nic("eth0", "up", 10),)),
                              driver_version="550.54.15", cuda_driver_version=12040, simulated=True))
    assert write_checked(tmp_path, labels) == labels


# --- the writer --------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_writes_mode_0644_expiry_with_floor(features_dir: Path) -> None:
    clock = Clock()
    old = os.umask(0o077)
    try:
        writer = FeatureFileWriter(features_dir / "gpuwatch", interval_s=1.0, clock=clock)
        assert writer.update({P + "gpu.count": "1"})
    finally:
        os.umask(old)
    path = features_dir / "gpuwatch"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert check_feature_file(path, now=NOW) == {P + "gpu.count": "1"}
    assert writer.expiry_s == 5 * nfd.MIN_REFRESH_INTERVAL_S and writer.expires_at == NOW + 50
    assert "# +expiry-time=2026-09-21T14:14:10Z" in path.read_text()
    with pytest.raises(AssertionError, match="expired"):
        check_feature_file(path, now=NOW + 51)
    slow = FeatureFileWriter(features_dir / "slow", interval_s=30.0, expiry_intervals=4, clock=clock)
    assert slow.expiry_s == 120 and slow.refresh_margin_s == 60


def test_rewrites_only_on_change_or_near_expiry(features_dir: Path) -> None:
    clock = Clock()
    path = features_dir / "gpuwatch"
    writer = FeatureFileWriter(path, interval_s=1.0, clock=clock)
    assert writer.update({P + "a": "1"})
    inode = path.stat().st_ino
    for step in range(1, 30):  # every "interval" for 29 s: expiry 50 s away, margin 20 s
        clock.now = NOW + step
        assert not writer.update({P + "a": "1"}), step
    assert path.stat().st_ino == inode and writer.writes_total == 1
    clock.now = NOW + 30  # 20 s left: refresh
    assert writer.update({P + "a": "1"})
    assert path.stat().st_ino != inode and writer.expires_at == NOW + 80
    clock.now = NOW + 31
    assert writer.update({P + "a": "2"})  # changed
    assert check_feature_file(path, now=clock.now) == {P + "a": "2"}
    assert not writer.update({P + "a": "2"})
    path.unlink()  # deleted behind the writer's back
    assert writer.update({P + "a": "2"}) and path.exists()
    clock.now = NOW - 3600  # clock stepped back an hour: the written expiry is suspicious
    assert writer.update({P + "a": "2"}) and writer.expires_at == NOW - 3600 + 50
    assert writer.writes_total == 5 and writer.errors_total == 0


def test_rejects_nonsense_settings(features_dir: Path) -> None:
    with pytest.raises(ValueError):
        FeatureFileWriter(features_dir / "x", interval_s=0)
    with pytest.raises(ValueError):
        FeatureFileWriter(features_dir / "x", interval_s=1, expiry_intervals=2)


def test_temp_file_is_a_dot_file_in_a_dot_dir_of_the_same_directory(features_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, src_dir_fd: int | None = None) -> None:
        # the writer renames from an fd on the staging directory (issue 20, 6 d): name that path
        where = os.path.join(os.readlink(f"/proc/self/fd/{src_dir_fd}"), src) if src_dir_fd is not None else src
        renames.append((str(where), str(dst)))
        assert os.stat(where).st_dev == os.stat(Path(dst).parent).st_dev
        real_replace(src, dst, src_dir_fd=src_dir_fd)

    monkeypatch.setattr(nfd.os, "replace", spy)
    writer = FeatureFileWriter(features_dir / "gpuwatch", interval_s=1.0, clock=Clock())
    assert writer.update({P + "a": "1"})
    (src, dst), = renames
    temp = Path(src)
    assert dst == str(features_dir / "gpuwatch")
    assert temp.name.startswith(".") and temp.parent.name.startswith(".")
    assert temp.parent.parent == features_dir
    assert sorted(p.name for p in features_dir.iterdir()) == [".gpuwatch.tmp.d", "gpuwatch"]
    assert list(temp.parent.iterdir()) == []  # nothing left behind


def test_readers_see_old_or_new_never_partial(features_dir: Path) -> None:
    clock = Clock()
    path = features_dir / "gpuwatch"
    writer = FeatureFileWriter(path, interval_s=1.0, clock=clock)
    big_a = {f"{P}a-{i:03d}": "x" * 50 for i in range(300)}  # ~22 KB: many write() calls' worth
    big_b = {f"{P}b-{i:03d}": "y" * 50 for i in range(300)}
    assert writer.update(big_a)
    contents = {render_features(big_a, NOW + 50), render_features(big_b, NOW + 50)}
    stop = threading.Event()
    bad: list[str] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not stop.is_set():
            text = path.read_text()
            reads += 1
            if text not in contents:
                bad.append(text[-80:])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(60):
            assert writer.update(big_b if i % 2 == 0 else big_a)
    finally:
        stop.set()
        thread.join()
    assert not bad and reads > 0


# What NFD's watcher.Add(featureFilesDir) asks inotify for: fsnotify v1.10's default ops
# Create|Write|Remove|Rename|Chmod (fsnotify.go defaultOpts, backend_inotify.go AddWith) =
# IN_CREATE|IN_MODIFY|IN_DELETE|IN_DELETE_SELF|IN_MOVED_TO|IN_MOVED_FROM|IN_MOVE_SELF|IN_ATTRIB.
FSNOTIFY_DEFAULT_MASK = 0x100 | 0x2 | 0x200 | 0x400 | 0x80 | 0x40 | 0x800 | 0x4
IN_MOVED_TO = 0x80


def _inotify_events(directory: Path, action: object) -> list[tuple[int, str]]:
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        pytest.skip("inotify unavailable")
    try:
        if libc.inotify_add_watch(fd, str(directory).encode(), FSNOTIFY_DEFAULT_MASK) < 0:
            pytest.skip("inotify_add_watch failed")
        action()  # type: ignore[operator]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return []
    finally:
        os.close(fd)
    events, offset = [], 0
    while offset < len(data):
        _, mask, _, length = struct.unpack_from("iIII", data, offset)
        name = data[offset + 16:offset + 16 + length].rstrip(b"\0").decode()
        events.append((mask, name))
        offset += 16 + length
    return events


def test_nfd_watcher_sees_one_event_per_update(features_dir: Path) -> None:
    """NFD (v0.19+) re-discovers on any event in features.d, at most once a second, dropping
    the events in between: the only event per update must be the finished file arriving."""
    clock = Clock()
    writer = FeatureFileWriter(features_dir / "gpuwatch", interval_s=1.0, clock=clock)
    assert writer.update({P + "a": "1"})  # creates the staging dir once
    events = _inotify_events(features_dir, lambda: writer.update({P + "a": "2"}))
    assert [(mask & 0xFFF, name) for mask, name in events] == [(IN_MOVED_TO, "gpuwatch")]
    # what a dot-file written beside the target would have cost: events before the rename
    early = _inotify_events(features_dir, lambda: (features_dir / ".x.tmp").write_text("x"))
    assert early and all(name == ".x.tmp" for _, name in early)


def test_missing_directory_is_created_when_parent_exists(tmp_path: Path) -> None:
    writer = FeatureFileWriter(tmp_path / "features.d" / "gpuwatch", interval_s=1.0, clock=Clock())
    assert writer.update({P + "a": "1"})
    assert check_feature_file(tmp_path / "features.d" / "gpuwatch", now=NOW) == {P + "a": "1"}


def test_missing_parent_fails_cleanly_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuwatch.signals.nfd")
    clock = Clock()
    path = tmp_path / "no" / "features.d" / "gpuwatch"
    writer = FeatureFileWriter(path, interval_s=1.0, clock=clock)
    for step in range(5):
        clock.now = NOW + step
        assert not writer.update({P + "a": "1"})
    assert writer.errors_total == 5 and writer.writes_total == 0
    assert writer.last_error is not None and "neither the directory nor its parent exists" in writer.last_error
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    (tmp_path / "no").mkdir()
    assert writer.update({P + "a": "1"}) and path.exists()
    assert "written again" in caplog.text


def test_parent_is_a_regular_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "etc").write_text("not a directory")
    writer = FeatureFileWriter(tmp_path / "etc" / "features.d" / "gpuwatch", interval_s=1.0, clock=Clock())
    for _ in range(3):
        assert not writer.update({P + "a": "1"})
    assert writer.errors_total == 3 and writer.last_error
    assert caplog.text.count("cannot write the NFD feature file") == 1


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody can write to: mode 0555 for a non-root user; for root (which
    ignores the mode) a tmpfs mounted read-only."""
    directory = tmp_path / "features.d"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)
        return
    mount = shutil.which("mount") or "/bin/mount"
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "ro,size=64k,mode=0755", "gpuwatch-test", str(directory)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"root, and a read-only tmpfs cannot be mounted here: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_read_only_directory(read_only_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    writer = FeatureFileWriter(read_only_dir / "gpuwatch", interval_s=1.0, clock=clock)
    for step in range(4):
        clock.now = NOW + step
        assert not writer.update({P + "a": "1"})
    assert writer.errors_total == 4 and writer.writes_total == 0
    assert writer.last_error is not None and str(read_only_dir) in writer.last_error
    assert caplog.text.count("cannot write the NFD feature file") == 1
    assert list(read_only_dir.iterdir()) == []
    assert not writer.remove() and writer.errors_total == 4  # nothing to remove is not an error


def test_failed_write_leaves_old_file_and_no_temp(features_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = features_dir / "gpuwatch"
    writer = FeatureFileWriter(path, interval_s=1.0, clock=Clock())
    assert writer.update({P + "a": "1"})
    before = path.read_text()

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(nfd.os, "fsync", broken_fsync)
    assert not writer.update({P + "a": "2"})
    assert path.read_text() == before and writer.errors_total == 1
    assert list(writer.staging_dir.iterdir()) == []
    monkeypatch.undo()
    assert writer.update({P + "a": "2"})  # retried next interval
    assert check_feature_file(path, now=NOW) == {P + "a": "2"}


def test_stale_temp_files_from_a_crash_are_cleaned(features_dir: Path) -> None:
    staging = features_dir / ".gpuwatch.tmp.d"
    staging.mkdir()
    (staging / ".gpuwatch.999999.tmp").write_text("half a fi")
    (staging / "someone-elses").write_text("kept")
    writer = FeatureFileWriter(features_dir / "gpuwatch", interval_s=1.0, clock=Clock())
    assert writer.update({P + "a": "1"})
    assert sorted(p.name for p in staging.iterdir()) == ["someone-elses"]


def test_remove(features_dir: Path) -> None:
    clock = Clock()
    path = features_dir / "gpuwatch"
    writer = FeatureFileWriter(path, interval_s=1.0, clock=clock)
    assert writer.update({P + "a": "1"})
    assert writer.remove()
    assert list(features_dir.iterdir()) == []  # the file and the staging dir
    assert not writer.remove()
    assert writer.update({P + "a": "1"}) and path.exists()  # usable again (a restart in-process)
    assert writer.errors_total == 0


def test_labels_dict_is_copied(features_dir: Path) -> None:
    writer = FeatureFileWriter(features_dir / "gpuwatch", interval_s=1.0, clock=Clock())
    labels = {P + "a": "1"}
    assert writer.update(labels)
    labels[P + "a"] = "2"
    assert writer.update(labels)  # a mutated dict is a change


# --- the checker catches what NFD would do differently --------------------------------------------

GOOD_HEAD = "# gpuwatch\n# +expiry-time=2026-11-26T10:00:00Z\n"


@pytest.mark.parametrize(("name", "text", "message"), [
    (".hidden", GOOD_HEAD + f"{P}a=1\n", "starts with '.'"),
    ("big", GOOD_HEAD + f"{P}a=1\n" + "#" * MAX_FEATURE_FILE_SIZE, "NFD skips the whole file"),
    ("f", "# +expiry-time=tomorrow\n" + f"{P}a=1\n", "cannot parse the expiry"),
    ("f", "# +expiry-time=2026-11-26 10:00:00Z\n" + f"{P}a=1\n", "cannot parse the expiry"),
    ("f", "# +expiry-time=2026-13-26T10:00:00Z\n" + f"{P}a=1\n", "cannot parse the expiry"),
    ("f", "# +expiry-time\n" + f"{P}a=1\n", "needs a value"),
    ("f", "#+expiry-time=2026-11-26T10:00:00Z\n" + f"{P}a=1\n", "looks like a directive"),
    ("f", GOOD_HEAD + "# +expires=soon\n", "unknown directive"),
    ("f", f"{P}a=1\n", "no '# +expiry-time='"),
    ("f", "# +expiry-time=2020-01-01T00:00:00Z\n" + f"{P}a=1\n", "expired"),
    ("f", GOOD_HEAD + "gpuwatch.io/a b=1\n", "invalid label name"),
    ("f", GOOD_HEAD + "Gpuwatch.io/a=1\n", "prefix"),
    ("f", GOOD_HEAD + f"{P}{'a' * 64}=1\n", "longer than 63"),
    ("f", GOOD_HEAD + f"{P}a=-1\n", "invalid label value"),
    ("f", GOOD_HEAD + f"{P}a={'v' * 64}\n", "longer than 63"),
    ("f", GOOD_HEAD + f"{P}a = 1\n", "invalid label name"),
    ("f", GOOD_HEAD + "a=1\n", "unprefixed name"),
    ("f", GOOD_HEAD + "node.kubernetes.io/a=1\n", "refuses"),
    ("f", GOOD_HEAD + f"{P}a=1\n{P}a=2\n", "appears twice"),
    ("f", GOOD_HEAD + "vendor.io/a=1\n", "expected only gpuwatch.io/ labels"),
])
def test_checker_rejects(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_feature_file(path, now=NOW)


def test_checker_follows_nfd_semantics(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("\n  # comment\r\n# +expiry-time=2026-11-26T11:00:00+01:00\r\n"
                    f"  {P}flag  \n# +no-label\n{P}feature-only=1\n{P}b=2\n")
    assert check_feature_file(path, now=NOW) == {P + "flag": "true", P + "b": "2"}
    assert check_feature_file(path, now=NOW, namespace=None) == {P + "flag": "true", P + "b": "2"}
    no_expiry = tmp_path / "g"
    no_expiry.write_text(f"{P}a=1\nfeature.node.kubernetes.io/x=1\n")
    assert check_feature_file(no_expiry, now=NOW, require_expiry=False, namespace=None) == {
        P + "a": "1", "feature.node.kubernetes.io/x": "1"}
    (tmp_path / "dir").mkdir()
    with pytest.raises(AssertionError, match="not a regular file"):
        check_feature_file(tmp_path / "dir", now=NOW)
