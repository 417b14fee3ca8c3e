"""System tests for gpuwatch.signals.network: real network namespaces, veths and traffic.

Every test works only inside network namespaces it makes itself (`ip netns add`), joined by
a veth pair with link-local addresses (169.254.77.0/24), and sends a bounded amount of UDP
between them. IPv6 is off in those namespaces so that the counters carry nothing but the
test's datagrams and one ARP exchange. Readers of a namespace's NICs run in it
(`ip netns exec`, which also remounts /sys for it) and print JSON; container bytes are read
from this (host) process through /proc/<pid>. Namespaces, links and processes are removed
on every exit path.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.core.model import ContainerIdentity
from gpuwatch.signals.network import VANISHED, NetworkReader
from gpuwatch.sim import bundle as oci
from gpuwatch.sim import cgroups
from gpuwatch.sim.runc import repo_root
from tests.conftest import need_binary, need_root

pytestmark = [pytest.mark.root]

ADDRESS_A = "169.254.77.1"
ADDRESS_B = "169.254.77.2"
PORT = 9999
DATAGRAMS = 200
PAYLOAD = 1000
OVERHEAD = 14 + 20 + 8  # Ethernet + IPv4 + UDP headers per datagram
SLACK = 1024  # one ARP request and reply, nothing else (IPv6 is off)
VETH_SPEED = 10000 * 125000.0  # veth reports 10000 Mb/s

RECEIVER = f"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
s.bind(("{ADDRESS_B}", {PORT}))
print("ready", flush=True)
while True:
    s.recv(65536)
"""


@dataclass
class Pair:
    """Two namespaces made by the test, joined by veth `va` (in a) and `vb` (in b)."""

    a: str
    b: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, ns: str, argv: list[str]) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.processes.append(process)
        return process


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


@pytest.fixture
def pair() -> Iterator[Pair]:
    need_root()
    need_binary("ip", "iproute2")
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    made = Pair(a=f"gwnet-{tag}-a", b=f"gwnet-{tag}-b")
    created: list[str] = []
    try:
        for ns in (made.a, made.b):
            _ip("netns", "add", ns)
            created.append(ns)
            for key in ("all", "default"):
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"],
                               check=True, capture_output=True, timeout=30)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", made.a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", made.b)
        _ip("-n", made.a, "addr", "add", f"{ADDRESS_A}/24", "dev", "va")
        _ip("-n", made.b, "addr", "add", f"{ADDRESS_B}/24", "dev", "vb")
        _ip("-n", made.a, "link", "set", "va", "up")
        _ip("-n", made.b, "link", "set", "vb", "up")
        yield made
    finally:
        for process in made.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        assert made.a not in listed and made.b not in listed


def _run_in(ns: str, body: str, timeout_s: float = 60) -> Any:
    """Run `body` (Python with `reader`, `nics()`, `emit()`) in namespace `ns`; its JSON."""
    script = textwrap.dedent("""
        import json, socket, subprocess, sys, time
        from gpuwatch.signals.network import NetworkReader
        reader = NetworkReader(link_refresh_s=3600.0)
        def nics():
            return {n.device: [n.operstate, n.speed_bytes_per_second, n.receive_bytes_total,
                               n.transmit_bytes_total, n.rdma] for n in reader.read_nics()}
        def emit(value):
            print(json.dumps(value), flush=True)
    """) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(repo_root())}
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=timeout_s, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _send(count: int = DATAGRAMS, size: int = PAYLOAD) -> str:
    """Python lines that send `count` datagrams of `size` bytes from a to b, paced."""
    return textwrap.dedent(f"""
        out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for i in range({count}):
            out.sendto(b"x" * {size}, ("{ADDRESS_B}", {PORT}))
            if i % 50 == 49:
                time.sleep(0.01)
        time.sleep(0.2)
    """)


def _start_receiver(pair: Pair) -> subprocess.Popen[bytes]:
    receiver = pair.spawn(pair.b, [sys.executable, "-c", RECEIVER])
    assert receiver.stdout is not None
    assert receiver.stdout.readline().strip() == b"ready"
    return receiver


def _spawn_in(pair: Pair, ns: str, argv: list[str]) -> subprocess.Popen[bytes]:
    """A process in namespace `ns`, returned once it is there (`ip netns exec` joins, then execs)."""
    process = pair.spawn(ns, argv)
    deadline = time.monotonic() + 10
    while True:
        try:
            if os.stat(f"/proc/{process.pid}/ns/net").st_ino == _netns_inode(ns):
                return process
        except FileNotFoundError:
            pass
        assert time.monotonic() < deadline, f"{argv} did not enter {ns}"
        time.sleep(0.01)


def _identity(name: str, pod: str) -> ContainerIdentity:
    container_id = secrets.token_hex(32)
    return ContainerIdentity(runtime="containerd", cgroup_path=f"/kubepods/pod-{pod}/{container_id}",
                             container_id=container_id, container_name=name, pod_name=pod)


def _within_overhead(delta: int, count: int = DATAGRAMS, size: int = PAYLOAD) -> bool:
    return count * size <= delta <= count * (size + OVERHEAD) + SLACK


