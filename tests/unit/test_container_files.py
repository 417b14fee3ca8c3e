"""gpuwatch/core/containerfile.py on fixture trees: the rights a process's status gives, refusal
when they cannot be taken, and error text that never carries a file's content."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.core.containerfile import ContainerFileError, FileRights, parse_rights, read_container_file
from gpuwatch.signals.progress import ProgressReadError, parse_progress_value
from tests.unit.proc_status import write_status

STATUS = ("Name:\tpython3\nUid:\t1000\t1001\t1002\t1003\nGid:\t2000\t2001\t2002\t2003\n"
          "Groups:\t4 24 27 \nCapEff:\t0000000000000000\n")


def test_rights_are_the_fs_ids_groups_and_effective_caps() -> None:
    assert parse_rights(STATUS) == FileRights(1003, 2003, (4, 24, 27), 0)
    assert parse_rights(STATUS.replace("CapEff:\t0000000000000000", "CapEff:\t000001ffffffffff")) == \
        FileRights(1003, 2003, (4, 24, 27), (1 << 41) - 1)
    # no Groups / CapEff line: none (fewer rights, never more); no Uid or Gid: unknown
    assert parse_rights("Uid:\t5\t5\t5\t5\nGid:\t6\t6\t6\t6\n") == FileRights(5, 6, (), 0)
    for bad in ("", "Gid:\t6\t6\t6\t6\n", "Uid:\t5\t5\nGid:\t6\t6\t6\t6\n", "Uid:\tx\tx\tx\tx\nGid:\t6\t6\t6\t6\n"):
        assert parse_rights(bad) is None, bad


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    (tmp_path / "proc" / "42").mkdir(parents=True)
    (tmp_path / "ctr").mkdir()
    (tmp_path / "proc" / "42" / "root").symlink_to(tmp_path / "ctr")
    (tmp_path / "ctr" / "loss").write_bytes(b"s3cr3t-token and more\n")
    return tmp_path / "proc"


def test_a_process_without_known_rights_is_refused(proc: Path) -> None:
    with pytest.raises(ContainerFileError) as err:  # no status file: gone
        read_container_file(str(proc), 42, "/loss", 256)
    assert err.value.reason == "pid_gone"
    (proc / "42" / "status").write_text("Name:\tjob\n")
    with pytest.raises(ContainerFileError) as err:
        read_container_file(str(proc), 42, "/loss", 256)
    assert err.value.reason == "rights"


def test_another_uid_is_read_with_its_rights_or_not_at_all(proc: Path) -> None:
    os.chmod(proc.parent / "ctr" / "loss", 0o600)  # the agent's own file, 0600
    write_status(proc / "42", uid=12345, gid=12345, cap_effective=0)
    with pytest.raises(ContainerFileError) as err:
        read_container_file(str(proc), 42, "/loss", 256)
    # root: the kernel refuses uid 12345 (EACCES); not root: the agent refuses to try
    assert err.value.reason == ("unreadable" if os.geteuid() == 0 else "rights")
    assert "s3cr3t" not in str(err.value)


def test_errors_name_the_problem_not_the_content(proc: Path) -> None:
    write_status(proc / "42")
    data = read_container_file(str(proc), 42, "/loss", 256)
    with pytest.raises(ProgressReadError) as err:
        parse_progress_value(data)
    assert err.value.reason == "garbage" and "s3cr3t" not in str(err.value)
    for content in (b"inf\n", b"12abc\n", b"\xff\xfe\n"):
        with pytest.raises(ProgressReadError) as err:
            parse_progress_value(content)
        assert content.strip().decode(errors="replace") not in str(err.value)


def test_libcuda_discovery_keeps_regular_files_only(tmp_path: Path) -> None:
    from gpuwatch.probes.libcuda import discover

    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\x7fELF")
    os.mkfifo(tmp_path / "libcuda.so.fifo")
    (tmp_path / "libcuda.so.link").symlink_to(tmp_path / "libcuda.so.fifo")
    found = discover([str(lib), str(tmp_path / "libcuda.so.fifo"), str(tmp_path / "libcuda.so.link")],
                     proc_root=tmp_path / "noproc", pids=[], use_ld_cache=False)
    assert [c.path for c in found] == [str(lib)]
