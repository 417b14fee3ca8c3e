"""Pod/namespace/container names from runtime state files: OCI annotations (containerd CRI,
CRI-O), Docker's config.v2.json, runc's state.json; lookups under injected roots; garbage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatch.containers.metadata import (
    BundleRoots,
    MetadataLookup,
    metadata_from_annotations,
    parse_docker_config_v2,
    parse_oci_config,
    parse_runc_state,
)

ID = "b" * 64
UID = "11111111-2222-3333-4444-555555555555"

# What containerd's CRI plugin writes (io.kubernetes.cri.* keys, pkg/cri/annotations).
CONTAINERD_ANN = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.container-name": "trainer",
    "io.kubernetes.cri.sandbox-name": "resnet-0",
    "io.kubernetes.cri.sandbox-namespace": "ml",
    "io.kubernetes.cri.sandbox-uid": UID,
    "io.kubernetes.cri.sandbox-id": "c" * 64,
}
# What CRI-O writes: kubelet labels in io.kubernetes.cri-o.Labels (a JSON string) and its own keys.
CRIO_ANN = {
    "io.kubernetes.cri-o.ContainerType": "container",
    "io.kubernetes.cri-o.ContainerName": f"k8s_infer_llm-7d9f_serving_{UID}_0",
    "io.kubernetes.cri-o.Labels": json.dumps(
        {
            "io.kubernetes.container.name": "infer",
            "io.kubernetes.pod.name": "llm-7d9f",
            "io.kubernetes.pod.namespace": "serving",
            "io.kubernetes.pod.uid": UID,
        }
    ),
    "io.kubernetes.cri-o.Namespace": "serving",
    "io.kubernetes.cri-o.SandboxName": f"k8s_llm-7d9f_serving_{UID}_0",
}


def test_containerd_cri_annotations() -> None:
    m = metadata_from_annotations(CONTAINERD_ANN, "containerd", "x")
    assert (m.pod_name, m.pod_namespace, m.container_name, m.pod_uid, m.container_type) == (
        "resnet-0",
        "ml",
        "trainer",
        UID,
        "container",
    )


def test_plain_kubernetes_annotations_win() -> None:
    ann = {
        "io.kubernetes.pod.name": "p",
        "io.kubernetes.pod.namespace": "ns",
        "io.kubernetes.pod.uid": UID,
        "io.kubernetes.container.name": "c",
        "io.kubernetes.cri.sandbox-name": "other",
    }
    m = metadata_from_annotations(ann, "runc", "x")
    assert (m.pod_name, m.pod_namespace, m.container_name, m.pod_uid) == ("p", "ns", "c", UID)


def test_crio_labels_json() -> None:
    m = metadata_from_annotations(CRIO_ANN, "crio", "x")
    assert (m.pod_name, m.pod_namespace, m.container_name, m.pod_uid) == ("llm-7d9f", "serving", "infer", UID)


def test_crio_container_name_fallback_when_labels_broken() -> None:
    ann = dict(CRIO_ANN, **{"io.kubernetes.cri-o.Labels": "{not json"})
    m = metadata_from_annotations(ann, "crio", "x")
    assert (m.pod_name, m.pod_namespace, m.container_name, m.pod_uid) == ("llm-7d9f", "serving", "infer", UID)


def test_sandbox_gets_pod_container_name() -> None:
    ann = {k: v for k, v in CONTAINERD_ANN.items() if k != "io.kubernetes.cri.container-name"}
    ann["io.kubernetes.cri.container-type"] = "sandbox"
    m = metadata_from_annotations(ann, "containerd", "x")
    assert (m.container_name, m.container_type, m.pod_name) == ("POD", "sandbox", "resnet-0")


def test_non_string_annotation_values_ignored() -> None:
    m = metadata_from_annotations({"io.kubernetes.pod.name": 5, "io.kubernetes.pod.namespace": None}, "r", "x")
    assert (m.pod_name, m.pod_namespace) == ("", "")


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '"str"', '{"annotations": 7}', '{"annotations": []}'])
def test_oci_config_garbage(text: str) -> None:
    m = parse_oci_config(text, "containerd", "x")
    assert m is None or (m.pod_name, m.container_name) == ("", "")


DOCKER_V2 = {
    "ID": ID,
    "Name": f"/k8s_cuda_vecadd-5c_default_{UID}_3",
    "Config": {
        "Labels": {
            "io.kubernetes.container.name": "cuda",
            "io.kubernetes.pod.name": "vecadd-5c",
            "io.kubernetes.pod.namespace": "default",
            "io.kubernetes.pod.uid": UID,
            "io.kubernetes.docker.type": "container",
        }
    },
}


def test_docker_config_v2_dockershim_labels() -> None:
    m = parse_docker_config_v2(json.dumps(DOCKER_V2), "x")
    assert m is not None
    assert (m.runtime, m.pod_name, m.pod_namespace, m.container_name, m.pod_uid) == (
        "docker",
        "vecadd-5c",
        "default",
        "cuda",
        UID,
    )


def test_docker_config_v2_plain_container_uses_name() -> None:
    m = parse_docker_config_v2(json.dumps({"ID": ID, "Name": "/jupyter", "Config": {"Labels": None}}), "x")
    assert m is not None
    assert (m.container_name, m.pod_name) == ("jupyter", "")


def test_docker_config_v2_name_only_k8s_form() -> None:
    m = parse_docker_config_v2(json.dumps({"Name": f"/k8s_POD_web-1_prod_{UID}_0"}), "x")
    assert m is not None
    assert (m.container_name, m.pod_name, m.pod_namespace, m.pod_uid) == ("POD", "web-1", "prod", UID)


@pytest.mark.parametrize("text", ["", "{", "[1]", '{"Config": "x", "Name": 3}'])
def test_docker_config_v2_garbage(text: str) -> None:
    m = parse_docker_config_v2(text, "x")
    assert m is None or (m.container_name, m.pod_name) == ("", "")


def test_runc_state_bundle_key_and_old_labels_form() -> None:
    assert parse_runc_state(json.dumps({"bundle": "/b"})) == "/b"
    # runc 1.1 (this machine) keeps it only in config.labels
    assert parse_runc_state(json.dumps({"config": {"labels": ["x=y", "bundle=/run/b"]}})) == "/run/b"
    assert parse_runc_state("{") is None
    assert parse_runc_state(json.dumps({"bundle": "relative"})) is None


def _write(path: Path, doc: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))


@pytest.fixture
def roots(tmp_path: Path) -> BundleRoots:
    return BundleRoots(
        containerd_tasks=(str(tmp_path / "containerd"),),
        crio_containers=(str(tmp_path / "crio"),),
        runc_state=(str(tmp_path / "runc"),),
        docker_containers=(str(tmp_path / "docker"),),
    )


def test_lookup_each_runtime(tmp_path: Path, roots: BundleRoots) -> None:
    _write(tmp_path / "containerd" / "k8s.io" / ("1" * 64) / "config.json", {"annotations": CONTAINERD_ANN})
    _write(tmp_path / "crio" / ("2" * 64) / "userdata" / "config.json", {"annotations": CRIO_ANN})
    _write(tmp_path / "docker" / ("3" * 64) / "config.v2.json", DOCKER_V2)
    bundle = tmp_path / "bundles" / "x"
    _write(bundle / "config.json", {"annotations": {"io.kubernetes.pod.name": "runc-pod"}})
    _write(tmp_path / "runc" / "myctr" / "state.json", {"config": {"labels": [f"bundle={bundle}"]}})
    look = MetadataLookup(roots)
    got = {cid: look.lookup(cid) for cid in ("1" * 64, "2" * 64, "3" * 64, "myctr")}
    assert {k: (v.runtime, v.pod_name) if v else None for k, v in got.items()} == {
        "1" * 64: ("containerd", "resnet-0"),
        "2" * 64: ("crio", "llm-7d9f"),
        "3" * 64: ("docker", "vecadd-5c"),
        "myctr": ("runc", "runc-pod"),
    }
    assert look.lookup("4" * 64) is None


def test_lookup_refuses_path_traversal(tmp_path: Path, roots: BundleRoots) -> None:
    _write(tmp_path / "containerd" / "k8s.io" / "config.json", {"annotations": CONTAINERD_ANN})
    look = MetadataLookup(roots)
    for bad in ("..", "../k8s.io", "a/b", "", "/abs"):
        assert look.lookup(bad) is None


def test_lookup_unreadable_and_bad_json(tmp_path: Path, roots: BundleRoots) -> None:
    _write(tmp_path / "crio" / ID / "userdata" / "config.json", "{truncated")
    cfg = tmp_path / "docker" / ID / "config.v2.json"
    _write(cfg, DOCKER_V2)
    look = MetadataLookup(roots)
    m = look.lookup(ID, "crio")  # crio's file is garbage: falls through to docker's
    assert m is not None and m.runtime == "docker"
    cfg.unlink()
    cfg.mkdir()  # unreadable as a file even for root
    assert look.lookup(ID, "crio") is None


def test_runc_state_without_bundle_config_still_names_runtime(tmp_path: Path, roots: BundleRoots) -> None:
    _write(tmp_path / "runc" / "r1" / "state.json", {"bundle": str(tmp_path / "nope")})
    m = MetadataLookup(roots).lookup("r1")
    assert m is not None and (m.runtime, m.pod_name) == ("runc", "")
