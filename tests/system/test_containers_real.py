"""A real runc container in a kubepods cgroup, resolved by IdentityResolver on the real host.

The bundle sits under a tmp containerd-style task root (<root>/k8s.io/<id>/config.json) with
containerd's CRI annotations, so pod/namespace/container come from the same place as on a
Kubernetes node. runc gets its own --root in tmp. Everything is removed on every path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from gpuwatch.containers import BundleRoots, IdentityResolver
from gpuwatch.containers.cgroupfs import discover_mounts
from gpuwatch.enforce.cgroup_ops import CgroupTree

RO_BINDS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc")


class MiniRunc:
    """Just enough runc to start one container and always take it (and its cgroups) away."""

    def __init__(self, runc: str, state_root: Path) -> None:
        self.runc = runc
        self.state_root = state_root

    def cmd(self, *args: str, timeout_s: float = 15.0) -> str:
        # Files, not pipes: a detached container inherits runc's stdio and would hold a pipe open.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            res = subprocess.run(
                [self.runc, "--root", str(self.state_root), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                timeout=timeout_s,
            )
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(), err.read().decode()
        if res.returncode != 0:
            raise RuntimeError(f"runc {' '.join(args)} failed ({res.returncode}): {stderr.strip()}")
        return stdout

    def write_bundle(self, bundle: Path, cgroups_path: str, annotations: dict[str, str]) -> None:
        (bundle / "rootfs").mkdir(parents=True)
        subprocess.run([self.runc, "spec"], cwd=bundle, check=True, timeout=10)
        spec = json.loads((bundle / "config.json").read_text())
        spec["process"]["terminal"] = False
        spec["process"]["args"] = ["sleep", "30"]
        spec["root"] = {"path": "rootfs", "readonly": True}
        for d in RO_BINDS:
            if os.path.isdir(d):
                spec["mounts"].append({"destination": d, "type": "bind", "source": d, "options": ["rbind", "ro"]})
        spec["linux"]["cgroupsPath"] = cgroups_path
        spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
        spec["annotations"] = annotations
        (bundle / "config.json").write_text(json.dumps(spec))

    def pid(self, cid: str) -> int:
        return int(json.loads(self.cmd("state", cid))["pid"])

    def remove(self, cid: str) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.cmd("kill", cid, "KILL")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                self.cmd("delete", "--force", cid)
                return
            except RuntimeError as e:
                if "does not exist" in str(e):
                    return
                time.sleep(0.1)


def rmdir_cgroups(rel_dirs: list[str]) -> None:
    """rmdir the given cgroup dirs (deepest first) in every hierarchy; shared parents that
    other tests still use (not empty) are left alone."""
    mounts = discover_mounts()
    roots = {m for m in [mounts.unified, *mounts.v1.values()] if m}
    for root in roots:
        for rel in rel_dirs:
            try:
                os.rmdir(os.path.join(root, rel.lstrip("/")))
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EBUSY):
                    raise


class PodContainer(NamedTuple):
    """A real runc container in a k8s pod's cgroup, its bundle under a containerd task root."""

    runc: MiniRunc
    cid: str
    pod_uid: str
    cgroups_path: str
    roots: BundleRoots


@pytest.fixture
def pod_container(runc_required: str, tmp_path: Path) -> Iterator[PodContainer]:
    cid = uuid.uuid4().hex + uuid.uuid4().hex  # 64 hex, like a CRI container id
    pod_uid = str(uuid.uuid4())
    cgroups_path = f"/kubepods/burstable/pod{pod_uid}/{cid}"
    task_root = tmp_path / "containerd" / "io.containerd.runtime.v2.task"
    bundle = task_root / "k8s.io" / cid
    runc = MiniRunc(runc_required, tmp_path / "runc-root")
    annotations = {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.container-name": "cuda-worker",
        "io.kubernetes.cri.sandbox-name": "trainer-0",
        "io.kubernetes.cri.sandbox-namespace": "team-a",
        "io.kubernetes.cri.sandbox-uid": pod_uid,
    }
    runc.write_bundle(bundle, cgroups_path, annotations)
    try:
        runc.cmd("run", "--detach", "--bundle", str(bundle), cid, timeout_s=20)
        yield PodContainer(runc, cid, pod_uid, cgroups_path, BundleRoots(
            containerd_tasks=(str(task_root),), crio_containers=(), runc_state=(), docker_containers=()
        ))
    finally:
        runc.remove(cid)
        rmdir_cgroups([cgroups_path, f"/kubepods/burstable/pod{pod_uid}", "/kubepods/burstable", "/kubepods"])


