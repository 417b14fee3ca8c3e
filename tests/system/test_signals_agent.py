"""Scheduling signals end to end: the real agent on a simulated node with NVLink pairs and
three runc pods (each in its own network namespace), scraped by a real Prometheus with
gpuwatch's rules loaded.

* an Xid injected for one pod's pid becomes that pod's Xid counter, an unhealthy GPU with
  its reason, a changed NFD feature file (checked with NFD's rules) and a firing alert;
* the query shapes the descheduler (instant vector, instance = node, [0, 1]) and the
  load-watcher (`avg_over_time(...[w])`) run, and their values match the sim's ledger;
* topology and network series are there with the values the sim and the kernel give.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from gpuwatch.sim import node as simnode
from tests.conftest import need_binary, need_root
from tests.nfd_rules import check_feature_file
from tests.system.promstack import free_port, run_prometheus
from tests.system.sim_helpers import private_node
from tests.system.test_agent import agent_argv, pods, running_agent

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "gpuwatch-rules.yml"
INTERVAL_S = 1.0


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of `name` in a text exposition (simple parser for our output)."""
    found = []
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        labels: dict[str, str] = {}
        if "{" in head:
            body = head[head.index("{") + 1: head.rindex("}")]
            for part in body.split('",'):
                key, _, val = part.partition('="')
                labels[key.strip(",")] = val.rstrip('"')
        found.append((labels, float(value)))
    return found


def _snapshot(port: int) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/snapshot.json", timeout=5) as resp:
        return dict(json.load(resp))


@pytest.mark.slow
def test_xid_for_one_pod_reaches_counter_health_nfd_and_alert(tmp_path: Path) -> None:
    need_root()
    need_binary("runc", "runc")
    prometheus = need_binary("prometheus", "prometheus")
    port = free_port()
    features = tmp_path / "features.d" / "gpuwatch"
    with private_node(tmp_path / "node", devices=2, topology="nvlink-pairs") as sim:
        argv = agent_argv(sim, tmp_path / "node", port, tmp_path, f"--kmsg={sim.kmsg_path}",
                          f"--nfd-features-file={features}", "--no-probes")
        argv[argv.index("--interval=0.5")] = f"--interval={INTERVAL_S}"
        env = {**os.environ, "GPUWATCH_SIM_STATE": str(sim.state_path)}
        with running_agent(argv, env, tmp_path / "agent.log", port), pods(tmp_path / "node", sim) as running, \
                run_prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"], binary=prometheus, interval_s=0.5,
                               rule_files=[RULES]) as prom:
            assert prom.wait_for('gpuwatch_container_memory_bytes{namespace="ml-team"}', timeout_s=30)
            # --- before: every GPU healthy, labels NFD accepts -------------------------------
            deadline = time.monotonic() + 10
            while not features.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            before = check_feature_file(features)
            assert before["gpuwatch.io/gpu.count"] == "2"
            assert before["gpuwatch.io/gpu.healthy-count"] == "2"
            assert before["gpuwatch.io/gpu.unhealthy-count"] == "0"
            assert before["gpuwatch.io/gpu.topology"] == "nvlink"
            assert before["gpuwatch.io/gpu.nvlink-island"] == "2"
            assert before["gpuwatch.io/gpu.simulated"] == "true"

            # --- topology series match the sim's NVLink pairs --------------------------------
            text = _metrics(port)
            links = {(s["gpu"], s["peer"]): v for s, v in _samples(text, "gpuwatch_gpu_nvlink_links")}
            scores = {(s["gpu"], s["peer"]): v for s, v in _samples(text, "gpuwatch_gpu_pair_score")}
            levels = {(s["gpu"], s["peer"]): v for s, v in _samples(text, "gpuwatch_gpu_topology_level")}
            assert links[("0", "1")] == links[("1", "0")] > 0
            level_score = {0: 60, 10: 50, 20: 40, 30: 30, 40: 20, 50: 10}[int(levels[("0", "1")])]
            assert scores[("0", "1")] == level_score + 100 * links[("0", "1")]

            # --- network: the node's NICs as the kernel counts them, pods' own namespaces ---
            nics = {s["device"]: v for s, v in _samples(text, "gpuwatch_node_network_receive_bytes_total")}
            assert "lo" not in nics
            kernel = {line.split(":")[0].strip(): int(line.split(":")[1].split()[0])
                      for line in Path("/proc/net/dev").read_text().splitlines()[2:]}
            for device, value in nics.items():
                assert value <= kernel[device]  # read before this /proc/net/dev: never ahead of it
            pod_nets = {s["pod"] for s, _ in _samples(text, "gpuwatch_container_network_receive_bytes_total")}
            assert pod_nets == {"trainer-0", "notebook-1", "server-0"}

            # --- the query shapes the schedulers run, against the sim's ledger -------------
            status = simnode.status(sim)
            used = sum(d.memory_used_bytes for d in status.devices)
            total = sum(d.memory_total_bytes for d in status.devices)
            (desch,) = prom.wait_for("instance:gpuwatch_gpu_memory_used:ratio")
            assert desch["metric"]["instance"] == "sim-node"
            assert abs(float(desch["value"][1]) - used / total) < 1e-6
            (util,) = prom.wait_for("instance:gpuwatch_gpu_utilization:ratio")
            assert 0.0 < float(util["value"][1]) <= 1.0 and util["metric"]["instance"] == "sim-node"
            (watch,) = prom.wait_for("avg_over_time(gpuwatch_node_gpu_utilization_ratio[30s])")
            assert 0.0 < float(watch["value"][1]) <= 1.0
            (crane,) = prom.wait_for('instance:gpuwatch_gpu_memory_used:percent{instance=~"sim-node"}')
            assert abs(float(crane["value"][1]) - 100 * used / total) < 1e-4

            # --- inject an Xid for the trainer pod's process on its GPU ---------------------
            trainer = running.by_pod("trainer-0")
            snapshot = _snapshot(port)
            gpu = next(c["gpu_index"] for c in snapshot["containers"] if c["identity"]["pod_name"] == "trainer-0")
            injected = time.monotonic()
            simnode.inject_fault(sim, "xid", int(gpu), xid=48, pid=trainer.host_pid)
            counter: list[tuple[dict[str, str], float]] = []
            healthy: list[tuple[dict[str, str], float]] = []
            while time.monotonic() - injected < 2 * INTERVAL_S + 1.0:
                text = _metrics(port)
                counter = [(s, v) for s, v in _samples(text, "gpuwatch_container_xid_errors_total")
                           if s["pod"] == "trainer-0"]
                healthy = [(s, v) for s, v in _samples(text, "gpuwatch_gpu_healthy") if s["gpu"] == str(gpu)]
                if counter and healthy and healthy[0][1] == 0:
                    break
                time.sleep(0.1)
            assert counter, f"no Xid counter for the pod within two intervals:\n{text[-3000:]}"
            assert [(s["xid"], s["namespace"], s["gpu"], v) for s, v in counter] == [("48", "ml-team", str(gpu), 1.0)]
            assert healthy and healthy[0][1] == 0 and healthy[0][0]["reason"] == "xid"
            other = [v for s, v in _samples(text, "gpuwatch_container_xid_errors_total") if s["pod"] != "trainer-0"]
            assert other == []  # nobody else is charged
            # the NFD file changes (and stays valid for NFD)
            after: dict[str, str] = before
            while time.monotonic() - injected < 2 * INTERVAL_S + 1.0:
                after = check_feature_file(features)
                if after["gpuwatch.io/gpu.healthy-count"] == "1":
                    break
                time.sleep(0.1)
            assert after["gpuwatch.io/gpu.healthy-count"] == "1"
            assert after["gpuwatch.io/gpu.unhealthy-count"] == "1"
            # an alert fires for the pod (Prometheus scrapes every 0.5 s, evaluates every 0.5 s)
            deadline = time.monotonic() + 15
            firing: list[dict[str, object]] = []
            while time.monotonic() < deadline and not firing:
                firing = [a for a in prom.alerts() if a["labels"].get("alertname") == "ContainerCausedXid"
                          and a["state"] == "firing"]
                time.sleep(0.3)
            assert firing and firing[0]["labels"]["pod"] == "trainer-0"  # type: ignore[index]
            (unhealthy,) = prom.wait_for("instance:gpuwatch_gpus_unhealthy:count > 0")
            assert unhealthy["metric"]["instance"] == "sim-node"
            # Xid 48 does not heal by itself; a driver reload (the node re-created) would
            assert check_feature_file(features)["gpuwatch.io/gpu.unhealthy-count"] == "1"


