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


EXTENDER_FIELDS = {"urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "bindVerb", "weight", "enableHTTPS",
                   "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable"}


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for unit in ("ms", "s", "m"):
        if duration.endswith(unit):
            return float(duration[: -len(unit)]) * units[unit]
    raise AssertionError(f"bad duration {duration!r}")


def test_kube_scheduler_configuration_calls_the_extender_service() -> None:
    """Fields as kubescheduler.config.k8s.io/v1 Extender defines them (json names), verbs the
    server answers, the Service it reaches, a timeout above the extender's Prometheus timeout."""
    import kubernetes_validate

    from gpuwatch.extender.server import VERBS

    config = _load("kube-scheduler-config.yaml")
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in config["profiles"]] == ["default-scheduler"]  # the kubeadm route
    (ext,) = config["extenders"]
    assert set(ext) <= EXTENDER_FIELDS, set(ext) - EXTENDER_FIELDS
    assert ext["filterVerb"] in VERBS and ext["prioritizeVerb"] in VERBS
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is True
    assert 1 <= ext["weight"] <= 100
    assert _seconds(ext["httpTimeout"]) > 2.0  # the extender's default --prometheus-timeout
    assert [r["name"] for r in ext["managedResources"]] == ["nvidia.com/gpu"]
    docs = [d for d in yaml.safe_load_all((SCHEDULING / "extender.yaml").read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    kinds = {d["kind"]: d for d in docs}
    service = kinds["Service"]
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    port = service["spec"]["ports"][0]["port"]
    assert ext["urlPrefix"] == f"http://{host}:{port}"
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "extender"
    assert f"--listen=0.0.0.0:{container['ports'][0]['containerPort']}" in container["args"]
    assert kinds["Deployment"]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
