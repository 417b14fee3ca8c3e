"""`gpuwatch agent` as a real process on the simulated node with three runc pods.

Covers what only the whole daemon can show: the metrics it serves, alert-driven
enforcement through a real Prometheus -> Alertmanager -> webhook chain, that SIGTERM
leaves nothing frozen, and that unsafe configurations are refused before anything starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from gpuwatch.containers.cgroupfs import discover_mounts
from gpuwatch.sim import demo
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.conftest import need_binary, need_root
from tests.system.promstack import free_port, run_alertmanager, run_prometheus
from tests.system.sim_helpers import CONTEXT_BYTES, CONTEXT_MEMORY_OBJECTS, private_node, stop_process

TOKEN = "agent-test-token-0123456789abcdef"
MIB = 1 << 20
# the demo node's trainer-0 paused at 1 GiB, released as soon as it is under (the hardening tests' policy)
PAUSE_TRAINER = """
tuning: {release_after: 0s, min_hold: 0s}
rules:
  - name: pause-trainer
    match: {pod: trainer-0}
    limits: {gpu_memory: 1GiB}
    actions:
      - {do: pause, at: 100%}
"""


@dataclass
class Pods:
    sim: simnode.SimNode
    lab: ContainerLab
    containers: list[RunningContainer]
    dirs: dict[str, Path]

    def by_pod(self, pod: str) -> RunningContainer:
        workload = next(w for w in demo.DEFAULT_WORKLOADS if w.pod == pod)
        return next(c for c in self.containers if c.name == workload.container)


@contextmanager
def sim_node(base: Path) -> Iterator[simnode.SimNode]:
    """A private two-GPU simulated node (unique state file), always taken down."""
    with private_node(base, devices=2) as sim:
        yield sim


@contextmanager
def pods(base: Path, sim: simnode.SimNode | None = None) -> Iterator[Pods]:
    """The demo pods on `sim` (or on a fresh simulated node)."""
    with ExitStack() as stack:
        if sim is None:
            sim = stack.enter_context(sim_node(base))
        dirs = demo.default_lab_dirs(base)
        lab = stack.enter_context(ContainerLab(**dirs))
        yield Pods(sim, lab, demo.start_workloads(lab, sim), dirs)


def agent_argv(sim: simnode.SimNode, lab_base: Path, port: int, tmp: Path, *extra: str) -> list[str]:
    dirs = demo.default_lab_dirs(lab_base)
    return [sys.executable, "-m", "gpuwatch", "agent", f"--listen=127.0.0.1:{port}", "--node=sim-node",
            "--interval=0.5", f"--nvml-library={sim.libraries.nvml_path}",
            f"--containerd-root={dirs['bundle_root']}", f"--runc-root={dirs['runc_root']}",
            f"--device-prefix={sim.root}/dev/nvidia", f"--audit-log={tmp / 'audit.jsonl'}",
            f"--state-file={tmp / 'frozen.json'}", f"--lock-file={tmp / 'agent.lock'}", *extra]


@contextmanager
def running_agent(argv: list[str], env: dict[str, str], log: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"agent exited {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"agent did not serve /metrics:\n{log.read_text()}")
        yield proc
    finally:
        if proc.poll() is None:
            stop_process(proc)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def sample(text: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def is_frozen(container: RunningContainer) -> bool:
    v2 = Path(discover_mounts().unified or "/sys/fs/cgroup") / container.cgroup_path.lstrip("/") / "cgroup.events"
    if v2.exists() and "frozen 1" in v2.read_text():
        return True
    v1 = Path("/sys/fs/cgroup/freezer") / container.cgroup_path.lstrip("/") / "freezer.state"
    return v1.exists() and v1.read_text().strip() == "FROZEN"


def wait_until(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture
def agent_env(tmp_path: Path) -> dict[str, str]:
    need_root()
    need_binary("runc", "runc")
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_agent_serves_exact_memory_with_pod_labels(tmp_path: Path, agent_env: dict[str, str]) -> None:
    """Agent first, then the pods start: NVML memory and the probes' decoded ioctl bytes agree."""
    port = free_port()
    with sim_node(tmp_path / "node") as sim:
        env = {**agent_env, "GPUWATCH_SIM_STATE": str(sim.state_path)}
        with running_agent(agent_argv(sim, tmp_path / "node", port, tmp_path), env, tmp_path / "agent.log", port), \
                pods(tmp_path / "node", sim):
            def all_three() -> bool:
                text = scrape(port)
                return all(sample(text, "gpuwatch_container_memory_bytes", pod=w.pod) is not None
                           for w in demo.DEFAULT_WORKLOADS)
            wait_until(all_three, 20, "three pods in /metrics")
            text = scrape(port)
            # each pod's process holds its CUDA context (518 MiB, as on an H100) beside its memory
            for w in demo.DEFAULT_WORKLOADS:
                got = sample(text, "gpuwatch_container_memory_bytes", namespace=w.namespace, pod=w.pod,
                             container=w.container, gpu=str(w.gpu))
                assert got == w.memory_mib * MIB + CONTEXT_BYTES, (w, got)
            assert sample(text, "gpuwatch_namespace_memory_bytes", namespace="ml-team") == \
                (20480 + 8192) * MIB + 2 * CONTEXT_BYTES
            assert sample(text, "gpuwatch_gpu_backend_up") == 1
            assert sample(text, "gpuwatch_probes_up") == 1
            # the context's class-0x40 objects and the pod's one allocation, decoded from RM_ALLOC by
            # the probes: what the sim's ledger (RM's view) holds for the pod's process
            ledger = {(p.device, p.memory_bytes): p for p in simnode.status(sim).processes}
            for w in demo.DEFAULT_WORKLOADS:
                proc = ledger[(w.gpu, w.memory_mib * MIB + CONTEXT_BYTES)]
                assert proc.rm_objects == CONTEXT_MEMORY_OBJECTS + 1, (w, proc)
                assert sample(text, "gpuwatch_container_allocations_total", pod=w.pod) == proc.rm_objects, w
                assert sample(text, "gpuwatch_container_allocated_bytes", pod=w.pod) == \
                    proc.rm_memory_bytes == w.memory_mib * MIB + CONTEXT_BYTES, w


