"""kube-prometheus fit: the PrometheusRule and dashboards ConfigMap are the dashboards/ files
(one source, generated), kube-prometheus-stack's `release` label on what its Prometheus
selects, Grafana's sidecar label, `$__rate_interval` in rate panels, and every alert with a
description, a runbook section and a promtool case that fires it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from tests.unit.test_deploy_kustomize import KUBERNETES, render

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
RULES = DASHBOARDS / "gpuwatch-rules.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_PREFIX = "https://github.com/gpuwatch/gpuwatch/blob/main/docs/runbooks.md#"
PROMTOOL_TESTS = sorted((DASHBOARDS / "tests").glob("*_test.yml"))


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_generate", KUBERNETES / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_generated_files_are_up_to_date() -> None:
    for path, text in _generator().outputs().items():
        assert path.read_text() == text, f"{path.name} is stale: run `python3 deploy/kubernetes/generate.py`"


def test_prometheus_rule_is_the_rules_file() -> None:
    (rule,) = [d for d in render(KUBERNETES / "base") if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_dashboards_configmap_carries_every_dashboard_for_the_sidecar() -> None:
    (cm,) = [d for d in render(KUBERNETES / "base") if d["kind"] == "ConfigMap"
             and d["metadata"]["name"] == "gpuwatch-dashboards"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}
    assert cm["data"] == files
    assert sum(len(v) for v in cm["data"].values()) < 256 * 1024  # kubectl apply's annotation limit


def test_kube_prometheus_stack_overlay_sets_the_release_label() -> None:
    docs = render(KUBERNETES / "overlays" / "kube-prometheus-stack")
    selected = {d["kind"]: d for d in docs if d["kind"] in ("ServiceMonitor", "PrometheusRule")}
    assert set(selected) == {"ServiceMonitor", "PrometheusRule"}
    for doc in selected.values():
        assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack", doc["kind"]
    base = {(d["kind"], d["metadata"]["name"]): d for d in render(KUBERNETES / "base")}
    for doc in docs:  # nothing else changes
        if doc["kind"] not in selected:
            assert base[(doc["kind"], doc["metadata"]["name"])] == doc
    # the ServiceMonitor still selects the agent's Service
    (service,) = [d for d in docs if d["kind"] == "Service"]
    matcher = selected["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
    assert matcher.items() <= service["metadata"]["labels"].items()


def test_every_alert_has_a_description_and_a_runbook_section() -> None:
    anchors = {h.strip().lower() for h in re.findall(r"^## (\S+)\s*$", RUNBOOKS.read_text(), re.M)}
    names = set()
    for alert in _alerts():
        name, annotations = alert["alert"], alert.get("annotations", {})
        names.add(name)
        assert annotations.get("summary") and annotations.get("description"), name
        assert annotations.get("runbook_url") == RUNBOOK_PREFIX + name.lower(), name
        assert name.lower() in anchors, f"docs/runbooks.md has no section `## {name}`"
    assert anchors == {n.lower() for n in names}, "runbook sections without an alert"


def test_every_alert_has_a_promtool_case_that_fires_it() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for path in PROMTOOL_TESTS:
        doc = yaml.safe_load(path.read_text())
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check["exp_alerts"] else silent).add(check["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names <= fired, f"alerts no promtool case fires: {sorted(names - fired)}"
    assert names <= silent, f"alerts with no case where they stay silent: {sorted(names - silent)}"


def _panel_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']}", panel["type"], target["expr"]))
    return out


def test_rate_and_increase_panels_use_grafanas_intervals() -> None:
    """A fixed [1m] has fewer than two samples at 30-60 s scrape intervals (empty panels);
    $__rate_interval adapts to the scrape interval and the step; totals over the range use
    $__range."""
    checked = 0
    for where, kind, expr in _panel_queries():
        windows = re.findall(r"\b(?:rate|increase|irate)\([^\[]*\[([^\]]+)\]", expr)
        for window in windows:
            checked += 1
            wanted = "$__rate_interval" if kind == "timeseries" else "$__range"
            assert window == wanted, f"{where}: [{window}], want [{wanted}]"
    assert checked >= 9
