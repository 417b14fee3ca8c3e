"""The README's main job: `gpuwatch quickstart` on a host without GPUs.

It must say it is a simulation, show the three demo pods with their memory and PIDs, serve
metrics meanwhile, run the kernel probes where the host supports them (and say why not where
it does not), throttle the trainer pod under the demo policy with its STATE shown, point at
`gpuwatch trace`, and leave nothing behind (containers, cgroups, sim state, temp dirs).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from gpuwatch.sim.demo import DEFAULT_WORKLOADS
from tests.conftest import need_binary, need_root
from tests.system.promstack import free_port
from tests.system.sim_helpers import CONTEXT_BYTES, GIB, MIB


def _leftovers() -> set[str]:
    return set(glob.glob("/tmp/gpuwatch-quickstart-*")) | set(glob.glob("/dev/shm/gpuwatch-sim-quickstart"))


def _pod_line(stdout: str, pod: str) -> str:
    """The table row of a pod (not a note that names it)."""
    return next((ln for ln in stdout.splitlines() if pod in ln and not ln.startswith("note:")), "")


def _bcc_importable() -> bool:
    return importlib.util.find_spec("bcc") is not None


def test_quickstart_simulates_three_pods_with_probes_and_enforcer_and_cleans_up() -> None:
    need_root()
    need_binary("runc", "runc")
    before = _leftovers()
    env = {k: v for k, v in os.environ.items() if k not in ("GPUWATCH_NVML_LIBRARY", "GPUWATCH_SIM_STATE")}
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "quickstart", "--simulate", "--duration", "8",
         f"--listen=127.0.0.1:{port}"],
        env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "SIMULATED GPU node" in proc.stderr
    assert "SIMULATED GPU NODE" in proc.stdout
    # each pod's one process: what it allocated (20, 8, 12 GiB) and its CUDA context's 518 MiB
    shown = {w.pod: f"{(w.memory_mib * MIB + CONTEXT_BYTES) / GIB:.1f} GiB" for w in DEFAULT_WORKLOADS}
    assert shown == {"trainer-0": "20.5 GiB", "notebook-1": "8.5 GiB", "server-0": "12.5 GiB"}
    for pod, memory in shown.items():
        line = _pod_line(proc.stdout, pod)
        assert memory in line, proc.stdout
        assert "/1" in line, f"host/container PIDs missing: {line}"
    assert f"127.0.0.1:{port}/metrics" in proc.stderr
    # the probes: on where BCC is there (this host), else off with the agent's reason
    if _bcc_importable():
        assert "kernel probes: ON" in proc.stderr, proc.stderr
        assert "gpuwatch trace" in proc.stderr
        assert "note: kernel probes ON" in proc.stdout  # the view itself says so too
        trainer = _pod_line(proc.stdout, "trainer-0")
        assert "ioctl " in trainer and "alloc " in trainer, f"no probe counts for the trainer: {trainer}"
    else:
        assert "kernel probes: OFF -- " in proc.stderr and "BCC" in proc.stderr, proc.stderr
    # the enforcer under deploy/policies/demo.yaml: the trainer (60% busy, 30% allowed) is
    # throttled and says so; the others run
    assert "enforcer: ON with deploy/policies/demo.yaml" in proc.stderr, proc.stderr
    assert "note: enforcer ON" in proc.stdout
    states = {pod: _pod_line(proc.stdout, pod) for pod in ("trainer-0", "notebook-1", "server-0")}
    assert "throttled to 30%" in states["trainer-0"], proc.stdout
    assert "running" in states["notebook-1"] and "running" in states["server-0"], proc.stdout
    assert _leftovers() == before, "quickstart left files behind"
    assert not Path("/run/gpuwatch-sim/quickstart").exists()
    stray = subprocess.run(["pgrep", "-f", "gpuwatch sim run --name quickstart"], capture_output=True, text=True,
                           check=False)
    assert stray.stdout.strip() == "", f"workloads still running: {stray.stdout}"