def test_real_runc_container_identity(pod_container: PodContainer) -> None:
    runc, cid, pod_uid, cgroups_path, roots = pod_container
    host_pid = runc.pid(cid)

    class Clock:
        now = time.monotonic()

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    r = IdentityResolver(bundle_roots=roots, clock=clock)
    p = r.resolve_pid(host_pid)
    assert p is not None
    ident = p.identity
    assert (ident.pod_name, ident.pod_namespace, ident.container_name) == (
        "trainer-0",
        "team-a",
        "cuda-worker",
    )
    assert (ident.container_id, ident.pod_uid, ident.qos_class) == (cid, pod_uid, "burstable")
    assert ident.runtime == "containerd"  # found in the containerd task root
    assert ident.cgroup_path == cgroups_path

    # cgroup id: the inode of the container's dir in the v2 hierarchy, independently stat'ed
    unified = discover_mounts().unified
    assert unified is not None
    want_id = os.stat(unified.rstrip("/") + cgroups_path).st_ino
    assert ident.cgroup_id == want_id
    by_id = r.identity_for_cgroup_id(want_id)
    assert by_id is not None and by_id.container_id == cid and by_id.pod_name == "trainer-0"

    # NSpid: the container's init is pid 1 in its own pid namespace; comm is the real one
    assert (p.container_pid, p.comm) == (1, "sleep")

    # a second process exec'd into the container: another host pid, same container
    runc.cmd("exec", "--detach", cid, "sleep", "29")
    pids = {int(x) for x in runc.cmd("ps", "--format", "json", cid).strip().strip("[]").split(",") if x}
    others = pids - {host_pid}
    assert len(others) == 1
    q = r.resolve_pid(others.pop())
    assert q is not None and q.identity.container_id == cid and q.container_pid not in (None, 1)

    # the container goes: caches drop and the pid no longer resolves
    runc.remove(cid)
    rmdir_cgroups([cgroups_path])
    clock.now += 1.0
    r.begin_sweep()
    assert r.cache_sizes()["paths"] == 0 and r.cache_sizes()["metadata"] == 0
    assert r.resolve_pid(host_pid) is None


# The agent as the DaemonSet runs it on a cgroup v2 host: host PID namespace, the host's
# cgroup trees mounted, but its own cgroup namespace. This script is that agent's view.
AGENT_IN_NAMESPACE = r"""
import json, os, sys
from gpuwatch.containers import BundleRoots, IdentityResolver
from gpuwatch.containers.cgroupfs import discover_mounts
from gpuwatch.enforce.cgroup_ops import CgroupTree, own_cgroup_paths
from gpuwatch.policy.decisions import SafetyContext

args = json.loads(sys.argv[1])
mounts = discover_mounts()
roots = BundleRoots(containerd_tasks=tuple(args["tasks"]), crio_containers=(), runc_state=(), docker_containers=())
resolver = IdentityResolver(bundle_roots=roots)
pod = resolver.resolve_pid(args["pid"]).identity
me = resolver.resolve_pid(os.getpid()).identity
safety = SafetyContext(own_cgroup_paths())
by_id = resolver.identity_for_cgroup_id(pod.cgroup_id) if pod.cgroup_id is not None else None
mechanism = CgroupTree().handle(pod.cgroup_path).set_frozen(True)  # pause the pod's container
print(json.dumps({
    "seen": open(f"/proc/{args['pid']}/cgroup").read(),
    "mount_root": mounts.unified_hierarchy.mount_root,
    "ns_root": mounts.unified_hierarchy.ns_root,
    "pod": [pod.container_id, pod.pod_uid, pod.pod_name, pod.container_name, pod.cgroup_path, pod.cgroup_id],
    "by_id": by_id.container_id if by_id is not None else None,
    "me": me.cgroup_path,
    "own": sorted(safety.own_cgroup_paths),
    "refuses_me": safety.unsafe_reason(me),
    "refuses_pod": safety.unsafe_reason(pod),
    "mechanism": mechanism,
}))
"""


def test_agent_in_its_own_cgroup_namespace(pod_container: PodContainer) -> None:
    """`unshare --cgroup` from a child cgroup, as issue 12 reproduced the DaemonSet: the agent
    reads other pods' cgroups as `0::/../..`, mountinfo's cgroup2 root as `/../..`; it must
    still find the hierarchy, attribute the pod with its real cgroup id, know its own cgroup
    for the safety check and pause the right container."""
    runc, cid, pod_uid, cgroups_path, roots = pod_container
    pod_pid = runc.pid(cid)
    mounts = discover_mounts()
    assert mounts.unified is not None
    agent_cgroup = f"/gpuwatch-test-agentns-{uuid.uuid4().hex[:8]}/agent"
    # the agent's cgroup in v2 and, on hybrid hosts, in the v1 freezer (its namespace root there too)
    join = [os.path.join(mounts.unified, agent_cgroup.lstrip("/"))]
    freezer = mounts.v1.get("freezer")
    if freezer is not None:
        join.append(os.path.join(freezer, agent_cgroup.lstrip("/")))
    for directory in join:
        os.makedirs(directory)
    enter = " && ".join(f"echo $$ > {d}/cgroup.procs" for d in join)
    args = json.dumps({"pid": pod_pid, "tasks": list(roots.containerd_tasks)})
    repo = Path(__file__).resolve().parents[2]
    try:
        script = f'{enter} && exec unshare --cgroup "$0" -c "$1" "$2"'
        res = subprocess.run(
            ["sh", "-c", script, sys.executable, AGENT_IN_NAMESPACE, args],
            capture_output=True, text=True, timeout=60, cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo)},
        )
        assert res.returncode == 0, res.stderr
        seen = json.loads(res.stdout)
        # the layout issue 12 described, reproduced
        assert seen["mount_root"].startswith("/..")
        assert seen["seen"].startswith("0::/..") or "\n0::/.." in seen["seen"], seen["seen"]
        # ...and what the agent made of it: hierarchy paths as on the host
        assert seen["ns_root"] == agent_cgroup
        want_id = os.stat(mounts.unified.rstrip("/") + cgroups_path).st_ino
        assert seen["pod"] == [cid, pod_uid, "trainer-0", "cuda-worker", cgroups_path, want_id]
        assert seen["by_id"] == cid
        assert seen["me"] == agent_cgroup and agent_cgroup in seen["own"]
        assert seen["refuses_me"] and not seen["refuses_pod"]
        # the pause landed on the pod's container, seen from the host
        handle = CgroupTree().handle(cgroups_path)
        assert handle.is_frozen(), seen["mechanism"]
        handle.set_frozen(False)
        assert not handle.is_frozen()
    finally:
        with contextlib.suppress(OSError):
            CgroupTree().handle(cgroups_path).set_frozen(False)
        for directory in join:
            for d in (directory, os.path.dirname(directory)):
                with contextlib.suppress(OSError):
                    os.rmdir(d)


