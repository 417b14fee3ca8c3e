"""Kernel seconds per container against the simulated node's own ledger, with NVML samples
shaped like the real driver's (issue 17, items 1-2; gpuwatch/sim/README.md "NVML samples").

The fake NVML gives a process a sample only for the 1/6 s periods it ran in, several
processes' samples overlap in one period, and the agent (gpu/samples.py, pipeline/attribution.py)
integrates them by the time they cover. Ground truth is the sim's ledger of busy time per
process (`SimProcess.busy_seconds_total`), which the stub credits as kernels run.

Both sides are compared over one window whose ends stand still: every workload is frozen
(cgroup freezer; SIGSTOP for a host process), the agent is given time to read every sample
of the frozen GPUs (its cadence spaces the costly process-utilisation reads), then ledger and
metrics are read; thaw, run, freeze, read again. The agent's first read of a device is a
baseline that charges nothing, so the window starts after it.

* mixes: duty 0.05-0.9, time-slicing one simulated GPU (GPU 0 oversubscribed: 0.9 + 0.3 +
  0.05; GPU 1 under-subscribed with idle periods: 0.2 + 0.1 + 0.05): each container within
  5 % of its ledger;
* the H100 case of ../shared/real-gpu/README.md section 2 on the sim with the H100 cost
  model: four tenants holding 2,048 / 1,024 / 4,096 / 512 MiB at duty 0.3 / 0.1 / 0.4 / 0.05,
  the first two in one pod (ml/trainer-a), the third in another (research/notebook-b), the
  last on the host: each container within 5 % of the ledger and the GPU's containers summing
  to no more than its busy time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwatch.sim import SimNode, sim_env, status
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.system.sim_helpers import CONTEXT_BYTES, MIB, private_node, sim_container
from tests.system.test_pipeline_containers import Scrape, freezer_state, scrape, sim_agent, wait_for

pytestmark = pytest.mark.slow

INTERVAL_S = 1.0
NODE = "kernel-time-node"
RUN_S = 20.0
TOLERANCE = 0.05  # the bound: each container within 5 % of the ledger


@dataclass(frozen=True)
class Tenant:
    namespace: str
    pod: str
    container: str
    gpu: int
    mib: int
    duty: float


@dataclass
class Running:
    containers: dict[str, RunningContainer]
    host: list[subprocess.Popen[bytes]]

    def freeze(self, frozen: bool) -> None:
        for c in self.containers.values():
            freezer_state(c, "FROZEN" if frozen else "THAWED")
        for p in self.host:
            p.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop_host(self) -> None:
        """Kill the tenants outside containers (the lab stops the containers): a simworker
        outlives its node's removal, and one was left running after this test."""
        for p in self.host:
            p.kill()
            p.wait(10)


@pytest.fixture
def lab(tmp_path: Path, runc_required: str) -> Iterator[ContainerLab]:
    with ContainerLab(tmp_path / "work", bundle_root=tmp_path / "containerd", runc_root=tmp_path / "runc") as lab:
        yield lab


@contextmanager
def running_agent(node: SimNode, lab: ContainerLab, tmp_path: Path) -> Iterator[int]:
    """`gpuwatch agent` on the node (fake NVML by --nvml-library); yields its port."""
    with sim_agent(node, tmp_path, NODE, INTERVAL_S, f"--containerd-root={lab.bundle_root}",
                   f"--runc-root={lab.runc_root}") as (_, port):
        yield port


def worker_argv(node: SimNode, t: Tenant) -> list[str]:
    return [str(node.libraries.worker_path), "--gpu", str(t.gpu), "--mib-per-step", str(t.mib), "--steps", "1",
            "--duty", str(t.duty), "--kernel-ms", "10"]


def wait_ready(c: RunningContainer, workers: int, name: str) -> None:
    wait_for(lambda: c.logs().count("ready") >= workers or not c.running(), 20, f"{name} ready")


