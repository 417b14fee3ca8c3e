"""Build the agent's enforcer from CLI options (what `gpuwatch agent --policy` calls)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpuwatch.core.errors import ProbesUnavailable
from gpuwatch.core.model import ContainerIdentity
from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.enforcer import Enforcer, EnforcerConfig, EnforcerHooks
from gpuwatch.enforce.kernel_limits import DeviceGate, KernelProbes, NullDeviceGate
from gpuwatch.enforce.policy_reload import PolicyLoad
from gpuwatch.enforce.sharing_hooks import NodeContainers

log = logging.getLogger(__name__)


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
    """Every container on the node (enforce.sharing_hooks.NodeContainers): a walk of the cgroup v2
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
    config: EnforcerConfig | None = None,
    *,
    probes: KernelProbes | None = None,
    device_gate: DeviceGate | None = None,
    node_containers: NodeContainers | None = None,
    bundle_roots: Any = None,
    initial_policy: PolicyLoad | None = None,
) -> Enforcer:
    """Enforcer with the default actions, plugged into the node: `probes` (a started
    ProbeManager) are the in-kernel limit map and give device isolation its scope (a cgroup
    device program) unless `device_gate` is given; the node's containers (for exclusive GPUs
    and glob quotas) come from a CgroupNodeContainers over `bundle_roots` unless
    `node_containers` is given. Raises PolicyError for a bad policy. `initial_policy`: the
    policy already read (the agent reads it in a worker and reconciles the node under its
    lock before it builds the enforcer; then config.recover is False)."""
    config = config or EnforcerConfig()
    gate = device_gate if device_gate is not None else build_device_gate(probes, config.dry_run)
    if node_containers is None:
        node_containers = CgroupNodeContainers(bundle_roots=bundle_roots)
    hooks = EnforcerHooks(kernel_limits=probes, device_gate=gate, node_containers=node_containers)
    try:
        return Enforcer(policy_path, config, audit=AuditLog(audit_log), hooks=hooks, initial_policy=initial_policy)
    except BaseException:
        close = getattr(gate, "close", None)
        if device_gate is None and callable(close):  # ours: unload it with the failed enforcer
            close()
        raise
