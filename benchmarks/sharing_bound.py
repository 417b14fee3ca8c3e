"""How far could any scheduler go on bench_sharing's mixes? A fluid model of the GPUs' time.

    python benchmarks/sharing_bound.py [--quick] [--load N] [--mixes heterogeneous,memory-heavy,long-tail]

bench_sharing measures adaptive fair share against static fair share on real pods and the
simulated node, with everything real in the way: process starts, the agent's sampling and
admission latency, the engine's switches, a 2-core VM. This asks what an *ideal* scheduler
would reach on the same jobs with none of that (no I/O; runs in about a second per mix), so a
measured result can be read against what is possible at all:

* each job (the same Job list bench_sharing submits: arrival, footprint, GPU work, duty,
  pauses) starts STARTUP_S after it is placed, then needs `work_s` GPU-seconds; alone it keeps
  its GPU busy `duty` of the time and stops for `pause_s` after every `pause_every_s`
  GPU-seconds, as `gpuwatch sim run` does;
* memory is admitted as adaptive admits it: a job's whole declared footprint at its start,
  smallest first on its GPU, its CUDA context held from its start while it waits;
* a GPU's time goes to its admitted, unpaused jobs by

  - `slicing`: max-min fair shares, each capped at the job's duty -- what a time-sliced engine
    (a real GPU between contexts, the simulated one) gives contending jobs;
  - `oracle`: shortest remaining work first, each capped at its duty (SRPT, which minimises
    the average completion on one server; it needs every job's remaining work, which no real
    scheduler knows);
  - `learners`: the jobs that have not reached 95 % of their final progress first (max-min
    among them), the others share what is left -- an ideal progress-aware elastic share, which
    knows where each job's curve flattens (elastic has to estimate it from the progress rate);

* jobs are placed

  - `arrival`: at arrival by gpuwatch.policy.placement.choose_gpu with bench_sharing's
    loads (binpack by declared demand; a job that fits nowhere queues on the GPU that holds
    its context, or at the node), as every mode of the benchmark places them;
  - `late`: an oracle placement -- the job's start overlaps its wait, and it goes, whole, to
    whichever GPU first has memory for all of it, the one whose admitted jobs' duties sum
    lowest.

Printed per mix: the average completion (arrival to done, the start included) of `alone`
(each job by itself on its own GPU: nothing that shares reaches it) and of each combination
(`learners` with the benchmark's placement only), the makespan and the mean time to 95 % of
each job's final progress (bench_sharing's t95). These are not proofs of optimality (the best
order of a memory-constrained queue is NP-hard); they are the best of the ideal schedulers
modelled, each with zero overhead. The model lets a job that got less than its duty fall behind for good, where the
sim job catches up with up to 0.5 s of backlog: `slicing` is slightly pessimistic, by about
what bench_sharing's overheads add (README, "Sharing oversubscribed GPUs", compares them).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_sharing import CONTEXT_MIB, GIB, GPUS, MIB, STARTUP_S, Job, mixes  # noqa: E402

from gpuwatch.policy.placement import GpuLoad, choose_gpu  # noqa: E402

GPU_MIB = 8 * GIB // MIB
TIME_POLICIES = ("slicing", "oracle", "learners")
PLACEMENTS = ("arrival", "late")
_EPS = 1e-9


@dataclass
class FluidJob:
    """One job's state in the model."""

    job: Job
    gpu: int | None = None
    started_s: float | None = None  # its container's start (placed); work may begin STARTUP_S later
    admitted: bool = False
    done_work_s: float = 0.0
    pause_left_s: float = 0.0
    next_pause_work_s: float = math.inf
    end_s: float | None = None
    rate: float = 0.0  # GPU-seconds per second it gets now
    t95_s: float | None = None  # when it reached 95 % of its final progress (since its arrival)

    def __post_init__(self) -> None:
        if self.job.pause_every_s > 0:
            self.next_pause_work_s = self.job.pause_every_s
        self.work95_s = progress_95_work_s(self.job)

    @property
    def learning(self) -> bool:
        """Not yet at 95 % of its final progress."""
        return self.done_work_s < self.work95_s - 1e-7

    @property
    def remaining_work_s(self) -> float:
        return self.job.work_s - self.done_work_s

    def ready(self, now_s: float) -> bool:
        """Started and through its start-up: holds its context and asks for the rest."""
        return self.started_s is not None and now_s >= self.started_s + STARTUP_S - _EPS and self.end_s is None

    def computing(self, now_s: float) -> bool:
        return self.admitted and self.end_s is None and self.pause_left_s <= _EPS


def progress_95_work_s(job: Job) -> float:
    """The GPU work after which `job`'s progress |loss - start| reaches 95 % of its final value
    (bench_sharing's t95 criterion; the loss curves are monotonic, so by bisection)."""
    start = job.loss(0.0)
    target = 0.95 * abs(job.loss(job.work_s) - start)
    low, high = 0.0, job.work_s
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if abs(job.loss(middle) - start) >= target else (middle, high)
    return high


