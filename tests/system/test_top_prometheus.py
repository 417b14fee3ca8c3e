"""`gpuwatch top --prometheus` over a real Prometheus scraping two simulated nodes' agents.

Two simulated GPU nodes with their own names, an agent on each (`--node=sim-east`,
`--node=sim-west`, own ports, `--no-probes`), the demo pods in runc on the east node and
one more pod on the west node, and Prometheus scraping both agents -- the east agent
twice, under two addresses, as two scrape jobs or an HA pair would: the cluster view must
not double count. What `top --prometheus --once` and `--json` print is compared with the
workloads' exact allocations (the sim ledger) and with the agents' own /metrics.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.sim import demo
from gpuwatch.sim.runc import ContainerLab
from tests.conftest import need_binary, need_root
from tests.system.promstack import Prometheus, free_port, run_prometheus
from tests.system.sim_helpers import CONTEXT_BYTES, private_node
from tests.system.test_agent import running_agent, sample, scrape, wait_until
from tests.system.test_top_screen import EXIT_MARK, Pane, assert_restored, line_index, pane, tmux  # noqa: F401

MIB = 1 << 20
WEST_WORKLOADS = (demo.DemoWorkload("batch", "etl-0", "etl", gpu=1, memory_mib=4096, duty=0.1),)
NODES = {"sim-east": demo.DEFAULT_WORKLOADS, "sim-west": WEST_WORKLOADS}


@dataclass
class Cluster:
    prometheus: Prometheus
    ports: dict[str, int]


def _agent_argv(name: str, sim: Any, lab_base: Path, port: int, tmp: Path) -> list[str]:
    dirs = demo.default_lab_dirs(lab_base)
    return [sys.executable, "-m", "gpuwatch", "agent", f"--listen=127.0.0.1:{port}", f"--node={name}",
            "--interval=0.5", f"--nvml-library={sim.libraries.nvml_path}", "--no-probes", "--kmsg=none",
            f"--containerd-root={dirs['bundle_root']}", f"--runc-root={dirs['runc_root']}",
            f"--audit-log={tmp / f'{name}-audit.jsonl'}", f"--state-file={tmp / f'{name}-frozen.json'}",
            f"--lock-file={tmp / f'{name}-agent.lock'}"]  # one lock per simulated node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two nodes, their agents and Prometheus, shared by this module's tests (read-only)."""
    tmp_path = tmp_path_factory.mktemp("cluster")
    need_root()
    need_binary("runc", "runc")
    need_binary("prometheus", "prometheus")
    with ExitStack() as stack:
        ports: dict[str, int] = {}
        for name, workloads in NODES.items():
            base = tmp_path / name
            sim = stack.enter_context(private_node(base, devices=2))
            lab = stack.enter_context(ContainerLab(**demo.default_lab_dirs(base)))
            demo.start_workloads(lab, sim, workloads)
            ports[name] = free_port()
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUWATCH_SIM_STATE": str(sim.state_path)}
            stack.enter_context(running_agent(_agent_argv(name, sim, base, ports[name], tmp_path), env,
                                              tmp_path / f"{name}-agent.log", ports[name]))
        east, west = ports["sim-east"], ports["sim-west"]
        prom = stack.enter_context(run_prometheus(
            tmp_path / "prom", [f"127.0.0.1:{east}", f"localhost:{east}", f"127.0.0.1:{west}"], interval_s=0.5))
        # every pod is in Prometheus, the east ones twice (two targets: duplicate series)
        wait_until(lambda: len(prom.query('gpuwatch_container_memory_bytes{pod="trainer-0"}')) == 2, 40,
                   "the east agent scraped under both addresses")
        wait_until(lambda: len(prom.query("gpuwatch_container_memory_bytes")) == 2 * 3 + 1, 40,
                   "every pod's memory series in Prometheus")
        wait_until(lambda: len(prom.query("count by (node) (rate(gpuwatch_node_network_receive_bytes_total[1m]))"))
                   == 2, 20, "two samples of every node's NIC counters (for rate)")
        yield Cluster(prom, ports)


