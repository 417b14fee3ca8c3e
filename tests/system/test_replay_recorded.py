"""Record, then replay under the real probes (issue 11, item 3, on the simulated node).

The CUDA exercise program (gpuwatch/sim/csrc/cuda_exercise.c) runs on the simulated node
under the ioctl recorder; the trace it leaves is replayed by `gpuwatch sim replay
--pause-at-checkpoints` on a fresh set of device nodes, in a cgroup of its own, with the
probes attached. At every checkpoint the probes' live bytes per GPU (the agent's reader)
must equal the NVML per-process number recorded there -- the path the real-GPU traces
under tests/fixtures/traces/real/ take in test_probes_rm_model.py. Managed memory is
RM-free in the driver and in the sim (nvidia-uvm chunks): NVML does not count it in a
process's used memory (the H100: 518 MiB before, with and after the exercise's 64 MiB
managed range), so the probes and NVML agree at the managed checkpoints too.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim import sim_env
from gpuwatch.sim.node import driver_env
from gpuwatch.sim.tracefile import read_trace
from tests.conftest import need_bcc
from tests.system.sim_helpers import cgroup2_root, private_node
from tests.system.test_recorder import Programs, programs, recorder_env  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture(scope="module")
def replay_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_bcc()
    root = tmp_path_factory.mktemp("replayroot")
    (root / "dev").mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm"):
        os.mknod(root / "dev" / name, 0o666 | 0o020000, os.makedev(1, 3))
    return root


@pytest.fixture(scope="module")
def manager(replay_root: Path) -> Iterator[ProbeManager]:
    with ProbeManager(ProbeConfig(device_prefix=str(replay_root / "dev" / "nvidia"), alloc_uprobes=False,
                                  scan_all_processes=False)) as pm:
        yield pm


def _record(tmp_path: Path, programs: Programs, **mode: object) -> Path:  # noqa: F811
    with private_node(tmp_path, devices=2, rm_device_handles=True) as node:
        env = sim_env(node, dict(os.environ))
        env.update(driver_env(**mode))  # type: ignore[arg-type]
        trace_dir = tmp_path / "traces"
        env = recorder_env(env, programs, trace_dir, f"{node.root}/dev/nvidia")
        proc = subprocess.run([str(programs.exercise), "--device", "1"], env=env, capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (trace,) = trace_dir.glob("*.jsonl")
    return trace


@pytest.mark.parametrize("mode", [
    {"alloc_path": "rm-alloc", "suballoc_mib": 0, "context_mib": 0},
    {"alloc_path": "vid-heap", "suballoc_mib": 16, "context_mib": 5},
    {},  # the stub's defaults: real CUDA's shape (518 MiB context, 2 MiB carving, pools, VMM)
], ids=["rm-alloc", "vid-heap-suballoc-context", "defaults"])
def test_recorded_trace_replayed_under_the_probes_matches_nvml(
        tmp_path: Path, programs: Programs, replay_root: Path, manager: ProbeManager,  # noqa: F811
        mode: dict[str, object]) -> None:
    trace = _record(tmp_path, programs, **mode)
    checkpoints = read_trace(trace).checkpoints()
    assert len(checkpoints) >= 10
    cgroup = cgroup2_root() / f"gpuwatch-test-replay-{os.getpid()}-{mode.get('alloc_path', 'default')}"
    cgroup.mkdir()
    procs = str(cgroup / "cgroup.procs")

    def enter() -> None:
        with open(procs, "w") as f:
            f.write("0")

    replay = subprocess.Popen([sys.executable, "-m", "gpuwatch", "sim", "replay", str(trace), "--sim-root",
                               str(replay_root), "--pause-at-checkpoints"], preexec_fn=enter, cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    compared = []
    try:
        assert replay.stdout is not None and replay.stdin is not None
        while True:
            ready, _, _ = select.select([replay.stdout], [], [], 30.0)
            assert ready, "replay stalled"
            line = replay.stdout.readline()
            if not line:
                break
            cp = json.loads(line)
            found = [c for c in manager.read() if c.cgroup_id == cgroup.stat().st_ino]
            live = dict(found[0].allocated_bytes_by_gpu) if found else {}
            for gpu in cp["nvml"]:
                nvml = gpu["process_used_bytes"] or 0
                probe = live.get(gpu["minor"], 0)
                # managed checkpoints included: neither NVML nor RM counts the managed range
                assert probe == nvml, (cp["checkpoint"], gpu["minor"], probe, nvml)
            assert live.get(-1, 0) == 0, cp["checkpoint"]
            compared.append(cp["checkpoint"])
            replay.stdin.write("\n")
            replay.stdin.flush()
        _, err = replay.communicate(timeout=30)
        assert replay.returncode == 0, err
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.wait()
        cgroup.rmdir()
    assert compared == [c.name for c in checkpoints]
