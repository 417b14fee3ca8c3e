"""cgroup path -> container identity, from the path alone (pure, no I/O).

Every container runtime names its cgroups in a recognisable way. We split the path into
components and try a table of per-runtime patterns on each; the *deepest* matching
component wins (Kepler's approach), so nested clusters (kind: a Kubernetes node that is
itself a docker container) resolve to the innermost container, not the node.

Kubernetes pod cgroups are recognised separately (both kubelet cgroup drivers, every QoS
class) to fill in the pod UID and QoS class; the UID is normalised to its dashed form.

Runtime helpers (CRI-O / podman conmon) are marked role=monitor and carry no container id:
they are not the container. Login sessions, a user's systemd instance and terminal scopes
(user.slice, session-N.scope, vte-spawn-<uuid>.scope) are runtime "host" with their path.
Paths read in another cgroup namespace may start with '..' and lack the upper levels
(kubepods, QoS): a pod directory right after the '..' still counts as a pod.

Anything that matches nothing is kept, never dropped: "/" is the host, ``*.service`` /
``*.scope`` / ``*.slice`` / ``*.mount`` are systemd units, the rest is runtime "unknown" with
the raw path.
Pod name/namespace/container name are not in the path; see metadata.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TypeVar

from gpuwatch.containers.slurm import SlurmPlace, find_slurm
from gpuwatch.core.model import HOST_IDENTITY, ContainerIdentity

_M = TypeVar("_M")

# Runtime names reported in ContainerIdentity.runtime.
DOCKER = "docker"
CONTAINERD = "containerd"
CRIO = "crio"
PODMAN = "podman"
RUNC = "runc"
KUBEPODS = "kubepods"  # container under a kubepods pod dir with a bare id: runtime not in the path
SYSTEMD = "systemd"
ECS = "ecs"  # AWS ECS on Fargate: container ids are <32-hex task id>-<digits>
GARDEN = "garden"  # Cloud Foundry Garden: 8-4-4-4(-4) hex ids under garden.service
SLURM = "slurm"  # Slurm job steps (slurmstepd's job_<N>/step_<M> cgroups): see slurm_identity
LIBVIRT_LXC = "libvirt-lxc"  # libvirt LXC domains: machine-lxc\x2d<n>\x2d<name>.scope, <name>.libvirt-lxc
HOST = "host"
UNKNOWN = "unknown"

_HEX64 = r"[0-9a-f]{64}"
_BARE_ID = re.compile(rf"^({_HEX64})$")
_BARE_SCOPE = re.compile(rf"^(?P<id>{_HEX64})\.scope$")  # docker with the systemd driver nested: /docker/<id>.scope
_FARGATE_ID = re.compile(r"^[0-9a-f]{32}-[0-9]+$")
_GARDEN_ID = re.compile(r"^[0-9a-f]{8}(?:-[0-9a-f]{4}){3,4}$")
_SESSION_SCOPE = re.compile(r"^(?:session-[0-9a-z]+|.*-spawn-.+|vte-spawn-.+)\.scope$")


@dataclass(frozen=True)
class _Rule:
    """One component pattern: group 'id' is the container id."""

    runtime: str
    pattern: re.Pattern[str]
    role: str = "container"  # "container" or "monitor" (conmon: the runtime's helper process)


# Component patterns, tried in order on each path component (full match).
_RULES: tuple[_Rule, ...] = (
    # docker, systemd driver: /system.slice/docker-<id>.scope (also under kubepods-*.slice with
    # dockershim, and rootless under user@<uid>.service)
    _Rule(DOCKER, re.compile(rf"^docker-(?P<id>{_HEX64})(?:\.scope)?$")),
    # containerd CRI, systemd driver: cri-containerd-<id>.scope
    _Rule(CONTAINERD, re.compile(rf"^cri-containerd-(?P<id>{_HEX64})\.scope$")),
    # nerdctl / containerd outside Kubernetes, systemd driver: nerdctl-<id>.scope, containerd-<id>.scope
    _Rule(CONTAINERD, re.compile(rf"^(?:nerdctl|containerd)-(?P<id>{_HEX64})\.scope$")),
    # CRI-O: crio-<id>.scope (systemd) or crio-<id> (cgroupfs); conmon: crio-conmon-<id>[.scope]
    _Rule(CRIO, re.compile(rf"^crio-conmon-(?P<id>{_HEX64})(?:\.scope)?$"), role="monitor"),
    _Rule(CRIO, re.compile(rf"^crio-(?P<id>{_HEX64})(?:\.scope)?$")),
    # podman/libpod: libpod-<id>.scope (systemd), libpod-<id> (cgroupfs under /libpod_parent),
    # libpod-conmon-<id>.scope, quadlet: libpod-payload-<id>
    _Rule(PODMAN, re.compile(rf"^libpod-conmon-(?P<id>{_HEX64})(?:\.scope)?$"), role="monitor"),
    _Rule(PODMAN, re.compile(rf"^libpod-payload-(?P<id>{_HEX64})(?:\.scope)?$")),
    _Rule(PODMAN, re.compile(rf"^libpod-(?P<id>{_HEX64})(?:\.scope)?$")),
    # plain runc with the systemd driver (cgroupsPath "system.slice:runc:<id>"): runc-<id>.scope
    _Rule(RUNC, re.compile(r"^runc-(?P<id>[A-Za-z0-9][A-Za-z0-9_.+-]*)\.scope$")),
)

# containerd v1 with a systemd-style cgroupsPath but the cgroupfs driver writes one component
# "<pod slice>:cri-containerd:<id>" (seen in Kepler's tests): split it into pod + container.
_COLON_FORM = re.compile(rf"^(?P<slice>[^:]+\.slice):(?P<prefix>cri-containerd|crio|docker):(?P<id>{_HEX64})$")
_COLON_RUNTIME = {"cri-containerd": CONTAINERD, "crio": CRIO, "docker": DOCKER}

# Pod cgroups. systemd driver: kubepods-pod<uid>.slice (guaranteed),
# kubepods-burstable-pod<uid>.slice, kubepods-besteffort-pod<uid>.slice, with '_' in the uid;
# kind-style nested kubelets prefix "kubelet-". cgroupfs driver: pod<uid> under
# /kubepods[/burstable|/besteffort], with '-' in the uid. Static pods have 32-hex uids.
_POD_SLICE = re.compile(
    r"^(?:[a-z0-9]+-)?kubepods-(?:(?P<qos>burstable|besteffort)-)?pod(?P<uid>[0-9a-fA-F_-]{8,})\.slice$"
)
_POD_DIR = re.compile(r"^pod(?P<uid>[0-9a-fA-F-]{8,})$")
_QOS_DIRS = {"burstable", "besteffort"}
_CONTAINERD_NAMESPACE_DIRS = {"default", "k8s.io", "moby", "containerd", "buildkit"}
# `ctr run` / nerdctl with the cgroupfs driver: /<namespace>/<container id>, where the id is
# whatever name the user gave (containerd's identifier rules: 76 characters at most)
_CONTAINERD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,75}$")
_CI_JOB_PARENTS = {"actions_job"}  # GitHub Actions runner: docker --cgroup-parent=actions_job
# libvirt LXC: machine-lxc\x2d<n>\x2d<name>.scope (systemd; older: no <n>), <name>.libvirt-lxc
_LIBVIRT_LXC_SCOPE = re.compile(r"^machine-lxc\\x2d(?:[0-9]+\\x2d)?(?P<name>.+)\.scope$")
_LIBVIRT_LXC_DIR = re.compile(r"^(?P<name>.+)\.libvirt-lxc$")
_SYSTEMD_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
_UNIT = re.compile(r"^(?P<name>.+)\.(?P<kind>service|scope|slice|mount)$")


OUTER_CONTAINER_LABEL = "outer_container_id"  # nested clusters: the container the innermost one runs in


def normalize_pod_uid(uid: str) -> str:
    """Pod UID in its API form: lower case with dashes (the systemd driver writes '_')."""
    return uid.replace("_", "-").lower()


def split_components(path: str) -> list[str]:
    """Path components, with the containerd colon form split in two."""
    out: list[str] = []
    for comp in path.split("/"):
        if not comp or comp == ".":
            continue
        m = _COLON_FORM.match(comp)
        if m:
            out.append(m.group("slice"))
            out.append(f"{m.group('prefix')}:{m.group('id')}")
        else:
            out.append(comp)
    return out


def _under_docker(comps: list[str], i: int) -> bool:
    """Component i sits in a chain of docker container cgroups: /docker/<id>[/<id>...]."""
    j = i - 1
    while j >= 0 and _BARE_ID.match(comps[j]):
        j -= 1
    return j >= 0 and comps[j] == "docker"


def _match_container(comps: list[str], i: int) -> tuple[str, str, str] | None:
    """(runtime, container id, role) if component i names a container."""
    comp = comps[i]
    parent = comps[i - 1] if i > 0 else ""
    if comp.endswith((".scope", ".libvirt-lxc")) and "lxc" in comp:
        m = _LIBVIRT_LXC_SCOPE.match(comp) or _LIBVIRT_LXC_DIR.match(comp)
        if m:
            return LIBVIRT_LXC, _systemd_unescape(m.group("name")), "container"
    if "ecs" in comps[:i] and _FARGATE_ID.match(comp):
        return ECS, comp, "container"  # Fargate: /ecs/<task id>/<task id>-<digits>
    if (parent == "garden" or "garden.service" in comps[:i]) and _GARDEN_ID.match(comp):
        return GARDEN, comp, "container"  # /system.slice/garden.service/garden/<8-4-4-4-4>
    m = _BARE_SCOPE.match(comp)
    if m and parent == "docker":
        return DOCKER, m.group("id"), "container"
    if ":" in comp:
        prefix, _, cid = comp.partition(":")
        if prefix in _COLON_RUNTIME and _BARE_ID.match(cid):
            return _COLON_RUNTIME[prefix], cid, "container"
    if comp[0] in "dcnlr":  # cheap prefilter: every rule starts with one of these letters
        for rule in _RULES:
            m = rule.pattern.match(comp)
            if m:
                return rule.runtime, m.group("id"), rule.role
    if _BARE_ID.match(comp):
        if "ecs" in comps[:i]:
            return DOCKER, comp, "container"  # ECS on EC2 (docker): /ecs/<task id>/<id>
        if _under_docker(comps, i):
            return DOCKER, comp, "container"  # docker, cgroupfs driver: /docker/<id>, dind /docker/<outer>/<inner>
        if _POD_DIR.match(parent) or _POD_SLICE.match(parent):
            return KUBEPODS, comp, "container"  # kubelet cgroupfs: /kubepods/<qos>/pod<uid>/<id>
        if parent in _CONTAINERD_NAMESPACE_DIRS:
            return CONTAINERD, comp, "container"  # ctr/nerdctl cgroupfs: /<namespace>/<id>
        if parent == "libpod_parent":
            return PODMAN, comp, "container"
        if parent in _CI_JOB_PARENTS:
            return DOCKER, comp, "container"  # a CI job's container: /actions_job/<id>
        return UNKNOWN, comp, "container"  # a 64-hex leaf is a container id in every runtime
    if i == 1 and parent in _CONTAINERD_NAMESPACE_DIRS and _CONTAINERD_NAME.match(comp) and not _UNIT.match(comp):
        return CONTAINERD, comp, "container"  # `ctr run` with a name: /default/<name>, /k8s.io/<name>
    return None


def _systemd_unescape(name: str) -> str:
    """A systemd unit name's \\xNN escapes undone (machine-lxc\\x2d...: '-')."""
    return _SYSTEMD_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), name)


