"""Unit tests for gpuwatch.sim.cgroups: finding the cgroup hierarchies from mountinfo text
(hybrid and pure v2 hosts) and the plain directory helpers, on fixture trees."""

from __future__ import annotations

from pathlib import Path

from gpuwatch.sim import cgroups

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""

PURE_V2 = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
28 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate
"""

# inside a container: the hierarchy's root is a sub-cgroup, host paths would map wrongly
NESTED = """\
41 31 0:38 /kubepods/pod1/abc /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw
"""


def test_hybrid_host_lists_v2_and_every_v1_hierarchy() -> None:
    mounts = cgroups.parse_mountinfo(HYBRID)
    assert mounts.v2 == Path("/sys/fs/cgroup/unified")
    assert not mounts.pure_v2
    assert mounts.v1_controller("freezer") == Path("/sys/fs/cgroup/freezer")
    assert mounts.v1_controller("cpuacct") == Path("/sys/fs/cgroup/cpu,cpuacct")
    assert mounts.v1_controller("name=systemd") == Path("/sys/fs/cgroup/systemd")
    assert mounts.v1_controller("memory") is None
    dirs = mounts.all_dirs("/kubepods/pod1/c")
    assert dirs[0] == Path("/sys/fs/cgroup/unified/kubepods/pod1/c")
    assert Path("/sys/fs/cgroup/freezer/kubepods/pod1/c") in dirs
    assert len(dirs) == 5


def test_pure_v2_host() -> None:
    mounts = cgroups.parse_mountinfo(PURE_V2)
    assert mounts.pure_v2
    assert mounts.v2_dir("/gpuwatch-test/a") == Path("/sys/fs/cgroup/gpuwatch-test/a")
    assert mounts.v1_controller("freezer") is None


def test_sub_cgroup_mounts_are_ignored() -> None:
    assert cgroups.parse_mountinfo(NESTED).v2 is None


def test_this_host_has_a_v2_tree() -> None:
    assert cgroups.detect().v2 is not None


def test_make_dirs_reports_only_what_it_created(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    created = cgroups.make_dirs(tmp_path / "a" / "b" / "c")
    assert created == [tmp_path / "a" / "b" / "c", tmp_path / "a" / "b"]
    assert (tmp_path / "a" / "b" / "c").is_dir()
    assert cgroups.make_dirs(tmp_path / "a" / "b" / "c") == []


def test_read_pids_of_a_missing_cgroup_is_empty(tmp_path: Path) -> None:
    assert cgroups.read_pids(tmp_path / "gone") == []
    (tmp_path / "cgroup.procs").write_text("12\n34\n")
    assert cgroups.read_pids(tmp_path) == [12, 34]


def test_remove_dir_leaves_a_cgroup_with_children(tmp_path: Path) -> None:
    (tmp_path / "parent" / "child").mkdir(parents=True)
    assert cgroups.remove_dir(tmp_path / "parent", timeout_s=0.1) is False
    assert (tmp_path / "parent").is_dir()
    assert cgroups.remove_dir(tmp_path / "parent" / "child") is True
    assert cgroups.remove_dir(tmp_path / "parent") is True
    assert cgroups.remove_dir(tmp_path / "parent") is True  # already gone
