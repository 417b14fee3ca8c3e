"""Which GPU of a node a new job goes to (pure; no I/O).

A job declares its memory demand (its whole footprint: its pod's gpu_memory limit, the CUDA
context included). The node's memory arbitration (arbitration.py) promises each admitted job
all it declared, so a GPU's load is the demand promised to the jobs placed there and not
finished -- not the memory they hold yet (a job warming up holds less than it will).

Rule: among the GPUs where the demand fits in the memory not yet promised, `binpack` (the
extender's default, extender/node_fit.py) takes the one with the least of it left, so the
larger holes stay whole for larger jobs; `spread` takes the one with the most (a job that
shares meets the fewest co-tenants). When it fits nowhere, the GPU with the most
unpromised memory that still holds the job's CUDA context (`context_bytes`), in either
policy: the context is made at the job's start, before any allocation the kernel probes can
stop, so it must fit beside every promise -- the arbitration then queues the rest of the job
there until memory frees (over-admission, with the context as the safety margin). When not
even the context fits anywhere, None: the job waits at the node (a pending pod). With
`queue_on_gpu=False` a job that fits nowhere always waits at the node (late binding: it is
placed, whole, on the first GPU where its demand fits, instead of queueing behind the jobs
of the GPU chosen at its arrival). Ties: fewer jobs, then the lower index. Deterministic, so
a benchmark's modes see the same placement for the same arrivals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PLACEMENT_POLICIES = ("binpack", "spread")


@dataclass(frozen=True)
class GpuLoad:
    """One GPU as placement sees it."""

    index: int
    capacity_bytes: int
    promised_bytes: int  # declared demand of the jobs placed on it and not finished
    jobs: int = 0

    @property
    def unpromised_bytes(self) -> int:
        return self.capacity_bytes - self.promised_bytes


def choose_gpu(demand_bytes: int, gpus: Sequence[GpuLoad], context_bytes: int = 0, *,
               queue_on_gpu: bool = True, policy: str = "binpack") -> int | None:
    """The index of the GPU a job of `demand_bytes` goes to, or None: it waits at the node
    (see the module docstring). A job placed where it does not fit promises its GPU its
    context only, until the arbitration admits the rest; with `queue_on_gpu=False` it is not
    placed until its demand fits."""
    if policy not in PLACEMENT_POLICIES:
        raise ValueError(f"placement policy {policy!r}: use one of {', '.join(PLACEMENT_POLICIES)}")
    fitting = [g for g in gpus if g.unpromised_bytes >= demand_bytes]
    if fitting:
        sign = 1 if policy == "binpack" else -1
        return min(fitting, key=lambda g: (sign * g.unpromised_bytes, g.jobs, g.index)).index
    waiting_room = [g for g in gpus if g.unpromised_bytes >= context_bytes] if queue_on_gpu else []
    if not waiting_room:
        return None
    return min(waiting_room, key=lambda g: (-g.unpromised_bytes, g.jobs, g.index)).index
