"""Progress input end to end: runc pods declare their evaluation function by annotation, run
`gpuwatch sim run` with a progress model on one contended simulated GPU, and the real agent
serves gpuwatch_container_progress / _rate read through /proc/<pid>/root.

The jobs write /tmp/loss inside their containers: /tmp there is the container's own tmpfs,
invisible on the host at that path, so only a read through the container's root finds it.
Two pods share GPU 0 with duties 1.0 and 0.25 (the time-sliced engine gives ~0.75 and ~0.25);
both follow the same linear curve loss = 1 - K * work, so:
* the value follows the curve of each pod's own GPU time (kernel seconds);
* the rate per GPU-second is ~K for both (it measures the job, not its share);
* the rate per wall second is ~K times the share each gets (~3:1).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from gpuwatch.sim import demo
from gpuwatch.sim.node import SimNode
from gpuwatch.sim.runc import ContainerLab, ContainerSpec
from tests.conftest import need_binary, need_root
from tests.system.promstack import free_port
from tests.system.sim_helpers import private_node
from tests.system.test_agent import agent_argv, running_agent, sample, scrape, wait_until

K = 0.02  # loss lost per GPU-second
FAST = demo.DemoWorkload("ml-team", "fast-0", "fast", gpu=0, memory_mib=64, duty=1.0)
SLOW = demo.DemoWorkload("ml-team", "slow-0", "slow", gpu=0, memory_mib=64, duty=0.25)


def number(text: str, name: str, **labels: str) -> float:
    value = sample(text, name, **labels)
    assert value is not None, (name, labels, text)
    return value


@pytest.fixture
def agent_env() -> dict[str, str]:
    need_root()
    need_binary("runc", "runc")
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def job(w: demo.DemoWorkload, sim: SimNode, goal: str = "minimize") -> ContainerSpec:
    spec = demo.container_spec(w, sim, extra_argv=(
        "--work-s", "600", "--progress-curve", "linear", "--progress-rate", str(K), "--progress-start", "1",
        "--progress-file", "/tmp/loss", "--progress-goal", goal))
    return dataclasses.replace(spec, annotations={"gpuwatch.io/progress-file": "/tmp/loss",
                                                  "gpuwatch.io/progress-goal": goal})


def test_agent_exports_progress_that_follows_the_curve_and_the_share(tmp_path: Path,
                                                                     agent_env: dict[str, str]) -> None:
    port = free_port()
    host_file_existed = Path("/tmp/loss").exists()
    with private_node(tmp_path / "node", devices=1) as sim:
        dirs = demo.default_lab_dirs(tmp_path / "node")
        env = {**agent_env, "GPUWATCH_SIM_STATE": str(sim.state_path)}
        argv = agent_argv(sim, tmp_path / "node", port, tmp_path, "--no-probes")
        with ContainerLab(**dirs) as lab, running_agent(argv, env, tmp_path / "agent.log", port):
            containers = [lab.run(job(w, sim)) for w in (FAST, SLOW)]
            for c in containers:
                wait_until(lambda c=c: "ready" in c.logs() or not c.running(), 20, f"{c.name} ready")
                assert c.running(), c.logs()

            def both_have_rates() -> bool:
                text = scrape(port)
                return all(sample(text, "gpuwatch_container_progress_rate", pod=w.pod) is not None
                           for w in (FAST, SLOW))

            wait_until(both_have_rates, 30, "progress rates for both pods")
            time.sleep(3)
            first, t0 = scrape(port), time.monotonic()
            time.sleep(8)
            text, t1 = scrape(port), time.monotonic()
            (tmp_path / "metrics.txt").write_text(text)
            assert sample(text, "gpuwatch_container_progress_read_errors_total") is None  # no failed read
        if not host_file_existed:  # the jobs wrote /tmp/loss in their own /tmp, not the host's
            assert not Path("/tmp/loss").exists()
    got = {}
    for w in (FAST, SLOW):
        value = number(text, "gpuwatch_container_progress", pod=w.pod, goal="minimize")
        rate = number(text, "gpuwatch_container_progress_rate", pod=w.pod)
        wall = number(text, "gpuwatch_container_progress_wall_rate", pod=w.pod)
        kernel = number(text, "gpuwatch_container_kernel_seconds_total", pod=w.pod)
        kernel0 = number(first, "gpuwatch_container_kernel_seconds_total", pod=w.pod)
        value0 = number(first, "gpuwatch_container_progress", pod=w.pod, goal="minimize")
        share = (kernel - kernel0) / (t1 - t0)  # GPU-seconds per second between the two scrapes
        got[w.pod] = (value, rate, wall, share)
        print(f"\n{w.pod}: loss {value:.4f} after {kernel:.2f} GPU-s (curve: {1 - K * kernel:.4f}); "
              f"{rate:.4f}/GPU-s (K = {K}); {wall:.4f}/s at a GPU share of {share:.2f} (K x share = "
              f"{K * share:.4f}); over the last {t1 - t0:.1f} s the loss fell {value0 - value:.4f}")
        # the value follows the curve of the GPU time the agent measured for the pod (the job
        # counts its own work: they differ by what the agent has not integrated yet)
        assert abs(value - (1 - K * kernel)) <= K * 1.0, (w.pod, value, kernel)
        assert value < value0  # it keeps falling
        assert rate > 0 and abs(rate - K) <= 0.25 * K, (w.pod, rate)  # per GPU-second: the curve's slope
        assert abs(wall - K * share) <= 0.35 * K * share, (w.pod, wall, share)  # per second: slope x share
    # shares ~0.75 : 0.25 (less for the slow job when the host's CPUs are busy: its Python
    # loop between kernels then runs late), and the wall rates in the same ratio
    (_, _, fast_wall, fast_share), (_, _, slow_wall, slow_share) = got[FAST.pod], got[SLOW.pod]
    assert fast_share >= 0.55 and 0.08 <= slow_share <= 0.32 and fast_share + slow_share <= 1.02
    assert abs((fast_wall / slow_wall) / (fast_share / slow_share) - 1) <= 0.35, (fast_wall, slow_wall)
