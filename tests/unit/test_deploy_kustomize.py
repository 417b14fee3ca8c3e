"""The kustomize base and overlays in deploy/kubernetes render (kubectl's built-in kustomize)
into manifests that validate against the offline API schemas, and every manifest names the
image deploy/image/build.sh builds and tags."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuwatch.probes.bcc_loader import BUNDLED_HEADERS
from tests.conftest import need_binary
from tests.unit.test_deploy_manifests import CRD_KINDS, KUBERNETES_VERSION, _check_node_feature_rule

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
OVERLAYS = sorted(p.parent for p in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
BUILD_SH = ROOT / "deploy" / "image" / "build.sh"


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR`: the documents kubectl apply -k would send."""
    kubectl = need_binary("kubectl", "kubectl (its built-in kustomize renders the manifests)")
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def image_ref() -> str:
    """What `build.sh ref` prints: the reference the build tags its image with."""
    proc = subprocess.run(["bash", str(BUILD_SH), "ref"], capture_output=True, text=True, timeout=30, check=True)
    return proc.stdout.strip()


def key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def validate(doc: dict[str, Any]) -> None:
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"] == CRD_KINDS[doc["kind"]]
        if doc["kind"] == "NodeFeatureRule":
            _check_node_feature_rule(doc)
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def daemonset_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return dict(container)


@pytest.mark.parametrize("directory", [BASE, *OVERLAYS], ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_kustomization_renders_valid_manifests(directory: Path) -> None:
    docs = render(directory)
    assert docs
    for doc in docs:
        validate(doc)


def test_base_holds_every_manifest_file() -> None:
    """A manifest added to base/ but not to its kustomization would never be deployed."""
    files = {key(doc) for path in BASE.glob("*.yaml") if path.name != "kustomization.yaml"
             for doc in yaml.safe_load_all(path.read_text()) if doc}
    assert {key(doc) for doc in render(BASE)} == files


def test_without_crds_overlay_drops_only_the_crd_objects() -> None:
    base = {key(d): d for d in render(BASE)}
    plain = {key(d): d for d in render(KUBERNETES / "overlays" / "without-crds")}
    assert {kind for kind, _ in base} >= set(CRD_KINDS)
    assert set(plain) == {k for k in base if k[0] not in CRD_KINDS}
    assert all(plain[k] == base[k] for k in plain)


def test_manifests_name_the_image_the_build_script_makes() -> None:
    ref = image_ref()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ref.endswith(":" + version)
    container = daemonset_container(render(BASE))
    assert container["image"] == ref
    assert container["imagePullPolicy"] == "IfNotPresent", "a locally loaded image must not be pulled"
    (extender,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "scheduling" / "extender.yaml").read_text())
                   if d and d["kind"] == "Deployment"]
    assert extender["spec"]["template"]["spec"]["containers"][0]["image"] == ref


def test_registry_overlay_retags_the_image() -> None:
    container = daemonset_container(render(KUBERNETES / "overlays" / "registry"))
    name, _, tag = container["image"].rpartition(":")
    assert name != image_ref().rpartition(":")[0] and tag == image_ref().rpartition(":")[2]
    assert container["imagePullPolicy"] == "Always"


def test_daemonset_mounts_what_the_agent_reads_on_the_host() -> None:
    """The host's whole cgroup tree (a private cgroup namespace would otherwise hide the pods),
    host /proc at the --proc-root the agent is given, bpffs; no host kernel headers: BCC compiles
    against the image's bundled tree, which no mount may hide."""
    docs = render(BASE)
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    container = daemonset_container(docs)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host[mounts["/sys/fs/cgroup"]] == "/sys/fs/cgroup"
    assert host[mounts["/host/proc"]] == "/proc" and "--proc-root=/host/proc" in container["args"]
    assert host[mounts["/sys/fs/bpf"]] == "/sys/fs/bpf"
    assert not {"/lib/modules", "/usr/src", "/opt/gpuwatch/kernel-headers"} & set(mounts), mounts
    assert not [m for m in mounts if BUNDLED_HEADERS.is_relative_to(m) and m != "/"], mounts
    assert pod["hostPID"] is True and container["securityContext"]["privileged"] is True