HOSTILE_MODELS = [
    "Ünïcödé GPU / with slashes \\ and \"quotes\" " + "x" * 300,
    "--- .. __",
]


@pytest.mark.slow
@pytest.mark.parametrize("model", HOSTILE_MODELS, ids=["long-unicode-slashes", "only-punctuation"])
def test_hostile_model_names_still_give_a_file_nfd_accepts(tmp_path: Path, model: str) -> None:
    """The agent's labels from a GPU whose model name no label value could hold, into a
    features.d directory that does not exist yet."""
    need_root()
    port = free_port()
    features = tmp_path / "features.d" / "gpuwatch"
    with private_node(tmp_path / "node", devices=1, model=model) as sim:
        argv = agent_argv(sim, tmp_path / "node", port, tmp_path, f"--kmsg={sim.kmsg_path}",
                          f"--nfd-features-file={features}", "--no-probes", "--no-network")
        env = {**os.environ, "GPUWATCH_SIM_STATE": str(sim.state_path)}
        with running_agent(argv, env, tmp_path / "agent.log", port):
            deadline = time.monotonic() + 15
            while not features.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            labels = check_feature_file(features)
    assert labels["gpuwatch.io/gpu.count"] == "1"
    product = labels.get("gpuwatch.io/gpu.product")
    if any(ch.isalnum() and ch.isascii() for ch in model):
        assert product and len(product) <= 63 and product.startswith("gpuwatch-sim")
    assert "gpuwatch.io/gpu.topology" not in labels  # one GPU: no pair to rank
    assert labels["gpuwatch.io/gpu.nvlink-island"] == "1"
