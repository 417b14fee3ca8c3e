"""Reading a container's progress file through /proc/<pid>/root, on fixture trees (no root).

The fixture proc root holds <proc>/<pid>/root as a link to a directory that plays the
container's root, like the kernel's magic link; every case runs with openat2
(RESOLVE_IN_ROOT) and with the O_NOFOLLOW walk used where openat2 is missing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from gpuwatch.core.annotations import label_annotations, parse_progress_goal, parse_progress_path
from gpuwatch.signals.progress import (
    MAX_PROGRESS_BYTES,
    ProgressReadError,
    parse_progress_value,
    read_progress_file,
)
from tests.unit.proc_status import write_status

RESOLVERS = ["openat2", "walk"]


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """(proc root, container root): pid 42's root is the container root."""
    proc, ctr = tmp_path / "proc", tmp_path / "ctr"
    (proc / "42").mkdir(parents=True)
    (ctr / "train").mkdir(parents=True)
    (proc / "42" / "root").symlink_to(ctr)
    write_status(proc / "42")
    return proc, ctr


def read(proc: Path, path: str, resolver: str, pid: int = 42) -> bytes:
    return read_progress_file(str(proc), pid, path, resolver=resolver)


def reason(proc: Path, path: str, resolver: str, pid: int = 42) -> str:
    with pytest.raises(ProgressReadError) as err:
        parse_progress_value(read(proc, path, resolver, pid))
    return err.value.reason


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_a_value_is_read_from_inside_the_container(tree: tuple[Path, Path], resolver: str) -> None:
    proc, ctr = tree
    (ctr / "train" / "loss").write_text("0.25\n")
    assert parse_progress_value(read(proc, "/train/loss", resolver)).value == 0.25
    (ctr / "train" / "loss").write_text("  1.5e-3 1700000000.5 step=12\nmore lines\n")
    assert parse_progress_value(read(proc, "/train/loss", resolver)).value == 0.0015


@pytest.mark.parametrize("resolver", RESOLVERS)
@pytest.mark.parametrize(("content", "why"), [
    (b"", "empty"), (b"\n  \n", "empty"), (b"loss", "garbage"), (b"nan\n", "garbage"), (b"inf", "garbage"),
    (b"0.5\xff\n", "garbage"), (b"\x00\x00\x00", "garbage"), (b"1.2.3\n", "garbage"), (b"1e\n", "garbage"),
])
def test_garbage_and_empty_files_are_errors(tree: tuple[Path, Path], resolver: str, content: bytes,
                                            why: str) -> None:
    proc, ctr = tree
    (ctr / "train" / "loss").write_bytes(content)
    assert reason(proc, "/train/loss", resolver) == why


def test_a_value_without_the_newline_this_writer_uses_is_partial() -> None:
    assert parse_progress_value(b"0.12", expect_newline=False).value == 0.12
    with pytest.raises(ProgressReadError) as err:
        parse_progress_value(b"0.12", expect_newline=True)  # "0.1234\n" caught half written
    assert err.value.reason == "partial"
    assert parse_progress_value(b"0.1234\n", expect_newline=True).value == 0.1234


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_size_is_bounded(tree: tuple[Path, Path], resolver: str) -> None:
    proc, ctr = tree
    (ctr / "train" / "big").write_bytes(b"1" * 10_000_000)
    assert reason(proc, "/train/big", resolver) == "too_large"
    exact = b"0.75" + b" " * (MAX_PROGRESS_BYTES - 5) + b"\n"
    assert len(exact) == MAX_PROGRESS_BYTES
    (ctr / "train" / "exact").write_bytes(exact)
    assert parse_progress_value(read(proc, "/train/exact", resolver)).value == 0.75
    (ctr / "train" / "over").write_bytes(exact + b" ")
    assert reason(proc, "/train/over", resolver) == "too_large"


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_symlinks_never_lead_out_of_the_container_root(tree: tuple[Path, Path], tmp_path: Path,
                                                        resolver: str) -> None:
    proc, ctr = tree
    secret = tmp_path / "host-secret"
    secret.write_text("123456\n")
    (ctr / "train" / "abs").symlink_to(secret)  # absolute host path
    (ctr / "train" / "rel").symlink_to("../../host-secret")  # climbs out of ctr
    (ctr / "train" / "deep").symlink_to("../../../../../../../../../../" + str(secret).lstrip("/"))
    (ctr / "escape").symlink_to(tmp_path)  # a directory link on the way
    for path in ("/train/abs", "/train/rel", "/train/deep", f"/escape/{secret.name}"):
        with pytest.raises(ProgressReadError) as err:
            read(proc, path, resolver)
        # openat2 resolves them inside the container root (no such file there); the walk
        # refuses every symlink
        assert err.value.reason == ("missing" if resolver == "openat2" else "symlink"), (path, err.value)


