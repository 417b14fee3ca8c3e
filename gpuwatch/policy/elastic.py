"""Progress-aware elastic GPU time (FlowCon), pure: who yields GPU time to whom.

Every round, per GPU with two or more running tenants:

* each job that declares a progress file (signals/progress.py: `Snapshot.progress`) gets a
  growth efficiency: the evaluation gained in its goal's direction per GPU-second it ran,
  over the last `elastic.window` of good reads, divided by its own reference rate (the first
  full window's rate) -- so a loss falling from 1000 and an accuracy rising from 0.1 compare.
  A plateaued job reads ~0; a job whose curve is as steep as at its start reads ~1;
* the GPU's time is divided: tenants without an efficiency (no progress input, not measured
  yet, an annotated `gpu-share`, or on several GPUs) keep their fair share (1 / tenants, or
  the annotated share); the rest of the GPU goes to the jobs with an efficiency, each at least
  `elastic.floor`, the remainder in proportion to their efficiency (plateaued jobs --
  efficiency below `elastic.plateau` -- weigh nothing, so they yield down to the floor);
* the division changes only when some share moves by more than `elastic.hysteresis`, and at
  most once per `elastic.min_dwell` (a tenant arriving or leaving redivides at once);
* it is carried out by the closed-loop throttle (enforce/duty_cycle.py): while some job yields
  (its share is below the fair one), every tenant but the one with the largest share is
  throttled to its share, and that one takes what is left (`elastic.throttle: yielding`:
  only the yielding jobs are throttled, the others share the rest by plain time slicing, so
  no share below what a job would use is imposed on it); when nobody yields, the elastic
  throttles are released (plain time slicing is already fair);
* while containers wait for memory on a GPU (rescheduling), nobody there is made to yield:
  a plateaued job that is slowed down holds its memory longer and keeps the queue waiting.
  With `elastic.checkpoint_plateaued`, a plateaued job there yields its memory instead: it gets
  the checkpoint signal (one job per GPU at a time), so a waiting job can start;
* `elastic.divide: plateau`: only plateaued jobs yield (to the floor), the others share the
  rest equally -- a job still learning is not slowed in proportion to how much its curve has
  flattened, which would delay what it has left to gain.
* with `elastic.contended`, only where the engine is contended: nobody starts yielding on a
  GPU whose tenants' SM utilisation sums to less than it (the jobs' own idle phases -- input,
  checkpoints -- already leave the others the time a freeze would give them), and yielding in
  force ends when the sum falls below half of it.

A read that failed (garbage, a partial write, a missing file) or no new good read within the
window leaves the job's efficiency unknown for the round: its share is held, never lowered
on bad input. Paused, waiting and ladder-throttled containers are left to their holder.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gpuwatch.core.model import ContainerIdentity, ContainerProgress
from gpuwatch.policy.decisions import Decision, Verb
from gpuwatch.policy.rules import ElasticDivide, ElasticSettings, ElasticThrottle, ReschedulingSettings
from gpuwatch.policy.sharing import sharing_of
from gpuwatch.policy.usage import ContainerView

ELASTIC_RULE = "elastic"
MAX_EFFICIENCY = 2.0
"""Efficiency is clamped here: a job cannot claim the GPU by writing a huge jump."""
SHARE_EPSILON = 1e-3

Emit = Callable[[Decision], Decision]


@dataclass(frozen=True)
class ElasticJob:
    """The controller's memory of one container."""

    identity: ContainerIdentity
    gpu_index: int = -1
    samples: tuple[tuple[float, float, float], ...] = ()
    """(read time, value in the goal's direction, container kernel seconds) of good reads."""
    reference_rate: float | None = None
    efficiency: float | None = None
    share: float | None = None
    """Its part of the GPU in the division in force."""
    throttle: float | None = None
    """The throttle share the controller holds on it (None: not throttled by it)."""
    checkpointed: bool = False
    """It was sent the checkpoint signal to yield its memory (elastic.checkpoint_plateaued)."""


@dataclass(frozen=True)
class ElasticState:
    jobs: Mapping[str, ElasticJob] = field(default_factory=dict)
    changed_s: Mapping[int, float] = field(default_factory=dict)
    """GPU index -> when its division last changed."""
    tenants: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """GPU index -> the running tenants of the division in force."""


@dataclass(frozen=True)
class ElasticStatus:
    """What the view shows about one container's GPU time."""

    gpu_index: int
    role: str
    """"gaining", "yielding", "plateaued", "fair" (no efficiency: fair share), "measuring",
    "fixed" (annotated gpu-share), "alone" or "queue" (containers wait for memory on the GPU:
    the division is not applied)."""
    efficiency: float | None
    share: float | None
    throttle: float | None