def test_read_nics_counts_the_traffic_sent(pair: Pair) -> None:
    _start_receiver(pair)
    body = "before = nics()\n" + _send() + 'emit({"before": before, "after": nics(), "errors": reader.errors_total})\n'
    result = _run_in(pair.a, body)
    before, after = result["before"], result["after"]
    assert set(after) == {"va"}  # lo is not a NIC
    state, speed, rx, tx, rdma = after["va"]
    assert (state, speed, rdma) == ("up", VETH_SPEED, False)
    sent = tx - before["va"][3]
    assert _within_overhead(sent), sent
    assert rx - before["va"][2] <= SLACK  # nothing comes back but an ARP reply
    assert result["errors"] == {"nics": 0, "rdma": 0, "netns": 0, VANISHED: 0}


def test_operstate_and_speed_follow_the_link_at_the_next_reads(pair: Pair) -> None:
    """Link changes reach the reader through link events, not its (here: 1 h) refresh."""
    result = _run_in(pair.a, f"""
        def wait_for(up):
            # the kernel settles operstate asynchronously (linkwatch); the reader must see
            # what /sys says within a few reads, long before its refresh
            deadline = time.monotonic() + 5
            while True:
                seen = nics()["va"]
                kernel = open("/sys/class/net/va/operstate").read().strip()
                if ((seen[0] == "up") == up and seen[0] == kernel) or time.monotonic() > deadline:
                    return seen[:2] + [kernel]
                time.sleep(0.05)
        steps = {{"start": wait_for(True)}}
        subprocess.run(["ip", "-n", "{pair.b}", "link", "set", "vb", "down"], check=True)
        steps["peer down"] = wait_for(False)
        subprocess.run(["ip", "-n", "{pair.b}", "link", "set", "vb", "up"], check=True)
        steps["peer up"] = wait_for(True)
        subprocess.run(["ip", "link", "set", "va", "down"], check=True)
        steps["down"] = wait_for(False)
        subprocess.run(["ip", "link", "set", "va", "up"], check=True)
        steps["up again"] = wait_for(True)
        emit(steps)
    """)
    assert result["start"] == ["up", VETH_SPEED, "up"]
    # no carrier, no speed; with the peer in another namespace the kernel says "down"
    # (in the same one, "lowerlayerdown")
    state, speed, kernel = result["peer down"]
    assert state == kernel and state in ("down", "lowerlayerdown") and speed is None
    assert result["peer up"] == ["up", VETH_SPEED, "up"]
    assert result["down"] == ["down", None, "down"]
    assert result["up again"] == ["up", VETH_SPEED, "up"]


def test_netlink_and_sysfs_agree_on_the_links(pair: Pair) -> None:
    _ip("-n", pair.a, "link", "add", "vdown", "type", "veth", "peer", "name", "vdown2")
    result = _run_in(pair.a, """
        from gpuwatch.signals.network import NetlinkLinks, SysfsLinks
        netlink = NetlinkLinks("/sys")
        listed = [[link.name, link.index, link.operstate, link.carrier, link.loopback, link.speed_mbps]
                  for link in netlink.links(full=True)]
        netlink.close()
        fallback = [[link.name, link.index, link.operstate, link.carrier, link.loopback, link.speed_mbps]
                    for link in SysfsLinks("/sys").links(full=True)]
        emit({"netlink": listed, "sysfs": fallback})
    """)
    assert result["netlink"] == result["sysfs"]
    by_name = {row[0]: row for row in result["netlink"]}
    assert by_name["lo"][4] is True
    assert by_name["va"][5] == 10000
    assert by_name["vdown"][2:] == ["down", False, False, None]


def test_read_nics_cost_stays_well_under_a_millisecond(pair: Pair) -> None:
    for i in range(2):
        _ip("-n", pair.a, "link", "add", f"vx{i}", "type", "veth", "peer", "name", f"vy{i}")
        _ip("-n", pair.a, "link", "set", f"vx{i}", "up")
        _ip("-n", pair.a, "link", "set", f"vy{i}", "up")
    result = _run_in(pair.a, """
        assert len(reader.read_nics()) == 5
        start = time.thread_time()
        for _ in range(200):
            reader.read_nics()
        emit({"per_call_ms": (time.thread_time() - start) / 200 * 1e3})
    """)
    print(f"read_nics: {result['per_call_ms']:.3f} ms CPU per call (5 NICs)")
    assert result["per_call_ms"] < 0.5


def test_read_rdma_on_this_host() -> None:
    need_root()
    reader = NetworkReader()
    ports = reader.read_rdma()
    if not Path("/sys/class/infiniband").exists():
        assert ports == ()
    for port in ports:
        assert port.device and port.port >= 1 and port.state
    assert reader.errors_total["rdma"] == 0