def test_alert_driven_pause_then_sigterm_thaws(tmp_path: Path, agent_env: dict[str, str]) -> None:
    """Prometheus rule fires -> Alertmanager -> agent webhook (token) -> enforcer freezes the pod;
    SIGTERM to the agent thaws it again."""
    need_binary("prometheus", "prometheus")
    need_binary("prometheus-alertmanager", "prometheus-alertmanager")
    port, hook_port = free_port(), free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    policy = Path(__file__).resolve().parents[2] / "deploy" / "policies" / "alert-only.yaml"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "t", "rules": [{
        "alert": "TrainerHoldsTooMuch",
        "expr": 'gpuwatch_container_memory_bytes{pod="trainer-0"} > 10 * 2^30',
        "labels": {"gpuwatch_action": "pause", "severity": "critical"}}]}]}))
    with pods(tmp_path / "node") as p:
        trainer = p.by_pod("trainer-0")
        env = {**agent_env, "GPUWATCH_SIM_STATE": str(p.sim.state_path)}
        argv = agent_argv(p.sim, tmp_path / "node", port, tmp_path, f"--policy={policy}",
                          f"--webhook-listen=127.0.0.1:{hook_port}", f"--webhook-token-file={token_file}")
        with running_agent(argv, env, tmp_path / "agent.log", port) as agent, \
                run_alertmanager(tmp_path / "am", f"http://127.0.0.1:{hook_port}/api/v1/alerts", TOKEN) as am, \
                run_prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"], rule_files=[rules], alertmanager=am,
                               interval_s=0.5):
            wait_until(lambda: is_frozen(trainer), 40, "the trainer pod to be frozen by the webhook")
            others = [c for c in p.containers if c is not trainer]
            assert not any(is_frozen(c) for c in others), "only the alert's target may be paused"
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=20) == 0, (tmp_path / "agent.log").read_text()
        assert not is_frozen(trainer), "SIGTERM must thaw what the agent froze"
        audit = (tmp_path / "audit.jsonl").read_text()
        assert "TrainerHoldsTooMuch" in audit and "pause" in audit


