"""Build the agent's enforcer from CLI options (what `gpuwatch agent --policy` calls)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.frozen import DEFAULT_STATE_PATH
from gpuwatch.enforce.limitmap import DeviceGate, LimitMap, NullDeviceGate
from gpuwatch.errors import ProbesUnavailable

log = logging.getLogger(__name__)


class ProbeLimitMap:
    """LimitMap over the probes manager's BPF limit map (set_limit/clear_limit).

    The enforcer picks the kernel action per container from its rule (see
    limitmap.kernel_action); `action`, when given, overrides it for every container."""

    def __init__(self, probes: Any, action: str | None = None) -> None:
        self.probes = probes
        self.action = action

    def set_limit(self, cgroup_id: int, limit_bytes: int, action: str = "event") -> None:
        self.probes.set_limit(cgroup_id, limit_bytes, self.action or action)

    def clear(self, cgroup_id: int) -> None:
        self.probes.clear_limit(cgroup_id)


def build_device_gate(probes: Any, dry_run: bool = False) -> DeviceGate:
    """The cgroup device program (BpfDeviceGate, same device prefix and cgroup v2 mount as the
    probes) when the probes run, else NullDeviceGate; says what is off and why."""
    config = getattr(probes, "config", None)
    if config is None:
        log.info("device isolation off: no BPF probes (policy `limits.devices` is reported, not enforced)")
        return NullDeviceGate()
    if dry_run:
        return NullDeviceGate()  # a dry run acts on nothing: no program to load
    from gpuwatch.probes.devicegate import BpfDeviceGate

    gate = BpfDeviceGate(device_prefix=config.device_prefix, cgroup_root=config.cgroup_root)
    try:
        gate.load()
    except ProbesUnavailable as err:
        log.warning("device isolation off (policy `limits.devices` is reported, not enforced): %s", err)
        return NullDeviceGate()
    log.info("device isolation on: cgroup device program for %sN (loaded in %.2f s)",
             config.device_prefix, gate.load_s)
    return gate


def build_enforcer(
    policy_path: str | Path,
    audit_log: str | Path,
    dry_run: bool = False,
    limit_map: LimitMap | None = None,
    probes: Any = None,
    frozen_state_path: str | Path = DEFAULT_STATE_PATH,
    kernel_limit_action: str | None = None,
    device_gate: DeviceGate | None = None,
) -> Enforcer:
    """Enforcer with the default actions; `probes` (a started ProbeManager) wires the
    in-kernel limit map unless `limit_map` is given, and device isolation (a cgroup device
    program) unless `device_gate` is given. Raises PolicyError for a bad policy."""
    if limit_map is None and probes is not None and hasattr(probes, "set_limit"):
        limit_map = ProbeLimitMap(probes, kernel_limit_action)
    gate = device_gate if device_gate is not None else build_device_gate(probes, dry_run)
    try:
        return Enforcer(
            policy_path,
            audit=AuditLog(audit_log),
            dry_run=dry_run,
            limit_map=limit_map,
            device_gate=gate,
            frozen_state_path=frozen_state_path,
        )
    except BaseException:
        close = getattr(gate, "close", None)
        if device_gate is None and callable(close):  # ours: unload it with the failed enforcer
            close()
        raise