def top(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gpuwatch", "top", "--prometheus", cluster.prometheus.base_url, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_top_prometheus_lists_both_nodes_pods_with_their_memory(cluster: Cluster) -> None:
    result = top(cluster, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "gpuwatch.cluster/1"
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert set(nodes) == set(NODES)
    for name, workloads in NODES.items():
        node = nodes[name]
        assert node["simulated"] and node["backend_up"]
        assert node["age_s"] is not None and 0 <= node["age_s"] < 30
        assert node["network_throughput_bytes"] is not None  # rate() over the agents' NIC counters
        assert [g["index"] for g in node["gpus"]] == [0, 1] and all(g["healthy"] for g in node["gpus"])
        metrics = scrape(cluster.ports[name])
        got = {(c["namespace"], c["pod"], c["container"], c["gpu"]): c["memory_bytes"] for c in node["containers"]}
        # each pod's process: its memory and its CUDA context (518 MiB, as on an H100)
        assert got == {(w.namespace, w.pod, w.container, w.gpu): w.memory_mib * MIB + CONTEXT_BYTES
                       for w in workloads}, got
        for c in node["containers"]:  # the agent's own numbers, not double even where scraped twice
            assert c["memory_bytes"] == sample(metrics, "gpuwatch_container_memory_bytes", pod=c["pod"])
            assert c["container_id"] and c["pod_uid"]
            assert c["kernel_seconds_total"] is not None and c["sm_utilization_ratio"] is not None
        for g in node["gpus"]:
            on_gpu = sum(w.memory_mib * MIB + CONTEXT_BYTES for w in workloads if w.gpu == g["index"])
            assert g["tenants"] == sum(1 for w in workloads if w.gpu == g["index"])
            assert g["memory_used_bytes"] == sample(metrics, "gpuwatch_gpu_memory_used_bytes", gpu=str(g["index"]))
            assert g["memory_used_bytes"] >= on_gpu and g["memory_total_bytes"] > 0
    namespaces = {n["namespace"]: n["memory_bytes"] for n in doc["namespaces"]}
    assert namespaces["ml-team"] == (20480 + 8192) * MIB + 2 * CONTEXT_BYTES  # east scraped twice, counted once
    assert namespaces["inference"] == 12288 * MIB + CONTEXT_BYTES and namespaces["batch"] == 4096 * MIB + CONTEXT_BYTES


def shown_gib(memory_mib: int) -> str:
    """How top shows a pod holding `memory_mib` beside its CUDA context (518 MiB, as on an H100)."""
    return f"{(memory_mib * MIB + CONTEXT_BYTES) / 2**30:.1f}"


def test_top_prometheus_once_table_and_filters(cluster: Cluster) -> None:
    result = top(cluster, "--once")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"cluster {cluster.prometheus.base_url}  nodes 2" in lines[0]
    assert "SIMULATED GPU NODE" in result.stdout
    for name in NODES:
        assert any(line.startswith(f"{name}  GPU 0  ") for line in lines)
        assert any(line.startswith(f"{name}  GPU 1  ") for line in lines)
    rows = {line.split()[2]: line.split() for line in lines if line.startswith("  sim-")}
    assert rows["trainer-0"][:4] == ["sim-east", "ml-team", "trainer-0", "trainer"]
    assert rows["trainer-0"][4:6] == [shown_gib(20480), "GiB"]  # 20.5
    assert rows["etl-0"][:6] == ["sim-west", "batch", "etl-0", "etl", shown_gib(4096), "GiB"]  # 4.5
    assert len(rows) == 4

    west = json.loads(top(cluster, "--json", "--node", "sim-west").stdout)
    assert [n["name"] for n in west["nodes"]] == ["sim-west"]
    ml = top(cluster, "--once", "--flat", "--namespace", "ml-team", "--sort", "name")
    assert [line.split()[2] for line in ml.stdout.splitlines() if line.startswith("  sim-")] == [
        "notebook-1", "trainer-0"]
    missing = top(cluster, "--once", "--node", "sim-north")
    assert missing.returncode == 1 and "no gpuwatch data for node 'sim-north'" in missing.stderr


def test_live_cluster_screen(cluster: Cluster, pane: Pane) -> None:  # noqa: F811 (pytest fixture)
    argv = [sys.executable, "-m", "gpuwatch", "top", "--prometheus", cluster.prometheus.base_url, "-d", "0.5"]
    modes = "stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' '"
    pane.start(f"{shlex.join(argv)}; echo {EXIT_MARK}$?; echo MODES: $({modes}); sleep 120", width=140)
    screen = pane.wait_text("sim-west  GPU 1")
    assert "nodes 2" in screen and "containers 4" in screen
    assert line_index(screen, "sim-east  GPU 0") < line_index(screen, "trainer-0") < line_index(
        screen, "sim-east  GPU 1") < line_index(screen, "sim-west  GPU 0") < line_index(screen, "etl-0")

    pane.keys("g")  # one flat list over both nodes, biggest memory first
    screen = pane.wait_text("flat")
    header = screen.splitlines()[line_index(screen, "NAMESPACE")].split()
    assert header[:5] == ["NODE", "NAMESPACE", "POD", "CONTAINER", "GPU"]
    order = [line_index(screen, pod) for pod in ("trainer-0", "server-0", "notebook-1", "etl-0")]
    assert order == sorted(order)

    pane.keys("/", "west", "Enter")
    screen = pane.wait_text("filter 'west'")
    assert "etl-0" in screen and "trainer-0" not in screen

    pane.keys("q")
    pane.wait_text(EXIT_MARK)
    assert_restored(pane.wait_text("MODES:"), 0)
