"""NVML sample recording and replay (gpuwatch/sim/RECORDING.md, issue 17 item 4).

Recorded on the simulated node: `gpuwatch sim record-nvml` (pynvml against the fake NVML)
runs while simworkers run kernels on two GPUs (two time-slicing GPU 0, one on GPU 1). The file
is then replayed through the fake NVML (`set_nvml_replay`, time-shifted to now) under the
agent's NVML backend, swept every half second in a child process (NVML state is
process-global). Checked: the backend's kernel seconds per (GPU, pid) equal the integral of
the recorded samples (smUtil x the sample period, over the samples after the backend's
baseline read -- its first read of a device charges nothing; here the GPUs are still idle then,
so every replayed sample counts -- up to its last read), and the
replayed process lists name the recorded pids. The recording itself is checked for the
real driver's shape: samples only for the periods a process ran, overlapping timestamps
on the shared GPU, lastSeen advancing, NOT_FOUND before any kernel ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from gpuwatch.sim import SimNode, sim_env
from gpuwatch.sim.node import set_nvml_replay
from gpuwatch.sim.nvml_replay import compile_recording, integrate_recording, load_recording
from tests.system.sim_helpers import private_node

pytestmark = pytest.mark.slow

WORKERS = ((0, 0.3), (0, 0.5), (1, 0.2))  # (gpu, duty)
LIFETIME_S = 6.0

SWEEPER = r'''
import json, sys, time
from gpuwatch.gpu.nvml import NvmlBackend
library, until = sys.argv[1], float(sys.argv[2])
backend = NvmlBackend(library_path=library)
seconds, listed, baseline = {}, {}, None
while time.time() < until:
    sweep = backend.sweep()
    for p in sweep.processes:
        key = f"{p.gpu_index}:{p.pid}"
        seconds[key] = seconds.get(key, 0.0) + (p.kernel_seconds or 0.0)
        if p.memory_bytes is not None:
            listed[key] = p.memory_bytes
    if baseline is None:  # after the first (baseline) read: the newest timestamp it saw (private probe)
        baseline = {d.index: d.util_timeline.newest_us for d in backend._devices}
    time.sleep(0.5)
final = {d.index: d.util_timeline.newest_us for d in backend._devices}
print(json.dumps({"seconds": seconds, "listed": listed, "baseline": baseline, "final": final}))
'''


def record(node: SimNode, out: Path) -> None:
    workers = " & ".join(f"{node.libraries.worker_path} --gpu {gpu} --mib-per-step 64 --duty {duty} "
                         f"--kernel-ms 10 --lifetime-s {LIFETIME_S} >/dev/null" for gpu, duty in WORKERS)
    env = sim_env(node, dict(os.environ))
    subprocess.run([sys.executable, "-m", "gpuwatch", "sim", "record-nvml", "--out", str(out), "--interval-s", "0.5",
                    "--", "/bin/sh", "-c", f"sleep 0.5; {workers} & wait"], env=env, check=True, timeout=60)


def test_record_on_the_sim_then_replay_under_the_agent(tmp_path: Path) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=8 << 30) as node:
        rec_path = tmp_path / "recording.jsonl"
        record(node, rec_path)
        lines = [json.loads(x) for x in rec_path.read_text().splitlines()]
        assert lines[0]["kind"] == "header" and len(lines[0]["devices"]) == 2
        assert lines[-1] == {"kind": "end", "t": lines[-1]["t"], "rc": 0}
        reads = [x for x in lines if x["kind"] == "ProcessUtilization"]
        assert reads[0]["rc"] == "NOT_FOUND" and reads[0]["last_seen_us"] == 0  # nothing ran yet
        assert any(x["last_seen_us"] > 0 for x in reads)  # lastSeen advances with the samples
        rec = load_recording(rec_path)
        by_time: dict[tuple[int, int], set[int]] = defaultdict(set)
        for s in rec.samples:
            by_time[(s.gpu, s.timestamp_us)].add(s.pid)
            assert 0 < s.sm_percent <= 100
        assert max(len(p) for (g, _), p in by_time.items() if g == 0) == 2  # overlapping on the shared GPU
        assert max(len(p) for (g, _), p in by_time.items() if g == 1) == 1
        for (g, _), pids in by_time.items():  # a period's shares add up to at most the period
            assert sum(s.sm_percent for s in rec.samples if s.gpu == g and s.pid in pids
                       and (s.gpu, s.timestamp_us) == (g, _)) <= 101
        recorded_pids = {s.pid for s in rec.samples}
        assert len(recorded_pids) == len(WORKERS)

        compiled = tmp_path / "replay.bin"
        info = compile_recording(rec_path, compiled)
        assert info.devices == 2 and info.samples == len(rec.samples)
        origin_s = time.time() + 1.0  # the backend's first sweeps see an idle GPU (NOT_FOUND)
        set_nvml_replay(node, compiled, origin_s)
        env = {**os.environ, "GPUWATCH_SIM_STATE": str(node.state_path)}
        env.pop("LD_LIBRARY_PATH", None)
        out = subprocess.run([sys.executable, "-c", SWEEPER, str(node.libraries.nvml_path),
                              str(origin_s + info.duration_s + 1.0)],
                             env=env, capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        set_nvml_replay(node, None)

    origin_us, start_us = round(origin_s * 1e6), round(rec.started_s * 1e6)

    def recorded(ts: dict[str, int]) -> dict[int, int]:  # replayed timestamp -> recorded clock
        return {int(gpu): t - origin_us + start_us for gpu, t in ts.items()}

    expected = integrate_recording(rec, after_us=recorded(got["baseline"]), until_us=recorded(got["final"]))
    agent = {(int(k.split(":")[0]), int(k.split(":")[1])): v for k, v in got["seconds"].items() if v > 0}
    print("\n(gpu, pid): integral of the recorded samples vs the agent's NVML backend")
    for key in sorted(set(expected) | set(agent)):
        print(f"  {key}: recorded {expected.get(key, 0.0):.4f} s  agent {agent.get(key, 0.0):.4f} s")
    assert set(agent) == set(expected)
    for key, want in expected.items():
        assert want > 0.2, f"{key}: too little replayed work to compare ({want:.3f} s)"
        assert agent[key] == pytest.approx(want, rel=0.01, abs=0.005), key
    listed = {int(k.split(":")[1]) for k in got["listed"]}
    assert recorded_pids <= listed  # the replayed process lists name the recorded pids
