"""Container metadata (pod name, namespace, container name, pod uid) from runtime state files.

No API server: the runtimes already wrote what we need to disk.
* containerd: the OCI bundle <task root>/<namespace>/<id>/config.json; CRI annotations
  io.kubernetes.cri.{sandbox-name,sandbox-namespace,sandbox-uid,container-name}.
* CRI-O: <overlay-containers>/<id>/userdata/config.json; io.kubernetes.pod.{name,namespace,uid},
  io.kubernetes.container.name, and io.kubernetes.cri-o.{Labels,Name,Namespace,ContainerName}.
* runc's own state <runc root>/[<namespace>/]<id>/state.json names the bundle directory;
  its config.json is read like the above.
* Docker: /var/lib/docker/containers/<id>/config.v2.json: Name and Config.Labels (the
  dockershim put io.kubernetes.* labels there).
The parsers are pure and never raise on bad input: they return None or empty fields.

GPU sharing annotations (gpuwatch.io/sharing: exclusive|shared|auto, gpuwatch.io/gpu-share:
"0.5"; vocabulary in gpuwatch/core/annotations.py, meaning in gpuwatch/policy/sharing.py) are read from the same
annotations (CRI-O also from its io.kubernetes.cri-o.Annotations JSON; Docker from labels of
that name or dockershim's "annotation.<key>" labels). The progress annotations
(gpuwatch.io/progress-file: a path inside the container, gpuwatch.io/progress-goal:
minimize|maximize; vocabulary in gpuwatch/core/annotations.py, reader in gpuwatch/signals/progress.py) are read the same
way. Valid values become `ContainerMetadata.sharing_labels` and, through the resolver,
identity labels under the same keys; an invalid value is logged once (per file and value)
and treated as absent.
containerd copies pod annotations into a container's config.json only when its runtime
handler lists them: `pod_annotations = ["gpuwatch.io/*"]` in the CRI plugin's runtime config.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.containers.procfs import read_text
from gpuwatch.core.annotations import NODE_ANNOTATION_KEYS, label_annotations

log = logging.getLogger(__name__)
_REPORTED_MAX = 4096
_reported: set[tuple[str, str]] = set()

# Ids are path components; refuse anything that could walk out of a root.
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,254}$")
# "k8s_<container>_<pod>_<namespace>_<uid>_<attempt>" (dockershim Name, CRI-O ContainerName)
_K8S_NAME = re.compile(r"^/?k8s_(?P<c>[^_]+)_(?P<p>[^_]+)_(?P<ns>[^_]+)_(?P<uid>[^_]+)_\d+$")
# the gpuwatch.io annotations carried into identity labels: sharing, then progress
ANNOTATION_KEYS = NODE_ANNOTATION_KEYS


@dataclass(frozen=True)
class BundleRoots:
    """Where runtimes keep per-container state. Injected so tests need no root.

    Each runc root holds <id>/state.json directly (runc --root); containerd's and docker's
    runc roots are one namespace level deeper, so those namespaces are listed explicitly.
    """

    containerd_tasks: tuple[str, ...] = ("/run/containerd/io.containerd.runtime.v2.task",)
    crio_containers: tuple[str, ...] = ("/run/containers/storage/overlay-containers",)
    runc_state: tuple[str, ...] = (
        "/run/runc",
        "/run/containerd/runc/k8s.io",
        "/run/containerd/runc/default",
        "/run/containerd/runc/moby",
        "/run/docker/runtime-runc/moby",
    )
    docker_containers: tuple[str, ...] = ("/var/lib/docker/containers",)


@dataclass(frozen=True)
class ContainerMetadata:
    """What a runtime's state files say about one container."""

    runtime: str
    source: str  # the file it came from
    container_name: str = ""
    pod_name: str = ""
    pod_namespace: str = ""
    pod_uid: str = ""
    container_type: str = ""  # "sandbox" for the pod's pause container, else "container"/""
    # the valid gpuwatch.io annotations (sharing and progress: ANNOTATION_KEYS), normalised
    sharing_labels: tuple[tuple[str, str], ...] = ()


