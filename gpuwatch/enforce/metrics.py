"""Enforcer metrics as a prometheus Collector: fresh families on every scrape.

gpuwatch_enforce_actions_total{action,result}, gpuwatch_enforce_limit_bytes /
gpuwatch_enforce_limit_gpu_time_share per container, gpuwatch_enforce_paused /
gpuwatch_enforce_throttled_share per container, gpuwatch_policy_reloads_total{result},
gpuwatch_policy_loaded_timestamp_seconds, gpuwatch_deadlocks_{detected,resolved}_total,
gpuwatch_namespace_gpu_memory_quota_bytes{node,namespace} (the policy's namespace quotas, for
schedulers), gpuwatch_enforce_exclusive_gated_containers{node,gpu,uuid,model}; per container
from the enforcer's view: gpuwatch_enforce_memory_fair_share_bytes, _waiting_for_memory_seconds,
_pending_allocation_bytes (rescheduling), gpuwatch_enforce_elastic_share{role} and
gpuwatch_enforce_growth_efficiency (elastic); gpuwatch_container_inkernel_enforcement_suspended
(the probe vs NVML cross-check, enforce/inkernel_guard.py); WebhookMetrics:
gpuwatch_webhook_requests_total{result}, gpuwatch_webhook_alerts_total{result}.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuwatch.core.model import ContainerEnforcement, ContainerIdentity

TARGET_LABELS = ["namespace", "pod", "container", "container_id", "cgroup"]


def _target_labels(identity: ContainerIdentity) -> list[str]:
    return [
        identity.pod_namespace,
        identity.pod_name,
        identity.container_name,
        identity.container_id,
        identity.cgroup_path,
    ]


@dataclass(frozen=True)
class TargetLimits:
    identity: ContainerIdentity
    rule: str
    memory_limit_bytes: int | None
    gpu_time_share_limit: float | None


class EnforcerMetrics(Collector):
    """Counters are updated by the enforcer; gauges are set from its latest view."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.actions: Counter[tuple[str, str]] = Counter()
        self.reloads: Counter[str] = Counter()
        self.deadlocks_detected = 0
        self.deadlocks_resolved = 0
        self.policy_loaded_s = 0.0
        self.stale_snapshots = 0
        self._limits: tuple[TargetLimits, ...] = ()
        self._paused: tuple[ContainerIdentity, ...] = ()
        self._throttled: tuple[tuple[ContainerIdentity, float, float | None], ...] = ()
        self._node = ""
        self._quotas: tuple[tuple[str, int], ...] = ()
        self._gated: tuple[tuple[tuple[str, str, str, str], int], ...] = ()
        self._enforcement: tuple[ContainerEnforcement, ...] = ()
        self.guard_family: Callable[[], Metric] | None = None  # the in-kernel guard's (enforce/inkernel_guard.py)

    def count_action(self, action: str, result: str) -> None:
        with self._lock:
            self.actions[(action, result)] += 1

    def count_reload(self, ok: bool) -> None:
        with self._lock:
            self.reloads["success" if ok else "failure"] += 1

    def count_deadlocks(self, detected: int, resolved: int) -> None:
        with self._lock:
            self.deadlocks_detected += detected
            self.deadlocks_resolved += resolved

    def set_view(
        self,
        limits: tuple[TargetLimits, ...],
        paused: tuple[ContainerIdentity, ...],
        throttled: tuple[tuple[ContainerIdentity, float, float | None], ...],
    ) -> None:
        with self._lock:
            self._limits, self._paused, self._throttled = limits, paused, throttled

    def set_sharing(
        self,
        node: str,
        quotas: tuple[tuple[str, int], ...],
        gated: tuple[tuple[tuple[str, str, str, str], int], ...],
    ) -> None:
        """Namespace GPU memory quotas (namespace, bytes) and, per exclusively held GPU
        ((node, gpu, uuid, model), containers the device gate keeps off it)."""
        with self._lock:
            self._node, self._quotas, self._gated = node, quotas, gated

    def set_sharing_view(self, enforcement: tuple[ContainerEnforcement, ...]) -> None:
        """The enforcer's per-container view (rescheduling and elastic state)."""
        with self._lock:
            self._enforcement = enforcement

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            node, quotas, gated = self._node, self._quotas, self._gated
            enforcement = self._enforcement
            actions = dict(self.actions)
            reloads = dict(self.reloads)
            limits, paused, throttled = self._limits, self._paused, self._throttled
            detected, resolved, loaded = (
                self.deadlocks_detected,
                self.deadlocks_resolved,
                self.policy_loaded_s,
            )
            stale = self.stale_snapshots
        fam = CounterMetricFamily(
            "gpuwatch_enforce_actions",
            "Enforcement actions by action and result.",
            labels=["action", "result"],
        )
        for (action, result), value in sorted(actions.items()):
            fam.add_metric([action, result], value)
        yield fam
        fam = CounterMetricFamily(
            "gpuwatch_policy_reloads",
            "Policy (re)loads by result; a failed reload keeps the running policy.",
            labels=["result"],
        )
        for result in ("success", "failure"):
            fam.add_metric([result], reloads.get(result, 0))
        yield fam
        yield GaugeMetricFamily(
            "gpuwatch_policy_loaded_timestamp_seconds", "When the running policy was loaded.", value=loaded
        )
        yield CounterMetricFamily("gpuwatch_deadlocks_detected", "GPU memory deadlocks detected.", value=detected)
        yield CounterMetricFamily("gpuwatch_deadlocks_resolved", "GPU memory deadlocks resolved.", value=resolved)
        yield CounterMetricFamily(
            "gpuwatch_enforce_stale_snapshots",
            "Snapshots not acted on because they were older than 2 intervals.",
            value=stale,
        )
        mem = GaugeMetricFamily(
            "gpuwatch_enforce_limit_bytes",
            "Current GPU memory limit per container.",
            labels=[*TARGET_LABELS, "rule"],
        )
        share = GaugeMetricFamily(
            "gpuwatch_enforce_limit_gpu_time_share",
            "Current GPU-time share limit per container (1 = one GPU).",
            labels=[*TARGET_LABELS, "rule"],
        )
        for item in limits:
            labels = [*_target_labels(item.identity), item.rule]
            if item.memory_limit_bytes is not None:
                mem.add_metric(labels, item.memory_limit_bytes)
            if item.gpu_time_share_limit is not None:
                share.add_metric(labels, item.gpu_time_share_limit)
        yield mem
        yield share
        paused_fam = GaugeMetricFamily(
            "gpuwatch_enforce_paused", "1 while the agent holds the container frozen.", labels=TARGET_LABELS
        )
        for identity in paused:
            paused_fam.add_metric(_target_labels(identity), 1)
        yield paused_fam
        throttled_fam = GaugeMetricFamily(
            "gpuwatch_enforce_throttled_share",
            "Target GPU-time share of a throttled container.",
            labels=TARGET_LABELS,
        )
        measured = GaugeMetricFamily(
            "gpuwatch_enforce_throttle_measured_share",
            "Measured share of a throttled container (closed loop input).",
            labels=TARGET_LABELS,
        )
        for identity, target_share, measured_share in throttled:
            throttled_fam.add_metric(_target_labels(identity), target_share)
            if measured_share is not None:
                measured.add_metric(_target_labels(identity), measured_share)
        yield throttled_fam
        yield measured
        quota_fam = GaugeMetricFamily(
            "gpuwatch_namespace_gpu_memory_quota_bytes",
            "GPU memory quota of a namespace from the policy's namespace_quotas (the smallest where "
            "several match; glob quotas: for the namespaces present on the node).",
            labels=["node", "namespace"],
        )
        for namespace, quota in quotas:
            quota_fam.add_metric([node, namespace], quota)
        yield quota_fam
        gated_fam = GaugeMetricFamily(
            "gpuwatch_enforce_exclusive_gated_containers",
            "Containers the device gate keeps off a GPU while another container holds it exclusively.",
            labels=["node", "gpu", "uuid", "model"],
        )
        for gpu_labels, count in gated:
            gated_fam.add_metric(list(gpu_labels), count)
        yield gated_fam
        yield from _view_families(enforcement)
        guard_family = self.guard_family
        if guard_family is not None:
            yield guard_family()


