"""The README's main job: `gpuwatch quickstart` on a host without GPUs.

It must say it is a simulation, show the three demo pods with their memory and PIDs, serve
metrics meanwhile, and leave nothing behind (containers, cgroups, sim state, temp dirs).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import need_binary, need_root
from tests.system.promstack import free_port


def _leftovers() -> set[str]:
    return set(glob.glob("/tmp/gpuwatch-quickstart-*")) | set(glob.glob("/dev/shm/gpuwatch-sim-quickstart"))


def test_quickstart_simulates_three_pods_and_cleans_up() -> None:
    need_root()
    need_binary("runc", "runc")
    before = _leftovers()
    env = {k: v for k, v in os.environ.items() if k not in ("GPUWATCH_NVML_LIBRARY", "GPUWATCH_SIM_STATE")}
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "quickstart", "--simulate", "--duration", "3",
         f"--listen=127.0.0.1:{port}"],
        env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "SIMULATED GPU node" in proc.stderr
    assert "SIMULATED GPU NODE" in proc.stdout
    for pod, memory in (("trainer-0", "20.0 GiB"), ("notebook-1", "8.0 GiB"), ("server-0", "12.0 GiB")):
        line = next((ln for ln in proc.stdout.splitlines() if pod in ln), "")
        assert memory in line, proc.stdout
        assert "/1" in line, f"host/container PIDs missing: {line}"
    assert f"127.0.0.1:{port}/metrics" in proc.stderr
    assert _leftovers() == before, "quickstart left files behind"
    assert not Path("/run/gpuwatch-sim/quickstart").exists()
    stray = subprocess.run(["pgrep", "-f", "gpuwatch sim run --name quickstart"], capture_output=True, text=True,
                           check=False)
    assert stray.stdout.strip() == "", f"workloads still running: {stray.stdout}"
