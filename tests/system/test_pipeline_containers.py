"""The whole pipeline on the simulated node: runc containers -> NVML -> identity ->
attribution -> /metrics over HTTP from a running `gpuwatch agent`.

Three runc (k8s-style) containers in two namespaces run the sim's native `simworker`
with known memory and duty. Checked against ground truth, not against our own numbers:
* each container's memory on its GPU is exactly what NVML counts for its workload: what it
  allocated plus its CUDA context's own memory (518 MiB, as on the H100);
* its kernel seconds are within 10% of the busy time the sim's ledger recorded for its
  processes (the containers are frozen before comparing, so both sides stand still);
* namespace / pod / container labels come from the OCI bundle annotations;
* a stopped container's series are gone within two sample intervals;
* when every GPU is lost mid-run (the sim's "lost" fault: NVML answers GPU_IS_LOST)
  the agent keeps serving, says gpuwatch_gpu_backend_up 0, and recovers (counters
  intact) once the GPUs are back; likewise when the whole simulated node is taken down
  ("driver gone") and brought up again.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.containers.cgroupfs import discover_mounts
from gpuwatch.sim import SimNode, down, inject_fault, status, up
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.system.promstack import free_port
from tests.system.sim_helpers import (
    CONTEXT_BYTES,
    private_node,
    sim_agent_argv,
    sim_agent_env,
    sim_container,
    stop_process,
)

MIB = 1 << 20
INTERVAL_S = 0.5
NODE = "pipeline-node"


@dataclass(frozen=True)
class Workload:
    namespace: str
    pod: str
    container: str
    gpu: int
    mib: int
    steps: int
    duty: float

    @property
    def memory_bytes(self) -> int:
        """NVML's number for the container's one process: its steps and its context's memory."""
        return self.mib * self.steps * MIB + CONTEXT_BYTES


WORKLOADS = (
    Workload("team-a", "train-0", "trainer", gpu=0, mib=256, steps=1, duty=0.5),
    Workload("team-a", "eval-0", "evaluator", gpu=1, mib=96, steps=2, duty=0.25),
    Workload("team-b", "serve-0", "server", gpu=0, mib=64, steps=1, duty=0.0),
)


