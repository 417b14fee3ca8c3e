"""`gpuwatch top --once` against the real simulated node with three runc pods.

The command runs as its own process (as a user would run it), pointed at the sim's fake
libnvidia-ml.so.1 with --nvml-library. The pods are real runc containers in kubepods
cgroups running simulated GPU workloads with known memory; `top` must list each with its
host PID, its PID inside the container (NSpid) and exactly the memory NVML counts for it:
what it allocated plus its CUDA context's own memory (518 MiB, as on the H100).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import need_root
from tests.system.sim_helpers import CONTEXT_BYTES

MIB = 1 << 20


@pytest.fixture
def node(tmp_path: Path, runc_required: str) -> Iterator[object]:
    need_root()
    from tests.system.demo_node import demo_node

    with demo_node(tmp_path) as demo:
        yield demo


def run_top(demo: object, *args: str) -> subprocess.CompletedProcess[str]:
    sim = demo.sim  # type: ignore[attr-defined]
    env = dict(os.environ, GPUWATCH_SIM_STATE=str(sim.state_path))
    env.pop("LD_LIBRARY_PATH", None)  # the library comes from --nvml-library, nothing else
    argv = [sys.executable, "-m", "gpuwatch", "top", "--once", "--nvml-library",
            str(sim.libraries.nvml_path), "--node", "sim-test", "-d", "0.5", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_once_json_lists_each_pod_with_host_and_container_pids(node: object) -> None:
    from gpuwatch.sim import demo as simdemo

    done = run_top(node, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["node"] == "sim-test" and doc["simulated"] is True and doc["gpu_up"] is True
    assert len(doc["devices"]) == 2
    by_id = {c["identity"]["container_id"]: c for c in doc["containers"] if c["identity"]["container_id"]}
    workloads = {w.container: w for w in simdemo.DEFAULT_WORKLOADS}
    for container in node.containers:  # type: ignore[attr-defined]
        entry = by_id.get(container.id)
        assert entry is not None, f"{container.id} missing from {sorted(by_id)}"
        workload = workloads[container.name]
        assert entry["gpu_index"] == workload.gpu
        assert entry["memory_bytes"] == CONTEXT_BYTES + workload.memory_mib * MIB  # one process, one context
        pids = {(p["pid"], p["container_pid"]) for p in entry["processes"]}
        assert pids, f"no processes listed for {container.name}"
        in_cgroup = set(container.pids())
        assert {p for p, _ in pids} <= in_cgroup, (pids, in_cgroup)
        assert all(c == _ns_pid(p) for p, c in pids), f"container PIDs are not the NSpid ones: {pids}"
        assert all(c != p for p, c in pids)  # a separate PID namespace: the numbers differ


def test_once_table_shows_pids_and_the_simulation_banner(node: object) -> None:
    done = run_top(node)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "SIMULATED GPU NODE (gpuwatch sim)" in text
    assert text.count("\nGPU ") == 2
    for container in node.containers:  # type: ignore[attr-defined]
        lines = text.splitlines()
        row = next((i for i, line in enumerate(lines) if container.id[:12] in line
                    or container.name in line.split()), None)
        assert row is not None, f"no row for {container.name} ({container.id[:12]}):\n{text}"
        for pid in container.pids():
            if f"host pid {pid:>7}  ctr pid {_ns_pid(pid):>6}" in text:
                break
        else:
            raise AssertionError(f"no process line with host and container pid for {container.name}:\n{text}")


def _ns_pid(pid: int) -> int:
    """The PID inside the process's own namespace (last NSpid field)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid for {pid}")


def test_live_screen_on_the_simulated_node(node: object, tmp_path: Path) -> None:
    """The curses view fed by the real sampler (NVML via the sim's library) in a real terminal."""
    import shlex

    from tests.system.test_top_screen import BANNER, Pane, assert_restored, need_binary

    tmux = need_binary("tmux", "tmux")
    sim = node.sim  # type: ignore[attr-defined]
    argv = [sys.executable, "-m", "gpuwatch", "top", "--nvml-library", str(sim.libraries.nvml_path),
            "--node", "sim-live", "-d", "0.5"]
    modes = "stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' '"
    command = (f"env GPUWATCH_SIM_STATE={shlex.quote(str(sim.state_path))} {shlex.join(argv)}; "
               f"echo GPUWATCH_EXIT=$?; echo MODES: $({modes}); sleep 120")
    pane = Pane(tmux, f"gpuwatch-simtest-{os.getpid()}", "top")
    try:
        pane.start(command)
        screen = pane.wait_text(BANNER, timeout_s=20)
        assert "node sim-live" in screen
        containers = node.containers  # type: ignore[attr-defined]
        screen = pane.wait_for(lambda s: all(c.id[:12] in s or c.name in s for c in containers),
                               "a row per pod", timeout_s=20)
        assert screen.count("GPU 0") == 1 and "GPU 1" in screen
        pane.keys("j", "Enter")  # first container under GPU 0: its processes with both PIDs
        screen = pane.wait_text("host pid", timeout_s=10)
        first = containers[0] if containers[0].name == "trainer" else next(c for c in containers
                                                                           if c.name == "trainer")
        assert any(f"host pid {pid:>7}  ctr pid {_ns_pid(pid):>6}" in screen for pid in first.pids()), screen
        pane.keys("q")
        assert_restored(pane.wait_text("MODES:", timeout_s=10), 0)
    finally:
        subprocess.run([tmux, "-L", pane.socket_name, "kill-server"], capture_output=True, timeout=10, check=False)
