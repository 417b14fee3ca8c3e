"""Per-container measurements against a rule's limits (pure).

A container can sit on several GPUs; the snapshot has one ContainerUsage per (container,
GPU). Absolute memory limits apply to the container's total over its GPUs; percentage
limits apply on each GPU to that GPU's size (the worst GPU counts). GPU-time share is the
kernel-seconds rate over the rule's window, summed over GPUs (1.0 = one whole GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo
from gpuwatch.policy.rules import LimitKind, Limits

DISALLOWED_DEVICE_RATIO = 10.0
"""Ratio reported when a container uses a GPU it is not allowed: beyond every ladder step."""


@dataclass(frozen=True)
class ContainerView:
    """One container's rows from a snapshot, grouped."""

    identity: ContainerIdentity
    rows: tuple[ContainerUsage, ...]

    @property
    def memory_bytes(self) -> int:
        return sum(r.memory_bytes for r in self.rows)

    @property
    def kernel_seconds_total(self) -> float:
        return sum(r.kernel_seconds_total for r in self.rows)

    @property
    def sm_utilization_ratio(self) -> float:
        return sum(r.sm_utilization_ratio for r in self.rows)

    @property
    def gpu_indices(self) -> tuple[int, ...]:
        return tuple(sorted({r.gpu_index for r in self.rows}))

    @property
    def process_count(self) -> int:
        return len({p.pid for r in self.rows for p in r.processes})


def group_containers(rows: Iterable[ContainerUsage]) -> list[ContainerView]:
    """Group snapshot rows by container key, preserving first-seen order."""
    grouped: dict[str, list[ContainerUsage]] = {}
    identities: dict[str, ContainerIdentity] = {}
    for row in rows:
        key = row.identity.key
        grouped.setdefault(key, []).append(row)
        identities.setdefault(key, row.identity)
    return [ContainerView(identities[k], tuple(v)) for k, v in grouped.items()]


@dataclass(frozen=True)
class Measured:
    """Usage and usage/limit ratios for each limit a rule sets (None = cannot tell)."""

    memory_bytes: int
    memory_limit_bytes: int | None
    gpu_time_share: float
    gpu_time_limit: float | None
    processes: int
    devices: tuple[int, ...]
    ratios: tuple[tuple[LimitKind, float | None], ...]
    pending_bytes: int = 0

    def ratio(self, kinds: Sequence[LimitKind] = ()) -> float | None:
        """Worst ratio over `kinds` (all the rule's limits when empty); None if none known."""
        values = [r for k, r in self.ratios if (not kinds or k in kinds) and r is not None]
        return max(values) if values else None

    def worst_kind(self) -> LimitKind | None:
        known = [(r, k) for k, r in self.ratios if r is not None]
        return max(known)[1] if known else None

    def as_pairs(self) -> tuple[tuple[str, float], ...]:
        pairs: list[tuple[str, float]] = [
            ("memory_bytes", float(self.memory_bytes)),
            ("gpu_time_share", round(self.gpu_time_share, 4)),
            ("processes", float(self.processes)),
        ]
        if self.pending_bytes:
            pairs.append(("pending_allocation_bytes", float(self.pending_bytes)))
        if self.memory_limit_bytes is not None:
            pairs.append(("memory_limit_bytes", float(self.memory_limit_bytes)))
        if self.gpu_time_limit is not None:
            pairs.append(("gpu_time_limit", self.gpu_time_limit))
        pairs.extend((f"{k.value}_ratio", round(r, 4)) for k, r in self.ratios if r is not None)
        return tuple(pairs)


def measure(
    view: ContainerView,
    limits: Limits,
    gpu_time_share: float,
    devices: Sequence[DeviceInfo],
    pending_bytes: int = 0,
) -> Measured:
    """Compare one container's usage with `limits`. `pending_bytes` (an allocation the
    kernel stopped before it happened) counts as memory demand."""
    totals = {d.index: d.memory_total_bytes for d in devices}
    ratios: list[tuple[LimitKind, float | None]] = []
    memory_limit: int | None = None
    if limits.gpu_memory is not None:
        amount = limits.gpu_memory
        if amount.bytes is not None:
            memory_limit = amount.bytes
            ratios.append((LimitKind.GPU_MEMORY, (view.memory_bytes + pending_bytes) / amount.bytes))
        else:
            per_gpu: list[float] = []
            for row in view.rows:
                limit = amount.resolve_bytes(totals.get(row.gpu_index))
                if limit:
                    per_gpu.append((row.memory_bytes + pending_bytes) / limit)
                    memory_limit = limit if memory_limit is None else min(memory_limit, limit)
            ratios.append((LimitKind.GPU_MEMORY, max(per_gpu) if per_gpu else None))
    if limits.gpu_time_share is not None:
        ratios.append((LimitKind.GPU_TIME, gpu_time_share / limits.gpu_time_share))
    if limits.devices is not None:
        allowed = set(limits.devices)
        bad = [g for g in view.gpu_indices if g not in allowed]
        ratios.append((LimitKind.DEVICES, DISALLOWED_DEVICE_RATIO if bad else 0.0))
    if limits.max_processes is not None:
        ratios.append((LimitKind.PROCESSES, view.process_count / limits.max_processes))
    return Measured(
        memory_bytes=view.memory_bytes,
        pending_bytes=pending_bytes,
        memory_limit_bytes=memory_limit,
        gpu_time_share=gpu_time_share,
        gpu_time_limit=limits.gpu_time_share,
        processes=view.process_count,
        devices=view.gpu_indices,
        ratios=tuple(ratios),
    )


def rate_from_history(
    history: tuple[tuple[float, float], ...], timestamp_s: float, value: float, window_s: float
) -> tuple[tuple[tuple[float, float], ...], float | None]:
    """Append (t, counter) and return (pruned history, counter rate over the window or None).

    Keeps one sample at or before `t - window` as the baseline. A counter that went
    backwards (process restart) restarts the history.
    """
    if history and value < history[-1][1]:
        history = ()
    samples = [*history, (timestamp_s, value)]
    cutoff = timestamp_s - window_s
    while len(samples) >= 2 and samples[1][0] <= cutoff:
        samples.pop(0)
    base_t, base_v = samples[0]
    span = timestamp_s - base_t
    rate = (value - base_v) / span if span > 0 else None
    return tuple(samples), rate