def test_agent_daemon_in_its_own_cgroup_namespace(tmp_path: Path) -> None:
    """The whole `gpuwatch agent` (probes, sampler, enforcer) started by `unshare --cgroup`
    from a child cgroup, with the simulated node's runc pods outside it -- issue 12's
    reproduction. Before the one cgroup layer this served the probes' counters as
    container="cgroup-id:<n>" without pods and could not pause anything."""
    from gpuwatch.sim import demo
    from tests.conftest import need_binary, need_root
    from tests.system.promstack import free_port
    from tests.system.sim_helpers import CONTEXT_BYTES
    from tests.system.test_agent import (
        PAUSE_TRAINER,
        agent_argv,
        is_frozen,
        pods,
        running_agent,
        sample,
        scrape,
        sim_node,
        wait_until,
    )

    need_root()
    need_binary("runc", "runc")
    need_binary("unshare", "util-linux")
    mounts = discover_mounts()
    assert mounts.unified is not None
    agent_cgroup = os.path.join(mounts.unified, f"gpuwatch-test-agentd-{uuid.uuid4().hex[:8]}", "agent")
    os.makedirs(agent_cgroup)
    policy = tmp_path / "policy.yaml"
    policy.write_text(PAUSE_TRAINER)
    port = free_port()
    try:
        with sim_node(tmp_path / "node") as sim:
            argv = ["sh", "-c", f'echo $$ > {agent_cgroup}/cgroup.procs && exec unshare --cgroup "$@"', "sh",
                    *agent_argv(sim, tmp_path / "node", port, tmp_path, f"--policy={policy}")]
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUWATCH_SIM_STATE": str(sim.state_path)}
            log = tmp_path / "agent.log"
            with running_agent(argv, env, log, port) as agent, pods(tmp_path / "node", sim) as p:
                trainer = p.by_pod("trainer-0")
                others = [c for c in p.containers if c is not trainer]

                def attributed() -> bool:  # both sides: the probes' counters and NVML's sample, which may lag
                    text = scrape(port)
                    return all(sample(text, "gpuwatch_container_allocated_bytes", pod=w.pod) is not None
                               and sample(text, "gpuwatch_container_memory_bytes", pod=w.pod) is not None
                               for w in demo.DEFAULT_WORKLOADS)

                wait_until(attributed, 30, "the probes' counters and NVML's memory with pod labels")
                text = scrape(port)
                # our pods' counters carry their pods, never a bare cgroup id (other tests' gone
                # cgroups may still show up as cgroup-id:<n> on a shared machine)
                pod_ids = {os.stat(mounts.unified.rstrip("/") + c.cgroup_path).st_ino for c in p.containers}
                assert not any(f'container="cgroup-id:{i}"' in text for i in pod_ids)
                for w in demo.DEFAULT_WORKLOADS:  # its memory and its CUDA context (518 MiB, as on an H100)
                    want = (w.memory_mib << 20) + CONTEXT_BYTES
                    assert sample(text, "gpuwatch_container_memory_bytes", namespace=w.namespace, pod=w.pod,
                                  container=w.container) == want, w
                    assert sample(text, "gpuwatch_container_allocated_bytes", pod=w.pod) == want, w
                wait_until(lambda: is_frozen(trainer), 30, "the agent to pause the trainer")
                assert not any(is_frozen(c) for c in others), "only the trainer may be paused"
                agent.terminate()
                assert agent.wait(timeout=30) == 0, log.read_text()[-3000:]
                assert not is_frozen(trainer), "SIGTERM thaws what the agent paused"
            text = log.read_text()
            assert "device isolation on" in text, text[-3000:]
            assert "could not be placed" not in text and "no cgroup v2 hierarchy" not in text
    finally:
        for d in (agent_cgroup, os.path.dirname(agent_cgroup)):
            with contextlib.suppress(OSError):
                os.rmdir(d)