def _prune(samples: list[tuple[float, float, float]], window_s: float) -> list[tuple[float, float, float]]:
    """Keep the samples of the last window plus one at or before its start (the baseline)."""
    cutoff = samples[-1][0] - window_s
    while len(samples) >= 2 and samples[1][0] <= cutoff:
        samples.pop(0)
    return samples


def _window_rate(
    samples: Sequence[tuple[float, float, float]], settings: ElasticSettings, t: float
) -> tuple[float | None, bool]:
    """(rate per GPU-second over the window or None, whether the window is full)."""
    if len(samples) < 2 or t - samples[-1][0] > settings.window_s / 2:
        return None, False  # not enough reads, or no good read for half a window: unknown
    (t0, v0, k0), (t1, v1, k1) = samples[0], samples[-1]
    gpu_s = k1 - k0
    if gpu_s < max(settings.min_gpu_s, 1e-6):
        return None, False
    return (v1 - v0) / gpu_s, t1 - t0 >= 0.8 * settings.window_s


def observe(job: ElasticJob, progress: ContainerProgress | None, settings: ElasticSettings, t: float) -> ElasticJob:
    """Add the latest good read (if new) and recompute the efficiency; a failed read or a
    stale input makes the efficiency unknown (None) without touching the reference."""
    if progress is None or progress.value is None or progress.updated_s is None:
        return replace(job, samples=(), efficiency=None)
    samples = list(job.samples)
    if samples and progress.kernel_seconds_total < samples[-1][2]:
        samples = []  # restarted (kernel seconds went back): a new job
        job = replace(job, reference_rate=None)
    if not samples or progress.updated_s > samples[-1][0]:
        samples.append((progress.updated_s, progress.direction * progress.value, progress.kernel_seconds_total))
    samples = _prune(samples, settings.window_s)
    rate, full = _window_rate(samples, settings, t)
    reference = job.reference_rate
    if reference is None and rate is not None and full and rate > 0:
        reference = rate
    efficiency = None
    if rate is not None and reference is not None and not progress.last_error:
        efficiency = min(max(rate / reference, 0.0), MAX_EFFICIENCY)
    return replace(job, samples=tuple(samples), reference_rate=reference, efficiency=efficiency)


def divide(
    fixed: Mapping[str, float], efficiencies: Mapping[str, float], settings: ElasticSettings
) -> dict[str, float]:
    """One GPU's shares: `fixed` tenants keep theirs; the rest of the GPU goes to the jobs
    with an efficiency, each at least the floor, the remainder in proportion to efficiency
    (plateaued ones weigh nothing; all plateaued: equal split). With `divide: plateau` every job
    that has not plateaued weighs the same. Where the fixed shares leave less than the floor
    for each of those jobs (a share held from a round with fewer tenants beside new fair ones,
    or annotations that add up to the whole GPU), the fixed shares give way in proportion, so
    no share is ever 0 -- a throttle to nothing would be a pause -- and the sum stays 1."""
    shares = dict(fixed)
    if not efficiencies:
        return shares
    floor = settings.floor
    taken = sum(fixed.values())
    if taken + floor * len(efficiencies) > 1.0:
        floor = min(floor, 1.0 / (len(efficiencies) + len(fixed)))
        room = 1.0 - floor * len(efficiencies)
        if taken > room:
            shares = {k: v * room / taken for k, v in fixed.items()}
    pool = max(1.0 - sum(shares.values()), 0.0)
    by_plateau = settings.divide is ElasticDivide.PLATEAU
    weights = {k: ((1.0 if by_plateau else e) if e >= settings.plateau else 0.0) for k, e in efficiencies.items()}
    total = sum(weights.values())
    rest = pool - floor * len(efficiencies)
    for key in efficiencies:
        part = weights[key] / total if total > 0 else 1.0 / len(efficiencies)
        shares[key] = min(floor + rest * part, 1.0)
    return shares


class _Controller:
    def __init__(self, settings: ElasticSettings, prev: ElasticState, t: float, emit: Emit) -> None:
        self.settings, self.prev, self.t, self.emit = settings, prev, t, emit
        self.jobs: dict[str, ElasticJob] = {}
        self.changed = dict(prev.changed_s)
        self.tenants: dict[int, tuple[str, ...]] = {}
        self.status: dict[str, ElasticStatus] = {}

    def hold(self, key: str, job: ElasticJob, share: float | None, reason: str, measured: tuple[tuple[str, float], ...]
             ) -> ElasticJob:
        """Make the throttle held on `key` equal `share` (None: none), emitting the change."""
        if share is None and job.throttle is None:
            return job
        if share is not None and job.throttle is not None and abs(share - job.throttle) < SHARE_EPSILON:
            return job
        if share is None:
            decision = self.emit(Decision(Verb.RELEASE, job.identity, ELASTIC_RULE, "elastic", reason, measured))
            return job if decision.suppressed else replace(job, throttle=None)
        decision = self.emit(
            Decision(Verb.THROTTLE, job.identity, ELASTIC_RULE, "elastic", reason, measured, share=round(share, 4),
                     period_s=self.settings.period_s)
        )
        return job if decision.suppressed else replace(job, throttle=round(share, 4))


