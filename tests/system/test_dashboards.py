"""Every dashboard panel's PromQL returns data from a live Prometheus fed by gpuwatch.

Grafana itself is not installable here, so the dashboards are checked where they can
break: their queries, run by a real Prometheus scraping the exporter on a simulated node
with three real runc pods.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.conftest import need_bcc, need_binary, need_root
from tests.system.promstack import free_port, run_prometheus
from tests.system.test_agent import agent_argv, pods, running_agent, sim_node

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
# Grafana's variables as it fills them in: $__rate_interval is max(4 x scrape interval,
# step + scrape interval), at least 1m with the default 15 s scrape; $__range the time range
TEMPLATE_VALUES = {"$node": ".*", "$namespace": ".*", "$__rate_interval": "1m", "$__range": "1h"}


def _queries() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            for target in panel.get("targets", []):
                found.append((path.name, panel["title"], target["expr"]))
    return found


def _expand(expr: str) -> str:
    return re.sub(r"\$(__rate_interval|__range|node|namespace)", lambda m: TEMPLATE_VALUES[m.group(0)], expr)


def test_dashboards_are_well_formed() -> None:
    queries = _queries()
    assert len(queries) >= 15
    for path in DASHBOARDS.glob("*.json"):
        doc = json.loads(path.read_text())
        assert doc["uid"] and doc["title"].startswith("gpuwatch")
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"


@pytest.mark.slow
def test_every_panel_query_returns_data(tmp_path: Path) -> None:
    """The real agent (probes + alert-only enforcer) on the simulated node, then the pods."""
    need_root()
    need_bcc()
    need_binary("runc", "runc")
    prometheus = need_binary("prometheus", "prometheus")
    port = free_port()
    policy = Path(__file__).resolve().parents[2] / "deploy" / "policies" / "alert-only.yaml"
    with sim_node(tmp_path / "node") as sim, \
            running_agent(agent_argv(sim, tmp_path / "node", port, tmp_path, f"--policy={policy}"),
                          {**os.environ, "GPUWATCH_SIM_STATE": str(sim.state_path)}, tmp_path / "agent.log", port), \
            pods(tmp_path / "node", sim), \
            run_prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"], binary=prometheus, interval_s=0.5,
                           rule_files=[DASHBOARDS / "gpuwatch-rules.yml"]) as prom:
        assert prom.wait_for('gpuwatch_container_memory_bytes{namespace="ml-team"}', timeout_s=20)
        time.sleep(3)  # enough samples for rate() windows
        empty = []
        for dashboard, title, expr in _queries():
            if not prom.query(_expand(expr)):
                empty.append(f"{dashboard}: {title}: {expr}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
        # Variables' label_values queries, as Grafana runs them
        assert {r["metric"]["namespace"] for r in prom.query("gpuwatch_namespace_memory_bytes")} >= {
            "ml-team", "inference"}
