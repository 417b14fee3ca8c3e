"""The real curses screen of `gpuwatch top`, driven through tmux.

tmux gives the program a real terminal (a pty with a terminfo TERM); `send-keys` types,
`capture-pane -p` reads what is on screen. The view reads a `--snapshot-file` document,
so these tests need no GPU and no sampler. After the view exits, the pane's shell prints
`stty` modes, which shows whether the terminal was restored (canonical mode, echo).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.core import snapshot_doc as jsondoc
from gpuwatch.core.model import ContainerIdentity
from tests.conftest import need_binary
from tests.unit.test_tui_samples import GIB, sample_snapshot, usage

BANNER = "SIMULATED GPU NODE (gpuwatch sim)"
EXIT_MARK = "GPUWATCH_EXIT="


class Pane:
    """One detached tmux session on a private server socket."""

    def __init__(self, tmux: str, socket_name: str, session: str) -> None:
        self.tmux = tmux
        self.socket_name = socket_name
        self.session = session

    def cmd(self, *args: str) -> str:
        done = subprocess.run([self.tmux, "-L", self.socket_name, *args], capture_output=True, text=True,
                              timeout=10, check=True)
        return done.stdout

    def start(self, command: str, width: int = 120, height: int = 40) -> None:
        self.cmd("new-session", "-d", "-s", self.session, "-x", str(width), "-y", str(height), command)

    def keys(self, *keys: str) -> None:
        for key in keys:
            self.cmd("send-keys", "-t", self.session, key)
            time.sleep(0.05)

    def text(self) -> str:
        return self.cmd("capture-pane", "-p", "-t", self.session)

    def wait_for(self, predicate: Callable[[str], bool], what: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            screen = self.text()
            if predicate(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; screen was:\n{screen}")

    def wait_text(self, needle: str, timeout_s: float = 10.0) -> str:
        return self.wait_for(lambda s: needle in s, repr(needle), timeout_s)


@pytest.fixture
def tmux() -> str:
    return need_binary("tmux", "tmux")


@pytest.fixture
def pane(tmux: str) -> Iterator[Pane]:
    socket_name = f"gpuwatch-test-{os.getpid()}-{time.monotonic_ns()}"
    p = Pane(tmux, socket_name, "top")
    try:
        yield p
    finally:
        subprocess.run([tmux, "-L", socket_name, "kill-server"], capture_output=True, timeout=10, check=False)


@pytest.fixture
def snap_file(tmp_path: Path) -> Path:
    path = tmp_path / "snapshot.json"
    path.write_text(jsondoc.dumps(sample_snapshot()), encoding="utf-8")
    return path


def top_command(snap_file: Path, *extra: str) -> str:
    """Run top in the pane, then report its exit code and the terminal's modes."""
    argv = [sys.executable, "-m", "gpuwatch", "top", "--snapshot-file", str(snap_file), "-d", "0.2", *extra]
    modes = "stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' '"
    return (f"{shlex.join(argv)}; echo {EXIT_MARK}$?; echo MODES: $({modes}); "
            f"sleep 120")


def line_index(screen: str, needle: str) -> int:
    return next(i for i, line in enumerate(screen.splitlines()) if needle in line)


def assert_restored(screen: str, exit_code: int) -> None:
    assert f"{EXIT_MARK}{exit_code}" in screen
    modes = next(line for line in screen.splitlines() if line.startswith("MODES:")).split()
    assert "icanon" in modes and "echo" in modes, f"terminal left in raw/noecho mode: {modes}"
    assert "q quit" not in screen, "the view is still on screen after exit"


