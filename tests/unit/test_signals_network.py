"""Unit tests for gpuwatch.signals.network on fixture trees (no root, no netlink).

/proc and /sys are directories under tmp_path. A network namespace is a file under
tmp_path/ns; `<proc>/<pid>/ns/net` is a symlink to it, so os.stat() gives every pid of one
"namespace" the same inode, as nsfs does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from gpuwatch.core.model import ContainerIdentity, ContainerNetwork
from gpuwatch.signals.network import (
    VANISHED,
    LinkInfo,
    LinkSourceError,
    NetworkReader,
    SysfsLinks,
    namespace_bytes,
    parse_net_dev,
    parse_rdma_rate,
    parse_rdma_state,
    speed_bytes_per_second,
)

HEADER = (
    "Inter-|   Receive                                                |  Transmit\n"
    " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
    "carrier compressed\n"
)


def net_dev(**interfaces: tuple[int, int]) -> str:
    """A /proc/net/dev text with the given (rx_bytes, tx_bytes) per interface."""
    lines = [f"{name:>6}: {rx:>8} 11 0 0 0 0 0 0 {tx:>8} 22 0 0 0 0 0 0" for name, (rx, tx) in interfaces.items()]
    return HEADER + "\n".join(lines) + "\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def identity(name: str, pod: str = "") -> ContainerIdentity:
    return ContainerIdentity(runtime="containerd", cgroup_path=f"/kubepods/{pod or name}/{name}",
                             container_id=f"{name:0<64}"[:64], container_name=name, pod_name=pod or name)


# -- parsers --------------------------------------------------------------------------------


def test_parse_net_dev_reads_64_bit_bytes_and_counts_bad_lines() -> None:
    big = 2**40 + 7
    garbage = "garbage line\n  eth1: 1 2 3\nbond0: x 0 0 0 0 0 0 0 1 0 0 0 0 0 0 0\n"
    text = net_dev(lo=(100, 100), eth0=(big, 5)) + garbage
    counters, bad = parse_net_dev(text)
    assert counters == {"lo": (100, 100), "eth0": (big, 5)}
    assert bad == 3
    assert namespace_bytes(counters) == (big, 5)


def test_parse_net_dev_of_nothing() -> None:
    assert parse_net_dev("") == ({}, 0)
    assert parse_net_dev(HEADER) == ({}, 0)


@pytest.mark.parametrize(("text", "state"), [
    ("4: ACTIVE\n", "ACTIVE"), ("1: DOWN", "DOWN"), ("5: ACTIVE_DEFER\n", "ACTIVE_DEFER"), ("ACTIVE", "ACTIVE"),
    ("", None), ("4:", None), ("4: act ive", None), ("\x00\x01", None),
])
def test_parse_rdma_state(text: str, state: str | None) -> None:
    assert parse_rdma_state(text) == state


@pytest.mark.parametrize(("text", "rate"), [
    ("100 Gb/sec (4X EDR)\n", 12.5e9), ("2.5 Gb/sec (1X SDR)", 2.5e9 / 8), ("400 Gb/sec (4X NDR)", 50e9),
    ("10 Gb/sec (1X QDR)", 1.25e9), ("0 Gb/sec", None), ("fast", None), ("", None), ("Gb/sec", None),
])
def test_parse_rdma_rate(text: str, rate: float | None) -> None:
    assert parse_rdma_rate(text) == rate


@pytest.mark.parametrize(("mbps", "expected"), [
    (10000, 1.25e9), (100000, 12.5e9), (1, 125000.0), (None, None), (-1, None), (0, None), (0xFFFFFFFF, None),
])
def test_speed_bytes_per_second(mbps: int | None, expected: float | None) -> None:
    assert speed_bytes_per_second(mbps) == expected


# -- RDMA -----------------------------------------------------------------------------------


def rdma_port(sys_root: Path, device: str, port: int, *, state: str | None = "4: ACTIVE",
              rate: str | None = "100 Gb/sec (4X EDR)", link_layer: str | None = "InfiniBand",
              rcv_words: str | None = "1000", xmit_words: str | None = "2500") -> Path:
    directory = sys_root / "class" / "infiniband" / device / "ports" / str(port)
    directory.mkdir(parents=True)
    for name, value in (("state", state), ("rate", rate), ("link_layer", link_layer),
                        ("counters/port_rcv_data", rcv_words), ("counters/port_xmit_data", xmit_words)):
        if value is not None:
            write(directory / name, value + "\n")
    return directory


def test_read_rdma_parses_ports_and_counts_words(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    rdma_port(sys_root, "mlx5_0", 1)
    rdma_port(sys_root, "mlx5_0", 2, state="1: DOWN", rate=None, rcv_words="0", xmit_words="0")
    rdma_port(sys_root, "rxe0", 1, rate="10 Gb/sec (1X QDR)", link_layer="Ethernet", rcv_words=None, xmit_words=None)
    reader = NetworkReader(proc_root=str(tmp_path / "proc"), sys_root=str(sys_root))
    ports = reader.read_rdma()
    assert [(p.device, p.port) for p in ports] == [("mlx5_0", 1), ("mlx5_0", 2), ("rxe0", 1)]
    active, down, soft = ports
    assert active.state == "ACTIVE"
    assert active.rate_bytes_per_second == 12.5e9
    assert active.link_layer == "InfiniBand"
    assert (active.receive_bytes_total, active.transmit_bytes_total) == (4000, 10000)  # 4-byte words
    assert down.state == "DOWN" and down.rate_bytes_per_second is None
    assert (down.receive_bytes_total, down.transmit_bytes_total) == (0, 0)
    assert soft.link_layer == "Ethernet" and soft.rate_bytes_per_second == 1.25e9
    assert (soft.receive_bytes_total, soft.transmit_bytes_total) == (None, None)  # no counters dir
    assert reader.errors_total["rdma"] == 0
    assert reader.last_error == ""


def test_read_rdma_without_infiniband_is_empty_and_quiet(tmp_path: Path) -> None:
    (tmp_path / "sys" / "class").mkdir(parents=True)
    reader = NetworkReader(proc_root=str(tmp_path / "proc"), sys_root=str(tmp_path / "sys"))
    assert reader.read_rdma() == ()
    assert reader.read_rdma() == ()
    assert reader.errors_total["rdma"] == 0


def test_read_rdma_garbage_is_counted_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sys_root = tmp_path / "sys"
    rdma_port(sys_root, "bad0", 1, state="weird state", rate="lots", rcv_words="many", xmit_words="-5")
    (sys_root / "class" / "infiniband" / "bad0" / "ports" / "notaport").mkdir()
    (sys_root / "class" / "infiniband" / "noports").mkdir()  # a device without ports/
    reader = NetworkReader(proc_root=str(tmp_path / "proc"), sys_root=str(sys_root))
    with caplog.at_level(logging.WARNING, logger="gpuwatch.signals.network"):
        first = reader.read_rdma()
        per_call = reader.errors_total["rdma"]
        second = reader.read_rdma()
    assert first == second
    (port,) = first
    assert (port.device, port.port, port.state) == ("bad0", 1, "UNKNOWN")
    assert port.rate_bytes_per_second is None
    assert port.receive_bytes_total is None and port.transmit_bytes_total is None
    assert per_call == 5  # state, rate, port_rcv_data, "notaport", noports/ports
    assert reader.errors_total["rdma"] == 2 * per_call
    assert reader.last_error.startswith("rdma: ")
    assert len(caplog.records) == per_call  # one line per distinct error, not per cycle


# -- NICs -----------------------------------------------------------------------------------


def sys_net(sys_root: Path, name: str, *, index: int, operstate: str = "up", carrier: str | None = "1",
            speed: str | None = "10000", flags: str = "0x1003", type_: str = "1") -> None:
    directory = sys_root / "class" / "net" / name
    for file, value in (("ifindex", str(index)), ("operstate", operstate), ("carrier", carrier),
                        ("speed", speed), ("flags", flags), ("type", type_)):
        if value is not None:
            write(directory / file, value + "\n")


def nic_tree(tmp_path: Path) -> tuple[Path, Path]:
    proc, sys_root = tmp_path / "proc", tmp_path / "sys"
    sys_net(sys_root, "lo", index=1, operstate="unknown", speed=None, flags="0x9", type_="772")
    sys_net(sys_root, "eth0", index=2, speed="25000")
    sys_net(sys_root, "eth1", index=3, operstate="down", carrier=None, speed="-1")
    sys_net(sys_root, "ib0", index=4, speed="100000")
    sys_net(sys_root, "veth1", index=5, operstate="lowerlayerdown", carrier="0", speed="10000")
    sys_net(sys_root, "roce0", index=6, speed="-1")
    write(proc / "net" / "dev", net_dev(lo=(9, 9), eth0=(2**33, 200), eth1=(0, 0), ib0=(30, 40), veth1=(5, 6),
                                        roce0=(7, 8)))
    ib = sys_root / "class" / "infiniband"
    write(ib / "mlx5_0" / "device" / "net" / "ib0" / "ifindex", "4\n")  # <ibdev>/device/net/<netdev>
    rdma_port(sys_root, "rxe0", 1)
    write(ib / "rxe0" / "ports" / "1" / "gid_attrs" / "ndevs" / "0", "roce0\n")  # the GID -> netdev mapping
    return proc, sys_root


def test_read_nics_from_sysfs_links(tmp_path: Path) -> None:
    proc, sys_root = nic_tree(tmp_path)
    reader = NetworkReader(proc_root=str(proc), sys_root=str(sys_root), links=SysfsLinks(str(sys_root)))
    nics = {nic.device: nic for nic in reader.read_nics()}
    assert list(nics) == ["eth0", "eth1", "ib0", "veth1", "roce0"]  # by ifindex, no loopback
    eth0 = nics["eth0"]
    assert (eth0.operstate, eth0.speed_bytes_per_second) == ("up", 25000 * 125000.0)
    assert (eth0.receive_bytes_total, eth0.transmit_bytes_total) == (2**33, 200)
    assert not eth0.rdma
    assert nics["eth1"].operstate == "down" and nics["eth1"].speed_bytes_per_second is None
    assert nics["veth1"].speed_bytes_per_second is None  # no carrier
    assert nics["roce0"].speed_bytes_per_second is None  # -1: unknown
    assert nics["ib0"].rdma and nics["roce0"].rdma
    assert nics["ib0"].speed_bytes_per_second == 12.5e9
    assert reader.errors_total == {"nics": 0, "rdma": 0, "netns": 0, VANISHED: 0}


def test_read_nics_counters_are_read_every_call(tmp_path: Path) -> None:
    proc, sys_root = nic_tree(tmp_path)
    reader = NetworkReader(proc_root=str(proc), sys_root=str(sys_root), links=SysfsLinks(str(sys_root)))
    reader.read_nics()
    write(proc / "net" / "dev", net_dev(lo=(9, 9), eth0=(2**33 + 1000, 300), eth1=(0, 0), ib0=(30, 40),
                                        veth1=(5, 6), roce0=(7, 8)))
    eth0 = next(nic for nic in reader.read_nics() if nic.device == "eth0")
    assert (eth0.receive_bytes_total, eth0.transmit_bytes_total) == (2**33 + 1000, 300)


def test_read_nics_garbage_and_missing_counters(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc, sys_root = nic_tree(tmp_path)
    write(proc / "net" / "dev", HEADER + "  eth0: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16\n  ib0: garbage\n\x00\n")
    reader = NetworkReader(proc_root=str(proc), sys_root=str(sys_root), links=SysfsLinks(str(sys_root)))
    with caplog.at_level(logging.WARNING, logger="gpuwatch.signals.network"):
        assert [nic.device for nic in reader.read_nics()] == ["eth0"]  # only what has counters
        reader.read_nics()
    assert reader.errors_total["nics"] == 2
    assert len(caplog.records) == 1
    (proc / "net" / "dev").unlink()
    assert reader.read_nics() == ()
    assert reader.errors_total["nics"] == 3
    assert "net/dev" in reader.last_error


class ScriptedLinks:
    """A LinkSource over a link list the test sets: a full read sees `current`, otherwise
    only what `announce()` (a link event) passed on. Records each call's `full`."""

    def __init__(self, links: list[LinkInfo]) -> None:
        self.current = links
        self.seen: list[LinkInfo] = []
        self.calls: list[bool] = []
        self.fail: str | None = None
        self.closed = False

    def announce(self) -> None:
        self.seen = list(self.current)

    def links(self, full: bool) -> list[LinkInfo]:
        self.calls.append(full)
        if self.fail is not None:
            raise LinkSourceError(self.fail)
        if full:
            self.announce()
        return list(self.seen)

    def close(self) -> None:
        self.closed = True


