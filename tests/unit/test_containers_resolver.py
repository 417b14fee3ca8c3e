"""IdentityResolver over fixture /proc, cgroup and bundle trees built in tmp_path (no root).

The fixture trees are real directories: cgroup ids are the real inode numbers of the fixture
cgroup dirs, exactly as on a cgroup2 mount, so the id index is exercised for real.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.containers import BundleRoots, IdentityResolver

UID = "11111111-2222-3333-4444-555555555555"
CID = "c" * 64
POD_SLICE = f"kubepods-burstable-pod{UID.replace('-', '_')}.slice"
KPATH = f"/kubepods.slice/kubepods-burstable.slice/{POD_SLICE}/cri-containerd-{CID}.scope"
ANN = {
    "io.kubernetes.cri.container-name": "trainer",
    "io.kubernetes.cri.sandbox-name": "resnet-0",
    "io.kubernetes.cri.sandbox-namespace": "ml",
    "io.kubernetes.cri.sandbox-uid": UID,
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """A fake node: <tmp>/proc, <tmp>/cgroup/{unified,memory}, <tmp>/run/... bundle roots."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = root / "proc"
        self.unified = root / "cgroup" / "unified"
        self.memory = root / "cgroup" / "memory"
        for d in (self.proc / "self", self.unified, self.memory):
            d.mkdir(parents=True)
        (self.proc / "self" / "mountinfo").write_text(
            f"41 31 0:38 / {self.unified} rw,relatime - cgroup2 cgroup2 rw\n"
            f"35 31 0:32 / {self.memory} rw,relatime - cgroup cgroup rw,memory\n"
        )
        self.roots = BundleRoots(
            containerd_tasks=(str(root / "containerd"),),
            crio_containers=(str(root / "crio"),),
            runc_state=(str(root / "runc"),),
            docker_containers=(str(root / "docker"),),
        )

    def cgroup(self, path: str, hierarchy: Path | None = None) -> int:
        d = (hierarchy or self.unified) / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        return d.stat().st_ino

    def bundle(self, cid: str, annotations: dict[str, str], ns: str = "k8s.io") -> Path:
        p = self.root / "containerd" / ns / cid / "config.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"ociVersion": "1.0.2", "annotations": annotations}))
        return p

    def process(
        self,
        pid: int,
        cgroup: str,
        start: int = 5000,
        comm: str = "python3",
        nspid: tuple[int, ...] = (),
        cgroup_text: str | None = None,
        state: str = "S",
    ) -> Path:
        d = self.proc / str(pid)
        d.mkdir()
        rest = " ".join([state, "1"] + ["0"] * 17 + [str(start)] + ["0"] * 30)
        (d / "stat").write_text(f"{pid} ({comm}) {rest}\n")
        (d / "cgroup").write_text(cgroup_text if cgroup_text is not None else f"0::{cgroup}\n")
        ns = "\t".join(str(x) for x in (nspid or (pid,)))
        (d / "status").write_text(f"Name:\t{comm}\nUmask:\t0022\nPid:\t{pid}\nNSpid:\t{ns}\n")
        return d

    def kill(self, pid: int) -> None:
        shutil.rmtree(self.proc / str(pid))

    def resolver(self, clock: FakeClock, **kw: float) -> IdentityResolver:
        return IdentityResolver(proc_root=str(self.proc), bundle_roots=self.roots, clock=clock, **kw)  # type: ignore[arg-type]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


