"""fdseed's /proc parsing on a fixture tree (no BPF): which fd links are device nodes under
the prefix (configured or resolved spelling), their kind/minor exactly as the kernel's
gw_classify decides, a process's cgroup v2 id and start time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.containers.cgroupfs import CgroupMounts
from gpuwatch.probes import fdseed, layout


def _proc(root: Path, pid: int, links: dict[int, str], cgroup: str = "0::/pods/a\n",
          starttime: int = 4242) -> None:
    fd_dir = root / str(pid) / "fd"
    fd_dir.mkdir(parents=True)
    for fd, target in links.items():
        os.symlink(target, fd_dir / str(fd))
    (root / str(pid) / "cgroup").write_text(cgroup)
    rest = " ".join(["S"] + ["0"] * 18 + [str(starttime)] + ["0"] * 10)
    (root / str(pid) / "stat").write_text(f"{pid} (a (weird) name) {rest}\n")


@pytest.mark.parametrize(("suffix", "expected"), [
    ("ctl", (layout.GW_KIND_CTL, layout.GW_DEV_UNKNOWN)),
    ("0", (layout.GW_KIND_GPU, 0)),
    ("15", (layout.GW_KIND_GPU, 15)),
    ("99", (layout.GW_KIND_GPU, 99)),
    ("-uvm", (layout.GW_KIND_UVM, layout.GW_DEV_UNKNOWN)),
    ("-uvm-tools", (layout.GW_KIND_UVM, layout.GW_DEV_UNKNOWN)),
    ("ctlx", (layout.GW_KIND_OTHER, layout.GW_DEV_UNKNOWN)),
    ("123", (layout.GW_KIND_OTHER, layout.GW_DEV_UNKNOWN)),
    ("-modeset", (layout.GW_KIND_OTHER, layout.GW_DEV_UNKNOWN)),
    ("-caps/nvidia-cap1", (layout.GW_KIND_OTHER, layout.GW_DEV_UNKNOWN)),
])
def test_classify_mirrors_the_kernel(suffix: str, expected: tuple[int, int]) -> None:
    assert fdseed.classify(suffix) == expected


def test_scan_finds_device_fds_under_both_spellings_of_the_prefix(tmp_path: Path) -> None:
    real = tmp_path / "real" / "dev"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    prefix = str(tmp_path / "link" / "dev" / "nvidia")  # configured through a symlink
    resolved = str(real / "nvidia")
    assert fdseed.device_prefixes(prefix) == (prefix, resolved)
    proc = tmp_path / "proc"
    _proc(proc, 10, {0: "/dev/pts/0", 3: resolved + "ctl", 4: resolved + "1", 7: prefix + "-uvm",
                     9: resolved + "0 (deleted)", 11: "socket:[123]", 12: "/dev/nvidia0"})
    _proc(proc, 11, {0: "/dev/null"})
    (proc / "self").mkdir()  # not a pid
    found = fdseed.scan(proc, prefix)
    assert list(found) == [10]
    assert [(d.fd, d.kind, d.minor) for d in found[10]] == [
        (3, layout.GW_KIND_CTL, layout.GW_DEV_UNKNOWN), (4, layout.GW_KIND_GPU, 1),
        (7, layout.GW_KIND_UVM, layout.GW_DEV_UNKNOWN), (9, layout.GW_KIND_GPU, 0)]


def test_a_vanished_process_yields_nothing(tmp_path: Path) -> None:
    assert fdseed.process_device_fds(tmp_path, 999, ("/dev/nvidia",)) == []
    assert fdseed.cgroup_id(tmp_path, 999, CgroupMounts.v2_only(tmp_path)) is None
    assert fdseed.start_time(tmp_path, 999) is None


def test_cgroup_id_is_the_v2_directory_inode_and_start_time_is_parsed(tmp_path: Path) -> None:
    cgroot = tmp_path / "cgroup"
    (cgroot / "pods" / "a").mkdir(parents=True)
    proc = tmp_path / "proc"
    _proc(proc, 20, {}, cgroup="12:memory:/x\n0::/pods/a\n", starttime=777)
    _proc(proc, 21, {}, cgroup="12:memory:/x\n")  # cgroup v1 only: no id
    assert fdseed.cgroup_id(proc, 20, CgroupMounts.v2_only(cgroot)) == os.stat(cgroot / "pods" / "a").st_ino
    assert fdseed.cgroup_id(proc, 21, CgroupMounts.v2_only(cgroot)) is None
    assert fdseed.start_time(proc, 20) == 777


def test_reports_add_up() -> None:
    total = fdseed.SeedReport()
    total.add(fdseed.SeedReport(processes=1, seeded=2, fd_overflow=1, seeded_tgids={5}))
    total.add(fdseed.SeedReport(processes=1, known=3, tgid_overflow=1, seeded_tgids={6}))
    assert (total.processes, total.seeded, total.known, total.fd_overflow, total.tgid_overflow) == (2, 2, 3, 1, 1)
    assert total.seeded_tgids == {5, 6}