def start_tenants(node: SimNode, lab: ContainerLab, tenants: list[Tenant], log_dir: Path) -> Running:
    """One container per (namespace, pod, container), its tenants started by one shell; pod ""
    = a process on the host. Waits until every worker printed its ready line."""
    groups: dict[tuple[str, str, str], list[Tenant]] = {}
    for t in tenants:
        groups.setdefault((t.namespace, t.pod, t.container), []).append(t)
    running = Running({}, [])
    for (namespace, pod, container), members in groups.items():
        if not pod:
            for k, t in enumerate(members):
                out = log_dir / f"host-{k}.log"
                with out.open("wb") as f:
                    proc = subprocess.Popen(worker_argv(node, t), env=sim_env(node, dict(os.environ)),
                                            stdout=f, stderr=subprocess.STDOUT)
                running.host.append(proc)
                wait_for(lambda out=out: b"ready" in out.read_bytes(), 20, f"host tenant {k} ready")  # type: ignore[misc]
            continue
        script = " & ".join(" ".join(worker_argv(node, t)) for t in members) + " & wait"
        c = lab.run(sim_container(node, container, ["/bin/sh", "-c", script], namespace=namespace, pod=pod))
        wait_ready(c, len(members), container)
        assert c.running(), c.logs()
        running.containers[container] = c
    return running


@dataclass(frozen=True)
class Reading:
    """Ledger and agent, both standing still."""

    ledger_s: dict[int, float]  # busy seconds per host pid (all GPUs)
    device_busy_s: dict[int, float]  # busy seconds per GPU, every process
    agent: Scrape


def settled_reading(node: SimNode, port: int, series: list[dict[str, str]]) -> Reading:
    """With every workload frozen: wait until the agent's kernel seconds stop moving (it has read
    every sample of the frozen GPUs: its reads of process samples are spaced by its cadence), then
    read the ledger and the metrics."""
    def values() -> list[float | None]:
        m = scrape(port)
        return [m.value("gpuwatch_container_kernel_seconds_total", **labels) for labels in series]

    last, since = values(), time.monotonic()
    deadline = time.monotonic() + 20
    while time.monotonic() - since < 3 * INTERVAL_S + 1.0 and time.monotonic() < deadline:
        time.sleep(0.5)
        now = values()
        if now != last:
            last, since = now, time.monotonic()
    ledger = status(node)
    per_pid: dict[int, float] = {}
    per_gpu: dict[int, float] = {}
    for p in ledger.processes:
        per_pid[p.host_pid] = per_pid.get(p.host_pid, 0.0) + p.busy_seconds_total
        per_gpu[p.device] = per_gpu.get(p.device, 0.0) + p.busy_seconds_total
    return Reading(per_pid, per_gpu, scrape(port))


def window(node: SimNode, port: int, running: Running, series: dict[str, dict[str, str]]
           ) -> tuple[Reading, Reading]:
    """Frozen -> settled reading -> thawed for RUN_S -> frozen -> settled reading."""
    running.freeze(True)
    before = settled_reading(node, port, list(series.values()))
    running.freeze(False)
    time.sleep(RUN_S)
    running.freeze(True)
    after = settled_reading(node, port, list(series.values()))
    return before, after


def pids_of(running: Running, name: str) -> set[int]:
    if name == "host":
        return {p.pid for p in running.host}
    return set(running.containers[name].pids())


def compare(running: Running, series: dict[str, dict[str, str]], before: Reading, after: Reading
            ) -> dict[str, tuple[float, float]]:
    """(agent kernel seconds, ledger busy seconds) per container over the window."""
    out = {}
    for name, labels in series.items():
        pids = pids_of(running, name)
        ledger = sum(after.ledger_s.get(p, 0.0) - before.ledger_s.get(p, 0.0) for p in pids)
        a0 = before.agent.value("gpuwatch_container_kernel_seconds_total", **labels) or 0.0
        a1 = after.agent.value("gpuwatch_container_kernel_seconds_total", **labels) or 0.0
        out[name] = (a1 - a0, ledger)
    return out


def report(title: str, rows: dict[str, tuple[float, float]]) -> None:
    print(f"\n{title}")
    for name, (agent_s, ledger_s) in rows.items():
        ratio = agent_s / ledger_s if ledger_s else float("nan")
        print(f"  {name:14s} ledger {ledger_s:7.3f} s  agent {agent_s:7.3f} s  ratio {ratio:.3f}")