def alone_s(job: Job) -> float:
    """Completion of `job` by itself on a GPU: start, its work at its duty, its pauses."""
    pauses = math.ceil(job.work_s / job.pause_every_s) - 1 if job.pause_every_s > 0 else 0
    return STARTUP_S + job.work_s / job.duty + max(pauses, 0) * job.pause_s


def max_min(jobs: Sequence[FluidJob], capacity: float) -> tuple[dict[int, float], float]:
    """Max-min fair rates with each job capped at its duty (those below the equal share get
    their duty), and the capacity left over."""
    rates: dict[int, float] = {}
    left = list(jobs)
    while left:
        share = capacity / len(left)
        below = [fj for fj in left if fj.job.duty <= share + _EPS]
        if not below:
            rates.update((id(fj), share) for fj in left)
            return rates, 0.0
        for fj in below:
            rates[id(fj)] = fj.job.duty
            capacity -= fj.job.duty
            left.remove(fj)
    return rates, capacity


def share_time(jobs: Sequence[FluidJob], policy: str) -> dict[int, float]:
    """Rates (GPU-seconds per second) of the computing jobs of one GPU, by `policy`."""
    if policy == "oracle":
        rates: dict[int, float] = {}
        capacity = 1.0
        for fj in sorted(jobs, key=lambda fj: (fj.remaining_work_s, fj.job.arrival_s)):
            rates[id(fj)] = min(fj.job.duty, capacity)
            capacity -= rates[id(fj)]
        return rates
    if policy == "learners":
        rates, capacity = max_min([fj for fj in jobs if fj.learning], 1.0)
        rest, _ = max_min([fj for fj in jobs if not fj.learning], capacity)
        return rates | rest
    return max_min(jobs, 1.0)[0]


class FluidNode:
    """GPUS GPUs of GPU_MIB, the jobs of one mix, one time policy and one placement."""

    def __init__(self, jobs: Sequence[Job], time_policy: str, placement: str, gpus: int = GPUS) -> None:
        if time_policy not in TIME_POLICIES or placement not in PLACEMENTS:
            raise ValueError(f"time policy in {TIME_POLICIES}, placement in {PLACEMENTS}")
        self.jobs = [FluidJob(j) for j in sorted(jobs, key=lambda j: j.arrival_s)]
        self.time_policy, self.placement, self.gpus = time_policy, placement, gpus
        self.now_s = 0.0

    def _on(self, gpu: int) -> list[FluidJob]:
        return [fj for fj in self.jobs if fj.gpu == gpu and fj.end_s is None]

    def _place(self) -> None:
        """Arrived jobs without a GPU, in arrival order (the node's queue)."""
        for fj in self.jobs:
            if fj.gpu is not None or fj.job.arrival_s > self.now_s + _EPS:
                continue
            if self.placement == "late":
                fj.started_s = fj.job.arrival_s  # its start overlaps its wait
                room = [g for g in range(self.gpus)
                        if sum(o.job.footprint_mib for o in self._on(g)) + fj.job.footprint_mib <= GPU_MIB]
                if room:
                    fj.gpu = min(room, key=lambda g: (sum(o.job.duty for o in self._on(g)), g))
                continue
            loads = [GpuLoad(g, GPU_MIB * MIB, sum(o.job.footprint_mib for o in self._on(g)) * MIB, len(self._on(g)))
                     for g in range(self.gpus)]
            fj.gpu = choose_gpu(fj.job.footprint_mib * MIB, loads, CONTEXT_MIB * MIB)
            if fj.gpu is not None:
                fj.started_s = self.now_s

    def _admit(self) -> None:
        """Per GPU: ready jobs whose whole footprint fits beside what is held, smallest first;
        a job not admitted holds its context."""
        for gpu in range(self.gpus):
            here = [fj for fj in self._on(gpu) if fj.ready(self.now_s)]
            held = sum(fj.job.footprint_mib if fj.admitted else CONTEXT_MIB for fj in here)
            for fj in sorted((fj for fj in here if not fj.admitted), key=lambda fj: (fj.job.footprint_mib,
                                                                                    fj.job.arrival_s)):
                if held - CONTEXT_MIB + fj.job.footprint_mib <= GPU_MIB:
                    fj.admitted = True
                    held += fj.job.footprint_mib - CONTEXT_MIB

    def _rates(self) -> None:
        for fj in self.jobs:
            fj.rate = 0.0
        for gpu in range(self.gpus):
            computing = [fj for fj in self._on(gpu) if fj.computing(self.now_s)]
            for fj in computing:
                fj.rate = share_time(computing, self.time_policy)[id(fj)]

    def _next_event_s(self) -> float:
        """Time until the next change: an arrival, a start-up's end, a pause's end, a job
        reaching its next pause or its end."""
        gaps = [fj.job.arrival_s - self.now_s for fj in self.jobs if fj.job.arrival_s > self.now_s + _EPS]
        for fj in self.jobs:
            if fj.end_s is not None:
                continue
            if fj.started_s is not None and not fj.admitted and fj.started_s + STARTUP_S > self.now_s + _EPS:
                gaps.append(fj.started_s + STARTUP_S - self.now_s)
            if fj.admitted and fj.pause_left_s > _EPS:
                gaps.append(fj.pause_left_s)
            elif fj.rate > _EPS:
                target = min(fj.next_pause_work_s, fj.job.work_s, fj.work95_s if fj.learning else math.inf)
                gaps.append((target - fj.done_work_s) / fj.rate)
        return max(min(gaps), 0.0) if gaps else math.inf

    def _advance(self, dt_s: float) -> None:
        self.now_s += dt_s
        for fj in self.jobs:
            if fj.end_s is not None or not fj.admitted:
                continue
            if fj.pause_left_s > _EPS:
                fj.pause_left_s = max(fj.pause_left_s - dt_s, 0.0)
                continue
            fj.done_work_s += fj.rate * dt_s
            if fj.t95_s is None and not fj.learning:
                fj.t95_s = self.now_s - fj.job.arrival_s
            if fj.done_work_s >= fj.job.work_s - 1e-7:
                fj.end_s = self.now_s
            elif fj.done_work_s >= fj.next_pause_work_s - 1e-7:
                fj.pause_left_s = fj.job.pause_s
                fj.next_pause_work_s += fj.job.pause_every_s

    def run(self) -> FluidResult:
        while any(fj.end_s is None for fj in self.jobs):
            self._place()
            self._admit()
            self._rates()
            dt_s = self._next_event_s()
            if math.isinf(dt_s):
                stuck = [fj.job.name for fj in self.jobs if fj.end_s is None]
                raise RuntimeError(f"the model cannot go on: {', '.join(stuck)} never run (a job larger than a GPU?)")
            self._advance(dt_s)
        return FluidResult({fj.job.name: (fj.end_s or 0.0) - fj.job.arrival_s for fj in self.jobs},
                           max(fj.end_s or 0.0 for fj in self.jobs),
                           {fj.job.name: fj.t95_s if fj.t95_s is not None else 0.0 for fj in self.jobs})


