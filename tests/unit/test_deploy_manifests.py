"""Kubernetes manifests validate against the offline API schemas (kubernetes-validate).

The ServiceMonitor is a Prometheus Operator CRD with no built-in schema: it is checked for
the fields the operator needs instead, and named in the skip list explicitly. So is the
NodeFeatureRule (Node Feature Discovery's CRD): it is checked against the shape NFD's CRD
and API types define, and against the labels the agent actually writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base"  # the kustomize base
CRD_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "PrometheusRule": "monitoring.coreos.com/v1",
             "NodeFeatureRule": "nfd.k8s-sigs.io/v1alpha1"}
KUBERNETES_VERSION = "1.30"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue  # kustomize's own file (rendered and validated in test_deploy_kustomize.py)
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


@pytest.mark.parametrize(("name", "doc"), _documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_manifest_is_valid(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"] == CRD_KINDS[doc["kind"]]
        if doc["kind"] == "ServiceMonitor":
            assert doc["spec"]["endpoints"][0]["port"] == "metrics"
        elif doc["kind"] == "PrometheusRule":  # its groups = the rule file (test_kube_prometheus.py)
            assert doc["spec"]["groups"] and all(g["name"] and g["rules"] for g in doc["spec"]["groups"])
        else:
            _check_node_feature_rule(doc)
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_daemonset_serves_metrics_port_matching_service() -> None:
    docs = {d["kind"]: d for _, d in _documents()}
    container = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == 9400
    assert "--listen=0.0.0.0:9400" in container["args"]
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "metrics"
    assert docs["DaemonSet"]["spec"]["template"]["spec"]["hostPID"] is True


def test_shipped_policies_are_valid(tmp_path: Path) -> None:
    """The ConfigMap's policy and every example policy load without errors."""
    from gpuwatch.policy.loader import load_policy

    docs = {d["kind"]: d for _, d in _documents()}
    embedded = tmp_path / "policy.yaml"
    embedded.write_text(docs["ConfigMap"]["data"]["policy.yaml"])
    load_policy(embedded)
    for example in sorted((DEPLOY.parents[1] / "policies").glob("*.yaml")):
        load_policy(example)


# --- NodeFeatureRule (nfd.k8s-sigs.io/v1alpha1) --------------------------------------------------
# The shape below is NFD's, from github.com/kubernetes-sigs/node-feature-discovery:
# api/nfd/v1alpha1/types.go (Rule, FeatureMatcherTerm, MatchExpression, MatchOp and the value
# counts each op takes), deployment/base/nfd-crds/nfd-api-crds.yaml (cluster scope; required
# rules[].name, matchFeatures[].feature, matchExpressions.*.op, taints[].key/effect),
# pkg/apis/nfd/validate/validate.go (feature names are <domain>.<feature>; taint keys need a
# prefix outside kubernetes.io) and pkg/apis/nfd/nodefeaturerule/expression.go (Gt/Ge/Lt/Le
# compare integers with strconv.Atoi unless type is "version").

_RULE_KEYS = {"name", "labels", "labelsTemplate", "annotations", "vars", "varsTemplate", "taints",
              "extendedResources", "matchFeatures", "matchAny"}
_TERM_KEYS = {"feature", "matchExpressions", "matchName"}
_NO_VALUE_OPS = {"Exists", "DoesNotExist", "IsTrue", "IsFalse"}
_ONE_VALUE_OPS = {"Gt", "Ge", "Lt", "Le"}
_TWO_VALUE_OPS = {"GtLt", "GeLe"}
_SOME_VALUE_OPS = {"In", "NotIn", "InRegexp"}
_TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}


def _check_expression(where: str, expr: Any) -> None:
    assert isinstance(expr, dict) and set(expr) <= {"op", "value", "type"}, f"{where}: {expr!r}"
    op = expr["op"]
    values = expr.get("value", [])
    assert isinstance(values, list) and all(isinstance(v, str) for v in values), f"{where}: value must be strings"
    assert expr.get("type", "") in ("", "version"), f"{where}: type"
    if op in _NO_VALUE_OPS:
        assert not values, f"{where}: {op} takes no value"
    elif op in _ONE_VALUE_OPS or op in _TWO_VALUE_OPS:
        assert len(values) == (1 if op in _ONE_VALUE_OPS else 2), f"{where}: {op} value count"
        if expr.get("type", "") != "version":
            for v in values:
                int(v)  # strconv.Atoi in NFD; a ValueError fails the test
    else:
        assert op in _SOME_VALUE_OPS, f"{where}: unknown op {op!r}"
        assert values, f"{where}: {op} needs values"


