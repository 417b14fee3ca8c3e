"""hostcheck on fixture trees: each check reports what is there and a fix for what is not."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwatch.cli.hostcheck import (
    HostRoots,
    Status,
    cgroup_mode,
    check_binary,
    check_btf,
    check_kernel_headers,
    check_nvml,
    check_root,
    check_tracepoints,
    kernel_headers,
    kernel_headers_dir,
)
from gpuwatch.cli.main import cli
from gpuwatch.core.errors import ProbesUnavailable
from gpuwatch.probes.bcc_loader import find_kernel_headers

HYBRID_MOUNTINFO = """\
25 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw
35 25 0:30 / /sys/fs/cgroup ro shared:9 - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw shared:10 - cgroup2 cgroup2 rw
37 35 0:32 / /sys/fs/cgroup/systemd rw shared:11 - cgroup cgroup rw,name=systemd
40 35 0:35 / /sys/fs/cgroup/freezer rw shared:14 - cgroup cgroup rw,freezer
"""
V2_MOUNTINFO = "36 25 0:31 / /sys/fs/cgroup rw shared:10 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTINFO = "40 35 0:35 / /sys/fs/cgroup/freezer rw shared:14 - cgroup cgroup rw,freezer\n"


def _proc(tmp_path: Path, mountinfo: str) -> str:
    (tmp_path / "self").mkdir(parents=True)
    (tmp_path / "self" / "mountinfo").write_text(mountinfo)
    return str(tmp_path)


def test_cgroup_mode_hybrid(tmp_path: Path) -> None:
    assert cgroup_mode(_proc(tmp_path, HYBRID_MOUNTINFO)) == ("hybrid", "/sys/fs/cgroup/unified")


def test_cgroup_mode_pure_v2(tmp_path: Path) -> None:
    assert cgroup_mode(_proc(tmp_path, V2_MOUNTINFO)) == ("v2", "/sys/fs/cgroup")


def test_cgroup_mode_v1_and_missing(tmp_path: Path) -> None:
    assert cgroup_mode(_proc(tmp_path / "a", V1_MOUNTINFO)) == ("v1", None)
    assert cgroup_mode(str(tmp_path / "nothing")) == ("none", None)


def test_root_check_names_the_fix() -> None:
    assert check_root(0).status is Status.OK
    c = check_root(1000)
    assert c.status is Status.WARN and "sudo" in c.fix


def test_nvml_missing_suggests_driver_or_sim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUWATCH_NVML_LIBRARY", raising=False)

    def loader(name: str) -> object:
        raise OSError(f"{name}: cannot open shared object file")

    c = check_nvml(loader)
    assert c.status is Status.WARN
    assert "libnvidia-ml.so.1" in c.found and "gpuwatch sim up" in c.fix


def test_kernel_headers_order_env_then_host_then_merged_then_bundled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BCC_KERNEL_SOURCE, the host's /lib/modules/<release>/build, the host's merged tree
    (deploy/setup.sh), the image's bundled tree: the first that exists wins, and doctor says which."""
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    roots = HostRoots(lib_modules=str(tmp_path / "mods"), kernel_headers_fallback=str(tmp_path / "fallback"),
                      bundled_kernel_headers=str(tmp_path / "bundled"))
    none = check_kernel_headers(roots, "6.18.0")
    assert none.status is Status.WARN and "no kernel headers" in none.found and "agent image" in none.fix

    (tmp_path / "bundled" / "include").mkdir(parents=True)
    (tmp_path / "bundled" / "gpuwatch-headers.txt").write_text("Debian linux-headers-6.1.0-56-amd64 6.1.192-2\n")
    bundled = check_kernel_headers(roots, "6.18.0")
    assert bundled.status is Status.OK
    assert bundled.found == (f"{tmp_path / 'bundled'} (image bundled tree: Debian linux-headers-6.1.0-56-amd64 "
                             "6.1.192-2; the host has none for 6.18.0)")

    (tmp_path / "6.1.0-56").mkdir()
    (tmp_path / "fallback").symlink_to(tmp_path / "6.1.0-56")
    merged = check_kernel_headers(roots, "6.18.0").found
    assert merged.startswith(f"{tmp_path / '6.1.0-56'} (host merged tree: made by deploy/setup.sh, via "), merged

    (tmp_path / "usr-src").mkdir()
    (tmp_path / "mods" / "6.18.0").mkdir(parents=True)
    (tmp_path / "mods" / "6.18.0" / "build").symlink_to(tmp_path / "usr-src" / "linux-headers-6.18.0")
    assert "host merged tree" in check_kernel_headers(roots, "6.18.0").found, "a dangling build link is skipped"
    (tmp_path / "usr-src" / "linux-headers-6.18.0").mkdir()
    assert check_kernel_headers(roots, "6.18.0").found == f"{tmp_path}/mods/6.18.0/build (host /lib/modules)"
    assert kernel_headers(roots, "6.18.0").env({}) == {}, "BCC finds the host's own tree by itself"

    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path / "bundled"))
    chosen = kernel_headers(roots, "6.18.0")
    assert chosen.source == "BCC_KERNEL_SOURCE" and chosen.env({}) == {"BCC_KERNEL_SOURCE": str(tmp_path / "bundled")}
    assert kernel_headers_dir(roots, "6.18.0") == str(tmp_path / "bundled")
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(tmp_path / "nowhere"))
    wrong = check_kernel_headers(roots, "6.18.0")
    assert wrong.status is Status.WARN and "BCC_KERNEL_SOURCE" in wrong.found and "not a directory" in wrong.found
    assert kernel_headers_dir(roots, "6.18.0") is None


def test_bundled_tree_without_origin_file_still_serves(tmp_path: Path) -> None:
    (tmp_path / "bundled" / "include").mkdir(parents=True)
    found = find_kernel_headers("6.18.0", environ={}, lib_modules=tmp_path / "mods",
                                host_merged=tmp_path / "merged", bundled=tmp_path / "bundled")
    assert found.source == "image bundled tree" and "origin not recorded" in found.detail
    assert found.env({"PATH": "/bin"}) == {"PATH": "/bin", "BCC_KERNEL_SOURCE": str(tmp_path / "bundled")}
    (tmp_path / "empty").mkdir()  # a bundled path without include/ (an empty mount point) is no tree
    with pytest.raises(ProbesUnavailable, match="no kernel headers for BCC"):
        find_kernel_headers("6.18.0", environ={}, lib_modules=tmp_path / "mods",
                            host_merged=tmp_path / "merged", bundled=tmp_path / "empty")


def test_btf_and_tracepoints_on_fixture_sys(tmp_path: Path) -> None:
    roots = HostRoots(sys_root=str(tmp_path))
    assert check_btf(roots).status is Status.WARN
    assert check_tracepoints(roots).status is Status.WARN
    (tmp_path / "kernel/btf").mkdir(parents=True)
    (tmp_path / "kernel/btf/vmlinux").write_bytes(b"")
    (tmp_path / "kernel/tracing/events/syscalls/sys_enter_ioctl").mkdir(parents=True)
    assert check_btf(roots).status is Status.OK
    assert check_tracepoints(roots).status is Status.OK


def test_missing_binary_names_the_debian_package() -> None:
    c = check_binary("runc", "runc", "containers", which=lambda _n: None)
    assert c.status is Status.WARN and c.fix == "apt-get install runc"


def test_doctor_cli_runs_and_prints_every_check() -> None:
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    for name in ("root", "nvml", "bcc", "kernel-headers", "btf", "cgroups", "runc", "prometheus"):
        assert name in result.output


def test_help_works_without_optional_deps() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert "top" in result.output and "agent" in result.output