def _reason(role: str, efficiency: float | None, share: float, fair: float) -> str:
    eff = f"growth efficiency {efficiency:.0%} of its early rate" if efficiency is not None else "no efficiency"
    if role == "plateaued":
        return f"plateaued ({eff}): yields to {share:.0%} of the GPU (fair {fair:.0%})"
    if role == "yielding":
        return f"{eff}: yields to {share:.0%} of the GPU (fair {fair:.0%})"
    if role == "gaining":
        return f"{eff}: {share:.0%} of the GPU (fair {fair:.0%})"
    return f"no progress input: keeps its fair share {share:.0%} while others are re-divided"


def elastic_round(
    settings: ElasticSettings,
    views: Sequence[ContainerView],
    progress: Mapping[str, ContainerProgress],
    managed: Collection[str],
    held_elsewhere: Collection[str],
    prev: ElasticState,
    t: float,
    emit: Emit,
    queued_gpus: Collection[int] = (),
    rescheduling: ReschedulingSettings | None = None,
) -> tuple[ElasticState, dict[str, ElasticStatus]]:
    """One round of the controller. `managed`: keys a rule matches (only they are throttled);
    `held_elsewhere`: keys paused, waiting for memory or throttled by a ladder/quota (they do
    not run or are someone else's; their elastic throttle is forgotten, not released);
    `queued_gpus`: GPUs where containers wait for memory (rescheduling) -- there nobody is
    made to yield: a slowed-down holder would keep its memory, and the queue waiting, longer
    (with `checkpoint_plateaued` a plateaued job there is checkpointed with `rescheduling`'s
    signal and grace instead)."""
    run = _Controller(settings, prev, t, emit)
    present = {v.identity.key for v in views}
    # the ones gone, or the whole controller switched off: release what it holds
    for key, job in prev.jobs.items():
        if (key not in present or not settings.enabled) and job.throttle is not None and key not in held_elsewhere:
            why = "left the snapshot" if key not in present else "elastic sharing switched off"
            run.hold(key, job, None, f"elastic throttle ends: {why}", ())
    if not settings.enabled:
        return ElasticState(), {}
    by_gpu: dict[int, list[str]] = {}
    for view in views:
        key = view.identity.key
        job = prev.jobs.get(key) or ElasticJob(view.identity)
        gpus = view.gpu_indices
        job = replace(job, identity=view.identity, gpu_index=gpus[0] if len(gpus) == 1 else -1)
        job = observe(job, progress.get(key), settings, t)
        if key in held_elsewhere:
            job = replace(job, throttle=None, share=None)  # its holder's throttle/pause replaced ours
        run.jobs[key] = job
        if key not in held_elsewhere:
            for gpu in gpus:
                by_gpu.setdefault(gpu, []).append(key)
    busy: dict[int, float] = {}
    for view in views:
        for row in view.rows:
            busy[row.gpu_index] = busy.get(row.gpu_index, 0.0) + row.sm_utilization_ratio
    for gpu, keys in sorted(by_gpu.items()):
        if settings.checkpoint_plateaued and gpu in queued_gpus:
            _yield_memory(run, gpu, sorted(keys), managed, rescheduling or ReschedulingSettings())
        _gpu_round(run, gpu, sorted(keys), managed, gpu in queued_gpus, busy.get(gpu, 0.0))
    return ElasticState(run.jobs, run.changed, run.tenants), run.status


