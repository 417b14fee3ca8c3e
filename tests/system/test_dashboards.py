"""Every dashboard panel's PromQL returns data from a live Prometheus fed by gpuwatch.

Grafana itself is not installable here, so the dashboards are checked where they can
break: their queries, run by a real Prometheus scraping the exporter on a simulated node
with three real runc pods.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.conftest import need_binary, need_root
from tests.system.demo_node import demo_node
from tests.system.promstack import run_prometheus

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
TEMPLATE_VALUES = {"$node": ".*", "$namespace": ".*"}


def _queries() -> list[tuple[str, str, str]]:
    found = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            for target in panel.get("targets", []):
                found.append((path.name, panel["title"], target["expr"]))
    return found


def _expand(expr: str) -> str:
    return re.sub(r"\$(node|namespace)", lambda m: TEMPLATE_VALUES[m.group(0)], expr)


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
    need_root()
    need_binary("runc", "runc")
    prometheus = need_binary("prometheus", "prometheus")
    with demo_node(tmp_path / "node") as node, \
            run_prometheus(tmp_path / "prom", [node.target], binary=prometheus, interval_s=0.5) as prom:
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