@pytest.fixture
def mem_node(tmp_path: Path) -> Iterator[Node]:
    """A Node on tmpfs when there is one (like /proc and cgroupfs, in memory): building 800
    fake pids on a busy ext4 takes seconds, on tmpfs milliseconds."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        with tempfile.TemporaryDirectory(dir=shm, prefix="gpuwatch-test-") as d:
            yield Node(Path(d))
    else:
        yield Node(tmp_path)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_pid_in_kubernetes_container(node: Node, clock: FakeClock) -> None:
    cg_id = node.cgroup(KPATH)
    node.bundle(CID, ANN)
    node.process(4242, KPATH, comm="trainer.py", nspid=(4242, 7))
    r = node.resolver(clock)
    assert r.mounts.unified == str(node.unified)
    p = r.resolve_pid(4242)
    assert p is not None
    assert (p.pid, p.container_pid, p.comm) == (4242, 7, "trainer.py")
    i = p.identity
    assert (i.runtime, i.container_id, i.pod_uid, i.qos_class) == ("containerd", CID, UID, "burstable")
    assert (i.pod_name, i.pod_namespace, i.container_name) == ("resnet-0", "ml", "trainer")
    assert i.cgroup_id == cg_id and i.cgroup_path == KPATH
    assert r.identity_for_cgroup_id(cg_id) == i
    assert r.identity_for_cgroup_path(KPATH + "/") == i


def test_gone_pids(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    node.process(10, KPATH)
    node.process(11, "/")
    r = node.resolver(clock)
    assert set(r.resolve_pids([10, 11, 12])) == {10, 11}
    assert r.resolve_pid(11).identity.runtime == "host"  # type: ignore[union-attr]
    node.kill(10)
    assert r.resolve_pid(10) is None
    assert r.resolve_pids([10, 11]).keys() == {11}


def test_cgroup_id_index_rescan_is_rate_limited(node: Node, clock: FakeClock) -> None:
    r = node.resolver(clock, rescan_min_interval_s=2.0)
    assert r.identity_for_cgroup_id(123456789) is None  # first miss scans
    scans = r.index.scans
    new_id = node.cgroup(f"/system.slice/docker-{'d' * 64}.scope")
    assert r.identity_for_cgroup_id(new_id) is None  # within the interval: no second walk
    assert r.index.scans == scans
    clock.now += 2.5
    ident = r.identity_for_cgroup_id(new_id)
    assert ident is not None and (ident.runtime, ident.container_id, ident.cgroup_id) == (
        "docker",
        "d" * 64,
        new_id,
    )
    assert r.index.scans == scans + 1
    root = r.identity_for_cgroup_id(node.unified.stat().st_ino)
    assert root is not None and root.runtime == "host"


def test_caches_dropped_when_container_goes(node: Node, clock: FakeClock) -> None:
    cg_id = node.cgroup(KPATH)
    node.bundle(CID, ANN)
    node.process(20, KPATH)
    r = node.resolver(clock)
    assert r.resolve_pid(20) is not None
    assert r.cache_sizes() == {"pids": 1, "paths": 1, "metadata": 1}
    node.kill(20)
    (node.unified / KPATH.lstrip("/")).rmdir()
    clock.now += 1.0
    r.begin_sweep()
    assert r.cache_sizes()["paths"] == 0 and r.cache_sizes()["metadata"] == 0
    assert r.resolve_pid(20) is None
    clock.now += 5.0
    assert r.identity_for_cgroup_id(cg_id) is None


def test_zombie_is_gone(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    node.process(22, KPATH, state="Z")
    assert node.resolver(clock).resolve_pid(22) is None


def test_zombie_left_after_its_container_went_is_gone_after_sweep(node: Node, clock: FakeClock) -> None:
    """A container's init reparented to a pid 1 that does not reap: /proc/<pid> stays, same inode."""
    node.cgroup(KPATH)
    d = node.process(23, KPATH)
    r = node.resolver(clock)
    assert r.resolve_pid(23) is not None
    stat = (d / "stat").read_text()
    (d / "stat").write_text(stat.replace(") S ", ") Z ", 1))  # in place: /proc/23 unchanged
    assert r.resolve_pid(23) is not None  # cached: a hit costs one stat() and reads nothing
    (node.unified / KPATH.lstrip("/")).rmdir()
    clock.now += 1
    r.begin_sweep()
    assert r.resolve_pid(23) is None


