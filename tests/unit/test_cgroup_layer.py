"""The one cgroup layer (containers/cgroupfs.py) on fixture trees: mountinfo of v2, hybrid
and v1 hosts and of an agent in its own cgroup namespace, placing that namespace's root,
hierarchy paths, the agent's own cgroup, and the users of the layer (doctor, enforcement)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.cli.hostcheck import HostRoots, Status, cgroup_mode, check_cgroups
from gpuwatch.containers.cgroupfs import (
    CgroupMounts,
    discover_mounts,
    join_cgroup_path,
    own_cgroup_paths,
    parse_mountinfo,
)
from gpuwatch.containers.pidcgroup import cgroup_id_of_pid
from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.cgroup_ops import CgroupTree

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,release_agent=/x,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""
# What `unshare --cgroup` from /gpuwatch/agent printed on this hybrid machine (trimmed).
IN_NAMESPACE = """\
37 31 0:34 /../.. /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
41 31 0:38 /../.. /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_ONLY = "32 31 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"


def test_hybrid_mounts_by_hierarchy_and_controller() -> None:
    m = parse_mountinfo(HYBRID)
    assert (m.unified, m.mode, m.pure_v2) == ("/sys/fs/cgroup/unified", "hybrid", False)
    assert m.v1["cpuacct"] == m.v1["cpu"] == "/sys/fs/cgroup/cpu,cpuacct"
    assert m.v1_controller("name=systemd") == Path("/sys/fs/cgroup/systemd")
    assert len(m.all_dirs("/a/b")) == 4  # one directory per hierarchy, co-mounted controllers once
    assert m.all_dirs("/a/b")[0] == Path("/sys/fs/cgroup/unified/a/b")


def test_modes() -> None:
    assert parse_mountinfo(V1_ONLY).mode == "v1"
    assert parse_mountinfo("").mode == "none"
    assert parse_mountinfo(IN_NAMESPACE).mode == "hybrid"


def test_a_root_above_our_namespace_is_used_a_root_mount_preferred() -> None:
    m = parse_mountinfo(IN_NAMESPACE)
    v2 = m.unified_hierarchy
    assert v2 is not None and (v2.mount_point, v2.ups, v2.ns_root_known) == ("/sys/fs/cgroup/unified", 2, False)
    both = parse_mountinfo(IN_NAMESPACE + "50 31 0:38 / /mnt/cg2 rw - cgroup2 cgroup2 rw\n")
    assert both.unified == "/mnt/cg2"


def test_binds_of_sub_cgroups_are_not_used() -> None:
    assert parse_mountinfo("41 31 0:38 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n").unified is None


@pytest.mark.parametrize(("base", "rel", "want"), [
    ("/a/b/c", "/../../x/y", "/a/x/y"),
    ("/a/b/c", "../../x", "/a/x"),
    ("/a/b/c", "/", "/a/b/c"),
    ("/", "/x/./y//", "/x/y"),
    ("/a", "/../..", None),
])
def test_join_cgroup_path(base: str, rel: str, want: str | None) -> None:
    assert join_cgroup_path(base, rel) == want


PID = 4242 if os.getpid() != 4242 else 4243  # the fixture agent; never this test process


def _namespace_host(tmp_path: Path, own: str = "0::/\n6:freezer:/\n") -> tuple[Path, Path]:
    """A fixture host: v2 and freezer trees with the agent in /gpuwatch/agent (its namespace
    root), a pod beside it, and /proc/self as the agent sees it from inside its namespace."""
    v2, freezer = tmp_path / "unified", tmp_path / "freezer"
    for tree in (v2, freezer):
        for rel in ("gpuwatch/agent", "gpuwatch/decoy", "other/agent", "kubepods/pod1/ctr"):
            (tree / rel).mkdir(parents=True)
            (tree / rel / "cgroup.procs").write_text("")
        (tree / "gpuwatch/agent/cgroup.procs").write_text(f"17\n{PID}\n")
        (tree / "other/agent/cgroup.procs").write_text(f"{PID}1\n")  # a pid that merely starts alike
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(
        f"37 31 0:34 /../.. {freezer} rw - cgroup cgroup rw,freezer\n41 31 0:38 /../.. {v2} rw - cgroup2 cgroup2 rw\n")
    (proc / "self" / "cgroup").write_text(own)
    (proc / "77").mkdir()
    (proc / "77" / "cgroup").write_text("6:freezer:/../../kubepods/pod1/ctr\n0::/../../kubepods/pod1/ctr\n")
    return proc, v2


