"""Build the agent's enforcer from CLI options (what `gpuwatch agent --policy` calls)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuwatch.enforce.audit import AuditLog
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.enforce.frozen import DEFAULT_STATE_PATH
from gpuwatch.enforce.limitmap import LimitMap


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


def build_enforcer(
    policy_path: str | Path,
    audit_log: str | Path,
    dry_run: bool = False,
    limit_map: LimitMap | None = None,
    probes: Any = None,
    frozen_state_path: str | Path = DEFAULT_STATE_PATH,
    kernel_limit_action: str | None = None,
) -> Enforcer:
    """Enforcer with the default actions; `probes` (a started ProbeManager) wires the
    in-kernel limit map unless `limit_map` is given. Raises PolicyError for a bad policy."""
    if limit_map is None and probes is not None and hasattr(probes, "set_limit"):
        limit_map = ProbeLimitMap(probes, kernel_limit_action)
    return Enforcer(
        policy_path,
        audit=AuditLog(audit_log),
        dry_run=dry_run,
        limit_map=limit_map,
        frozen_state_path=frozen_state_path,
    )