def _sharing(annotations: dict[str, str], source: str) -> tuple[tuple[str, str], ...]:
    """The valid gpuwatch.io annotations (sharing, progress); each invalid one is logged once
    per (file, problem)."""
    pairs, problems = label_annotations(annotations)
    for problem in problems:
        if (source, problem) in _reported:
            continue
        if len(_reported) >= _REPORTED_MAX:
            _reported.clear()
        _reported.add((source, problem))
        log.warning("%s: %s; ignored (treated as absent)", source, problem)
    return pairs


def _s(v: Any) -> str:
    return v if isinstance(v, str) else ""


def metadata_from_annotations(annotations: Mapping[str, Any], runtime: str, source: str) -> ContainerMetadata:
    """Kubernetes identity from OCI annotations as containerd's CRI plugin or CRI-O write them."""
    a = {k: _s(v) for k, v in annotations.items() if isinstance(k, str)}
    labels = _json_map(a.get("io.kubernetes.cri-o.Labels", ""))

    def first(*keys: str) -> str:
        for k in keys:
            v = a.get(k) or labels.get(k)
            if v:
                return v
        return ""

    pod_name = first("io.kubernetes.pod.name", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri-o.KubeName")
    namespace = first(
        "io.kubernetes.pod.namespace", "io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri-o.Namespace"
    )
    pod_uid = first("io.kubernetes.pod.uid", "io.kubernetes.cri.sandbox-uid")
    container = first("io.kubernetes.container.name", "io.kubernetes.cri.container-name")
    ctype = first("io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType")
    k8s = _K8S_NAME.match(a.get("io.kubernetes.cri-o.ContainerName", ""))
    if k8s:
        container = container or k8s.group("c")
        pod_name = pod_name or k8s.group("p")
        namespace = namespace or k8s.group("ns")
        pod_uid = pod_uid or k8s.group("uid")
    if not container and ctype == "sandbox":
        container = "POD"
    sharing_source = {k: a[k] for k in ANNOTATION_KEYS if k in a}
    if len(sharing_source) < len(ANNOTATION_KEYS):  # CRI-O keeps the pod's annotations as JSON too
        crio = _json_map(a.get("io.kubernetes.cri-o.Annotations", ""))
        sharing_source = {**{k: crio[k] for k in ANNOTATION_KEYS if k in crio}, **sharing_source}
    return ContainerMetadata(
        runtime=runtime,
        source=source,
        container_name=container,
        pod_name=pod_name,
        pod_namespace=namespace,
        pod_uid=pod_uid,
        container_type=ctype,
        sharing_labels=_sharing(sharing_source, source),
    )


def _json_map(text: str) -> dict[str, str]:
    """A JSON object of strings (other values dropped), {} for anything else."""
    parsed = _json_object(text) if text else None
    return {k: _s(v) for k, v in parsed.items() if isinstance(k, str)} if parsed is not None else {}


def _json_object(text: str) -> dict[Any, Any] | None:
    """The JSON object `text` holds; None if it is not JSON or not an object."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def parse_oci_config(text: str, runtime: str, source: str) -> ContainerMetadata | None:
    """Metadata from an OCI bundle config.json, or None if it is not valid JSON."""
    doc = _json_object(text)
    if doc is None:
        return None
    ann = doc.get("annotations")
    return metadata_from_annotations(ann if isinstance(ann, dict) else {}, runtime, source)


def parse_docker_config_v2(text: str, source: str) -> ContainerMetadata | None:
    """Metadata from Docker's config.v2.json: Name and the io.kubernetes.* Config.Labels."""
    doc = _json_object(text)
    if doc is None:
        return None
    cfg = doc.get("Config")
    raw = cfg.get("Labels") if isinstance(cfg, dict) else None
    labels = {k: _s(v) for k, v in raw.items() if isinstance(k, str)} if isinstance(raw, dict) else {}
    name = _s(doc.get("Name")).lstrip("/")
    container = labels.get("io.kubernetes.container.name", "")
    pod = labels.get("io.kubernetes.pod.name", "")
    namespace = labels.get("io.kubernetes.pod.namespace", "")
    uid = labels.get("io.kubernetes.pod.uid", "")
    k8s = _K8S_NAME.match(name)
    if k8s:
        container, pod = container or k8s.group("c"), pod or k8s.group("p")
        namespace, uid = namespace or k8s.group("ns"), uid or k8s.group("uid")
    ctype = labels.get("io.kubernetes.docker.type", "")
    ctype = {"podsandbox": "sandbox"}.get(ctype, ctype)
    sharing_source = {k: labels[f"annotation.{k}"] for k in ANNOTATION_KEYS if f"annotation.{k}" in labels}
    sharing_source.update({k: labels[k] for k in ANNOTATION_KEYS if k in labels})
    return ContainerMetadata(
        runtime="docker",
        source=source,
        container_name=container or name,
        pod_name=pod,
        pod_namespace=namespace,
        pod_uid=uid,
        container_type=ctype,
        sharing_labels=_sharing(sharing_source, source),
    )


def parse_runc_state(text: str) -> str | None:
    """The bundle directory named by runc's state.json, or None."""
    doc = _json_object(text)
    if doc is None:
        return None
    bundle = doc.get("bundle")
    if isinstance(bundle, str) and bundle.startswith("/"):
        return bundle
    # older runc keeps it only in the config labels: "bundle=/path"
    cfg = doc.get("config")
    labels = cfg.get("labels") if isinstance(cfg, dict) else None
    if isinstance(labels, list):
        for lab in labels:
            if isinstance(lab, str) and lab.startswith("bundle=/"):
                return lab[len("bundle=") :]
    return None


class MetadataLookup:
    """Finds a container's state files under the configured roots (no caching here)."""

    def __init__(self, roots: BundleRoots) -> None:
        self.roots = roots

    def lookup(self, container_id: str, runtime_hint: str = "") -> ContainerMetadata | None:
        """First metadata found for the id, trying the hinted runtime's files first."""
        if not _SAFE_ID.match(container_id):
            return None
        order = ["containerd", "crio", "docker", "runc"]
        hint = {"kubepods": "containerd", "podman": "runc"}.get(runtime_hint, runtime_hint)
        if hint in order:
            order.remove(hint)
            order.insert(0, hint)
        for kind in order:
            meta = getattr(self, f"_{kind}")(container_id)
            if meta is not None:
                return meta
        return None

    def lookup_runc(self, container_id: str) -> ContainerMetadata | None:
        """Only runc's own state dirs (for cgroups named by a bare, non-hex runc id)."""
        return self._runc(container_id) if _SAFE_ID.match(container_id) else None

    def _containerd(self, cid: str) -> ContainerMetadata | None:
        return _first(_oci_file(os.path.join(root, ns, cid, "config.json"), "containerd")
                      for root in self.roots.containerd_tasks for ns in _subdirs(root))

    def _crio(self, cid: str) -> ContainerMetadata | None:
        return _first(_oci_file(os.path.join(root, cid, "userdata", "config.json"), "crio")
                      for root in self.roots.crio_containers)

    def _docker(self, cid: str) -> ContainerMetadata | None:
        return _first(_docker_file(os.path.join(root, cid, "config.v2.json")) for root in self.roots.docker_containers)

    def _runc(self, cid: str) -> ContainerMetadata | None:
        for root in self.roots.runc_state:
            state = os.path.join(root, cid, "state.json")
            text = read_text(state)
            if text is None:
                continue
            bundle = parse_runc_state(text)
            meta = _oci_file(os.path.join(bundle, "config.json"), "runc") if bundle else None
            return meta or ContainerMetadata(runtime="runc", source=state)
        return None


def _subdirs(root: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _oci_file(path: str, runtime: str) -> ContainerMetadata | None:
    text = read_text(path)
    return parse_oci_config(text, runtime, path) if text is not None else None


def _docker_file(path: str) -> ContainerMetadata | None:
    text = read_text(path)
    return parse_docker_config_v2(text, path) if text is not None else None


def _first(found: Iterable[ContainerMetadata | None]) -> ContainerMetadata | None:
    """The first metadata found; `found` is lazy, so no root past the first hit is read."""
    return next((meta for meta in found if meta is not None), None)
