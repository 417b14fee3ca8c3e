"""GPU sharing modes that pods ask for with annotations, and the pure decisions built on them.

A pod declares (pod annotations, which the runtime copies into the OCI bundle's config.json,
where containers/metadata.py reads them):

    gpuwatch.io/sharing:   exclusive | shared | auto
    gpuwatch.io/gpu-share: "0.5"            (or "50%": a time share of one GPU, in (0, 1])

The metadata reader validates them (an invalid value is logged once and treated as absent)
and puts the normalised values into the identity's labels under the same keys, so
`sharing_of(identity)` reads them back, and policy selectors can match them
(`labels: {gpuwatch.io/sharing: exclusive}`).

What the node does with them (enforce/enforcer.py; policy/SCHEMA.md "Sharing modes"):
* exclusive -- while the container uses GPU g (a usage row on g: it holds memory there or
  runs on it; or probe-decoded live allocations on g) every other container on the node
  gets g denied by the cgroup device gate (`plan_exclusive`).
* shared + gpu-share -- the container gets the closed-loop time-share throttle at that share
  unless its policy rule has a throttle step of its own.
* auto -- for the scheduler; the node records and exports it and enforces nothing.

Everything here is pure (no I/O); the vocabulary (keys, modes, parsers) lives in
core/annotations.py, where the metadata reader and the extender read it too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpuwatch.core.annotations import (
    EXCLUSIVE,
    GPU_SHARE_ANNOTATION,
    SHARED,
    SHARING_ANNOTATION,
    parse_gpu_share,
    parse_sharing_mode,
)
from gpuwatch.core.model import ContainerIdentity, Snapshot
from gpuwatch.policy.match import select_rule
from gpuwatch.policy.rules import Policy

GATE_MAX_GPUS = 64
"""GPU indices the device gate's allow mask can name (layout.GW_GATE_MAX_GPUS): a container
that may open every GPU but some is given the allow list 0..63 without those."""


@dataclass(frozen=True)
class SharingRequest:
    """What a container asked for: mode "" (no annotation), exclusive, shared or auto."""

    mode: str = ""
    gpu_share: float | None = None

    @property
    def throttle_share(self) -> float | None:
        """The share the node enforces: only `shared` with a gpu-share."""
        return self.gpu_share if self.mode == SHARED else None


def sharing_of(identity: ContainerIdentity) -> SharingRequest:
    """The sharing request in an identity's labels (invalid values read as absent)."""
    labels = dict(identity.labels)
    mode = parse_sharing_mode(labels.get(SHARING_ANNOTATION)) or ""
    return SharingRequest(mode, parse_gpu_share(labels.get(GPU_SHARE_ANNOTATION)))


# ---- who uses which GPU ---------------------------------------------------------------------


def gpu_users(snapshot: Snapshot) -> dict[int, dict[str, ContainerIdentity]]:
    """GPU index -> {container key: identity} of the containers on it: a usage row on that GPU
    that holds memory, has processes or SM time (NVML lists a process there), or live
    allocations on it decoded by the kernel probes. Host processes and other non-container
    cgroups are not tenants."""
    users: dict[int, dict[str, ContainerIdentity]] = {}
    for row in snapshot.containers:
        if not row.identity.is_container or row.gpu_index < 0:
            continue
        if row.memory_bytes > 0 or row.processes or row.sm_utilization_ratio > 0:
            users.setdefault(row.gpu_index, {}).setdefault(row.identity.key, row.identity)
    identities = dict(snapshot.probe_identities)
    for counter in snapshot.probe_counters:
        identity = identities.get(counter.cgroup_id)
        if identity is None or not identity.is_container:
            continue
        for gpu, size in counter.allocated_bytes_by_gpu:
            if gpu >= 0 and size > 0:
                users.setdefault(gpu, {}).setdefault(identity.key, identity)
    return users


def gpu_tenants(snapshot: Snapshot) -> dict[int, dict[str, ContainerIdentity]]:
    """GPU index -> every tenant on it, in a container or not: the containers of `gpu_users`
    plus each other cgroup (a host process, a systemd service, a plain docker container outside
    Kubernetes) that holds memory, runs or has processes on the GPU. What "exclusive"
    placement must count: a process outside any pod takes memory and SM time all the same."""
    tenants = gpu_users(snapshot)
    for row in snapshot.containers:
        if row.gpu_index < 0 or row.identity.key in tenants.get(row.gpu_index, {}):
            continue
        if row.memory_bytes > 0 or row.processes or row.sm_utilization_ratio > 0:
            tenants.setdefault(row.gpu_index, {})[row.identity.key] = row.identity
    return tenants


@dataclass(frozen=True)
class OutsidePodProcess:
    """A process on a GPU that belongs to no pod: what blocks an exclusive placement by name."""

    gpu_index: int
    pid: int
    comm: str
    cgroup_path: str
    memory_bytes: int


def outside_pod_processes(snapshot: Snapshot) -> list[OutsidePodProcess]:
    """The processes NVML lists on a GPU whose cgroup is no pod's, largest memory first."""
    found = [OutsidePodProcess(row.gpu_index, proc.pid, proc.comm, row.identity.cgroup_path,
                               proc.memory_bytes or 0)
             for row in snapshot.containers if row.gpu_index >= 0 and not row.identity.pod_name
             for proc in row.processes]
    return sorted(found, key=lambda p: (p.gpu_index, -p.memory_bytes, p.pid))