def _outer_container(comps: list[str], below: int) -> str:
    """The id of the nearest container enclosing component `below` (kind/minikube: the node's
    docker container around the pods; docker-in-docker: the outer container), or ""."""
    for i in range(below - 1, -1, -1):
        found = _match_container(comps, i)
        if found is not None and found[2] == "container":
            return found[1]
    return ""


def _context_labels(comps: list[str], at: int, runtime: str) -> tuple[tuple[str, str], ...]:
    """Labels that say where a container at component `at` sits: the enclosing container of a
    nested cluster, the systemd service that started it, its containerd namespace, its ECS task."""
    labels: list[tuple[str, str]] = []
    outer = _outer_container(comps, at)
    if outer:
        labels.append((OUTER_CONTAINER_LABEL, outer))
    parent = comps[at - 1] if at > 0 else ""
    if runtime == ECS and parent and parent != "ecs":
        labels.append(("ecs_task", parent))
    elif runtime == CONTAINERD and at == 1 and parent in _CONTAINERD_NAMESPACE_DIRS:
        labels.append(("containerd_namespace", parent))
    elif parent.endswith(".service"):
        labels.append(("systemd_unit", parent))  # podman under a service: <svc>.service/libpod-payload-<id>
    return tuple(labels)


def _match_pod(comps: list[str], i: int) -> tuple[str, str] | None:
    """(pod uid, qos class) if component i is a pod cgroup."""
    comp = comps[i]
    if "pod" not in comp:
        return None
    m = _POD_SLICE.match(comp)
    if m:
        return normalize_pod_uid(m.group("uid")), m.group("qos") or "guaranteed"
    m = _POD_DIR.match(comp)
    parent = comps[i - 1] if i > 0 else ""
    # below kubepods, or a cgroup namespace cut the upper levels off (/../burstable/pod<uid>)
    truncated = parent in _QOS_DIRS or (bool(comps[:i]) and all(c == ".." for c in comps[:i]))
    if m and (truncated or any(c.startswith("kubepods") for c in comps[:i])):
        qos = parent if parent in _QOS_DIRS else "guaranteed"
        return normalize_pod_uid(m.group("uid")), qos
    return None


