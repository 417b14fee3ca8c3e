"""Where the agent DaemonSet lands and how the kubelet judges it: GPU nodes by GPU Feature
Discovery's or Node Feature Discovery's labels (either), every node with overlays/all-nodes;
liveness on /healthz and readiness on /readyz of the metrics port; maxUnavailable spelled out."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_deploy_kustomize import KUBERNETES, render

GFD = {"nvidia.com/gpu.present": "true"}
NFD_VENDOR = {"feature.node.kubernetes.io/pci-10de.present": "true"}  # deviceLabelFields [vendor]
NFD_DEFAULT = {"feature.node.kubernetes.io/pci-0302_10de.present": "true"}  # [class, vendor], 3D controller


def _daemonset(overlay: str | None = None) -> dict[str, Any]:
    directory = KUBERNETES / "base" if overlay is None else KUBERNETES / "overlays" / overlay
    (ds,) = [d for d in render(directory) if d["kind"] == "DaemonSet"]
    return ds


def _schedules_on(ds: dict[str, Any], labels: dict[str, str]) -> bool:
    """kube-scheduler's NodeAffinity + nodeSelector for In/Exists terms (terms ORed, expressions ANDed)."""
    pod = ds["spec"]["template"]["spec"]
    if not pod.get("nodeSelector", {}).items() <= labels.items():
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True

    def matches(expr: dict[str, Any]) -> bool:
        if expr["operator"] == "In":
            return labels.get(expr["key"]) in expr["values"]
        if expr["operator"] == "Exists":
            return expr["key"] in labels
        raise AssertionError(f"operator {expr['operator']} not modelled here")

    return any(all(matches(e) for e in term["matchExpressions"]) for term in required["nodeSelectorTerms"])


@pytest.mark.parametrize(("labels", "expected"), [(GFD, True), (NFD_VENDOR, True), (NFD_DEFAULT, True),
                                                  ({"feature.node.kubernetes.io/pci-0300_10de.present": "true"},
                                                   True),
                                                  ({"feature.node.kubernetes.io/pci-0300_1002.present": "true"},
                                                   False),  # an AMD GPU
                                                  ({}, False)])
def test_base_lands_on_gpu_nodes_by_either_labeller(labels: dict[str, str], expected: bool) -> None:
    assert _schedules_on(_daemonset(), {"kubernetes.io/os": "linux", **labels}) is expected


def test_all_nodes_overlay_lands_everywhere_and_changes_nothing_else() -> None:
    ds = _daemonset("all-nodes")
    assert _schedules_on(ds, {}) and _schedules_on(ds, GFD)
    base = _daemonset()
    del base["spec"]["template"]["spec"]["affinity"]
    assert ds == base


def test_probes_use_the_agents_health_endpoints() -> None:
    ds = _daemonset()
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # liveness must not kill an agent still compiling its probes
    assert container["livenessProbe"]["initialDelaySeconds"] >= 15


def test_max_unavailable_is_explicit() -> None:
    strategy = _daemonset()["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 1
