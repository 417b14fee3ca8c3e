"""Device isolation with the cgroup device BPF program (root + BCC): real device nodes, real
cgroups, real opens.

Device nodes are made with mknod using NVIDIA's numbering (195:0 nvidia0, 195:1 nvidia1,
195:255 nvidiactl) in a temp dir. No driver is registered for major 195 here, so an open
that the cgroup check lets through fails with ENXIO in the (absent) driver; an open the
gate denies fails with EPERM before that. ENXIO is the proof of "allowed", EPERM of "denied".
Probing processes are moved into their cgroup before they open anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwatch.agent.enforcer_factory import build_device_gate, build_enforcer
from gpuwatch.containers.cgroupfs import discover_mounts
from gpuwatch.core.model import ContainerIdentity
from gpuwatch.enforce.enforcer import EnforcerConfig
from gpuwatch.enforce.kernel_limits import NullDeviceGate
from gpuwatch.probes import bpfsys
from gpuwatch.probes.devicegate import BpfDeviceGate
from gpuwatch.probes.devnodes import resolve_gpu_nodes
from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim.runc import ContainerLab, ContainerSpec
from tests.conftest import need, need_bcc, need_binary
from tests.system.enforce_lab import GIB, snapshot

pytestmark = [pytest.mark.root]
NODES = {"nvidia0": 0, "nvidia1": 1, "nvidiactl": 255}
ALLOWED, DENIED = "ENXIO", "EPERM"

# Waits for <ctl>/go<N>, opens every path, writes {path: "ok" | errno name} to <ctl>/out<N>.json;
# ends when <ctl>/stop appears. Opens nothing before the first go file.
PROBER = r"""
import errno, json, os, sys, time
ctl, paths = sys.argv[1], sys.argv[2:]
n = 1
while not os.path.exists(os.path.join(ctl, "stop")):
    if not os.path.exists(os.path.join(ctl, f"go{n}")):
        time.sleep(0.01)
        continue
    res = {}
    for p in paths:
        try:
            os.close(os.open(p, os.O_RDWR))
            res[os.path.basename(p)] = "ok"
        except OSError as e:
            res[os.path.basename(p)] = errno.errorcode.get(e.errno, str(e.errno))
    with open(os.path.join(ctl, f"out{n}.tmp"), "w") as f:
        json.dump(res, f)
    os.replace(os.path.join(ctl, f"out{n}.tmp"), os.path.join(ctl, f"out{n}.json"))
    n += 1
