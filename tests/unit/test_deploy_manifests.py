"""Kubernetes manifests validate against the offline API schemas (kubernetes-validate).

The ServiceMonitor is a Prometheus Operator CRD with no built-in schema: it is checked for
the fields the operator needs instead, and named in the skip list explicitly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
CRD_KINDS = {"ServiceMonitor"}
KUBERNETES_VERSION = "1.30"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


@pytest.mark.parametrize(("name", "doc"), _documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_manifest_is_valid(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert doc["spec"]["endpoints"][0]["port"] == "metrics"
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
    for example in sorted((DEPLOY.parent / "policies").glob("*.yaml")):
        load_policy(example)