def test_namespace_root_is_placed_where_our_pid_is(tmp_path: Path) -> None:
    proc, v2 = _namespace_host(tmp_path)
    m = discover_mounts(str(proc), pid=PID)
    assert m.unified_hierarchy is not None and m.unified_hierarchy.ns_root == "/gpuwatch/agent"
    freezer = m.v1_hierarchy("freezer")
    assert freezer is not None and freezer.ns_root == "/gpuwatch/agent"
    assert m.absolute("/../../kubepods/pod1/ctr") == "/kubepods/pod1/ctr"
    assert m.absolute("/../../kubepods/pod1/ctr", "freezer") == "/kubepods/pod1/ctr"
    assert m.v2_dir("/kubepods/pod1/ctr") == v2 / "kubepods/pod1/ctr"
    assert cgroup_id_of_pid(77, m, str(proc)) == os.stat(v2 / "kubepods/pod1/ctr").st_ino
    assert own_cgroup_paths(m, str(proc)) == {"/gpuwatch/agent"}
    assert cgroup_mode(str(proc)) == ("hybrid", str(v2))


def test_namespace_root_found_when_the_agent_moved_below_it(tmp_path: Path) -> None:
    proc, v2 = _namespace_host(tmp_path, own="0::/worker\n")
    (v2 / "gpuwatch/agent/cgroup.procs").write_text("17\n")
    (v2 / "gpuwatch/agent/worker").mkdir()
    (v2 / "gpuwatch/agent/worker/cgroup.procs").write_text(f"{PID}\n")
    m = discover_mounts(str(proc), pid=PID)
    assert m.unified_hierarchy is not None and m.unified_hierarchy.ns_root == "/gpuwatch/agent"
    assert "/gpuwatch/agent/worker" in own_cgroup_paths(m, str(proc))


def test_an_unplaceable_namespace_keeps_relative_paths_and_says_so(tmp_path: Path) -> None:
    proc, _ = _namespace_host(tmp_path)
    m = discover_mounts(str(proc), pid=999_999)
    assert m.unified_hierarchy is not None and not m.unified_hierarchy.ns_root_known
    assert any("could not be placed" in n for n in m.notes)
    assert m.absolute("/../../kubepods/pod1/ctr") == "/../../kubepods/pod1/ctr"
    assert cgroup_id_of_pid(77, m, str(proc)) is None  # no directory of ours names it


def test_enforcement_acts_on_the_placed_directory_and_refuses_unplaced_paths(tmp_path: Path) -> None:
    proc, v2 = _namespace_host(tmp_path)
    tree = CgroupTree(mounts=discover_mounts(str(proc), pid=PID))
    handle = tree.handle("/kubepods/pod1/ctr")
    assert handle.v2_dir == v2 / "kubepods/pod1/ctr"
    assert handle.v1_freezer_dir == tmp_path / "freezer/kubepods/pod1/ctr"
    with pytest.raises(EnforcementError):
        tree.handle("/../../kubepods/pod1/ctr")


def test_injected_v2_root_replaces_the_found_one() -> None:
    m = parse_mountinfo(HYBRID).with_unified("/fixture")
    assert m.unified == "/fixture" and m.v1["freezer"] == "/sys/fs/cgroup/freezer"
    assert CgroupMounts.v2_only("/x").pure_v2


def test_this_machine(tmp_path: Path) -> None:
    m = discover_mounts()
    assert m.unified is not None and os.path.isfile(os.path.join(m.unified, "cgroup.procs"))
    assert all(h.ns_root_known for h in m.hierarchies)


def test_doctor_says_where_our_cgroup_namespace_sits(tmp_path: Path) -> None:
    proc, _ = _namespace_host(tmp_path)
    (tmp_path / "unified/gpuwatch/agent/cgroup.procs").write_text(f"{os.getpid()}\n")
    check = check_cgroups(HostRoots(proc_root=str(proc)))
    assert check.status == Status.OK and "own cgroup namespace rooted at /gpuwatch/agent" in check.found


def test_doctor_warns_when_our_cgroup_namespace_cannot_be_placed(tmp_path: Path) -> None:
    proc, _ = _namespace_host(tmp_path)  # our real pid is in none of the fixture's cgroups
    check = check_cgroups(HostRoots(proc_root=str(proc)))
    assert check.status == Status.WARN and "pause/throttle of other pods" in check.loses


def test_agent_moved_out_of_its_namespace_root_is_not_guessed(tmp_path: Path) -> None:
    """A runtime may move the agent after it entered its namespace: /proc/self/cgroup then
    reads `0::/../moved`, which every sibling of the namespace root fits equally: none is
    guessed (a wrong root would misplace every cgroup inside the namespace)."""
    proc, v2 = _namespace_host(tmp_path, own="0::/../moved\n")
    (v2 / "gpuwatch/agent/cgroup.procs").write_text("17\n")
    (v2 / "gpuwatch/moved").mkdir()
    (v2 / "gpuwatch/moved/cgroup.procs").write_text(f"{PID}\n")
    m = discover_mounts(str(proc), pid=PID)
    assert m.unified_hierarchy is not None and not m.unified_hierarchy.ns_root_known
    assert m.notes
