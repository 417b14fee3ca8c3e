"""deploy/scheduling/: the example policies for the engines that read gpuwatch's Prometheus
signals name recording rules that really exist, in the shape each engine expects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEDULING = ROOT / "deploy" / "scheduling"


def _recorded() -> dict[str, str]:
    rules = yaml.safe_load((ROOT / "dashboards" / "gpuwatch-rules.yml").read_text())
    return {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}


def _load(name: str) -> Any:
    return yaml.safe_load((SCHEDULING / name).read_text())


def test_descheduler_policy_queries_a_ratio_rule_keyed_by_instance() -> None:
    policy = _load("descheduler-policy.yaml")
    assert policy["apiVersion"] == "descheduler/v1alpha2" and policy["kind"] == "DeschedulerPolicy"
    assert policy["prometheus"]["url"].startswith("http")
    (profile,) = policy["profiles"]
    configs = {c["name"]: c.get("args", {}) for c in profile["pluginConfig"]}
    args = configs["LowNodeUtilization"]
    assert args["metricsUtilization"]["source"] == "Prometheus"
    query = args["metricsUtilization"]["prometheus"]["query"]
    recorded = _recorded()
    assert query in recorded, f"{query} is not a recording rule in dashboards/gpuwatch-rules.yml"
    assert query.endswith("_ratio") or query.endswith(":ratio")
    assert set(args["thresholds"]) == set(args["targetThresholds"]) == {"MetricResource"}
    assert 0 < args["thresholds"]["MetricResource"] < args["targetThresholds"]["MetricResource"] <= 100
    assert "LowNodeUtilization" in profile["plugins"]["balance"]["enabled"]


def test_every_instance_rule_relabels_node_to_instance() -> None:
    recorded = _recorded()
    base = [name for name, expr in recorded.items() if name.startswith("instance:") and "label_replace" in expr]
    assert base, "no instance-level recording rules"
    for name in base:
        assert '"instance", "$1", "node"' in recorded[name], name


def test_crane_policy_names_percent_rules() -> None:
    policy = _load("crane-scheduler-policy.yaml")
    assert policy["kind"] == "DynamicSchedulerPolicy"
    assert policy["apiVersion"] == "scheduler.policy.crane.io/v1alpha1"
    spec = policy["spec"]
    recorded = _recorded()
    synced = {p["name"] for p in spec["syncPolicy"]}
    for section in ("predicate", "priority"):
        for entry in spec[section]:
            assert entry["name"] in synced, f"{section} {entry['name']} is not synced"
    for name in synced:
        assert name in recorded and name.endswith("_percent"), name
    for entry in spec["predicate"]:
        assert 0 < entry["maxLimitPecent"] <= 1  # crane's own (misspelt) field name
    assert abs(sum(p["weight"] for p in spec["priority"]) - 1.0) < 1e-9
