"""Build the agent's enforcer from CLI options (what `gpuwatch agent --policy` calls)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpuwatch.core.errors import ProbesUnavailable
from gpuwatch.core.model import ContainerIdentity
from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.freeze.frozen_state import DEFAULT_STATE_PATH
from gpuwatch.enforce.kernel_limits import KernelLimitTable, KernelProbes
from gpuwatch.enforce.limitmap import DeviceGate, LimitMap, NullDeviceGate
from gpuwatch.enforce.policy_reload import PolicyLoad
from gpuwatch.enforce.sharing_hooks import NodeContainers

log = logging.getLogger(__name__)


class ProbeLimitMap:
    """LimitMap over the probes' BPF limit map (kernel_limits.KernelLimitTable).

    The enforcer picks the kernel action per container from its rule (see
    limitmap.kernel_action); `action`, when given, overrides it for every container."""

    def __init__(self, probes: KernelLimitTable, action: str | None = None) -> None:
        self.probes = probes
        self.action = action

    def set_limit(self, cgroup_id: int, limit_bytes: int, action: str = "event") -> None:
        self.probes.set_limit(cgroup_id, limit_bytes, self.action or action)

    def clear(self, cgroup_id: int) -> None:
        self.probes.clear_limit(cgroup_id)


def build_device_gate(probes: KernelProbes | None, dry_run: bool = False) -> DeviceGate:
    """The cgroup device program (BpfDeviceGate, same device prefix and cgroup v2 mount as the
    probes) when the probes run, else NullDeviceGate; says what is off and why."""
    if probes is None:
        log.info("device isolation off: no BPF probes (policy `limits.devices` and pods' "
                 "`gpuwatch.io/sharing: exclusive` are reported, not enforced)")
        return NullDeviceGate()
    if dry_run:
        return NullDeviceGate()  # a dry run acts on nothing: no program to load
    from gpuwatch.probes.devicegate import BpfDeviceGate

    config = probes.config

    gate = BpfDeviceGate(device_prefix=config.device_prefix, cgroup_root=config.cgroup_root)
    try:
        gate.load()
    except ProbesUnavailable as err:
        log.warning("device isolation off (policy `limits.devices` and `gpuwatch.io/sharing: exclusive` "
                    "are reported, not enforced): %s", err)
        return NullDeviceGate()
    log.info("device isolation on: cgroup device program for %sN (loaded in %.2f s)",
             config.device_prefix, gate.load_s)
    return gate


class CgroupNodeContainers:
    """Every container on the node (enforce.sharing.NodeContainers): a walk of the cgroup v2
    tree below `subtrees` that stops at each cgroup whose path names a container (the runtime
    table of containers/cgroup_path.py; a gate on it covers the sub-cgroups the container
    makes), with the identity the containers layer gives it (runtime metadata: namespace,
    sharing labels) and its cgroup id. One walk is a few thousand scandir entries on a busy
    node; the enforcer asks only while a GPU is held exclusively (each snapshot) and for glob
    namespace quotas (every 30 s)."""

    def __init__(self, bundle_roots: Any = None, cgroup_root: str | None = None, proc_root: str = "/proc",
                 subtrees: tuple[str, ...] = ("/",)) -> None:
        from gpuwatch.containers.resolver import IdentityResolver

        self._resolver = IdentityResolver(proc_root=proc_root, cgroup_root=cgroup_root, bundle_roots=bundle_roots,
                                          sweep_min_interval_s=0.0)
        self.subtrees = subtrees

    def containers(self) -> list[ContainerIdentity]:
        import os

        from gpuwatch.containers.cgroup_path import normalize_path, parse_cgroup_path
        from gpuwatch.containers.cgroupfs import cgroup_dir

        root = self._resolver.mounts.unified
        if root is None:
            raise OSError("no cgroup v2 hierarchy is mounted")
        self._resolver.begin_sweep()
        found: list[ContainerIdentity] = []
        stack = [normalize_path(p) for p in self.subtrees]
        while stack:
            path = stack.pop()
            if path != "/" and parse_cgroup_path(path).container_id:
                identity = self._resolver.identity_for_cgroup_path(path)
                if identity.cgroup_id is not None:
                    found.append(identity)
                continue
            try:
                with os.scandir(cgroup_dir(root, path)) as entries:
                    subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue  # gone while walking, or not there (a subtree this node lacks)
            stack.extend(f"{path.rstrip('/')}/{name}" for name in subdirs)
        return found


def build_enforcer(
    policy_path: str | Path,
    audit_log: str | Path,
    dry_run: bool = False,
    limit_map: LimitMap | None = None,
    probes: KernelProbes | None = None,
    frozen_state_path: str | Path = DEFAULT_STATE_PATH,
    kernel_limit_action: str | None = None,
    device_gate: DeviceGate | None = None,
    node_containers: NodeContainers | None = None,
    bundle_roots: Any = None,
    initial_policy: PolicyLoad | None = None,
    recover: bool = True,
    lock_path: str | Path | None = None,
) -> Enforcer:
    """Enforcer with the default actions; `probes` (a started ProbeManager) wires the
    in-kernel limit map unless `limit_map` is given, and device isolation (a cgroup device
    program) unless `device_gate` is given. The node's containers (for exclusive GPUs and
    glob quotas) come from a CgroupNodeContainers over `bundle_roots` unless
    `node_containers` is given. Raises PolicyError for a bad policy. `initial_policy`,
    `recover`, `lock_path`: see Enforcer (the agent reads the policy in a worker and
    reconciles the node under its lock before it builds the enforcer)."""
    if limit_map is None and probes is not None:
        limit_map = ProbeLimitMap(probes, kernel_limit_action)
    gate = device_gate if device_gate is not None else build_device_gate(probes, dry_run)
    if node_containers is None:
        node_containers = CgroupNodeContainers(bundle_roots=bundle_roots)
    try:
        return Enforcer(
            policy_path,
            audit=AuditLog(audit_log),
            dry_run=dry_run,
            limit_map=limit_map,
            device_gate=gate,
            frozen_state_path=frozen_state_path,
            node_containers=node_containers,
            initial_policy=initial_policy,
            recover=recover,
            lock_path=lock_path,
        )
    except BaseException:
        close = getattr(gate, "close", None)
        if device_gate is None and callable(close):  # ours: unload it with the failed enforcer
            close()
        raise
