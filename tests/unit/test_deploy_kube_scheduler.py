"""Both kube-scheduler routes, validated offline: the default scheduler's configuration
(kubeadm's static pod) and the second scheduler's manifests. Field names are
kubescheduler.config.k8s.io/v1's (KubeSchedulerConfiguration, LeaderElectionConfiguration,
ClientConnectionConfiguration json tags); the manifests validate against the 1.30 API
schemas; the RBAC is what kube-scheduler needs; leader election is on with a lease each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEDULING = ROOT / "deploy" / "scheduling"
CONFIG_FIELDS = {"apiVersion", "kind", "parallelism", "leaderElection", "clientConnection", "healthzBindAddress",
                 "metricsBindAddress", "enableProfiling", "enableContentionProfiling", "percentageOfNodesToScore",
                 "podInitialBackoffSeconds", "podMaxBackoffSeconds", "profiles", "extenders",
                 "delayCacheUntilActive"}
LEADER_ELECTION_FIELDS = {"leaderElect", "leaseDuration", "renewDeadline", "retryPeriod", "resourceLock",
                          "resourceName", "resourceNamespace"}
CLIENT_CONNECTION_FIELDS = {"kubeconfig", "acceptContentTypes", "contentType", "qps", "burst"}


def _second() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((SCHEDULING / "second-scheduler.yaml").read_text()) if d]


def _second_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return dict(yaml.safe_load(cm["data"]["config.yaml"]))


def _check_config(config: dict[str, Any]) -> None:
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert set(config) <= CONFIG_FIELDS, set(config) - CONFIG_FIELDS
    assert set(config["leaderElection"]) <= LEADER_ELECTION_FIELDS
    assert set(config["clientConnection"]) <= CLIENT_CONNECTION_FIELDS
    assert config["leaderElection"]["leaderElect"] is True, "HA control planes need leader election"
    assert "kubeconfig" in config["clientConnection"], "with --config, kube-scheduler ignores --kubeconfig"


def test_default_scheduler_route_names_kubeadms_kubeconfig_and_lease() -> None:
    config = yaml.safe_load((SCHEDULING / "kube-scheduler-config.yaml").read_text())
    _check_config(config)
    assert config["clientConnection"]["kubeconfig"] == "/etc/kubernetes/scheduler.conf"
    election = config["leaderElection"]
    assert (election["resourceNamespace"], election["resourceName"]) == ("kube-system", "kube-scheduler")
    assert [p["schedulerName"] for p in config["profiles"]] == ["default-scheduler"]


def test_second_scheduler_manifests_validate() -> None:
    docs = _second()
    assert {d["kind"] for d in docs} == {"ServiceAccount", "ClusterRoleBinding", "RoleBinding", "Role", "ConfigMap",
                                         "Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_second_scheduler_config_has_its_own_lease_and_the_same_extender() -> None:
    docs = _second()
    config = _second_config(docs)
    _check_config(config)
    assert config["clientConnection"]["kubeconfig"] == "", "in-cluster: the ServiceAccount's token"
    election = config["leaderElection"]
    assert election["resourceName"] != "kube-scheduler"
    assert [p["schedulerName"] for p in config["profiles"]] == ["gpuwatch-scheduler"]
    default = yaml.safe_load((SCHEDULING / "kube-scheduler-config.yaml").read_text())
    assert config["extenders"] == default["extenders"]


def test_second_scheduler_deployment_runs_the_config_with_a_standby() -> None:
    docs = _second()
    config = _second_config(docs)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] >= 2  # leader + standby
    assert pod.get("automountServiceAccountToken", True) is not False  # the in-cluster kubeconfig
    (container,) = pod["containers"]
    (flag,) = [a for a in container["command"] if a.startswith("--config=")]
    path = Path(flag.split("=", 1)[1])
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
    assert volumes[mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert path.name in cm["data"]
    assert config["leaderElection"]["resourceNamespace"] == deployment["metadata"]["namespace"]
    assert container["livenessProbe"]["httpGet"]["port"] == 10259  # kube-scheduler's secure port


def test_second_scheduler_rbac_is_what_kube_scheduler_needs() -> None:
    docs = _second()
    config = _second_config(docs)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    account = sa["metadata"]["name"]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account

    def bound(kind: str) -> dict[str, dict[str, Any]]:
        out = {}
        for doc in docs:
            if doc["kind"] == kind and any(s["kind"] == "ServiceAccount" and s["name"] == account
                                           and s["namespace"] == sa["metadata"]["namespace"]
                                           for s in doc["subjects"]):
                out[doc["roleRef"]["name"]] = doc
        return out

    assert {"system:kube-scheduler", "system:volume-scheduler"} <= set(bound("ClusterRoleBinding"))
    role_bindings = bound("RoleBinding")
    assert role_bindings["extension-apiserver-authentication-reader"]["metadata"]["namespace"] == "kube-system"
    election = config["leaderElection"]
    (lease_role,) = [d for d in docs if d["kind"] == "Role"]
    assert lease_role["metadata"]["name"] in role_bindings
    assert lease_role["metadata"]["namespace"] == election["resourceNamespace"]
    verbs = {v for rule in lease_role["rules"] if "leases" in rule["resources"]
             and election["resourceName"] in rule.get("resourceNames", [election["resourceName"]])
             for v in rule["verbs"]}
    assert {"create", "get", "update"} <= verbs
