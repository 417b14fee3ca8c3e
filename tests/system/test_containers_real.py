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
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.containers import BundleRoots, IdentityResolver
from gpuwatch.containers.cgroupfs import discover_mounts

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


@pytest.fixture
def pod_container(runc_required: str, tmp_path: Path) -> Iterator[dict[str, object]]:
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
        yield {
            "runc": runc,
            "cid": cid,
            "pod_uid": pod_uid,
            "cgroups_path": cgroups_path,
            "roots": BundleRoots(
                containerd_tasks=(str(task_root),), crio_containers=(), runc_state=(), docker_containers=()
            ),
        }
    finally:
        runc.remove(cid)
        rmdir_cgroups([cgroups_path, f"/kubepods/burstable/pod{pod_uid}", "/kubepods/burstable", "/kubepods"])


def test_real_runc_container_identity(pod_container: dict[str, object]) -> None:
    runc = pod_container["runc"]
    assert isinstance(runc, MiniRunc)
    cid, pod_uid = str(pod_container["cid"]), str(pod_container["pod_uid"])
    cgroups_path = str(pod_container["cgroups_path"])
    roots = pod_container["roots"]
    assert isinstance(roots, BundleRoots)
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