@dataclass(frozen=True)
class FluidResult:
    completion_s: dict[str, float]  # per job: arrival to done
    makespan_s: float
    t95_s: dict[str, float]  # per job: arrival to 95 % of its final progress

    @property
    def avg_completion_s(self) -> float:
        return sum(self.completion_s.values()) / len(self.completion_s)

    @property
    def avg_t95_s(self) -> float:
        return sum(self.t95_s.values()) / len(self.t95_s)


@dataclass(frozen=True)
class Bound:
    """One ideal scheduler's figures on a mix (makespan and t95: None for `alone`)."""

    avg_completion_s: float
    makespan_s: float | None = None
    avg_t95_s: float | None = None


def bounds(jobs: Sequence[Job]) -> dict[str, Bound]:
    """`alone` and every time policy x placement (learners: with the benchmark's placement)."""
    out = {"alone": Bound(sum(alone_s(j) for j in jobs) / len(jobs))}
    for placement in PLACEMENTS:
        for policy in TIME_POLICIES:
            if policy == "learners" and placement != "arrival":
                continue
            result = FluidNode(jobs, policy, placement).run()
            out[f"{policy} / {placement}"] = Bound(result.avg_completion_s, result.makespan_s, result.avg_t95_s)
    return out


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bench_sharing --quick's scale (0.6 of the work)")
    parser.add_argument("--load", type=int, default=2, help="copies of each mix submitted (bench_sharing's --load)")
    parser.add_argument("--mixes", default="heterogeneous,memory-heavy,long-tail", help="comma-separated mixes")
    args = parser.parse_args(argv)
    if args.load < 1:
        parser.error("--load must be 1 or more")
    every = mixes(args.quick, args.load)
    names = [m.strip() for m in args.mixes.split(",") if m.strip()]
    unknown = [m for m in names if m not in every]
    if unknown:
        parser.error(f"unknown mix {', '.join(unknown)}: use {', '.join(every)}")
    out(f"fluid model: {GPUS} GPUs of {GPU_MIB // 1024} GiB, load {args.load}{', quick scale' if args.quick else ''}, "
        "zero overhead")
    for name in names:
        out(f"{name}:")
        out(f"  {'scheduler':20s}{'avg completion s':>18}{'makespan s':>12}{'t95 s':>9}")
        for label, bound in bounds(every[name]).items():
            out(f"  {label:20s}{bound.avg_completion_s:>18.2f}{fmt(bound.makespan_s):>12}{fmt(bound.avg_t95_s):>9}")
    return 0


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
