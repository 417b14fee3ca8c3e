"""Start-up reconciliation for the agent: thaw what a gone agent froze, audit and count it.

The agent runs this right after it took the node lock and before anything else (probes,
ports, the enforcer) -- with or without a policy, so an agent restarted without
`--policy` still thaws what its predecessor left frozen. The work is
`FrozenRegistry.recover()` (enforce/freeze/frozen_state.py); this module writes each step to the audit
log (opened only when there is something to record) and counts it in
`gpuwatch_recovery_actions_total{action,result}`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.cgroup_ops import CgroupTree
from gpuwatch.enforce.freeze.frozen_state import FrozenRegistry, RecoveryAction
from gpuwatch.enforce.freeze.markers import MarkerOwner

log = logging.getLogger(__name__)


class RecoveryMetrics(Collector):
    """gpuwatch_recovery_actions_total{action, result}: start-up reconciliation steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, step: RecoveryAction) -> None:
        with self._lock:
            key = (step.action, step.result)
            self.counts[key] = self.counts.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "gpuwatch_recovery_actions",
            "Start-up reconciliation steps: thaw (a cgroup a gone agent left frozen), leave (a live "
            "agent holds it), move-aside (a broken frozen-state file), by result.",
            labels=["action", "result"],
        )
        with self._lock:
            counts = dict(self.counts)
        for (action, result), value in sorted(counts.items()):
            family.add_metric([action, result], value)
        yield family


def recover_node(cgroups: CgroupTree, state_path: str | Path, lock_path: str | Path | None,
                 audit_path: str | Path, metrics: RecoveryMetrics, dry_run: bool = False) -> list[str]:
    """Reconcile the node's freeze markers and the journal; returns the cgroups thawed."""
    steps: list[RecoveryAction] = []
    registry = FrozenRegistry(cgroups, state_path, owner=MarkerOwner.current(lock_path))
    thawed = registry.recover(steps.append)
    if not steps:
        return thawed
    for step in steps:
        metrics.count(step)
    from gpuwatch.enforce.audit import AuditLog

    try:
        audit = AuditLog(audit_path)
    except EnforcementError as err:
        log.error("recovery steps not audited: %s", err)
        return thawed
    try:
        for step in steps:
            audit.record_recovery(step, dry_run=dry_run)
    except OSError as err:
        log.error("recovery steps not fully audited (%s): %s", audit_path, err)
    finally:
        audit.close()
    return thawed
