"""`gpuwatch sim` end to end: the Python workload's patterns, progress and checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuwatch.sim import status
from tests.system.sim_helpers import CONTEXT_BYTES, GIB, MIB, private_node, sim_run_argv, workers


def _run_argv(node_name: str, *args: str) -> list[str]:
    return sim_run_argv(*args, name=node_name)


def test_help_explains_the_simulation() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "sim", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for word in ("up", "down", "status", "fault", "run", "gpuwatch-sim"):
        assert word in out


def test_up_status_down_round_trip(tmp_path: Path) -> None:
    name = f"t{os.getpid()}-cli"
    env = dict(os.environ, GPUWATCH_SIM_ROOT=str(tmp_path / "root"))
    cli = [sys.executable, "-m", "gpuwatch", "sim"]
    try:
        up = subprocess.run(
            [*cli, "up", "--name", name, "--devices", "3", "--memory", "2GiB"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert up.returncode == 0, up.stderr
        st = subprocess.run([*cli, "status", "--name", name], env=env, capture_output=True, text=True, check=False)
        assert st.returncode == 0, st.stderr
        assert st.stdout.count("gpuwatch-sim H100 80GB HBM3") == 3
        assert "0.00 / 2.00 GiB  util 0%" in st.stdout
    finally:
        down = subprocess.run([*cli, "down", "--name", name], env=env, capture_output=True, text=True, check=False)
    assert down.returncode == 0 and "down" in down.stdout
    assert not Path(f"/dev/shm/gpuwatch-sim-{name}").exists()


def test_hold_pattern_reports_progress_and_checkpoints_on_signal(tmp_path: Path) -> None:
    marker = tmp_path / "ckpt"
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node, workers(node) as w:
        proc = w.start(
            argv=_run_argv(
                node.name,
                "--mib-per-step",
                "64",
                "--steps",
                "2",
                "--interval-s",
                "0.05",
                "--duty",
                "0.5",
                "--kernel-ms",
                "5",
                "--checkpoint-marker",
                str(marker),
            )
        )
        ready = w.wait_line(proc, "ready")
        assert int(ready[2]) == 128 * MIB
        progress_file = node.progress_dir / str(proc.pid)
        deadline = time.monotonic() + 5
        while not progress_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        first = int(progress_file.read_text().split()[0])
        time.sleep(1.2)
        second = int(progress_file.read_text().split()[0])
        assert second > first
        held = {p.host_pid: p.memory_bytes for p in status(node).processes}
        assert held == {proc.pid: CONTEXT_BYTES + 128 * MIB}  # NVML's: the context's memory and the steps'
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=10) == 0
        checkpoint = w.wait_line(proc, "checkpoint")
        assert int(marker.read_text()) == int(checkpoint[1]) >= second
        assert status(node).processes == ()
        assert not progress_file.exists()  # removed on a clean exit


def test_leak_pattern_runs_into_oom(tmp_path: Path) -> None:
    # 1 GiB of room beside the workload's context (its memory counts against the device)
    with private_node(tmp_path, devices=1, memory_bytes=CONTEXT_BYTES + GIB) as node, workers(node) as w:
        proc = w.start(
            argv=_run_argv(node.name, "--leak", "--mib-per-step", "300", "--steps", "0", "--interval-s", "0.01")
        )
        assert proc.wait(timeout=20) == 2
        oom = w.wait_line(proc, "oom")
    assert int(oom[2]) == 900 * MIB  # three steps fit into the 1 GiB left beside the context, the fourth does not


def test_free_pattern_returns_memory(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB) as node, workers(node) as w:
        proc = w.start(
            argv=_run_argv(node.name, "--free", "--mib-per-step", "100", "--steps", "3", "--interval-s", "0.3")
        )
        # the device's used memory over time: the context's alone, with a step, then
        # back to the context's (the process lives on after its steps, holding its context)
        seen: list[int] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            seen.append(status(node).devices[0].memory_used_bytes)
            stepped = CONTEXT_BYTES + 100 * MIB in seen
            if proc.poll() is not None or (stepped and seen[-1] == CONTEXT_BYTES):
                break
            time.sleep(0.05)
        ready = w.wait_line(proc, "ready")
    assert CONTEXT_BYTES + 100 * MIB in seen
    assert seen[-1] == CONTEXT_BYTES  # the step's memory returned
    assert int(ready[2]) == 0