@pytest.mark.parametrize(("extra", "message"), [
    (["--webhook-listen=0.0.0.0:0"], "refusing to serve the enforcement webhook on 0.0.0.0"),
    (["--webhook-listen=127.0.0.1:0"], "needs a token"),
])
def test_unsafe_webhook_configurations_are_refused(tmp_path: Path, extra: list[str], message: str) -> None:
    need_root()
    policy = Path(__file__).resolve().parents[2] / "deploy" / "policies" / "alert-only.yaml"
    env = {k: v for k, v in os.environ.items() if k != "GPUWATCH_WEBHOOK_TOKEN"}
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    if "0.0.0.0" in extra[0]:
        extra = [*extra, f"--webhook-token-file={token_file}"]
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "agent", "--listen=127.0.0.1:0", "--no-probes",
         f"--policy={policy}", f"--audit-log={tmp_path / 'a.jsonl'}", f"--state-file={tmp_path / 'f.json'}",
         f"--lock-file={tmp_path / 'agent.lock'}", "--nvml-library=/nonexistent/libnvidia-ml.so.1", *extra],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_agent_started_after_the_pods_counts_their_later_allocations_only(
        tmp_path: Path, agent_env: dict[str, str]) -> None:
    """Pods first, agent after (an agent restart on a busy node): the probes seed the device fds
    the pods opened before, so a pod that keeps allocating is counted from the agent's start;
    what was allocated before is unknown to the probes and not invented (NVML has it all)."""
    port = free_port()
    leaker = demo.DemoWorkload("ml-team", "leaker-0", "leaker", gpu=0, memory_mib=64, duty=0.0)
    steps = 60
    with pods(tmp_path / "node") as p:
        leak = p.lab.run(demo.container_spec(leaker, p.sim, extra_argv=(
            "--leak", "--steps", str(steps), "--interval-s", "0.3")))
        wait_until(lambda: "progress" in leak.logs(), 20, "the leaker's first allocation")
        env = {**agent_env, "GPUWATCH_SIM_STATE": str(p.sim.state_path)}
        with running_agent(agent_argv(p.sim, tmp_path / "node", port, tmp_path), env,
                           tmp_path / "agent.log", port):
            def leaker_done_and_counted() -> bool:
                text = scrape(port)
                allocs = sample(text, "gpuwatch_container_allocations_total", pod="leaker-0")
                live = sample(text, "gpuwatch_container_allocated_bytes", pod="leaker-0", gpu="0")
                nvml = sample(text, "gpuwatch_container_memory_bytes", pod="leaker-0")
                return ("ready" in leak.logs() and nvml == steps * 64 * MIB + CONTEXT_BYTES and allocs is not None
                        and live == allocs * 64 * MIB)
            wait_until(leaker_done_and_counted, 60, "the leaker's allocations in /metrics")
            text = scrape(port)
            allocs = sample(text, "gpuwatch_container_allocations_total", pod="leaker-0")
            assert allocs is not None and 0 < allocs < steps, allocs  # some were before the agent
            assert sample(text, "gpuwatch_container_allocated_bytes", pod="leaker-0", gpu="0") == allocs * 64 * MIB
            for w in demo.DEFAULT_WORKLOADS:  # allocated (context and all) before the agent, nothing since
                assert sample(text, "gpuwatch_container_allocations_total", pod=w.pod) in (None, 0), w
                assert sample(text, "gpuwatch_container_allocated_bytes", pod=w.pod) in (None, 0), w
                assert sample(text, "gpuwatch_container_memory_bytes", pod=w.pod) == \
                    w.memory_mib * MIB + CONTEXT_BYTES, w