def _is_user_session(comps: list[str]) -> bool:
    """A login session, a user's systemd instance or a terminal's scope: someone's host
    processes (user.slice/..., session-14.scope, .../vte-spawn-<uuid>.scope), not a service."""
    top = next((c for c in comps if c != ".."), "")
    if top == "user.slice" or (top.startswith("user-") and top.endswith(".slice")):
        return True
    return any(_SESSION_SCOPE.match(c) or c.startswith("user@") for c in comps)


def normalize_path(path: str) -> str:
    """'/'-rooted path without empty or '.' components; empty becomes '/'."""
    return "/" + "/".join(c for c in path.strip().split("/") if c and c != ".")


def _innermost(comps: list[str], match: Callable[[list[str], int], _M | None]) -> tuple[_M | None, int]:
    """The match nearest the leaf (components scanned from the last) and its index; (None, -1)
    where no component matches."""
    for i in range(len(comps) - 1, -1, -1):
        found = match(comps, i)
        if found:
            return found, i
    return None, -1


@lru_cache(maxsize=8192)
def parse_cgroup_path(path: str) -> ContainerIdentity:
    """Identity from a cgroup path alone: runtime, container id, pod uid and QoS class.

    Never raises and never returns None: unknown paths come back as runtime "unknown" (or
    "systemd" for units) with the raw path, the root as the host identity.
    """
    path = normalize_path(path)
    if path == "/":
        return HOST_IDENTITY
    comps = split_components(path)
    container, container_at = _innermost(comps, _match_container)
    pod, pod_at = _innermost(comps, _match_pod)
    slurm = find_slurm(comps) if "slurm" in path else None
    if slurm is not None and slurm.job_at > container_at and slurm.job_at > pod_at:
        outer = _outer_container(comps, slurm.job_at)
        return slurm_identity(path, slurm, ((OUTER_CONTAINER_LABEL, outer),) if outer else ())
    if pod_at > container_at:
        # A pod-level cgroup (no container below it in this path): belongs to the pod.
        assert pod is not None
        outer = _outer_container(comps, pod_at)
        return ContainerIdentity(runtime=KUBEPODS, cgroup_path=path, pod_uid=pod[0], qos_class=pod[1],
                                 labels=((OUTER_CONTAINER_LABEL, outer),) if outer else ())
    if container is not None:
        runtime, cid, role = container
        pod_uid, qos = pod if pod is not None else ("", "")
        if role != "container":
            # the runtime's helper (conmon) watches the container but is not it: it must not
            # carry the container's id (its usage is the pod's, or the runtime's)
            return ContainerIdentity(runtime=runtime, cgroup_path=path, pod_uid=pod_uid, qos_class=qos,
                                     labels=(("role", role),))
        # a name-like id (ctr run's, a libvirt domain's) is also the container's name
        name = cid if runtime == LIBVIRT_LXC or (runtime == CONTAINERD and not _BARE_ID.match(cid)) else ""
        return ContainerIdentity(
            runtime=runtime,
            cgroup_path=path,
            container_id=cid,
            container_name=name,
            pod_uid=pod_uid,
            qos_class=qos,
            labels=_context_labels(comps, container_at, runtime),
        )
    if _is_user_session(comps):
        return ContainerIdentity(runtime=HOST, cgroup_path=path)
    for comp in reversed(comps):
        m = _UNIT.match(comp)
        if m:
            name = m.group("name")
            return ContainerIdentity(runtime=SYSTEMD, cgroup_path=path, container_name=name)
    return ContainerIdentity(runtime=UNKNOWN, cgroup_path=path)