def test_live_screen_banner_rows_sort_expand_quit(pane: Pane, snap_file: Path) -> None:
    pane.start(top_command(snap_file))
    screen = pane.wait_text(BANNER)
    assert "node sim-node-1" in screen
    assert "sort MEMORY desc" in screen
    assert line_index(screen, "trainer") < line_index(screen, "server")  # 8 GiB above 2 GiB
    assert "host pid" not in screen

    pane.keys("s")  # memory -> SM%: server (90%) above trainer (70%)
    screen = pane.wait_text("sort SM% desc")
    assert line_index(screen, "server") < line_index(screen, "trainer")

    pane.keys("j", "j", "Enter")  # GPU 0 -> server -> trainer, expand it
    screen = pane.wait_text("host pid")
    trainer = line_index(screen, "trainer")
    lines = screen.splitlines()
    assert "4321" in lines[trainer + 1] and "ctr pid      1" in lines[trainer + 1]
    assert "4322" in lines[trainer + 2] and "worker" in lines[trainer + 2]

    pane.keys("q")
    screen = pane.wait_text(EXIT_MARK)
    assert_restored(pane.wait_text("MODES:"), 0)
    assert BANNER not in screen


def test_live_screen_filter_help_and_file_reread(pane: Pane, snap_file: Path) -> None:
    pane.start(top_command(snap_file))
    pane.wait_text(BANNER)
    pane.keys("/", "research", "Enter")
    screen = pane.wait_text("filter 'research'")
    assert "jupyter" in screen and "trainer" not in screen

    newcomer = usage(ContainerIdentity(runtime="containerd", cgroup_path="/kubepods/x", container_id="new1",
                                       container_name="newcomer", pod_name="late-pod",
                                       pod_namespace="research"), 1, 3 * GIB, 0.4, 2.0,
                     ((9001, 3, "late", 3 * GIB),))
    updated = sample_snapshot()
    updated = dataclasses.replace(updated, containers=(*updated.containers, newcomer))
    snap_file.write_text(jsondoc.dumps(updated), encoding="utf-8")
    pane.wait_text("newcomer")  # the document is re-read on every refresh

    pane.keys("h")
    pane.wait_text("cycle the sort key")
    pane.keys("x")
    pane.wait_for(lambda s: "cycle the sort key" not in s and "newcomer" in s, "help closed")
    pane.keys("q")
    assert_restored(pane.wait_text("MODES:"), 0)


def test_ctrl_c_restores_the_terminal(pane: Pane, snap_file: Path) -> None:
    pane.start(top_command(snap_file))
    pane.wait_text(BANNER)
    pane.keys("C-c")
    assert_restored(pane.wait_text("MODES:"), 0)


def test_resize_to_tiny_and_back_does_not_crash(pane: Pane, snap_file: Path) -> None:
    pane.start(top_command(snap_file))
    pane.wait_text(BANNER)
    for width, height in ((30, 6), (12, 2), (2, 1), (120, 40)):
        pane.cmd("resize-window", "-t", "top", "-x", str(width), "-y", str(height))
        time.sleep(0.4)
        assert EXIT_MARK not in pane.text(), f"top exited after resizing to {width}x{height}"
    screen = pane.wait_text(BANNER)
    assert "trainer" in screen
    pane.keys("q")
    assert_restored(pane.wait_text("MODES:"), 0)


def test_non_tty_output_is_the_plain_table(snap_file: Path) -> None:
    """The same command with stdout piped prints the --once table and says so on stderr."""
    done = subprocess.run([sys.executable, "-m", "gpuwatch", "top", "--snapshot-file", str(snap_file)],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert "not a terminal" in done.stderr
    assert "GPU 0" in done.stdout and "host pid    4321" in done.stdout


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def test_sigterm_restores_the_terminal(pane: Pane, snap_file: Path) -> None:
    pane.start(top_command(snap_file))
    pane.wait_text(BANNER)
    shell_pid = int(pane.cmd("display-message", "-p", "-t", "top", "#{pane_pid}").strip())
    children = _children(shell_pid)
    assert len(children) == 1, f"expected only top under the pane's shell: {children}"
    top_pid = children[0]
    assert "gpuwatch" in Path(f"/proc/{top_pid}/cmdline").read_text()
    os.kill(top_pid, signal.SIGTERM)
    assert_restored(pane.wait_text("MODES:"), 128 + signal.SIGTERM)
