"""Probe pieces that need no root: ELF symbol offsets, op names, event decoding, and the
exact message when BPF is unavailable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.probes import layout
from gpuwatch.probes.elf import ElfError, symbol_offsets
from gpuwatch.probes.kernel_events import KernelEvent, ioctl_op_name
from gpuwatch.probes.libcuda import discover

REPO = Path(__file__).resolve().parents[2]
FAKE_CUDA = REPO / "tests" / "system" / "test_probes_fakecuda.c"


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler is required (apt-get install gcc)")
    out = tmp_path_factory.mktemp("elf") / "libcuda.so.1"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(out), str(FAKE_CUDA)], check=True)
    return out


def _nm_defined(path: Path) -> dict[str, int]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm is required (apt-get install binutils)")
    out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return {parts[2]: int(parts[0], 16) for parts in (line.split() for line in out.splitlines())
            if len(parts) == 3 and parts[1] in "Tt"}


def test_symbol_offsets_match_nm_and_point_at_the_function_bytes(fake_lib: Path) -> None:
    wanted = ["cuMemAlloc_v2", "cuMemFree_v2", "cuLaunchKernel", "cuGraphLaunch", "cuMemCreate"]
    offsets = symbol_offsets(str(fake_lib), [*wanted, "cuNotThere"])
    nm = _nm_defined(fake_lib)
    assert set(offsets) == set(wanted)  # absent symbols are simply not returned
    # gcc -shared maps the text segment at p_vaddr == p_offset, so nm's address is the offset
    assert offsets == {name: nm[name] for name in wanted}


def test_non_elf_file_is_rejected(tmp_path: Path) -> None:
    bogus = tmp_path / "libcuda.so.1"
    bogus.write_bytes(b"not an elf file at all" * 10)
    with pytest.raises(ElfError):
        symbol_offsets(str(bogus), ["cuMemAlloc_v2"])


def test_discover_dedups_by_inode(fake_lib: Path, tmp_path: Path) -> None:
    link = tmp_path / "libcuda.so"
    link.symlink_to(fake_lib)
    copy = tmp_path / "copy" / "libcuda.so.1"
    copy.parent.mkdir()
    shutil.copy(fake_lib, copy)
    found = discover([str(fake_lib), str(link), str(copy)], proc_root=tmp_path / "no-proc")
    assert {c.inode_key for c in found} == {(os.stat(p).st_dev, os.stat(p).st_ino) for p in (fake_lib, copy)}


def test_op_names() -> None:
    assert ioctl_op_name(0x2B) == "rm_alloc"
    assert ioctl_op_name(0x29) == "rm_free"
    assert ioctl_op_name(0x99) == "esc_0x99"


def test_event_record_decodes() -> None:
    ev = layout.GwEvent(ts_ns=5, cgroup_id=77, bytes=4096, value=2, type=layout.GW_EV_OOM, tgid=10,
                        tid=11, device=layout.GW_DEV_CUDA, source=layout.GW_SRC_CUDA, kind=0,
                        comm=b"python3")
    e = KernelEvent.from_record(bytes(ev) + b"\0" * 8)
    assert (e.type, e.cgroup_id, e.size_bytes, e.tgid, e.comm, e.device, e.source) == \
        ("oom", 77, 4096, 10, "python3", None, "cuda")


def _start_in_subprocess(extra_args: list[str], as_nobody: bool) -> subprocess.CompletedProcess[str]:
    code = ("from gpuwatch.core.errors import ProbesUnavailable\n"
            "from gpuwatch.probes.manager import ProbeManager\n"
            "try:\n    ProbeManager().start()\nexcept ProbesUnavailable as e:\n    print('UNAVAILABLE', e)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def drop() -> None:
        os.setgid(65534)
        os.setuid(65534)

    return subprocess.run([sys.executable, *extra_args, "-c", code], capture_output=True, text=True,
                          env=env, cwd="/", preexec_fn=drop if as_nobody else None, timeout=60, check=False)


def test_not_root_says_what_is_off_and_the_fix() -> None:
    result = _start_in_subprocess([], as_nobody=os.geteuid() == 0)
    assert "UNAVAILABLE BPF probes off: not running as root" in result.stdout, result.stderr
    assert "NVML attribution continues" in result.stdout
    assert "fix:" in result.stdout


def test_missing_bcc_says_what_is_off_and_the_fix() -> None:
    result = _start_in_subprocess(["-S"], as_nobody=False)  # -S: no site-packages, so no bcc
    if os.geteuid() != 0:  # the root check comes first
        assert "not running as root" in result.stdout, result.stderr
        return
    assert "UNAVAILABLE BPF probes off: BCC (python3-bpfcc) is not importable" in result.stdout, result.stderr
    assert "never `pip install bcc`" in result.stdout


def test_discover_finds_copies_mapped_by_processes_and_in_container_roots(fake_lib: Path, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    # pid 10: a container whose root holds its own libcuda, which it has mapped
    root10 = tmp_path / "rootfs10"
    (root10 / "usr" / "lib").mkdir(parents=True)
    shutil.copy(fake_lib, root10 / "usr" / "lib" / "libcuda.so.1")
    (proc / "10").mkdir(parents=True)
    (proc / "10" / "root").symlink_to(root10)
    (proc / "10" / "maps").write_text(
        "7f00-7f10 r-xp 00000000 fd:00 123 /usr/lib/libcuda.so.1\n7f20-7f30 r--p 0 fd:00 9 /usr/lib/libc.so.6\n")
    # pid 11: not mapped yet, but its root filesystem ships one in a standard directory
    root11 = tmp_path / "rootfs11"
    (root11 / "usr" / "lib64").mkdir(parents=True)
    shutil.copy(fake_lib, root11 / "usr" / "lib64" / "libcuda.so.1")
    (proc / "11").mkdir()
    (proc / "11" / "root").symlink_to(root11)
    (proc / "11" / "maps").write_text("")
    (proc / "self").symlink_to(proc / "12")
    (proc / "12").mkdir()
    (proc / "12" / "root").symlink_to("/")
    found = discover([], proc_root=proc, use_ld_cache=False)
    inode = {(os.stat(p).st_dev, os.stat(p).st_ino) for p in (root10 / "usr/lib/libcuda.so.1",
                                                                 root11 / "usr/lib64/libcuda.so.1")}
    assert {c.inode_key for c in found} == inode
    assert {c.inode_key for c in discover([], proc_root=proc, use_ld_cache=False, pids=[11])} == {
        (os.stat(root11 / "usr/lib64/libcuda.so.1").st_dev, os.stat(root11 / "usr/lib64/libcuda.so.1").st_ino)}


def test_live_cgroup_ids_are_the_directory_inodes(tmp_path: Path) -> None:
    from gpuwatch.containers.cgroupfs import discover_mounts, live_cgroup_ids

    (tmp_path / "kubepods" / "pod1" / "ctr").mkdir(parents=True)
    (tmp_path / "system.slice").mkdir()
    (tmp_path / "cgroup.procs").write_text("")
    expected = {os.stat(p).st_ino for p in (tmp_path, tmp_path / "kubepods", tmp_path / "kubepods" / "pod1",
                                            tmp_path / "kubepods" / "pod1" / "ctr", tmp_path / "system.slice")}
    assert live_cgroup_ids(tmp_path) == expected
    assert live_cgroup_ids(tmp_path / "missing") == set()
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    assert discover_mounts(str(tmp_path / "proc")).unified == "/sys/fs/cgroup/unified"