SLURM_NAMESPACE = "slurm"  # the `namespace` of every Slurm job (its jobs are the pods)


def slurm_identity(path: str, place: SlurmPlace, labels: tuple[tuple[str, str], ...] = ()) -> ContainerIdentity:
    """A Slurm step as a container, its job as a pod: namespace "slurm", pod "job-<N>",
    container "step-<M>" with container id "<N>.<M>" (Slurm's own step id: 42.0, 42.batch);
    labels slurm_job, slurm_step and slurm_uid (v1 paths carry the uid; on v2 the resolver
    adds it, and slurm_user, from the process). A job-level cgroup is the job (a pod without
    a container); the step's slurmstepd is role=monitor, not the step."""
    found = [("slurm_job", place.job)]
    if place.step:
        found.append(("slurm_step", place.step))
    if place.uid:
        found.append(("slurm_uid", place.uid))
    job = ContainerIdentity(runtime=SLURM, cgroup_path=path, pod_name=f"job-{place.job}",
                            pod_namespace=SLURM_NAMESPACE, labels=(*found, *labels))
    if not place.step:
        return job
    if place.stepd:
        return replace(job, labels=(*found, ("role", "monitor"), *labels))
    return replace(job, container_id=f"{place.job}.{place.step}", container_name=f"step-{place.step}")