def test_read_containers_counts_a_namespace_once_and_skips_the_host(pair: Pair) -> None:
    receiver = _start_receiver(pair)
    sidecar = _spawn_in(pair, pair.b, ["sleep", "60"])
    host_process = subprocess.Popen(["sleep", "60"])
    try:
        trainer, side, hostnet, agent = (_identity("trainer", "p"), _identity("sidecar", "p"),
                                         _identity("hostnet", "h"), _identity("agent", "a"))
        targets = [(trainer, receiver.pid), (side, sidecar.pid), (hostnet, host_process.pid), (agent, os.getpid())]
        with NetworkReader() as reader:
            before = {c.identity.container_name: c for c in reader.read_containers(targets)}
            _run_in(pair.a, _send() + "\nemit(0)\n")
            after = {c.identity.container_name: c for c in reader.read_containers(targets)}
            assert set(after) == {"trainer", "sidecar"}  # host-network ones are the node's bytes
            assert (after["trainer"].receive_bytes_total, after["trainer"].transmit_bytes_total) == \
                (after["sidecar"].receive_bytes_total, after["sidecar"].transmit_bytes_total)
            received = after["trainer"].receive_bytes_total - before["trainer"].receive_bytes_total
            assert _within_overhead(received), received
            assert after["trainer"].transmit_bytes_total - before["trainer"].transmit_bytes_total <= SLACK

            sidecar.kill()
            sidecar.wait()
            assert {c.identity.container_name for c in reader.read_containers(targets)} == {"trainer"}
            assert reader.errors_total[VANISHED] == 1
            # pid 1 may be unreadable in a sandbox; nothing else is an error
            assert reader.errors_total["netns"] in (0, 1)
            assert reader.errors_total["netns"] == 0 or "1/ns/net" in reader.last_error
    finally:
        host_process.kill()
        host_process.wait()


def _bundle(bundle_dir: Path, netns: str, cgroup_path: str) -> None:
    rootfs = bundle_dir / "rootfs"
    rootfs.mkdir(parents=True)
    ro_binds = []
    for directory in oci.SYSTEM_DIRS:
        host = Path(directory)
        if host.is_symlink():
            (rootfs / directory.lstrip("/")).symlink_to(os.readlink(host))
        elif host.is_dir():
            ro_binds.append(directory)
    config = oci.build_config(argv=["/bin/sleep", "60"], env={}, cgroups_path=cgroup_path, hostname="netns-test",
                              ro_binds=ro_binds, rw_binds=[], annotations={}, new_network=True)
    # join the namespace made for it, as containerd does with the one the CNI plugin set up
    for namespace in config["linux"]["namespaces"]:
        if namespace["type"] == "network":
            namespace["path"] = f"/run/netns/{netns}"
    (bundle_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.runc
def test_runc_container_in_its_own_namespace(pair: Pair, tmp_path: Path) -> None:
    runc = need_binary("runc", "runc")
    receiver = _start_receiver(pair)
    container_id = f"gwnet-{secrets.token_hex(8)}"
    cgroup_path = f"/{container_id}"
    bundle_dir, state_root, pid_file = tmp_path / "bundle", tmp_path / "runc", tmp_path / "init.pid"
    _bundle(bundle_dir, pair.b, cgroup_path)
    try:
        with open(tmp_path / "runc.log", "wb") as log:  # detached: the container keeps runc's stdio
            started = subprocess.run([runc, "--root", str(state_root), "run", "--detach", "--bundle",
                                      str(bundle_dir), "--pid-file", str(pid_file), container_id],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=30)
        assert started.returncode == 0, (tmp_path / "runc.log").read_text()
        container_pid = int(pid_file.read_text())
        assert os.stat(f"/proc/{container_pid}/ns/net").st_ino == _netns_inode(pair.b)
        assert os.stat(f"/proc/{container_pid}/ns/pid").st_ino != os.stat("/proc/self/ns/pid").st_ino
        workload, listener = _identity("workload", "q"), _identity("listener", "q")
        targets = [(workload, container_pid), (listener, receiver.pid)]
        with NetworkReader(max_netns_per_cycle=1) as reader:
            before = {c.identity.container_name: c.receive_bytes_total for c in reader.read_containers(targets)}
            _run_in(pair.a, _send() + "\nemit(0)\n")
            after = {c.identity.container_name: c.receive_bytes_total for c in reader.read_containers(targets)}
        assert before["workload"] == before["listener"]
        assert after["workload"] == after["listener"]
        assert _within_overhead(after["workload"] - before["workload"]), after["workload"] - before["workload"]
    finally:
        subprocess.run([runc, "--root", str(state_root), "delete", "--force", container_id], capture_output=True,
                       timeout=30)
        shutil.rmtree(bundle_dir, ignore_errors=True)
    for directory in cgroups.detect().all_dirs(cgroup_path):
        assert not directory.exists(), directory


def test_reader_never_raises_on_vanishing_targets(pair: Pair) -> None:
    process = _spawn_in(pair, pair.b, ["sleep", "60"])
    target = [(_identity("short", "s"), process.pid)]
    with NetworkReader() as reader:
        assert len(reader.read_containers(target)) == 1
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert reader.read_containers(target) == ()
        assert reader.read_containers([(_identity("never", "n"), 2**22 + 12345)]) == ()
    assert reader.errors_total[VANISHED] == 2