MIXES = [
    # GPU 0: oversubscribed (duties add up to 1.25): time-sliced, every period shared
    Tenant("mix", "heavy-0", "heavy", gpu=0, mib=64, duty=0.9),
    Tenant("mix", "mid-0", "mid", gpu=0, mib=64, duty=0.3),
    Tenant("mix", "light-0", "light", gpu=0, mib=64, duty=0.05),
    # GPU 1: under-subscribed (0.35): idle periods between samples
    Tenant("mix", "b-0", "b20", gpu=1, mib=64, duty=0.2),
    Tenant("mix", "b-1", "b10", gpu=1, mib=64, duty=0.1),
    Tenant("mix", "b-2", "b05", gpu=1, mib=64, duty=0.05),
]


def test_kernel_seconds_match_the_ledger_for_duty_mixes(tmp_path: Path, lab: ContainerLab) -> None:
    with private_node(tmp_path, devices=2, memory_bytes=16 << 30) as node, \
            running_agent(node, lab, tmp_path) as port:
        running = start_tenants(node, lab, MIXES, tmp_path)
        series = {t.container: {"container_id": running.containers[t.container].id} for t in MIXES}
        time.sleep(2.0)  # the agent's baseline read of each GPU happens here
        before, after = window(node, port, running, series)
        rows = compare(running, series, before, after)
        report("duty mixes (GPU 0: 0.9 + 0.3 + 0.05; GPU 1: 0.2 + 0.1 + 0.05)", rows)
        for name, (agent_s, ledger_s) in rows.items():
            assert ledger_s > 0.3, f"{name} did too little work to compare ({ledger_s:.3f} s)"
            assert agent_s == pytest.approx(ledger_s, rel=TOLERANCE), f"{name}: agent {agent_s} vs ledger {ledger_s}"
        for gpu in (0, 1):
            names = [t.container for t in MIXES if t.gpu == gpu]
            busy = after.device_busy_s[gpu] - before.device_busy_s[gpu]
            assert sum(rows[n][0] for n in names) <= busy * 1.01 + 0.05


H100_CASE = [
    Tenant("ml", "trainer-a", "trainer", gpu=0, mib=2048, duty=0.3),
    Tenant("ml", "trainer-a", "trainer", gpu=0, mib=1024, duty=0.1),
    Tenant("research", "notebook-b", "notebook", gpu=0, mib=4096, duty=0.4),
    Tenant("", "", "host", gpu=0, mib=512, duty=0.05),
]


def test_h100_four_tenant_case_on_the_sim(tmp_path: Path, lab: ContainerLab) -> None:
    with private_node(tmp_path, devices=1, memory_bytes=80 << 30, nvml_cost="h100-580") as node, \
            running_agent(node, lab, tmp_path) as port:
        running = start_tenants(node, lab, H100_CASE, tmp_path)
        try:
            check_h100_case(node, port, running)
        finally:
            running.stop_host()


def check_h100_case(node: SimNode, port: int, running: Running) -> None:
    """The four tenants' memory and kernel seconds, from the agent, against the ledger."""
    series = {name: {"container_id": c.id} for name, c in running.containers.items()}
    time.sleep(2.0)
    m = scrape(port)
    known = {c.id for c in running.containers.values()}
    host = [lab for n, lab, _ in m.samples
            if n == "gpuwatch_container_kernel_seconds_total" and lab.get("container_id") not in known]
    assert len(host) == 1, f"expected one host series: {host}"
    series["host"] = host[0]
    # memory: NVML's per-process numbers summed (each with its 518 MiB context)
    for name, c in running.containers.items():
        want = sum(t.mib * MIB + CONTEXT_BYTES for t in H100_CASE if t.container == name)
        assert m.value("gpuwatch_container_memory_bytes", container_id=c.id) == want
    before, after = window(node, port, running, series)
    rows = compare(running, series, before, after)
    busy = after.device_busy_s[0] - before.device_busy_s[0]
    report(f"H100 case on the sim (cost model h100-580; GPU busy {busy:.3f} s over {RUN_S:.0f} s)", rows)
    total = sum(agent_s for agent_s, _ in rows.values())
    print(f"  sum of containers {total:.3f} s = {total / busy:.3f} of the GPU's busy time")
    assert total <= busy * 1.01 + 0.05, f"containers sum to {total} s, GPU busy {busy} s"
    for name, (agent_s, ledger_s) in rows.items():
        assert ledger_s > 0.3, f"{name} did too little work to compare ({ledger_s:.3f} s)"
        assert agent_s == pytest.approx(ledger_s, rel=TOLERANCE), f"{name}: agent {agent_s} vs ledger {ledger_s}"
