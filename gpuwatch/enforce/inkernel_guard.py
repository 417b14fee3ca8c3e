"""The safety net in front of the in-kernel limit: no container is killed (or stopped) in the
kernel on a probe counter NVML contradicts.

Every snapshot the enforcer hands the snapshot to `InKernelGuard.observe`, which compares
each container's probe live bytes with its NVML memory (the snapshot's probe_nvml, made once
per interval by the sampler; policy/probe_trust.py: the hysteresis) and carries out what
changes: a suspension or resumption is audited (event "crosscheck", action
"suspend-inkernel" / "resume-inkernel"), logged once (a warning when suspended, info when
resumed) and shown by
`gpuwatch_container_inkernel_enforcement_suspended`. The enforcer leaves the suspended
containers out of the kernel limit map (Enforcer._push_limits), so the BPF program finds no
entry and cannot act; polling enforcement on NVML numbers goes on as before.

The residual window: a counter that starts diverging is acted on by the kernel until the 3rd
diverging interval suspends it.
"""

from __future__ import annotations

import logging

from prometheus_client.core import GaugeMetricFamily

from gpuwatch.core.labels import PROBE_LABELS, identity_labels
from gpuwatch.core.model import Snapshot
from gpuwatch.core.probe_nvml import probe_nvml_of
from gpuwatch.enforce.audit import AuditLog
from gpuwatch.policy.probe_trust import ProbeNvmlCrossCheck, SuspensionChange

log = logging.getLogger(__name__)
CROSSCHECK_RULE = "crosscheck"
SUSPENDED_METRIC = "gpuwatch_container_inkernel_enforcement_suspended"


class InKernelGuard:
    """Owns the cross-check state for one enforcer; audits and logs its changes."""

    def __init__(self, audit: AuditLog, dry_run: bool = False, check: ProbeNvmlCrossCheck | None = None) -> None:
        self.audit = audit
        self.dry_run = dry_run
        self.check = check or ProbeNvmlCrossCheck()
        self.changes_total = 0
        self._rows: tuple[tuple[tuple[str, ...], bool], ...] = ()  # metric rows, swapped whole per snapshot

    def observe(self, snapshot: Snapshot) -> list[SuspensionChange]:
        """Judge one snapshot; audit and log each suspension or resumption it causes."""
        changes = self.check.observe(probe_nvml_of(snapshot))
        for change in changes:
            self.changes_total += 1
            self._record(change)
        rows: dict[tuple[str, ...], bool] = {}
        for identity, suspended in self.check.tracked().values():
            labels = (snapshot.node, *identity_labels(identity))
            rows[labels] = rows.get(labels, False) or suspended
        self._rows = tuple(sorted(rows.items()))
        return changes

    def suspended_keys(self) -> frozenset[str]:
        """Keys of the containers the kernel must not act on now."""
        return frozenset(self.check.suspended())

    def _record(self, change: SuspensionChange) -> None:
        c = change.comparison
        who = change.identity.display_name
        if change.suspended:
            log.warning("in-kernel kill/stop suspended for %s: %s", who, change.reason)
        else:
            log.info("in-kernel kill/stop resumed for %s: %s", who, change.reason)
        measured = {"probe_bytes": float(c.probe_bytes or 0), "nvml_bytes": float(c.nvml_bytes or 0),
                    "divergence_bytes": float(c.divergence_bytes or 0),
                    "allowed_excess_bytes": float(change.allowed_excess_bytes),
                    "intervals": float(change.intervals)}
        self.audit.record_event(
            change.identity, event="crosscheck", rule=CROSSCHECK_RULE, scope="container", reason=change.reason,
            action="suspend-inkernel" if change.suspended else "resume-inkernel",
            result="dry_run" if self.dry_run else "ok",
            detail=("dry run: nothing pushed to the kernel either way" if self.dry_run
                    else "kept out of the kernel limit map; polling enforcement on NVML numbers continues"
                    if change.suspended else "back in the kernel limit map (when a rule gives it a limit)"),
            measured=measured, dry_run=self.dry_run)

    def metric_family(self) -> GaugeMetricFamily:
        """1 per container whose in-kernel enforcement is suspended, 0 per other container
        the cross-check follows (container labels without the GPU: the judgement is over all
        of its GPUs, as the kernel limit is)."""
        family = GaugeMetricFamily(
            SUSPENDED_METRIC,
            "1 while in-kernel kill/stop is suspended for the container because its probe counter exceeds "
            "NVML's memory by more than max(64 MiB, 10%) (3 intervals in a row); polling enforcement goes on.",
            labels=PROBE_LABELS)
        for labels, suspended in self._rows:
            family.add_metric(list(labels), 1.0 if suspended else 0.0)
        return family