def exclusive_holders(users: Mapping[int, Mapping[str, ContainerIdentity]]) -> dict[int, dict[str, ContainerIdentity]]:
    """GPU index -> the `exclusive` containers among its users (normally one; more is a conflict)."""
    held: dict[int, dict[str, ContainerIdentity]] = {}
    for gpu, found in users.items():
        for key, identity in found.items():
            if sharing_of(identity).mode == EXCLUSIVE:
                held.setdefault(gpu, {})[key] = identity
    return held


# ---- the exclusive gate ---------------------------------------------------------------------


def gate_exemption(policy: Policy, identity: ContainerIdentity, unsafe_reason: str = "",
                   need_cgroup_id: bool = True) -> str:
    """Why the exclusive gate must leave this cgroup alone ("" = it may be gated): the host,
    the agent itself (`unsafe_reason` from the SafetyContext), cgroups that are not
    containers and protected namespaces -- unless a policy rule names them (literally, for a
    protected namespace: the usual rule of select_rule). The gate also needs the cgroup v2
    id (`need_cgroup_id`; a throttle does not)."""
    if unsafe_reason:
        return unsafe_reason
    named = select_rule(policy, identity).rule is not None
    namespace = identity.pod_namespace
    if namespace and namespace in policy.protected_namespaces and not named:
        return f"namespace {namespace} is protected (only a rule naming it may act on it)"
    if not identity.is_container and not named:
        return "not a container: the host is never gated"
    if need_cgroup_id and identity.cgroup_id is None:
        return "no cgroup v2 id: the device gate cannot attach"
    return ""


@dataclass(frozen=True)
class ExclusivePlan:
    """Which containers get which GPUs denied because another container holds them exclusively."""

    holders: Mapping[int, Mapping[str, ContainerIdentity]] = field(default_factory=dict)
    """GPU index -> the exclusive containers using it."""
    denied: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Container key -> GPUs it may not open (sorted)."""
    identities: Mapping[str, ContainerIdentity] = field(default_factory=dict)
    """Every candidate considered, by key."""
    exempt: Mapping[str, str] = field(default_factory=dict)
    """Container key -> why it was left alone although a GPU is held exclusively."""

    def holder_names(self, gpu: int) -> str:
        return ", ".join(sorted(i.display_name for i in self.holders.get(gpu, {}).values()))


def candidates(snapshot: Snapshot, node_containers: Iterable[ContainerIdentity] = ()) -> dict[str, ContainerIdentity]:
    """Every container known this round, by key: the snapshot's rows, the probes' cgroups and
    the node's container list. Where one key comes with and without a cgroup id, the one
    with the id is kept (the gate needs it)."""
    found: dict[str, ContainerIdentity] = {}
    every = [row.identity for row in snapshot.containers]
    every += [identity for _, identity in snapshot.probe_identities]
    every += list(node_containers)
    for identity in every:
        known = found.get(identity.key)
        if known is None or (known.cgroup_id is None and identity.cgroup_id is not None):
            found[identity.key] = identity
    return found


def plan_exclusive(
    policy: Policy,
    snapshot: Snapshot,
    node_containers: Iterable[ContainerIdentity] = (),
    unsafe_reason: Callable[[ContainerIdentity], str] | None = None,
) -> ExclusivePlan:
    """While an `exclusive` container uses GPU g, every other container gets g denied;
    the holders themselves (all of them, if several hold one GPU), the host, the agent and
    protected namespaces (see gate_exemption) are left alone. No holder, empty plan."""
    holders = exclusive_holders(gpu_users(snapshot))
    if not holders:
        return ExclusivePlan()
    found = candidates(snapshot, node_containers)
    denied: dict[str, tuple[int, ...]] = {}
    exempt: dict[str, str] = {}
    for key, identity in found.items():
        gpus = tuple(sorted(g for g, held in holders.items() if key not in held))
        if not gpus:
            continue
        why = gate_exemption(policy, identity, unsafe_reason(identity) if unsafe_reason else "")
        if why:
            exempt[key] = why
        else:
            denied[key] = gpus
    return ExclusivePlan(holders, denied, found, exempt)


def allowed_without(allowed: tuple[int, ...] | None, denied: Iterable[int]) -> tuple[int, ...]:
    """A gate's allow list minus the denied GPUs; `allowed` None = every GPU the gate knows."""
    gone = set(denied)
    base = allowed if allowed is not None else tuple(range(GATE_MAX_GPUS))
    return tuple(i for i in base if i not in gone)


# ---- namespace quotas as numbers for schedulers ---------------------------------------------


def is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def namespace_memory_quotas(policy: Policy, present_namespaces: Iterable[str]) -> dict[str, int]:
    """Namespace -> its GPU memory quota in bytes (the smallest, where several quotas match:
    every matching quota applies). Literal quota names always; glob quotas for the namespaces
    present on the node that match them."""
    present = sorted({ns for ns in present_namespaces if ns})
    quotas: dict[str, int] = {}
    for quota in policy.namespace_quotas:
        amount = quota.limits.gpu_memory
        if amount is None or amount.bytes is None:
            continue
        names = [n for n in present if fnmatch.fnmatchcase(n, quota.namespace)] if is_glob(quota.namespace) \
            else [quota.namespace]
        for name in names:
            quotas[name] = min(quotas.get(name, amount.bytes), amount.bytes)
    return quotas