def test_sweep_keeps_live_cgroups_and_drops_idle_pids(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    node.bundle(CID, ANN)
    node.process(21, KPATH)
    r = node.resolver(clock, idle_sweeps=2)
    r.resolve_pid(21)
    for _ in range(4):  # the pid is not asked about any more
        clock.now += 1.0
        r.begin_sweep()
    assert r.cache_sizes() == {"pids": 0, "paths": 1, "metadata": 1}  # the cgroup still exists


def test_pid_reuse_gets_new_identity(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    node.bundle(CID, ANN)
    node.process(30, KPATH, start=100)
    r = node.resolver(clock)
    assert r.resolve_pid(30).identity.container_id == CID  # type: ignore[union-attr]
    node.kill(30)
    other = f"/system.slice/docker-{'e' * 64}.scope"
    node.cgroup(other)
    node.process(30, other, start=900, comm="other")
    p = r.resolve_pid(30)
    assert p is not None and (p.identity.container_id, p.comm) == ("e" * 64, "other")


def test_recycled_proc_inode_same_start_time_is_same_process(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    node.process(31, KPATH, start=100)
    r = node.resolver(clock)
    first = r.resolve_pid(31)
    # Same process, but its /proc dir has a new inode (dentry evicted): only the start time
    # is re-read; the cgroup file is not (we prove that by changing it underneath).
    node.kill(31)
    node.process(31, "/elsewhere", start=100)
    assert r.resolve_pid(31) == first


def test_process_moved_between_cgroups_seen_after_recheck(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    d = node.process(32, "/")
    r = node.resolver(clock, pid_recheck_s=10.0)
    assert r.resolve_pid(32).identity.runtime == "host"  # type: ignore[union-attr]
    (d / "cgroup").write_text(f"0::{KPATH}\n")
    clock.now += 1
    assert r.resolve_pid(32).identity.runtime == "host"  # type: ignore[union-attr]  # cached
    clock.now += 10
    assert r.resolve_pid(32).identity.container_id == CID  # type: ignore[union-attr]


def test_metadata_that_appears_later_is_picked_up(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    node.process(40, KPATH)
    r = node.resolver(clock, metadata_retry_s=5.0)
    p = r.resolve_pid(40)
    assert p is not None and p.identity.container_id == CID and p.identity.pod_name == ""
    node.bundle(CID, ANN)
    clock.now += 1
    r.begin_sweep()
    assert r.resolve_pid(40).identity.pod_name == ""  # type: ignore[union-attr]  # retry not due
    clock.now += 5
    r.begin_sweep()
    p = r.resolve_pid(40)
    assert p is not None and (p.identity.pod_name, p.identity.pod_namespace) == ("resnet-0", "ml")


def test_docker_metadata(node: Node, clock: FakeClock) -> None:
    did = "d" * 64
    path = f"/system.slice/docker-{did}.scope"
    node.cgroup(path)
    cfg = node.root / "docker" / did / "config.v2.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps({"ID": did, "Name": "/jupyter", "Config": {"Labels": {}}}))
    node.process(50, path)
    r = node.resolver(clock)
    i = r.resolve_pid(50).identity  # type: ignore[union-attr]
    assert (i.runtime, i.container_name, i.display_name) == ("docker", "jupyter", "jupyter")


def test_plain_runc_cgroupfs_leaf_named_by_runc_state(node: Node, clock: FakeClock) -> None:
    bundle = node.root / "bundles" / "job1"
    bundle.mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"annotations": {"io.kubernetes.pod.name": "job"}}))
    state = node.root / "runc" / "job1" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"config": {"labels": [f"bundle={bundle}"]}}))
    node.cgroup("/job1")
    node.process(60, "/job1")
    i = node.resolver(clock).resolve_pid(60).identity  # type: ignore[union-attr]
    assert (i.runtime, i.container_id, i.pod_name) == ("runc", "job1", "job")


def test_hybrid_v1_only_process_uses_v1_dir_for_liveness(node: Node, clock: FakeClock) -> None:
    node.cgroup("/process_api/abc", hierarchy=node.memory)
    node.process(70, "", cgroup_text="9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n")
    r = node.resolver(clock)
    i = r.resolve_pid(70).identity  # type: ignore[union-attr]
    assert (i.runtime, i.cgroup_path, i.cgroup_id) == ("unknown", "/process_api/abc", None)
    node.kill(70)
    (node.memory / "process_api" / "abc").rmdir()
    clock.now += 1
    r.begin_sweep()
    assert r.cache_sizes()["paths"] == 0


def test_explicit_cgroup_root_overrides_mountinfo(node: Node, clock: FakeClock, tmp_path: Path) -> None:
    other = tmp_path / "v2"
    (other / "x.service").mkdir(parents=True)
    r = IdentityResolver(proc_root=str(node.proc), cgroup_root=str(other), bundle_roots=node.roots, clock=clock)
    assert r.identity_for_cgroup_path("/x.service").cgroup_id == (other / "x.service").stat().st_ino


@pytest.mark.parametrize(
    ("files", "expect_runtime"),
    [
        ({"stat": "garbage", "status": "\x00\xff"}, "containerd"),  # stat truncated: cgroup still read
        ({"cgroup": None}, "unknown"),  # cgroup unreadable: kept as unknown
        ({"status": None}, "containerd"),  # no status: no NSpid, identity still there
        ({"cgroup": "0::\n1:\n::::\n"}, "host"),
    ],
)
def test_garbage_proc_files(node: Node, clock: FakeClock, files: dict[str, str | None], expect_runtime: str) -> None:
    node.cgroup(KPATH)
    node.bundle(CID, ANN)
    d = node.process(80, KPATH)
    for name, content in files.items():
        if content is None:
            (d / name).unlink()
        else:
            (d / name).write_text(content)
    p = node.resolver(clock).resolve_pid(80)
    assert p is not None and p.identity.runtime == expect_runtime


def test_bad_bundle_json_gives_identity_without_metadata(node: Node, clock: FakeClock) -> None:
    node.cgroup(KPATH)
    node.bundle(CID, ANN).write_text("{not json")
    node.process(81, KPATH)
    i = node.resolver(clock).resolve_pid(81).identity  # type: ignore[union-attr]
    assert (i.container_id, i.pod_uid, i.pod_name) == (CID, UID, "")


def test_empty_pid_dir_is_gone(node: Node, clock: FakeClock) -> None:
    (node.proc / "90").mkdir()
    assert node.resolver(clock).resolve_pid(90) is None