@dataclass
class Scrape:
    samples: list[tuple[str, dict[str, str], float]]

    def value(self, name: str, **labels: str) -> float | None:
        found = [v for n, lab, v in self.samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
        assert len(found) <= 1, f"{name} {labels} matches {len(found)} series"
        return found[0] if found else None

    def labels_of(self, name: str, **labels: str) -> dict[str, str]:
        matches = [lab for n, lab, _ in self.samples
                   if n == name and all(lab.get(k) == x for k, x in labels.items())]
        assert len(matches) == 1, f"{name} {labels}: {matches}"
        return matches[0]


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return Scrape([(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples])


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll until `predicate()`; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def freezer_state(container: RunningContainer, state: str) -> None:
    """Freeze / thaw a container through the cgroup freezer (v2 if present, else v1)."""
    v2 = Path(discover_mounts().unified or "/sys/fs/cgroup") / container.cgroup_path.lstrip("/") / "cgroup.freeze"
    v1 = Path("/sys/fs/cgroup/freezer") / container.cgroup_path.lstrip("/") / "freezer.state"
    if v1.exists():
        v1.write_text(state)
    else:
        v2.write_text("1" if state == "FROZEN" else "0")


@pytest.fixture
def node(tmp_path: Path, runc_required: str) -> Iterator[SimNode]:
    with private_node(tmp_path, devices=2, memory_bytes=16 << 30) as sim:
        yield sim


@pytest.fixture
def lab(tmp_path: Path, runc_required: str) -> Iterator[ContainerLab]:
    with ContainerLab(tmp_path / "work", bundle_root=tmp_path / "containerd", runc_root=tmp_path / "runc") as lab:
        yield lab


@contextmanager
def sim_agent(node: SimNode, tmp_path: Path, node_name: str, interval_s: float,
              *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`gpuwatch agent` on the simulated node (sim_helpers.sim_agent_argv, its output in
    tmp_path/agent.log): yields it and its port once it serves metrics with the GPU backend up;
    stopped at the end."""
    port = free_port()
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(sim_agent_argv(node, tmp_path, port, node_name, interval_s, *extra),
                                env=sim_agent_env(node), stdout=out, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, f"agent exited {proc.returncode}:\n{log.read_text()}"
            try:
                return scrape(port).value("gpuwatch_gpu_backend_up", node=node_name) == 1.0
            except OSError:
                return False

        wait_for(up, 30, "the agent to serve metrics with the GPU backend up")
        yield proc, port
    finally:
        stop_process(proc)


@pytest.fixture
def agent(node: SimNode, lab: ContainerLab, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    with sim_agent(node, tmp_path, NODE, INTERVAL_S, f"--containerd-root={lab.bundle_root}",
                   f"--runc-root={lab.runc_root}") as running:
        yield running


def start(lab: ContainerLab, node: SimNode, w: Workload) -> RunningContainer:
    argv = [str(node.libraries.worker_path), "--gpu", str(w.gpu), "--mib-per-step", str(w.mib),
            "--steps", str(w.steps), "--duty", str(w.duty), "--kernel-ms", "5"]
    container = lab.run(sim_container(node, w.container, argv, namespace=w.namespace, pod=w.pod))
    wait_for(lambda: "ready" in container.logs() or not container.running(), 15, f"{w.container} ready")
    assert container.running() and "ready" in container.logs(), container.logs()
    return container


def test_containers_on_the_simulated_node_through_metrics(
        node: SimNode, lab: ContainerLab, agent: tuple[subprocess.Popen[bytes], int]) -> None:
    proc, port = agent
    containers = {w.container: start(lab, node, w) for w in WORKLOADS}
    time.sleep(3.0)  # let them run kernels for a while
    for w in WORKLOADS:
        freezer_state(containers[w.container], "FROZEN")
    time.sleep(3 * INTERVAL_S)  # both the ledger and the agent's integral now stand still
    m = scrape(port)
    ledger = status(node)

    for w in WORKLOADS:
        c = containers[w.container]
        labels = m.labels_of("gpuwatch_container_memory_bytes", container_id=c.id)
        assert (labels["namespace"], labels["pod"], labels["container"]) == (w.namespace, w.pod, w.container)
        assert labels["gpu"] == str(w.gpu) and labels["node"] == NODE and labels["pod_uid"] == c.pod_uid
        assert m.value("gpuwatch_container_memory_bytes", container_id=c.id) == w.memory_bytes
        assert m.value("gpuwatch_container_processes", container_id=c.id) == 1
        busy_s = sum(p.busy_seconds_total for p in ledger.processes if p.host_pid in c.pids())
        kernel_s = m.value("gpuwatch_container_kernel_seconds_total", container_id=c.id)
        assert kernel_s is not None
        if w.duty == 0:
            assert busy_s == 0 and kernel_s == 0
        else:
            assert busy_s > 0.3, f"{w.container} did too little work to compare ({busy_s:.3f} s)"
            assert kernel_s == pytest.approx(busy_s, rel=0.10), f"{w.container}: {kernel_s} vs ledger {busy_s}"

    team_a = [w for w in WORKLOADS if w.namespace == "team-a"]
    assert m.value("gpuwatch_namespace_memory_bytes", namespace="team-a") == sum(w.memory_bytes for w in team_a)
    assert m.value("gpuwatch_namespace_containers", namespace="team-a") == 2
    assert m.value("gpuwatch_pod_memory_bytes", namespace="team-b", pod="serve-0") == WORKLOADS[2].memory_bytes
    gpu0_used = m.value("gpuwatch_gpu_memory_used_bytes", gpu="0")
    assert gpu0_used == sum(w.memory_bytes for w in WORKLOADS if w.gpu == 0)
    kernel_before = {name: m.value("gpuwatch_container_kernel_seconds_total", container_id=c.id)
                     for name, c in containers.items()}
    for c in containers.values():
        freezer_state(c, "THAWED")

    # a stopped container's series are gone within two intervals
    server = containers.pop("server")
    server.stop()
    took = wait_for(lambda: scrape(port).value("gpuwatch_container_memory_bytes", container_id=server.id) is None,
                    5, "the stopped container's series to vanish")
    assert took <= 2 * INTERVAL_S + 0.25, f"series of a stopped container lingered {took:.2f} s"
    assert scrape(port).value("gpuwatch_pod_memory_bytes", namespace="team-b", pod="serve-0") is None

    # every GPU lost mid-run: the agent keeps serving and says the backend is down. The
    # workloads are frozen meanwhile: a lost GPU fails their CUDA calls (they would exit).
    for c in containers.values():
        freezer_state(c, "FROZEN")
    for gpu in range(node.device_count):
        inject_fault(node, "lost", gpu)
    wait_for(lambda: scrape(port).value("gpuwatch_gpu_backend_up", node=NODE) == 0.0, 5, "backend_up 0")
    outage = scrape(port)
    assert outage.value("gpuwatch_container_memory_bytes", container_id=containers["trainer"].id) is None
    time.sleep(3 * INTERVAL_S)
    assert proc.poll() is None, "the agent died when NVML failed"
    assert scrape(port).value("gpuwatch_gpu_backend_up", node=NODE) == 0.0
    for gpu in range(node.device_count):
        inject_fault(node, "clear", gpu)
    for c in containers.values():
        freezer_state(c, "THAWED")
    wait_for(lambda: scrape(port).value("gpuwatch_gpu_backend_up", node=NODE) == 1.0, 10, "recovery")
    wait_for(lambda: scrape(port).value("gpuwatch_container_memory_bytes",
                                        container_id=containers["trainer"].id) == WORKLOADS[0].memory_bytes,
             5, "the trainer's series to come back")
    after = scrape(port).value("gpuwatch_container_kernel_seconds_total", container_id=containers["trainer"].id)
    assert after is not None and kernel_before["trainer"] is not None
    assert after >= kernel_before["trainer"], "kernel seconds went backwards across the outage"

    # the simulated node taken down under the running agent ("driver gone"), then re-created
    for c in containers.values():
        freezer_state(c, "FROZEN")
    down(node.name)
    wait_for(lambda: scrape(port).value("gpuwatch_gpu_backend_up", node=NODE) == 0.0, 5, "backend_up 0 (down)")
    time.sleep(3 * INTERVAL_S)
    assert proc.poll() is None, "the agent died when the simulated driver went away"
    up(devices=2, memory_bytes=16 << 30, name=node.name, root=node.root)
    wait_for(lambda: scrape(port).value("gpuwatch_gpu_backend_up", node=NODE) == 1.0, 15, "recovery after up")
    again = scrape(port)
    assert again.value("gpuwatch_gpu_memory_used_bytes", gpu="0") == 0  # a fresh node: empty ledger
    for c in containers.values():
        freezer_state(c, "THAWED")