def test_a_symlink_inside_the_container_works_with_openat2_only(tree: tuple[Path, Path]) -> None:
    proc, ctr = tree
    (ctr / "data").mkdir()
    (ctr / "data" / "value").write_text("0.5\n")
    (ctr / "train" / "link").symlink_to("/data/value")  # absolute: "/" is the container's root
    assert parse_progress_value(read(proc, "/train/link", "openat2")).value == 0.5
    assert reason(proc, "/train/link", "walk") == "symlink"


def test_magic_links_are_refused(tmp_path: Path) -> None:
    # this process's own root is "/", whose /proc holds magic links (fd, cwd, root) that
    # would lead anywhere: RESOLVE_NO_MAGICLINKS refuses them
    target = tmp_path / "value"
    target.write_text("7\n")
    fd = os.open(target, os.O_RDONLY)
    try:
        pid = os.getpid()
        for path in (f"/proc/{pid}/fd/{fd}", f"/proc/{pid}/cwd/{target}", "/proc/self/root/etc/hostname"):
            with pytest.raises(ProgressReadError) as err:
                read_progress_file("/proc", os.getpid(), path, resolver="openat2")
            assert err.value.reason == "symlink", path
        data = read_progress_file("/proc", os.getpid(), str(target), resolver="openat2")
        assert parse_progress_value(data).value == 7
    finally:
        os.close(fd)


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_vanished_pid_missing_file_and_directories(tree: tuple[Path, Path], resolver: str) -> None:
    proc, ctr = tree
    assert reason(proc, "/train/loss", resolver, pid=4242) == "pid_gone"
    assert reason(proc, "/train/none", resolver) == "missing"
    assert reason(proc, "/nowhere/none", resolver) == "missing"
    (ctr / "train" / "file").write_text("1\n")
    assert reason(proc, "/train/file/below", resolver) == "missing"
    assert reason(proc, "/train", resolver) == "not_regular"


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_a_fifo_is_refused_without_blocking(tree: tuple[Path, Path], resolver: str) -> None:
    proc, ctr = tree
    os.mkfifo(ctr / "train" / "pipe")
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(reason(proc, "/train/pipe", resolver)), daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(5)
    assert result == ["not_regular"] and time.monotonic() - start < 2


@pytest.mark.skipif(os.geteuid() != 0, reason="root reads any mode")
@pytest.mark.parametrize("resolver", RESOLVERS)
def test_device_files_are_refused(tree: tuple[Path, Path], resolver: str) -> None:
    proc, ctr = tree
    os.mknod(ctr / "train" / "zero", 0o644 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
    assert reason(proc, "/train/zero", resolver) == "not_regular"


def test_the_annotation_vocabulary() -> None:
    assert parse_progress_path("/train/loss") == "/train/loss"
    assert parse_progress_path(" //train/./loss/ ") == "/train/loss"
    for bad in ("train/loss", "/train/../etc/passwd", "/", "", "/a\0b", "/" + "x" * 2000, 5, None):
        assert parse_progress_path(bad) is None, bad
    assert parse_progress_goal(" Maximize ") == "maximize"
    assert parse_progress_goal("lower") is None
    pairs, problems = label_annotations({"gpuwatch.io/progress-file": "/out//loss",
                                            "gpuwatch.io/progress-goal": "MINIMIZE", "other": "x"})
    assert pairs == (("gpuwatch.io/progress-file", "/out/loss"), ("gpuwatch.io/progress-goal", "minimize"))
    assert problems == ()
    pairs, problems = label_annotations({"gpuwatch.io/progress-file": "../loss",
                                            "gpuwatch.io/progress-goal": "up"})
    assert pairs == () and len(problems) == 2
    assert label_annotations({}) == ((), ())