def _view_families(enforcement: tuple[ContainerEnforcement, ...]) -> Iterator[Metric]:
    fair = GaugeMetricFamily(
        "gpuwatch_enforce_memory_fair_share_bytes",
        "Fair share of GPU memory while the container's GPU is oversubscribed (fair_share.split).",
        labels=TARGET_LABELS,
    )
    waiting = GaugeMetricFamily(
        "gpuwatch_enforce_waiting_for_memory_seconds",
        "How long the container has been paused waiting for GPU memory (rescheduling).",
        labels=TARGET_LABELS,
    )
    pending = GaugeMetricFamily(
        "gpuwatch_enforce_pending_allocation_bytes",
        "An allocation stopped at the kernel, waiting for admission.",
        labels=TARGET_LABELS,
    )
    elastic = GaugeMetricFamily(
        "gpuwatch_enforce_elastic_share",
        "The container's part of its GPU in the elastic (progress-aware) division.",
        labels=[*TARGET_LABELS, "role"],
    )
    efficiency = GaugeMetricFamily(
        "gpuwatch_enforce_growth_efficiency",
        "Progress per GPU-second over the elastic window, relative to the job's early rate.",
        labels=TARGET_LABELS,
    )
    for item in enforcement:
        labels = _target_labels(item.identity)
        if item.memory_fair_share_bytes is not None:
            fair.add_metric(labels, item.memory_fair_share_bytes)
        if item.waiting_s is not None:
            waiting.add_metric(labels, item.waiting_s)
        if item.pending_bytes:
            pending.add_metric(labels, item.pending_bytes)
        if item.elastic_share is not None:
            elastic.add_metric([*labels, item.elastic_role], item.elastic_share)
        if item.growth_efficiency is not None:
            efficiency.add_metric(labels, item.growth_efficiency)
    yield from (fair, waiting, pending, elastic, efficiency)