"""

# An agent stand-in: gates a cgroup, says which program is attached, then waits to be killed.
AGENT = r"""
import sys, time
from gpuwatch.probes.devicegate import BpfDeviceGate
gate = BpfDeviceGate(device_prefix=sys.argv[1])
gate.allow_only(int(sys.argv[2]), (0,))
print(gate.prog_id(), flush=True)
time.sleep(600)
"""


class Prober:
    """A process that opens the device nodes on request and reports the errno of each."""

    def __init__(self, ctl: Path, paths: list[str], argv_prefix: list[str] | None = None) -> None:
        ctl.mkdir(parents=True)
        self.ctl = ctl
        self.round = 0
        self.argv = [*(argv_prefix or []), sys.executable, "-c", PROBER, str(ctl), *paths]

    def start_in(self, cgroup: Path) -> subprocess.Popen[bytes]:
        """Start it and move it into `cgroup` (it opens nothing until the first probe())."""
        proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)
        (cgroup / "cgroup.procs").write_text(str(proc.pid))
        return proc

    def probe(self, timeout_s: float = 10.0) -> dict[str, str]:
        self.round += 1
        (self.ctl / f"go{self.round}").touch()
        out = self.ctl / f"out{self.round}.json"
        deadline = time.monotonic() + timeout_s
        while not out.exists():
            assert time.monotonic() < deadline, f"prober did not answer round {self.round}"
            time.sleep(0.01)
        result: dict[str, str] = json.loads(out.read_text())
        return result

    def stop(self) -> None:
        (self.ctl / "stop").touch()


def v2_root() -> Path:
    root = discover_mounts().unified
    need(root is not None, "needs a cgroup v2 hierarchy")
    assert root is not None
    return Path(root)


def remove_cgroup_tree(top: Path) -> None:
    """Kill every process below `top` and remove the directories, deepest first."""
    if not top.exists():
        return
    with contextlib.suppress(OSError):
        (top / "cgroup.kill").write_text("1")
    dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
    for directory in [*dirs, top]:
        deadline = time.monotonic() + 5
        while True:
            try:
                directory.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


@dataclass
class Env:
    devdir: Path
    prefix: str
    paths: list[str]
    top: Path  # the test's cgroup tree root


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    need_bcc()
    devdir = tmp_path / "dev"
    devdir.mkdir()
    for name, minor in NODES.items():
        os.mknod(devdir / name, 0o666 | 0o020000, os.makedev(195, minor))  # S_IFCHR
    top = v2_root() / f"gpuwatch-test-{uuid.uuid4().hex[:10]}"
    top.mkdir()
    try:
        yield Env(devdir, str(devdir / "nvidia"), [str(devdir / n) for n in NODES], top)
    finally:
        try:
            remove_cgroup_tree(top)
        finally:
            for name in NODES:
                (devdir / name).unlink(missing_ok=True)


def cgroup(env: Env, name: str) -> tuple[Path, int]:
    path = env.top / name
    path.mkdir(parents=True)
    return path, path.stat().st_ino


def attached(cgroup_dir: Path) -> tuple[int, ...]:
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return bpfsys.cgroup_prog_ids(fd, bpfsys.BPF_CGROUP_DEVICE)
    finally:
        os.close(fd)


def start_prober(env: Env, tmp_path: Path, name: str, where: Path) -> Prober:
    prober = Prober(tmp_path / f"ctl-{name}", env.paths)
    prober.start_in(where)
    return prober


def wait_gone(prog_id: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while bpfsys.prog_exists(prog_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_gpu_nodes_resolve_from_stat(env: Env) -> None:
    nodes = resolve_gpu_nodes(env.prefix)
    assert nodes.numbers == {0: (195, 0), 1: (195, 1)}  # nvidiactl is not a GPU node
    assert nodes.ungated == {}


def test_allow_only_denies_other_gpu_nodes_in_that_cgroup_only(env: Env, tmp_path: Path) -> None:
    gated, gated_id = cgroup(env, "gated")
    sub, _ = cgroup(env, "gated/sub")  # a sub-cgroup the container made itself
    other, _ = cgroup(env, "other")
    probers = {name: start_prober(env, tmp_path, name, where)
               for name, where in (("gated", gated), ("sub", sub), ("other", other))}
    gate = BpfDeviceGate(device_prefix=env.prefix)
    try:
        before = {name: p.probe() for name, p in probers.items()}
        assert all(r == {"nvidia0": ALLOWED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED} for r in before.values())
        gate.allow_only(gated_id, (0,))
        assert attached(gated) == (gate.prog_id(),) and attached(other) == ()
        expect_gated = {"nvidia0": ALLOWED, "nvidia1": DENIED, "nvidiactl": ALLOWED}
        assert probers["gated"].probe() == expect_gated
        assert probers["sub"].probe() == expect_gated
        assert probers["other"].probe() == {"nvidia0": ALLOWED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
        gate.allow_only(gated_id, (1,))  # a new mask: same attachment, new verdicts
        assert len(attached(gated)) == 1
        assert probers["gated"].probe() == {"nvidia0": DENIED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
        gate.allow_only(gated_id, ())
        assert probers["gated"].probe() == {"nvidia0": DENIED, "nvidia1": DENIED, "nvidiactl": ALLOWED}
    finally:
        gate.close()
        for p in probers.values():
            p.stop()


def test_clear_and_close_detach_everything(env: Env, tmp_path: Path) -> None:
    a, a_id = cgroup(env, "a")
    b, b_id = cgroup(env, "b")
    pa = start_prober(env, tmp_path, "a", a)
    pb = start_prober(env, tmp_path, "b", b)
    gate = BpfDeviceGate(device_prefix=env.prefix)
    try:
        gate.allow_only(a_id, (0,))
        gate.allow_only(b_id, (1,))
        prog = gate.prog_id()
        assert prog is not None
        assert pa.probe()["nvidia1"] == DENIED and pb.probe()["nvidia0"] == DENIED
        gate.clear(a_id)
        assert attached(a) == () and attached(b) == (prog,)
        assert pa.probe() == {"nvidia0": ALLOWED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
        assert pb.probe()["nvidia0"] == DENIED
        gate.close()
        assert attached(a) == () and attached(b) == ()
        assert pb.probe() == {"nvidia0": ALLOWED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
        assert wait_gone(prog), "the device program is still loaded after close()"
        gate.close()  # idempotent
    finally:
        gate.close()
        pa.stop()
        pb.stop()


def test_killed_agent_leaves_nothing_attached(env: Env, tmp_path: Path) -> None:
    gated, gated_id = cgroup(env, "gated")
    prober = start_prober(env, tmp_path, "gated", gated)
    repo = Path(__file__).resolve().parents[2]
    agent = subprocess.Popen([sys.executable, "-c", AGENT, env.prefix, str(gated_id)],
                             stdout=subprocess.PIPE, cwd=repo, text=True)
    try:
        assert agent.stdout is not None
        prog = int(agent.stdout.readline())
        assert attached(gated) == (prog,)
        assert prober.probe()["nvidia1"] == DENIED
        agent.send_signal(signal.SIGKILL)  # no cleanup code runs
        agent.wait(timeout=10)
        assert attached(gated) == ()
        assert prober.probe() == {"nvidia0": ALLOWED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
        assert wait_gone(prog), "the device program outlived the agent"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        prober.stop()


def test_numbers_shared_with_other_nodes_are_not_gated(env: Env, tmp_path: Path) -> None:
    """Like the simulated node: every node has /dev/null's numbers. The gate cannot tell the
    GPUs apart from /dev/null, so it gates none of them (and /dev/null keeps working)."""
    simdev = tmp_path / "simdev"
    simdev.mkdir()
    null = os.stat("/dev/null").st_rdev
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        os.mknod(simdev / name, 0o666 | 0o020000, null)
    gated, gated_id = cgroup(env, "gated")
    prober = Prober(tmp_path / "ctl", [str(simdev / "nvidia1"), "/dev/null"])
    prober.start_in(gated)
    gate = BpfDeviceGate(device_prefix=str(simdev / "nvidia"))
    try:
        nodes = resolve_gpu_nodes(str(simdev / "nvidia"))
        assert nodes.numbers == {} and sorted(nodes.ungated) == [0, 1]
        gate.allow_only(gated_id, (0,))
        assert prober.probe() == {"nvidia1": "ok", "null": "ok"}
    finally:
        gate.close()
        prober.stop()


def test_gate_is_null_without_probes_or_in_dry_run() -> None:
    assert isinstance(build_device_gate(None), NullDeviceGate)
    assert isinstance(build_device_gate(object(), dry_run=True), NullDeviceGate)


@contextlib.contextmanager
def gate_lab(env: Env, tmp_path: Path, policy_text: str) -> Iterator[tuple[Path, ProbeManager, ContainerLab]]:
    """`policy_text` in tmp_path/policy.yaml, the probes started on env's device nodes (no ioctl
    or allocation probes: what the device gate needs) and a ContainerLab; the lab closed and the
    probes stopped at the end (the test closes its enforcer first)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text)
    probes = ProbeManager(ProbeConfig(device_prefix=env.prefix, ioctl=False, alloc_uprobes=False))
    probes.start()
    lab = ContainerLab(tmp_path / "lab", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc")
    try:
        yield policy, probes, lab
    finally:
        lab.close()
        probes.stop()


POLICY = """
rules:
  - name: one-gpu
    match: {namespace: ml}
    limits: {devices: [0]}
    actions: [{do: alert}]
"""


@pytest.mark.parametrize("runtime", ["k8s", "cgroup"])
def test_enforcer_rule_gates_a_container(env: Env, tmp_path: Path, runtime: str) -> None:
    """End to end: probes started, build_enforcer wires the gate, a policy rule's
    `limits.devices` reaches the kernel for a container's cgroup, is lifted when the
    container leaves the snapshot and is gone with the enforcer.

    "k8s": a runc container. runc's own v1 devices controller denies 195:* unless the spec
    allows it (what the NVIDIA toolkit adds), so the spec allows `c 195:* rwm` and the two
    layers compose: runc lets the GPUs through, the gate narrows them to GPU 0.
    "cgroup": a plain process in its own v2 cgroup (no v1 devices rules at all)."""
    if runtime == "k8s":
        need_binary("runc", "runc")
    with gate_lab(env, tmp_path, POLICY) as (policy, probes, lab):
        enforcer = None
        try:
            settings = EnforcerConfig(frozen_state_path=tmp_path / "frozen.json")
            enforcer = build_enforcer(policy, tmp_path / "audit.jsonl", settings, probes=probes)
            gate = enforcer.device_gate
            assert isinstance(gate, BpfDeviceGate)
            ctl = tmp_path / "ctl"
            prober = Prober(ctl, env.paths)
            if runtime == "k8s":
                spec = ContainerSpec(name="trainer", namespace="ml", argv=prober.argv,
                                     extra_binds=[str(env.devdir), str(ctl)],
                                     device_rules=[{"allow": True, "type": "c", "major": 195, "access": "rwm"}])
            else:
                spec = ContainerSpec(name="trainer", argv=prober.argv, runtime="cgroup",
                                     cgroup_path=f"{env.top.name}/trainer")
            container = lab.run(spec)
            who = ContainerIdentity(runtime=runtime, cgroup_path=container.cgroup_path,
                                    container_id=container.id, container_name="trainer",
                                    pod_name="trainer-0", pod_namespace="ml",
                                    cgroup_id=container.v2_dir.stat().st_ino)
            assert prober.probe() == {"nvidia0": ALLOWED, "nvidia1": ALLOWED, "nvidiactl": ALLOWED}
            enforcer.on_snapshot(snapshot((who, GIB)))
            assert attached(container.v2_dir) == (gate.prog_id(),)
            assert prober.probe() == {"nvidia0": ALLOWED, "nvidia1": DENIED, "nvidiactl": ALLOWED}
            enforcer.on_snapshot(snapshot())  # the container left the snapshot: gate lifted
            assert attached(container.v2_dir) == ()
            assert prober.probe()["nvidia1"] == ALLOWED
            enforcer.on_snapshot(snapshot((who, GIB)))
            assert prober.probe()["nvidia1"] == DENIED
            prog = gate.prog_id()
            assert prog is not None
            enforcer.close()  # agent shutdown: the gate goes with the enforcer
            assert attached(container.v2_dir) == () and wait_gone(prog)
            assert prober.probe()["nvidia1"] == ALLOWED
            prober.stop()
        finally:
            if enforcer is not None:
                enforcer.close()