def _check_node_feature_rule(doc: dict[str, Any]) -> None:
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}
    assert "namespace" not in doc["metadata"], "NodeFeatureRule is cluster-scoped"
    assert doc["metadata"]["name"]
    assert set(doc["spec"]) == {"rules"} and doc["spec"]["rules"]
    for rule in doc["spec"]["rules"]:
        assert isinstance(rule["name"], str) and rule["name"]
        assert set(rule) <= _RULE_KEYS, set(rule) - _RULE_KEYS
        for taint in rule.get("taints", []):
            assert set(taint) <= {"key", "value", "effect"} and taint["effect"] in _TAINT_EFFECTS
            prefix, slash, _ = taint["key"].partition("/")
            assert slash and prefix != "kubernetes.io" and not prefix.endswith(".kubernetes.io")
        terms = list(rule.get("matchFeatures", []))
        for any_of in rule.get("matchAny", []):
            terms += any_of["matchFeatures"]
        assert terms, "a rule without matchers matches every node"
        for term in terms:
            assert set(term) <= _TERM_KEYS and len(term["feature"].split(".")) == 2, term
            for element, expr in (term.get("matchExpressions") or {}).items():
                _check_expression(f"{rule['name']}/{term['feature']}/{element}", expr)
            if "matchName" in term:
                _check_expression(f"{rule['name']}/{term['feature']}/matchName", term["matchName"])


def _unhealthy_rule() -> dict[str, Any]:
    (doc,) = [d for _, d in _documents() if d["kind"] == "NodeFeatureRule"]
    (rule,) = doc["spec"]["rules"]
    return dict(rule)


def test_nodefeaturerule_taints_unhealthy_gpu_nodes() -> None:
    from gpuwatch.signals.nfd import LABEL_PREFIX

    rule = _unhealthy_rule()
    assert rule["taints"] == [{"key": "gpuwatch.io/gpu-unhealthy", "value": "true", "effect": "NoSchedule"}]
    (term,) = rule["matchFeatures"]
    assert term["feature"] == "local.feature"  # what NFD's local source calls the feature-file lines
    assert term["matchExpressions"] == {LABEL_PREFIX + "gpu.unhealthy-count": {"op": "Gt", "value": ["0"]}}


def test_nodefeaturerule_matches_what_the_agent_writes(tmp_path: Path) -> None:
    """Evaluate the rule (Gt on the integer feature value, absent -> no match) on the files the
    agent writes for a healthy node, a node with an unhealthy GPU, and a node with no GPU facts."""
    from gpuwatch.core.model import DeviceInfo, GpuHealth, NodeSignals, Snapshot
    from gpuwatch.signals.nfd import FeatureFileWriter, node_labels
    from tests.nfd_rules import check_feature_file

    (term,) = _unhealthy_rule()["matchFeatures"]
    ((element, expr),) = term["matchExpressions"].items()

    def matches(features: dict[str, str]) -> bool:
        return element in features and int(features[element]) > int(expr["value"][0])

    gpus = tuple(DeviceInfo(index=i, uuid=f"GPU-{i}", name="H100", pci_bus_id=None, memory_total_bytes=1 << 36,
                            memory_used_bytes=None, memory_free_bytes=None) for i in range(2))
    cases = {
        "healthy": (Snapshot(0.0, "n", gpus, ()), False),
        "unhealthy": (Snapshot(0.0, "n", gpus, (), signals=NodeSignals(
            health=(GpuHealth(0, "GPU-0", True, "ok"), GpuHealth(1, "GPU-1", False, "xid", xid=79)))), True),
        "unknown": (Snapshot(0.0, "n", (), (), gpu_up=False), False),
    }
    for name, (snapshot, tainted) in cases.items():
        path = tmp_path / name / "gpuwatch"
        assert FeatureFileWriter(path, interval_s=1.0).update(node_labels(snapshot))
        assert matches(check_feature_file(path)) is tainted, name


@pytest.mark.parametrize("breakage", ["op", "value", "effect", "feature", "namespace", "taint-key", "no-match"])
def test_nodefeaturerule_check_is_not_vacuous(breakage: str) -> None:
    import copy

    (doc,) = [d for _, d in _documents() if d["kind"] == "NodeFeatureRule"]
    doc = copy.deepcopy(doc)
    rule = doc["spec"]["rules"][0]
    expr = next(iter(rule["matchFeatures"][0]["matchExpressions"].values()))
    if breakage == "op":
        expr["op"] = "GreaterThan"
    elif breakage == "value":
        expr["value"] = ["zero"]
    elif breakage == "effect":
        rule["taints"][0]["effect"] = "NoSchedul"
    elif breakage == "feature":
        rule["matchFeatures"][0]["feature"] = "local"
    elif breakage == "namespace":
        doc["metadata"]["namespace"] = "gpuwatch"
    elif breakage == "taint-key":
        rule["taints"][0]["key"] = "node.kubernetes.io/gpu-unhealthy"
    else:
        del rule["matchFeatures"]
    with pytest.raises((AssertionError, ValueError, KeyError)):
        _check_node_feature_rule(doc)


def test_daemonset_writes_nfd_features_where_nfd_reads_them_and_tolerates_its_taint() -> None:
    docs = {d["kind"]: d for _, d in _documents()}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    (arg,) = [a for a in container["args"] if a.startswith("--nfd-features-file=")]
    path = Path(arg.split("=", 1)[1])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert str(path.parent) in mounts
    assert volumes[mounts[str(path.parent)]]["hostPath"]["path"] == "/etc/kubernetes/node-feature-discovery/features.d"
    rule = docs["NodeFeatureRule"]["spec"]["rules"][0]
    taint_keys = {t["key"] for t in rule["taints"]}
    tolerated = {t["key"] for t in pod["tolerations"] if t.get("operator") == "Exists"}
    assert taint_keys <= tolerated