WEBHOOK_RESULTS = ("ok", "unauthorized", "rejected", "too_large", "rate_limited")


WEBHOOK_OUTCOMES = (("ignored: no container", "no_target"), ("ignored: ambiguous target", "ambiguous_target"),
                    ("duplicate", "duplicate"))


class WebhookMetrics(Collector):
    """The Alertmanager webhook's requests by result (every request counts once:
    ok | unauthorized | rejected | too_large | rate_limited) and the alerts it read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.alerts: Counter[str] = Counter()

    def count_request(self, result: str) -> None:
        if result not in WEBHOOK_RESULTS:
            raise ValueError(f"unknown webhook result {result!r}")
        with self._lock:
            self.requests[result] += 1

    def count_alerts(self, accepted: int, rejected: int) -> None:
        with self._lock:
            self.alerts["accepted"] += accepted
            self.alerts["rejected"] += rejected

    def count_outcomes(self, results: Iterable[str]) -> None:
        """What the enforcer said of accepted alerts: targets matching no container or
        several, and repeats folded into an earlier identical action."""
        for text in results:
            for prefix, result in WEBHOOK_OUTCOMES:
                if text.startswith(prefix):
                    with self._lock:
                        self.alerts[result] += 1
                    break

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            requests, alerts = dict(self.requests), dict(self.alerts)
        fam = CounterMetricFamily(
            "gpuwatch_webhook_requests",
            "Alertmanager webhook requests by result: ok, unauthorized (missing/wrong token), rejected "
            "(bad method, path, JSON or payload), too_large (body or headers over the limit), "
            "rate_limited.",
            labels=["result"],
        )
        for result in WEBHOOK_RESULTS:
            fam.add_metric([result], requests.get(result, 0))
        yield fam
        fam = CounterMetricFamily(
            "gpuwatch_webhook_alerts",
            "Alerts in authenticated webhook requests: accepted (handed to the enforcer) or rejected "
            "(malformed, no target, unknown action, over the per-request cap); of the accepted: "
            "no_target (names no live container), ambiguous_target (several), duplicate (repeated).",
            labels=["result"],
        )
        for result in ("accepted", "rejected", *(r for _, r in WEBHOOK_OUTCOMES)):
            fam.add_metric([result], alerts.get(result, 0))
        yield fam