def test_no_mountinfo_and_no_cgroup_root(tmp_path: Path, clock: FakeClock) -> None:
    proc = tmp_path / "proc"
    (proc / "5").mkdir(parents=True)
    (proc / "5" / "cgroup").write_text(f"0::{KPATH}\n")
    r = IdentityResolver(proc_root=str(proc), bundle_roots=BundleRoots((), (), (), ()), clock=clock)
    i = r.resolve_pid(5).identity  # type: ignore[union-attr]
    assert (i.container_id, i.cgroup_id) == (CID, None)
    assert r.identity_for_cgroup_id(1) is None


def test_real_proc_self() -> None:
    """Against the real /proc and cgroup mounts of this machine (no root needed)."""
    r = IdentityResolver()
    me = r.resolve_pid(os.getpid())
    assert me is not None and me.pid == os.getpid() and me.container_pid is not None
    with open(f"/proc/{os.getpid()}/cgroup") as f:
        unified = next(line[3:].strip() for line in f if line.startswith("0::"))
    assert r.mounts.unified is not None
    want_id = os.stat(r.mounts.unified.rstrip("/") + (unified if unified != "/" else "")).st_ino
    by_id = r.identity_for_cgroup_id(want_id)
    assert by_id is not None and by_id.cgroup_path == unified


def test_warm_sweep_cost_800_pids_200_containers(mem_node: Node) -> None:
    """The benchmark shape: 800 processes in 200 containers, re-resolved every cycle."""
    pids = []
    for c in range(200):
        cid = f"{c:064x}"
        path = f"/kubepods.slice/kubepods-burstable.slice/{POD_SLICE}/cri-containerd-{cid}.scope"
        mem_node.cgroup(path)
        mem_node.bundle(cid, dict(ANN, **{"io.kubernetes.cri.container-name": f"c{c}"}))
        for k in range(4):
            pid = 1000 + c * 4 + k
            mem_node.process(pid, path)
            pids.append(pid)
    r = IdentityResolver(proc_root=str(mem_node.proc), bundle_roots=mem_node.roots)
    t0 = time.process_time()
    cold = r.resolve_pids(pids)
    t1 = time.process_time()
    assert len(cold) == 800 and len({p.identity.container_id for p in cold.values()}) == 200
    assert cold[1000 + 7 * 4].identity.container_name == "c7"
    cycles = 20
    t2 = time.process_time()
    for _ in range(cycles):
        r.begin_sweep()
        warm = r.resolve_pids(pids)
    t3 = time.process_time()
    assert warm == cold
    per_cycle_ms = (t3 - t2) / cycles * 1e3
    print(
        f"cold {(t1 - t0) * 1e3:.1f} ms, warm {per_cycle_ms:.2f} ms/cycle",
        f"({per_cycle_ms * 1e3 / 800:.1f} us/pid)",
    )
    assert per_cycle_ms < 10.0  # half the whole cycle's 20 ms CPU budget, with margin for slow CI


def test_cgroup_recreated_under_same_name_gets_new_id(node: Node, clock: FakeClock) -> None:
    """A container restarted with the same id: same path, new directory, new cgroup id."""
    old_id = node.cgroup(KPATH)
    node.bundle(CID, ANN)
    r = node.resolver(clock)
    assert r.identity_for_cgroup_path(KPATH).cgroup_id == old_id
    d = node.unified / KPATH.lstrip("/")
    moved = node.root / "old-cgroup"
    d.rename(moved)  # the old inode stays alive until the new dir exists: ids must differ
    new_id = node.cgroup(KPATH)
    moved.rmdir()
    assert new_id != old_id
    clock.now += 1
    r.begin_sweep()
    ident = r.identity_for_cgroup_path(KPATH)
    assert ident.cgroup_id == new_id and ident.pod_name == "resnet-0"


def test_cgroup_that_appears_later_gets_its_id(node: Node, clock: FakeClock) -> None:
    r = node.resolver(clock)
    assert r.identity_for_cgroup_path(KPATH).cgroup_id is None
    cg_id = node.cgroup(KPATH)
    clock.now += 1
    r.begin_sweep()
    assert r.identity_for_cgroup_path(KPATH).cgroup_id == cg_id


def test_path_outside_our_cgroup_namespace(node: Node, clock: FakeClock) -> None:
    """An agent in a private cgroupns sees other pods as /../../kubepods/...: the identity is
    still parsed from the path, but no id is made up for a dir we cannot see."""
    node.cgroup(KPATH)
    node.process(95, "", cgroup_text=f"0::/../..{KPATH}\n")
    i = node.resolver(clock).resolve_pid(95).identity  # type: ignore[union-attr]
    assert (i.container_id, i.pod_uid, i.cgroup_id) == (CID, UID, None)
