"""/proc/<pid>/{cgroup,stat,status} and mountinfo parsing: v2, hybrid, v1-only and garbage."""

from __future__ import annotations

import os

import pytest

from gpuwatch.containers.cgroupfs import parse_mountinfo
from gpuwatch.containers.procfs import (
    choose_cgroup_path,
    parse_cgroup_file,
    parse_stat,
    parse_status,
    read_text,
)

ID = "a" * 64
KPATH = f"/kubepods/burstable/pod11111111-2222-3333-4444-555555555555/{ID}"

# What runc 1.1 wrote on this hybrid build machine for a container with that cgroupsPath.
HYBRID_RUNC = "\n".join(
    [f"{n}:{c}:{KPATH}" for n, c in [(9, "name=systemd"), (8, "pids"), (4, "memory"), (1, "cpu")]] + [f"0::{KPATH}", ""]
)
# This machine's own sandbox: only the v1 memory controller places it somewhere.
HYBRID_V1_ONLY = "9:name=systemd:/\n4:memory:/process_api/82a1dc48c19ca99d74bbe6f9cb8c9c0d\n1:cpu:/\n0::/\n"
# Docker on a v1-only host (neuvector cgroup_test.go TestDockerIDCentOS), no 0:: line.
V1_DOCKER = (
    f"10:devices:/system.slice/docker-{ID}.scope\n"
    f"2:cpuacct,cpu:/system.slice/docker-{ID}.scope\n"
    f"1:name=systemd:/system.slice/docker-{ID}.scope\n"
)


def test_pure_v2() -> None:
    choice = choose_cgroup_path(parse_cgroup_file(f"0::{KPATH}\n"))
    assert (choice.path, choice.hierarchy, choice.unified) == (KPATH, "", KPATH)


def test_hybrid_prefers_unified() -> None:
    choice = choose_cgroup_path(parse_cgroup_file(HYBRID_RUNC))
    assert (choice.path, choice.hierarchy) == (KPATH, "")


def test_hybrid_falls_back_to_v1_when_unified_is_root() -> None:
    choice = choose_cgroup_path(parse_cgroup_file(HYBRID_V1_ONLY))
    assert choice.path == "/process_api/82a1dc48c19ca99d74bbe6f9cb8c9c0d"
    assert choice.hierarchy == "memory"
    assert choice.unified == "/"


def test_v1_prefers_name_systemd_and_splits_comounted_controllers() -> None:
    cg = parse_cgroup_file(V1_DOCKER)
    assert ("cpu", f"/system.slice/docker-{ID}.scope") in cg.v1
    assert ("cpuacct", f"/system.slice/docker-{ID}.scope") in cg.v1
    choice = choose_cgroup_path(cg)
    assert (choice.path, choice.hierarchy, choice.unified) == (
        f"/system.slice/docker-{ID}.scope",
        "name=systemd",
        None,
    )


def test_v1_majority_path_wins_without_systemd() -> None:
    text = "5:devices:/a\n4:memory:/b\n3:pids:/b\n2:cpu:/\n0::/\n"
    assert choose_cgroup_path(parse_cgroup_file(text)).path == "/b"


@pytest.mark.parametrize(
    "text",
    ["", "garbage", "0::", "0:/x", ":::", "0::relative/path\n", "\x00\x01\x02", "9:name=systemd:"],
)
def test_garbage_cgroup_file_is_root(text: str) -> None:
    choice = choose_cgroup_path(parse_cgroup_file(text))
    assert choice.path == "/"


def test_parse_stat_comm_with_spaces_and_parens() -> None:
    fields = " ".join(["S"] + ["0"] * 18 + ["123456"] + ["0"] * 30)
    assert parse_stat(f"42 (my (weird) comm) {fields}") == ("my (weird) comm", "S", 123456)
    zombie = parse_stat(f"42 (x) Z {fields[2:]}")
    assert zombie is not None and zombie.exited


@pytest.mark.parametrize("text", ["", "42", "42 (x", "42 (x) S 1 2 3", "42 (x) " + "S " * 18 + "notanumber"])
def test_parse_stat_truncated(text: str) -> None:
    assert parse_stat(text) is None


def test_parse_stat_real_self() -> None:
    text = read_text("/proc/self/stat")
    assert text is not None
    parsed = parse_stat(text)
    assert parsed is not None
    comm, state, start = parsed
    assert state == "R" and not parsed.exited
    assert comm  # python / pytest
    with open("/proc/uptime") as f:
        boot_ticks = os.sysconf("SC_CLK_TCK") * float(f.read().split()[0])
    assert 0 < start <= boot_ticks + 1


def test_parse_status_nspid() -> None:
    text = "Name:\tsleep\nUmask:\t0022\nState:\tS (sleeping)\nNSpid:\t9678\t12\t1\nNSpgid:\t9678\t1\n"
    assert parse_status(text) == ("sleep", (9678, 12, 1))


@pytest.mark.parametrize("text", ["", "Name:\n", "NSpid:\tx\ty\n", "Name:\tx\nNSpid:"])
def test_parse_status_garbage(text: str) -> None:
    _name, nspid = parse_status(text)
    assert nspid == ()


def test_parse_status_real_self_nspid_last_is_own_pid_in_host_ns() -> None:
    text = read_text("/proc/self/status")
    assert text is not None
    _, nspid = parse_status(text)
    assert nspid and nspid[0] == os.getpid()


def test_read_text_missing_is_none(tmp_path: object) -> None:
    assert read_text("/proc/0/definitely-not-here") is None


HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,release_agent=/x,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
PURE_V2_MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
"""


def test_mountinfo_hybrid() -> None:
    m = parse_mountinfo(HYBRID_MOUNTINFO)
    assert m.unified == "/sys/fs/cgroup/unified"
    assert m.v1["memory"] == "/sys/fs/cgroup/memory"
    assert m.v1["name=systemd"] == "/sys/fs/cgroup/systemd"
    assert not any(k.startswith("release_agent") for k in m.v1)


def test_mountinfo_pure_v2() -> None:
    m = parse_mountinfo(PURE_V2_MOUNTINFO)
    assert (m.unified, m.v1) == ("/sys/fs/cgroup", {})


def test_mountinfo_escapes_and_garbage() -> None:
    text = "1 2 0:3 / /mnt/with\\040space rw - cgroup2 none rw\nnot a mountinfo line\n1 2 - x\n"
    assert parse_mountinfo(text).unified == "/mnt/with space"


def test_mountinfo_ignores_bind_mounts_of_subtrees() -> None:
    text = (
        "50 31 0:38 /kubepods /host/cg rw - cgroup2 cgroup2 rw\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    )
    assert parse_mountinfo(text).unified == "/sys/fs/cgroup/unified"


def test_mountinfo_real_machine_has_a_v2_mount() -> None:
    text = read_text("/proc/self/mountinfo")
    assert text is not None
    m = parse_mountinfo(text)
    assert m.unified is not None and os.path.isfile(os.path.join(m.unified, "cgroup.procs"))