def link(name: str, index: int, operstate: str = "up", speed: int | None = 10000) -> LinkInfo:
    return LinkInfo(name=name, index=index, operstate=operstate, carrier=operstate == "up",
                    loopback=name == "lo", speed_mbps=speed)


def test_full_link_reads_are_clock_driven(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    write(proc / "net" / "dev", net_dev(lo=(1, 1), eth0=(10, 20)))
    now = [100.0]
    source = ScriptedLinks([link("lo", 1), link("eth0", 2)])
    reader = NetworkReader(proc_root=str(proc), sys_root=str(tmp_path / "sys"), clock=lambda: now[0],
                           links=source, link_refresh_s=30.0)
    reader.read_nics()
    now[0] += 29.0
    reader.read_nics()
    now[0] += 1.0
    reader.read_nics()
    assert source.calls == [True, False, True]

    source.current = [link("lo", 1), link("eth0", 2, operstate="down")]
    source.announce()  # a link event
    now[0] += 1.0
    (eth0,) = reader.read_nics()
    assert eth0.operstate == "down" and eth0.speed_bytes_per_second is None
    assert source.calls[-1] is False


def test_an_unannounced_interface_forces_a_full_read_at_most_every_few_seconds(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    write(proc / "net" / "dev", net_dev(lo=(1, 1), eth0=(10, 20)))
    now = [100.0]
    source = ScriptedLinks([link("lo", 1), link("eth0", 2)])
    reader = NetworkReader(proc_root=str(proc), sys_root=str(tmp_path / "sys"), clock=lambda: now[0], links=source)
    reader.read_nics()
    write(proc / "net" / "dev", net_dev(lo=(1, 1), eth0=(10, 20), eth9=(3, 4)))
    now[0] += 1.0
    assert [nic.device for nic in reader.read_nics()] == ["eth0"]
    assert source.calls == [True, False]  # too soon for another full read
    source.current.append(link("eth9", 9))
    now[0] += 5.0
    assert [nic.device for nic in reader.read_nics()] == ["eth0", "eth9"]
    assert source.calls == [True, False, False, True]


def test_link_source_failure_keeps_the_last_list(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proc = tmp_path / "proc"
    write(proc / "net" / "dev", net_dev(lo=(1, 1), eth0=(10, 20)))
    now = [100.0]
    source = ScriptedLinks([link("lo", 1), link("eth0", 2)])
    reader = NetworkReader(proc_root=str(proc), sys_root=str(tmp_path / "sys"), clock=lambda: now[0], links=source)
    assert len(reader.read_nics()) == 1
    source.fail = "rtnetlink link dump failed: [Errno 105] No buffer space available"
    with caplog.at_level(logging.WARNING, logger="gpuwatch.signals.network"):
        for _ in range(3):
            now[0] += 31.0
            assert [nic.device for nic in reader.read_nics()] == ["eth0"]
    assert reader.errors_total["nics"] == 3
    assert len(caplog.records) == 1
    assert reader.last_error == f"nics: {source.fail}"


def test_close_releases_the_link_source(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    write(proc / "net" / "dev", net_dev(lo=(1, 1), eth0=(10, 20)))
    source = ScriptedLinks([link("lo", 1), link("eth0", 2)])
    with NetworkReader(proc_root=str(proc), sys_root=str(tmp_path / "sys"), links=source) as reader:
        assert reader.read_nics()
    assert source.closed
    reader.close()
    assert reader.read_nics() == ()


# -- containers -----------------------------------------------------------------------------


class ProcTree:
    """A fixture /proc: pids whose ns/net are symlinks to namespace files, each with a net/dev."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = root / "proc"
        self.ns_dir = root / "ns"
        self.ns_dir.mkdir(parents=True)
        self.add("1", "host", lo=(1, 1), eth0=(10**9, 10**9))
        self.add("self", "host", lo=(1, 1), eth0=(10**9, 10**9))

    def namespace(self, name: str) -> Path:
        path = self.ns_dir / name
        path.touch()
        return path

    def add(self, pid: int | str, ns: str, **interfaces: tuple[int, int]) -> None:
        directory = self.proc / str(pid)
        (directory / "ns").mkdir(parents=True, exist_ok=True)
        link_path = directory / "ns" / "net"
        if link_path.is_symlink():
            link_path.unlink()
        link_path.symlink_to(self.namespace(ns))
        self.set_bytes(pid, **interfaces)

    def set_bytes(self, pid: int | str, **interfaces: tuple[int, int]) -> None:
        write(self.proc / str(pid) / "net" / "dev", net_dev(**interfaces))

    def reader(self, max_netns_per_cycle: int = 32) -> NetworkReader:
        return NetworkReader(proc_root=str(self.proc), sys_root=str(self.root / "sys"),
                             max_netns_per_cycle=max_netns_per_cycle)


def by_name(result: tuple[ContainerNetwork, ...]) -> dict[str, tuple[int, int]]:
    return {c.identity.container_name: (c.receive_bytes_total, c.transmit_bytes_total) for c in result}


def test_containers_bytes_per_namespace_without_lo(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    tree.add(100, "podA", lo=(5000, 5000), eth0=(100, 200), net1=(1, 2))
    tree.add(200, "podB", lo=(7, 7), eth0=(300, 400))
    reader = tree.reader()
    result = reader.read_containers([(identity("a"), 100), (identity("b"), 200)])
    assert by_name(result) == {"a": (101, 202), "b": (300, 400)}
    assert reader.errors_total == {"nics": 0, "rdma": 0, "netns": 0, VANISHED: 0}


def test_containers_in_the_host_or_agent_namespace_are_skipped(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    tree.add("self", "agent", eth0=(5, 5))  # the agent in a namespace of its own
    tree.add(100, "host", eth0=(10**9, 10**9))  # a hostNetwork pod
    tree.add(101, "agent", eth0=(5, 5))
    tree.add(200, "podB", eth0=(300, 400))
    reader = tree.reader()
    result = reader.read_containers([(identity("host"), 100), (identity("agent"), 101), (identity("b"), 200)])
    assert by_name(result) == {"b": (300, 400)}


def test_a_pod_namespace_is_read_once_for_all_its_containers(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    tree.add(100, "pod", eth0=(100, 200))
    tree.add(101, "pod", eth0=(100, 200))
    (tree.proc / "101" / "net" / "dev").unlink()  # reading it would count a vanished pid
    reader = tree.reader()
    targets = [(identity("trainer", pod="p"), 100), (identity("sidecar", pod="p"), 101),
               (identity("trainer", pod="p"), 100)]  # the same container twice: reported once
    result = reader.read_containers(targets)
    assert [c.identity.container_name for c in result] == ["trainer", "sidecar"]
    assert by_name(result) == {"trainer": (100, 200), "sidecar": (100, 200)}
    assert reader.errors_total[VANISHED] == 0


def test_vanished_pids_are_dropped_and_counted(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    tree.add(100, "podA", eth0=(1, 2))
    tree.add(200, "podB", eth0=(3, 4))
    tree.add(201, "podB", eth0=(3, 4))
    (tree.proc / "200" / "net" / "dev").unlink()  # gone between its ns/net and its net/dev
    tree.add(300, "podC", eth0=(5, 6))
    (tree.proc / "300" / "net" / "dev").unlink()  # the only pid of its namespace
    reader = tree.reader()
    targets = [(identity("a"), 100), (identity("gone"), 999), (identity("b1"), 200), (identity("b2"), 201),
               (identity("c"), 300)]
    result = reader.read_containers(targets)
    # podB was read through its other pid; b1's pid and c's (the only one of podC) are gone
    assert by_name(result) == {"a": (1, 2), "b2": (3, 4)}
    assert reader.errors_total[VANISHED] == 3  # pid 999, and the net/dev reads of 200 and 300
    assert reader.errors_total["netns"] == 0


def test_garbage_and_unreadable_net_dev(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tree = ProcTree(tmp_path)
    tree.add(100, "podA", eth0=(1, 2))
    write(tree.proc / "100" / "net" / "dev", net_dev(eth0=(1, 2)) + "this is not a counter line\n")
    tree.add(200, "podB", eth0=(3, 4))
    (tree.proc / "200" / "net" / "dev").unlink()
    (tree.proc / "200" / "net" / "dev").mkdir()  # unreadable: EISDIR
    reader = tree.reader()
    with caplog.at_level(logging.WARNING, logger="gpuwatch.signals.network"):
        for _ in range(3):
            result = reader.read_containers([(identity("a"), 100), (identity("b"), 200)])
            assert by_name(result) == {"a": (1, 2)}
    assert reader.errors_total["netns"] == 3 * 2  # both namespaces are read every call
    assert len(caplog.records) == 2


def test_unreadable_host_namespace_is_counted_not_raised(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    (tree.proc / "1" / "ns" / "net").unlink()
    tree.add(100, "podA", eth0=(1, 2))
    reader = tree.reader()
    assert by_name(reader.read_containers([(identity("a"), 100)])) == {"a": (1, 2)}
    assert reader.errors_total["netns"] == 1
    assert "1/ns/net" in reader.last_error


def test_round_robin_bounds_reads_and_keeps_last_values(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    names = [f"c{i}" for i in range(5)]
    for i in range(5):
        tree.add(100 + i, f"ns{i}", eth0=(i, 0))
    targets = [(identity(name), 100 + i) for i, name in enumerate(names)]
    reader = tree.reader(max_netns_per_cycle=2)

    def bump(value: int) -> None:
        for i in range(5):
            tree.set_bytes(100 + i, eth0=(value + i, 0))

    assert by_name(reader.read_containers(targets)) == {"c0": (0, 0), "c1": (1, 0)}  # never-read ones wait
    bump(100)
    assert by_name(reader.read_containers(targets)) == {"c0": (0, 0), "c1": (1, 0), "c2": (102, 0), "c3": (103, 0)}
    bump(200)
    result = by_name(reader.read_containers(targets))
    assert result == {"c0": (200, 0), "c1": (1, 0), "c2": (102, 0), "c3": (103, 0), "c4": (204, 0)}
    bump(300)
    result = by_name(reader.read_containers(targets))  # least recently read first: c1, c2
    assert result == {"c0": (200, 0), "c1": (301, 0), "c2": (302, 0), "c3": (103, 0), "c4": (204, 0)}


def test_cache_holds_only_namespaces_asked_for(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    for i in range(4):
        tree.add(100 + i, f"ns{i}", eth0=(i, 0))
    reader = tree.reader(max_netns_per_cycle=1)
    everyone = [(identity(f"c{i}"), 100 + i) for i in range(4)]
    for _ in range(4):
        reader.read_containers(everyone)
    assert len(by_name(reader.read_containers(everyone))) == 4
    assert by_name(reader.read_containers(everyone[:1])) == {"c0": (0, 0)}
    tree.set_bytes(101, eth0=(999, 0))
    # c1 was dropped from the cache when it was not asked for: it is new again, read first
    assert by_name(reader.read_containers(everyone[:2])) == {"c0": (0, 0), "c1": (999, 0)}


def test_a_reused_namespace_inode_does_not_lend_old_bytes(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    tree.add(100, "podA", eth0=(1, 0))
    tree.add(101, "podB", eth0=(2, 0))
    reader = tree.reader(max_netns_per_cycle=1)
    reader.read_containers([(identity("a"), 100)])
    reader.read_containers([(identity("a"), 100), (identity("b"), 101)])
    # a's pod went away and a new pod got a namespace with a's inode (same file here)
    tree.add(200, "podA", eth0=(50, 0))
    result = by_name(reader.read_containers([(identity("new"), 200), (identity("b"), 101)]))
    assert result == {"new": (50, 0), "b": (2, 0)}


def test_stat_targets_real_inodes(tmp_path: Path) -> None:
    """The fixture's premise: symlinked namespace files share an inode, others do not."""
    tree = ProcTree(tmp_path)
    tree.add(100, "x")
    tree.add(101, "x")
    tree.add(102, "y")
    inode = [os.stat(tree.proc / str(pid) / "ns" / "net").st_ino for pid in (100, 101, 102)]
    assert inode[0] == inode[1] != inode[2]


def test_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_netns_per_cycle"):
        NetworkReader(max_netns_per_cycle=0)


def test_a_pid_that_left_its_namespace_is_caught_at_its_next_read(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    tree.add(100, "podA", eth0=(1, 2))
    reader = tree.reader()
    assert by_name(reader.read_containers([(identity("a"), 100)])) == {"a": (1, 2)}
    tree.add(100, "elsewhere", eth0=(7, 7))  # pid 100 now belongs to another namespace
    assert reader.read_containers([(identity("a"), 100)]) == ()
    assert reader.errors_total[VANISHED] == 1
    # asked again, the target is looked up afresh and reports its new namespace
    assert by_name(reader.read_containers([(identity("a"), 100)])) == {"a": (7, 7)}


def test_sysfs_links_answer_the_last_list_between_full_reads(tmp_path: Path) -> None:
    _, sys_root = nic_tree(tmp_path)
    source = SysfsLinks(str(sys_root))
    first = source.links(full=True)
    assert [link.name for link in first] == ["lo", "eth0", "eth1", "ib0", "veth1", "roce0"]
    assert first[0].loopback and not first[1].loopback
    (sys_root / "class" / "net" / "eth0" / "operstate").write_text("down\n")
    assert source.links(full=False) == first
    assert next(link for link in source.links(full=True) if link.name == "eth0").operstate == "down"
    source.close()
    with pytest.raises(LinkSourceError, match="cannot list"):
        SysfsLinks(str(tmp_path / "nowhere")).links(full=True)


def test_a_pod_member_that_exited_is_dropped_when_its_namespace_is_read(tmp_path: Path) -> None:
    tree = ProcTree(tmp_path)
    tree.add(100, "pod", eth0=(1, 2))
    tree.add(101, "pod", eth0=(1, 2))
    reader = tree.reader()
    targets = [(identity("trainer", pod="p"), 100), (identity("sidecar", pod="p"), 101)]
    assert set(by_name(reader.read_containers(targets))) == {"trainer", "sidecar"}
    (tree.proc / "101" / "ns" / "net").unlink()  # the sidecar's process exited
    assert by_name(reader.read_containers(targets)) == {"trainer": (1, 2)}
    assert reader.errors_total[VANISHED] == 1
