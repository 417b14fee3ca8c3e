"""The job model of `gpuwatch sim run` that bench_sharing's realistic mixes use: a training
job's GPU-idle phases (input wait at its --duty, a pause every --pause-every-s GPU-seconds),
memory grown while it warms up and then held (a caching allocator's plateau), progress that
follows the GPU work done -- checked on the simulated GPU.

1 GPU-second of work at duty 0.5 with a 0.3 s pause after every 0.3 GPU-seconds: ~1 s of
kernels, ~1 s of input gaps and 3 pauses (0.9 s) -- ~2.9 s of wall time. Its memory, seen by
the simulated NVML, grows in 3 steps 0.25 s apart from the context's 518 MiB and plateaus."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from gpuwatch.sim.node import status
from tests.system.sim_helpers import GIB, private_node, workers
from tests.system.test_sim_progress_job import Job

MIB = 1 << 20


# spin: each kernel burns its host thread; sleep: it sleeps (bench_sharing's node) -- the duty
# schedule counts a launch as at least its kernel, so the phases are the same
@pytest.mark.parametrize("kernel_host", ["spin", "sleep"])
def test_phases_duty_pauses_and_memory_warm_up(tmp_path: Path, kernel_host: str) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=GIB, kernel_host=kernel_host) as node, workers(node) as w:
        t0 = time.monotonic()
        job = Job(w, "--mib-per-step", "64", "--steps", "3", "--interval-s", "0.25", "--hold", "--duty", "0.5",
                  "--kernel-ms", "10", "--work-s", "1.0", "--pause-every-s", "0.3", "--pause-s", "0.3",
                  "--context-mib", "518", "--progress-curve", "exp", "--progress-rate", "1",
                  "--progress-file", str(tmp_path / "loss"))
        used: list[tuple[float, int]] = []
        while job.proc.poll() is None and time.monotonic() - t0 < 30:
            used.append((time.monotonic() - t0, status(node).devices[0].memory_used_bytes))
            time.sleep(0.05)
        assert job.finish() == 0
    words = dict(part.split("=") for part in job.at("phases")[1][1:])
    gpu_s, input_s, pause_s = float(words["gpu"]), float(words["input"]), float(words["pause"])
    wall_s = job.at("done")[0] - t0  # ("ready" comes after the warm-up steps, which work already)
    print(f"\n{kernel_host}: phases gpu {gpu_s:.2f} s, input {input_s:.2f} s, pause {pause_s:.2f} s; "
          f"wall {wall_s:.2f} s; "
          f"memory MiB {sorted({u // MIB for _, u in used})}")
    assert 0.95 <= gpu_s <= 1.6  # the kernels (longer when the host CPU is busy)
    assert 0.6 <= input_s / gpu_s <= 1.4  # duty 0.5: as long waiting for input as on the GPU
    assert 0.85 <= pause_s <= 1.1  # 3 pauses of 0.3 s (after 0.3, 0.6 and 0.9 GPU-s)
    assert wall_s >= 2.6
    # memory: context, then three 64 MiB steps while working, then a plateau until the end
    levels = sorted({u // MIB for _, u in used if u})
    assert levels[-1] == 518 + 3 * 64 and len(levels) >= 3, levels  # grew in steps (0.25 s apart) to the plateau
    grown = [t for t, u in used if u // MIB == levels[-1]]
    assert grown and grown[-1] - grown[0] >= 1.5, "the footprint plateaus for the rest of the job"
    # progress follows the work done: the final loss is the curve at 1 GPU-second
    assert abs(float((tmp_path / "loss").read_text()) - math.exp(-1.0)) < 1e-8
