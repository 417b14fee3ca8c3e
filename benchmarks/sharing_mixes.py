"""Job mixes for bench_sharing shaped by published GPU cluster traces (data only; no I/O).

What the traces say (the few numbers kept here; the traces themselves are not in the repo):

* Alibaba PAI GPU trace v2020 (Weng et al., "MLaaS in the Wild", NSDI '22;
  github.com/alibaba/clusterdata, pai_gpu_trace_2020), per-instance lifetime averages of the
  sensor table (gpu_wrk_util, avg/max_gpu_wrk_mem) as summarised by affinode.io's analysis of
  the 3.0 M instance records: mean GPU utilisation 10.5 %, median 1.5 %, 75 % of instances
  below 10 %, only 5 % at 50 % or more; 98 % use less GPU than they requested; GPU memory is
  held whether or not compute is used (54 % of memory-time by instances that barely compute).
* Microsoft Philly trace (Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for
  DNN Training Workloads", ATC '19; github.com/msr-fiddle/philly-traces), per-minute
  nvidia-smi utilisation joined to the jobs (affinode.io's analysis of 93 k jobs): GPUs of
  jobs shorter than 6 h idle 49 % of the time, of jobs longer than 24 h 25 %; 65 % of idle
  periods are in the middle of a job (input, checkpoints, evaluation), not at its ends.

From them, three job classes (scaled: seconds for hours, an 8 GiB GPU for an 80 GiB one; a
job's memory is its whole footprint, the 518 MiB context included). The duties are those of
*training* jobs that share a GPU meaningfully -- the busy half of the PAI distribution and
Philly's 51-75 % busy -- not the PAI median (inference and notebooks at ~0 %, which would
share for free):

    class   footprint   duty   GPU work   pause (checkpoint/eval)
    small   1.5 GiB     0.30   short      0.3 s every 1.5 GPU-s
    medium  3 GiB       0.50   medium     0.3 s every 1.5 GPU-s
    large   5 GiB       0.65   long       0.3 s every 1.5 GPU-s   (Philly's long jobs: ~75 % busy)

Memory sizes are skewed as in PAI (many small holders, a few large). Convergence: loss
curves exp with a per-job rate (fast ones plateau early), or linear (learning to the end).

Load: each mix alone asks 1.2-1.4x the node's memory at once, a queue that drains within one
job's time. bench_sharing submits it twice by default (`--load 2`), as a node of a busy
cluster sees a queue behind its running jobs (Jeon et al. analyse the queueing delays of
Philly's jobs, a large part of their completion times); `--load 1` is the burst alone.
"""

from __future__ import annotations

from dataclasses import dataclass

SMALL_MIB, MEDIUM_MIB, LARGE_MIB = 1536, 3072, 5120
DUTY = {"small": 0.30, "medium": 0.50, "large": 0.65}
PAUSE_EVERY_S, PAUSE_S = 1.5, 0.3
ARRIVAL_GAP_S = 0.3


@dataclass(frozen=True)
class JobShape:
    """One job of a mix before scaling: class, GPU work (GPU-seconds), loss curve and rate."""

    name: str
    size: str  # small | medium | large
    work_s: float
    curve: str = "exp"
    rate: float = 0.5

    @property
    def memory_mib(self) -> int:
        return {"small": SMALL_MIB, "medium": MEDIUM_MIB, "large": LARGE_MIB}[self.size]

    @property
    def duty(self) -> float:
        return DUTY[self.size]


def heterogeneous() -> list[JobShape]:
    """PAI-like skew: many small jobs, some medium, a few large; 39 GiB asked of 32."""
    return [
        JobShape("large-a", "large", 5.0, "exp", 0.5), JobShape("small-a", "small", 2.0, "exp", 1.5),
        JobShape("medium-a", "medium", 3.0, "linear", 0.25), JobShape("small-b", "small", 2.5, "exp", 1.0),
        JobShape("large-b", "large", 4.0, "exp", 0.3), JobShape("small-c", "small", 1.5, "exp", 2.0),
        JobShape("medium-b", "medium", 3.5, "exp", 0.6), JobShape("small-d", "small", 2.0, "linear", 0.4),
        JobShape("large-c", "large", 4.5, "linear", 0.2), JobShape("medium-c", "medium", 3.0, "exp", 0.8),
        JobShape("small-e", "small", 2.0, "exp", 1.2), JobShape("medium-d", "medium", 2.5, "exp", 0.5),
        JobShape("small-f", "small", 1.5, "exp", 1.5), JobShape("medium-e", "medium", 3.0, "linear", 0.3),
    ]


def memory_heavy() -> list[JobShape]:
    """Mostly medium and large jobs: 45 GiB asked of 32 (without arbitration: OOM)."""
    return [
        JobShape("large-a", "large", 4.0, "exp", 0.4), JobShape("medium-a", "medium", 3.0, "exp", 0.6),
        JobShape("large-b", "large", 3.5, "linear", 0.25), JobShape("medium-b", "medium", 3.0, "exp", 0.8),
        JobShape("large-c", "large", 4.0, "exp", 0.5), JobShape("small-a", "small", 2.0, "exp", 1.0),
        JobShape("medium-c", "medium", 2.5, "linear", 0.35), JobShape("large-d", "large", 3.0, "exp", 0.6),
        JobShape("medium-d", "medium", 3.0, "exp", 0.5), JobShape("small-b", "small", 2.0, "exp", 1.5),
        JobShape("medium-e", "medium", 2.5, "exp", 0.7),
    ]


def long_tail() -> list[JobShape]:
    """Converging and long-tail jobs: half plateau after a fifth of their work (fast exp),
    half learn to the end (linear or slow exp); 27 GiB asked of 32 -- time, not memory, is short."""
    return [
        JobShape("plateau-a", "medium", 4.0, "exp", 2.5), JobShape("learner-a", "medium", 3.0, "linear", 0.3),
        JobShape("plateau-b", "large", 4.0, "exp", 2.0), JobShape("learner-b", "small", 2.5, "exp", 0.15),
        JobShape("plateau-c", "small", 3.5, "exp", 3.0), JobShape("learner-c", "medium", 3.0, "linear", 0.3),
        JobShape("plateau-d", "medium", 4.0, "exp", 2.5), JobShape("learner-d", "small", 2.5, "linear", 0.35),
        JobShape("plateau-e", "small", 3.0, "exp", 2.5), JobShape("learner-e", "medium", 3.0, "exp", 0.15),
    ]


MIXES = {"heterogeneous": heterogeneous, "memory-heavy": memory_heavy, "long-tail": long_tail}
