"""Metric families for containers' progress (their evaluation functions; signals/progress.py).

Per container that declared gpuwatch.io/progress-file, with the container labels (node,
namespace, pod, pod_uid, container, container_id; progress is per container, not per GPU):
* `gpuwatch_container_progress{goal}` -- the last good value read from its file;
* `gpuwatch_container_progress_rate` -- evaluation gained per GPU-second of the container
  over the recent window, in the goal's direction (positive = improving; ~0 = plateau);
* `gpuwatch_container_progress_wall_rate` -- the same per wall second (grows with the GPU
  share the container gets);
* `gpuwatch_container_progress_read_errors_total{reason}` -- reads that could not be used
  (the last good value was kept), by reason (signals.progress.ERROR_REASONS).
A value or rate that is not known yet is left out, never exported as 0.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuwatch.core.labels import PROBE_LABELS, identity_labels
from gpuwatch.core.model import Snapshot


def progress_families(s: Snapshot) -> list[Metric]:
    value = GaugeMetricFamily("gpuwatch_container_progress",
                              "Last value of the container's evaluation function (gpuwatch.io/progress-file); "
                              "goal says which way is better.", labels=[*PROBE_LABELS, "goal"])
    rate = GaugeMetricFamily("gpuwatch_container_progress_rate",
                             "Evaluation gained per GPU-second of the container over the recent window, "
                             "in the goal's direction (positive = progress).", labels=PROBE_LABELS)
    wall_rate = GaugeMetricFamily("gpuwatch_container_progress_wall_rate",
                                  "Evaluation gained per wall second over the recent window, in the goal's "
                                  "direction.", labels=PROBE_LABELS)
    errors = CounterMetricFamily("gpuwatch_container_progress_read_errors",
                                 "Reads of the container's progress file that could not be used, by reason "
                                 "(the last good value is kept).", labels=[*PROBE_LABELS, "reason"])
    seen: set[tuple[str, ...]] = set()
    for p in s.progress:
        labels = [s.node, *identity_labels(p.identity)]
        if tuple(labels) in seen:
            continue
        seen.add(tuple(labels))
        if p.value is not None:
            value.add_metric([*labels, p.goal], p.value)
        if p.rate_per_gpu_second is not None:
            rate.add_metric(labels, p.rate_per_gpu_second)
        if p.rate_per_second is not None:
            wall_rate.add_metric(labels, p.rate_per_second)
        for reason, count in p.errors_by_reason:
            errors.add_metric([*labels, reason], count)
    return [value, rate, wall_rate, errors]