def _yield_memory(run: _Controller, gpu: int, keys: list[str], managed: Collection[str],
                  rescheduling: ReschedulingSettings) -> None:
    """Containers wait for memory on `gpu`: the plateaued job there with the least efficiency gets
    the checkpoint signal, unless one of them is already checkpointing (one at a time: its memory
    may be all the queue needs)."""
    jobs = run.jobs
    if any(jobs[k].checkpointed for k in keys):
        return
    plateaued = [k for k in keys if k in managed and jobs[k].gpu_index == gpu and jobs[k].efficiency is not None
                 and (jobs[k].efficiency or 0.0) < run.settings.plateau
                 and sharing_of(jobs[k].identity).throttle_share is None]
    if not plateaued:
        return
    key = min(plateaued, key=lambda k: (jobs[k].efficiency or 0.0, k))
    efficiency = jobs[key].efficiency or 0.0
    decision = run.emit(Decision(
        Verb.CHECKPOINT_KILL, jobs[key].identity, ELASTIC_RULE, "elastic",
        f"plateaued (growth efficiency {efficiency:.0%} of its early rate) while containers wait for memory on "
        f"GPU {gpu}: checkpointed so that its memory goes to the queue (elastic.checkpoint_plateaued)",
        (("growth_efficiency", round(efficiency, 4)),), signal=rescheduling.signal, grace_s=rescheduling.grace_s))
    if not decision.suppressed:
        jobs[key] = replace(jobs[key], checkpointed=True)


def _gpu_round(run: _Controller, gpu: int, keys: list[str], managed: Collection[str], queued: bool,
               busy: float = 1.0) -> None:
    settings = run.settings
    jobs = run.jobs
    if settings.contended > 0:
        in_force = any(jobs[k].throttle is not None for k in keys)
        idle = busy < (settings.contended / 2 if in_force else settings.contended)
    else:
        idle = False
    fair = 1.0 / len(keys)
    fixed: dict[str, float] = {}
    efficiencies: dict[str, float] = {}
    roles: dict[str, str] = {}
    for key in keys:
        job = jobs[key]
        annotated = sharing_of(job.identity).throttle_share
        if len(keys) == 1:
            roles[key] = "alone"
        elif annotated is not None:
            fixed[key], roles[key] = annotated, "fixed"
        elif job.gpu_index != gpu or key not in managed:
            fixed[key], roles[key] = fair, "fair"
        elif job.efficiency is None:
            if job.share is not None and job.reference_rate is not None:
                fixed[key], roles[key] = job.share, "held"  # unknown this round: keep its share
            else:
                fixed[key], roles[key] = fair, "measuring" if job.samples else "fair"
        else:
            efficiencies[key] = job.efficiency
            roles[key] = "plateaued" if job.efficiency < settings.plateau else ""
    previous: dict[str, float | None] = {k: jobs[k].share for k in keys}
    membership_changed = tuple(keys) != run.prev.tenants.get(gpu)
    wanted = divide(fixed, efficiencies, settings) if len(keys) > 1 else {}
    was = {k: v if v is not None else fair for k, v in previous.items()}
    moved = max((abs(wanted.get(k, fair) - was[k]) for k in keys), default=0.0)
    dwelt = run.t - run.changed.get(gpu, float("-inf")) >= settings.min_dwell_s
    if membership_changed or (dwelt and moved > settings.hysteresis):
        shares = {k: wanted.get(k, fair) for k in keys}
        if shares != was:
            run.changed[gpu] = run.t
    else:
        shares = was
    run.tenants[gpu] = tuple(keys)
    elastic_keys = [k for k in keys if k in efficiencies or roles[k] == "held"]
    yielding = not queued and not idle and any(shares[k] < fair - settings.hysteresis for k in elastic_keys)
    top = max(keys, key=lambda k: (shares[k], k in elastic_keys, k)) if keys else None
    for key in keys:
        job = replace(jobs[key], share=shares[key] if len(keys) > 1 else None)
        role = roles[key] or ("gaining" if shares[key] >= fair - settings.hysteresis else "yielding")
        if role == "held":
            role = "yielding" if shares[key] < fair - settings.hysteresis else "gaining"
        held_to_share = key != top if settings.throttle is ElasticThrottle.ALL_BUT_TOP else \
            key in elastic_keys and shares[key] < fair - settings.hysteresis
        throttle = shares[key] if yielding and held_to_share and key in managed and role != "fixed" else None
        measured: tuple[tuple[str, float], ...] = (("fair_share", round(fair, 4)),
                                                   ("elastic_share", round(shares[key], 4)))
        if job.efficiency is not None:
            measured += (("growth_efficiency", round(job.efficiency, 4)),)
        reason = _reason(role, job.efficiency, shares[key], fair) if throttle is not None else \
            ("elastic: containers wait for memory on this GPU; plain time slicing until the queue is empty"
             if queued else f"elastic: the GPU's engine is not contended (busy {busy:.0%}); plain time slicing"
             if idle else "elastic: nobody yields on this GPU; back to plain time slicing")
        if queued and role in ("gaining", "yielding", "plateaued"):
            role = "queue"
        if key in managed and role != "fixed":
            job = run.hold(key, job, throttle, reason, measured)
        jobs[key] = job
        run.status[key] = ElasticStatus(gpu, role, job.efficiency, shares[key] if len(keys) > 1 else None,
                                        job.throttle)
