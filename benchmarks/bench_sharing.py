"""Benchmark: sharing a GPU whose memory is oversubscribed -- none vs static fair share vs
adaptive fair share + execution rescheduling (Chen et al. 2019) vs that + progress-aware
elastic GPU time (FlowCon).

    sudo .venv/bin/python benchmarks/bench_sharing.py [--quick] [--repeats N]
                         [--mixes heterogeneous,memory-heavy,long-tail] [--modes none,static,adaptive,elastic]
                         [--order smallest|arrival] [--placement queue|late] [--fit binpack|spread]
                         [--node-queue arrival|smallest] [--headroom F]
                         [--requeue-after S] [--contended F] [--elastic-throttle all-but-top|yielding]
                         [--elastic-divide plateau|efficiency] [--checkpoint-plateaued on|off]
                         [--plateau F]
                         [--load N] [--kernel-host sleep|spin] [--keep]

On the simulated GPU node (gpuwatch/sim: 4 GPUs of 8 GiB; kernels contend for each device's
engine, time-sliced, and sleep on the host -- `sim up --kernel-host sleep`: a real node's
GPUs cost its CPUs nothing, while spinning kernels would need one of this 2-core VM's cores
per busy GPU; memory is a shared ledger that answers CUDA_ERROR_OUT_OF_MEMORY when full) it
runs job mixes in real runc containers (pods in namespace `bench`), each job a
`gpuwatch sim run` shaped like a training job (benchmarks/sharing_mixes.py, from the Alibaba
PAI and Philly traces): GPU work at a duty (the rest of each step waits for input), a pause
every 1.5 GPU-seconds (a checkpoint save), memory grown in 3 steps while it warms up and then
held, a loss curve of the work done in a progress file declared with the
gpuwatch.io/progress-file annotation. A job's memory is its whole footprint as its pod's rule
declares it: its CUDA context (518 MiB as on an H100, passed explicitly: --context-mib) and
data in whole 2 MiB pages. Each mix is submitted `--load` times (default 2: the node has a
queue of about twice the mix's demand, as in a busy cluster). Jobs arrive 0.3 s apart and
are placed on a GPU at arrival by gpuwatch/policy/placement.py (the rule the extender picks a
pod's GPU on a node by, the same in every mode: binpack by declared demand -- the fullest GPU
where it fits, `--fit spread`: the emptiest; a job that fits nowhere waits on a GPU where its
context fits beside every promise, or at the node; `--placement late`: it always waits at the
node until a GPU has room for all of it). Jobs waiting at the node (pending pods) are taken in
arrival order, as kube-scheduler's PrioritySort takes pods of one priority (`--node-queue
smallest`: the smallest declared demand first).
The agent's pipeline runs in this process exactly as `gpuwatch agent --policy` wires
it (sampler, kernel probes with the limit map and the event pump that wakes the sampler,
enforcer with freezer and throttle), with one
policy per mode:

* none: a catch-all rule without limits. A job whose allocation finds the GPU full gets
  CUDA_ERROR_OUT_OF_MEMORY and fails (exit 2); it is resubmitted from scratch after a second;
* static: fair share with `split: equal` -- a job may hold at most the GPU / the jobs holding
  memory (counting itself); beyond it, it waits (stopped at the allocation, frozen);
* adaptive: fair share with `split: demand` and execution rescheduling: jobs admitted for
  their whole declared demand (`--headroom F` < 1: for their current footprint + F x the
  declared demand, rescheduling.headroom), smallest declared demand first (`--order arrival`:
  in arrival order; rescheduling.order), the rest wait frozen at their first allocation and
  are resumed in that order as memory frees (a deadlock is broken by checkpoint-then-kill,
  never by OOM; `--requeue-after S`: a job waiting S seconds is checkpointed and placed
  again, rescheduling.checkpoint_after);
* elastic: adaptive + the `elastic` section: plateaued jobs yield GPU time to the ones still
  learning (`--elastic-divide efficiency`: all in proportion to growth efficiency) and, while
  jobs wait for memory on their GPU, their memory: checkpointed, placed again, resumed from
  the checkpoint (`--checkpoint-plateaued off`: not); `--contended F`: only where the tenants
  keep the engine busy F of the time or more; `--elastic-throttle yielding`: only the
  yielding jobs are throttled.

Per run: average job completion (arrival to done), makespan, time-averaged GPU memory
utilisation of the node and GPU busy (the GPUs' engine utilisation as NVML reports it: where
it is near 100 %, time and not memory limits the jobs), OOM failures, mean time to 95 % of
each job's final progress, and what `gpuwatch top`'s STATE column said of each job against
what the kernel and the cgroups showed (`view_check`). Each mix runs every mode `--repeats`
times (modes interleaved within a repeat, so a slow spell of the VM hits all of them); the
table gives means and ±half the spread and, under it (default placement), what ideal schedulers
reach on the same jobs with no overhead (benchmarks/sharing_bound.py), then one JSON line with
"modes" (means over the mixes) and "mixes" (per mix, with *_spread and the repeats).

Needs root, runc and BCC. `--quick` (CI, ~3 min): the long-tail mix at 0.6 of the work,
the managed modes, 3 repeats (`--mixes` picks others at that scale). Everything started is
stopped, the temp directory removed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

GIB = 1 << 30
MIB = 1 << 20
MODES = ("none", "static", "adaptive", "elastic")
GPUS = 4
"""Simulated GPUs of the node (8 GiB each)."""
NAMESPACE = "bench"
RETRY_S = 1.0
CONTEXT_MIB = 518
"""Each job's CUDA context (a real H100's; `gpuwatch sim run --context-mib`): part of its footprint."""
STARTUP_S = 1.0
POLL_S = 0.1
QUICK_MIXES = ("long-tail",)
"""The mixes --quick runs unless --mixes names others (at the quick scale too)."""
KEYS = ("avg_completion_s", "makespan_s", "mem_util", "gpu_busy", "oom_failures", "t95_progress_s")


@dataclass(frozen=True)
class Job:
    """One training-like job: a footprint of at most `memory_mib` -- its CUDA context, then data grown in `steps`
    while working -- `work_s` GPU-seconds, a loss curve (exp or linear: both can be resumed from a checkpoint by
    shifting V0)."""

    name: str
    memory_mib: int
    steps: int
    work_s: float
    curve: str
    rate: float
    duty: float = 1.0
    pause_every_s: float = 0.0
    pause_s: float = 0.0
    start: float = 1.0
    arrival_s: float = 0.0

    @property
    def step_mib(self) -> int:
        """Data per step: what is left of `memory_mib` beside the context, in steps of whole 2 MiB pages (the
        driver rounds a larger allocation up to them, so the footprint is exactly `footprint_mib`)."""
        return max(self.memory_mib - CONTEXT_MIB, 0) // self.steps // 2 * 2

    @property
    def footprint_mib(self) -> int:
        """What the job holds on the GPU at its last step (context and data): its declared demand."""
        return CONTEXT_MIB + self.steps * self.step_mib

    def loss(self, work_s: float) -> float:
        if self.curve == "exp":
            return self.start * math.exp(-self.rate * work_s)
        return max(0.0, self.start - self.rate * work_s)


def mixes(quick: bool, load: int = 1) -> dict[str, list[Job]]:
    """The trace-shaped mixes (benchmarks/sharing_mixes.py); `quick` scales the work down.
    `load` > 1 submits each mix's jobs that many times (the copies named <job>-2, <job>-3, ...),
    all ARRIVAL_GAP_S apart: a node with a queue of about `load` times the mix's demand, as in
    a busy cluster."""
    from sharing_mixes import ARRIVAL_GAP_S, MIXES, PAUSE_EVERY_S, PAUSE_S  # beside this script

    scale = 0.6 if quick else 1.0
    out: dict[str, list[Job]] = {}
    for name, shapes in MIXES.items():
        submitted = [(shape, f"{shape.name}-{copy + 1}" if copy else shape.name)
                     for copy in range(load) for shape in shapes()]
        out[name] = [Job(job_name, shape.memory_mib, 3, round(shape.work_s * scale, 2), shape.curve,
                         shape.rate / scale, shape.duty, PAUSE_EVERY_S * scale, PAUSE_S, arrival_s=ARRIVAL_GAP_S * i)
                     for i, (shape, job_name) in enumerate(submitted)]
    return out


@dataclass(frozen=True)
class ElasticKnobs:
    """The elastic mode's options (policy `elastic` section, gpuwatch/policy/SCHEMA.md)."""

    contended: float = 0.0  # elastic.contended
    throttle: str = "all-but-top"  # elastic.throttle
    divide: str = "plateau"  # elastic.divide
    checkpoint_plateaued: bool = True  # elastic.checkpoint_plateaued
    plateau: float = 0.05  # elastic.plateau

    def text(self) -> str:
        return (f"{f', contended: {self.contended:.0%}' if self.contended else ''}, throttle: {self.throttle}, "
                f"divide: {self.divide}, checkpoint_plateaued: {str(self.checkpoint_plateaued).lower()}, "
                f"plateau: {self.plateau:.0%}")


def policy_text(mode: str, jobs: list[Job], quick: bool, requeue_after_s: float | None = None,
                order: str = "smallest", headroom: float = 1.0, elastic: ElasticKnobs | None = None) -> str:
    """The policy of one mode: managed modes declare each job's memory with its pod's rule."""
    if mode == "none":
        return f"rules:\n  - name: all\n    match: {{namespace: {NAMESPACE}}}\n"
    split = "equal" if mode == "static" else "demand"
    after = f"{requeue_after_s:g}s, grace: 5s" if requeue_after_s is not None and mode != "static" else "never"
    lines = [f"fair_share: {{enabled: true, split: {split}}}",
             f"rescheduling: {{checkpoint_after: {after}, gate_new: true, demand_from_limit: true"
             f"{', order: ' + order if mode != 'static' else ''}"
             f"{f', headroom: {headroom:.0%}' if mode != 'static' and headroom < 1 else ''}}}",
             "deadlock: {enabled: true, action: checkpoint-then-kill, grace: 10s}"]
    if mode == "elastic":
        window, dwell = ("1s", "1s") if quick else ("3s", "3s")
        lines.append(f"elastic: {{enabled: true, window: {window}, floor: 10%, hysteresis: 5%, min_dwell: {dwell},"
                     f" min_gpu_time: 0.2s{(elastic or ElasticKnobs()).text()}}}")
    lines.append("tuning: {max_actions_per_minute: 600}")
    lines.append("rules:")
    for job in jobs:
        lines += [f"  - name: {job.name}", f"    match: {{namespace: {NAMESPACE}, pod: {job.name}}}",
                  f"    limits: {{gpu_memory: {job.footprint_mib}MiB}}",
                  "    actions: [{do: alert, at: 101%}]"]  # its declared demand: reaching it is no violation
    return "\n".join(lines) + "\n"


# ---- the agent's pipeline, in this process ----------------------------------------------------


class Pipeline:
    """Sampler + kernel probes + enforcer, wired as `gpuwatch agent --policy` wires them; the
    policy (a new enforcer) changes per run."""

    def __init__(self, sim: Any, lab_dirs: dict[str, Path], work: Path, interval_s: float) -> None:
        from gpuwatch.containers import BundleRoots
        from gpuwatch.pipeline.sampler import build_sampler
        from gpuwatch.probes.manager import ProbeConfig, ProbeManager

        os.environ["GPUWATCH_SIM_STATE"] = str(sim.state_path)
        self.work = work
        self.interval_s = interval_s
        self.roots = BundleRoots(containerd_tasks=(str(lab_dirs["bundle_root"]),),
                                 runc_state=(str(lab_dirs["runc_root"]),))
        self.probes = ProbeManager(ProbeConfig(device_prefix=str(sim.dev_dir / "nvidia"),
                                               libcuda_paths=(str(sim.libraries.cuda_path),)))
        self.probes.start()
        self.sampler = build_sampler(nvml_library=str(sim.libraries.nvml_path), interval_s=interval_s,
                                     node="bench", probe_source=self.probes, bundle_roots=self.roots)
        self.sampler.start()
        from gpuwatch.agent.event_pump import EventPump

        self.pump = EventPump(self.probes.poll_events, self.sampler.wake).start()
        self.enforcer: Any = None
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-enforcer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from gpuwatch.core.errors import GpuwatchError

        for snapshot in self.sampler.follow(self._stop, poll_s=self.interval_s / 4):
            events = self.pump.take()
            with self._lock:
                enforcer = self.enforcer
                if enforcer is None:
                    continue
                try:
                    enforcer.on_snapshot(snapshot, events)
                except GpuwatchError as err:
                    self.errors.append(str(err))

    def use_policy(self, name: str, text: str) -> None:
        from gpuwatch.agent.enforcer_factory import CgroupNodeContainers, build_enforcer
        from gpuwatch.enforce.enforcer import EnforcerConfig
        from gpuwatch.enforce.kernel_limits import NullDeviceGate

        path = self.work / f"policy-{name}.yaml"
        path.write_text(text)
        with self._lock:
            if self.enforcer is not None:
                self.enforcer.close()
            self.pump.take()  # events of the previous run are not this one's
            settings = EnforcerConfig(frozen_state_path=self.work / "frozen.json", recover=False,
                                      lock_path=self.work / "agent.lock")
            self.enforcer = build_enforcer(
                path, self.work / f"audit-{name}.jsonl", settings, probes=self.probes, device_gate=NullDeviceGate(),
                node_containers=CgroupNodeContainers(bundle_roots=self.roots, subtrees=("/kubepods",)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pump.stop()
        with self._lock:
            if self.enforcer is not None:
                self.enforcer.close()
                self.enforcer = None
        self.sampler.stop()
        self.probes.stop()


# ---- one run: a mix under a mode ----------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One look at a running job: what the benchmark saw of it in the kernel and the cgroup, and
    what `gpuwatch top`'s STATE column said of it at that moment (the enforcer's view, rendered
    by the same function top uses)."""

    t: float
    stopped: bool  # a process of it stopped (T): held at an allocation by the kernel probes
    frozen: bool  # its cgroup frozen (cgroup.freeze): paused, waiting, or in a throttle's off phase
    state: str  # top's STATE text ("-": the enforcer's view does not list it yet)


LAG_S = 0.6
"""A view built once per agent interval (0.25 s) lags what the kernel did: looks this soon
after the job was stopped or continued are not counted for or against top."""


def view_check(runs: list[JobRun]) -> dict[str, Any]:
    """Issue 21 item 4: does top say why a job waits or runs slower? Per look at a job:
    STATE says "waiting for memory" exactly when a process of it is stopped at an allocation
    (`waiting_agreement`, looks within LAG_S of a stop or continue left out); every job stopped
    for LAG_S or longer was shown waiting (`jobs_waited` / `jobs_shown_waiting`; shorter stops
    are the admission gate's, released at the next round); while STATE says "throttled to x%"
    the job was found frozen in `throttled_frozen` of the looks (the throttle's off phases),
    while it says "running" in `running_frozen` (should be ~0: nothing holds it)."""
    agree = counted = 0
    waited = shown = 0
    frozen_by_state = {"throttled": [0, 0], "running": [0, 0]}
    for run in runs:
        changes = [b.t for a, b in zip(run.seen, run.seen[1:], strict=False) if a.stopped != b.stopped]
        longest = start = 0.0
        for i, look in enumerate(run.seen):
            if look.stopped and (i == 0 or not run.seen[i - 1].stopped):
                start = look.t
            if look.stopped:
                longest = max(longest, look.t - start)
        if longest >= LAG_S:
            waited += 1
            shown += any(s.state.startswith("waiting for memory") for s in run.seen)
        for look in run.seen:
            kind = "throttled" if look.state.startswith("throttled to ") else \
                "running" if look.state.startswith("running") else ""
            if kind:
                frozen_by_state[kind][0] += look.frozen
                frozen_by_state[kind][1] += 1
            if look.state == "-" or any(0 <= look.t - c < LAG_S for c in changes):
                continue
            counted += 1
            agree += look.stopped == look.state.startswith("waiting for memory")

    def ratio(kind: str) -> float | None:
        frozen, looks = frozen_by_state[kind]
        return round(frozen / looks, 3) if looks else None

    return {"looks": counted, "waiting_agreement": round(agree / counted, 4) if counted else None,
            "jobs_waited": waited, "jobs_shown_waiting": shown,
            "throttled_looks": frozen_by_state["throttled"][1], "throttled_frozen": ratio("throttled"),
            "running_looks": frozen_by_state["running"][1], "running_frozen": ratio("running")}


@dataclass
class JobRun:
    job: Job
    progress_file: Path
    attempts: int = 0
    oom_failures: int = 0
    done_s: float | None = None
    container: Any = None
    next_start_s: float = 0.0
    done_work_s: float = 0.0  # resumed from (after a checkpoint)
    gpu: int | None = None  # placed at its first start
    samples: list[tuple[float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)

    def argv(self, sim_name: str) -> list[str]:
        job = self.job
        left = max(job.work_s - self.done_work_s, 0.01)
        start = job.loss(self.done_work_s)
        # a training job's start (imports, data loading) before its first CUDA allocation
        startup = ["/bin/sh", "-c", f'sleep {STARTUP_S:g} && exec "$@"', job.name]
        return [*startup, sys.executable, "-m", "gpuwatch", "sim", "run", "--name", sim_name,
                "--gpu", str(self.gpu or 0),
                "--context-mib", str(CONTEXT_MIB),  # with the steps: the declared demand exactly
                "--mib-per-step", str(job.step_mib), "--steps", str(job.steps), "--interval-s", "0.5", "--hold",
                "--duty", f"{job.duty:g}", "--kernel-ms", "10", "--work-s", f"{left:.3f}",
                "--pause-every-s", f"{job.pause_every_s:g}", "--pause-s", f"{job.pause_s:g}",
                "--progress-curve", job.curve, "--progress-rate", f"{job.rate:g}",
                "--progress-start", f"{max(start, 1e-9):.9g}", "--progress-file", str(self.progress_file),
                "--progress-interval-s", "0.1"]


def last_work_done(logs: str) -> float:
    """The work done at the last `evaluation <value> <work done s>` line of a job's output."""
    done = 0.0
    for line in logs.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "evaluation":
            try:
                done = float(parts[2])
            except ValueError:
                continue
    return done


def t95(samples: list[tuple[float, float]], start: float, final: float) -> float | None:
    """First time the progress |loss - start| reached 95% of its final value, in the attempt
    chain that finished (a progress that falls back below, a restart from scratch, resets it)."""
    target = 0.95 * abs(final - start)
    crossed: float | None = None
    for t, value in samples:
        reached = abs(value - start) >= target
        if reached and crossed is None:
            crossed = t
        elif not reached:
            crossed = None
    return crossed


class Run:
    def __init__(self, pipeline: Pipeline, lab: Any, sim: Any, mode: str, mix: str, jobs: list[Job], work: Path,
                 timeout_s: float, retry_s: float, gpus: int = GPUS, repeat: int = 0, late_binding: bool = False,
                 requeue_after_s: float | None = None, order: str = "smallest", headroom: float = 1.0,
                 elastic: ElasticKnobs | None = None, fit: str = "binpack", node_queue: str = "arrival") -> None:
        self.pipeline, self.lab, self.sim = pipeline, lab, sim
        self.fit, self.node_queue = fit, node_queue
        self.gpus = gpus
        self.late_binding = late_binding
        self.order = order
        self.headroom = headroom
        self.elastic = elastic or ElasticKnobs()
        self.requeue_after_s = requeue_after_s if mode in ("adaptive", "elastic") else None
        self.mode, self.mix = mode, mix
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.dir = work / f"{mix}-{mode}-{repeat}"
        self.dir.mkdir(parents=True)
        self.jobs = [JobRun(j, self.dir / j.name / "loss", next_start_s=j.arrival_s) for j in jobs]
        for run in self.jobs:
            run.progress_file.parent.mkdir()
        self.memory: list[tuple[float, float]] = []
        self.busy: list[tuple[float, float]] = []  # the GPUs' mean engine utilisation (NVML's, last second)

    def _spec(self, run: JobRun) -> Any:
        from gpuwatch.sim import node as simnode
        from gpuwatch.sim.runc import ContainerSpec

        return ContainerSpec(
            name=f"{run.job.name}-{run.attempts}", namespace=NAMESPACE, pod=run.job.name,
            argv=run.argv(self.sim.name), env=simnode.sim_env(self.sim),
            extra_binds=[str(self.sim.state_path.parent), str(self.sim.root), str(run.progress_file.parent)],
            ro_binds=[str(self.sim.libraries.lib_dir)],
            annotations={"gpuwatch.io/progress-file": str(run.progress_file),
                         "gpuwatch.io/progress-goal": "minimize"},
        )

    def _place(self, run: JobRun) -> int | None:
        """The GPU by the node's placement rule (gpuwatch.policy.placement): per GPU, the
        declared demand of the jobs placed there and not done (a job placed to wait counts all
        of it: a GPU takes one such job, whose context fitted, at a time) -- or None."""
        from gpuwatch.policy.placement import GpuLoad, choose_gpu

        loads = []
        for index in range(self.gpus):
            placed = [r for r in self.jobs if r.gpu == index and r.done_s is None]
            loads.append(GpuLoad(index, 8 * GIB, sum(r.job.footprint_mib for r in placed) * MIB, len(placed)))
        return choose_gpu(run.job.footprint_mib * MIB, loads, CONTEXT_MIB * MIB, queue_on_gpu=not self.late_binding,
                          policy=self.fit)

    def _node_ratios(self) -> tuple[float, float]:
        """(memory used / memory, the GPUs' mean utilisation over the last second) of the node."""
        from gpuwatch.sim import node as simnode

        devices = simnode.status(self.sim).devices
        total = sum(d.memory_total_bytes for d in devices)
        memory = sum(d.memory_used_bytes for d in devices) / total if total else 0.0
        busy = statistics.fmean(d.utilization_percent / 100 for d in devices) if devices else 0.0
        return memory, busy

    def _stop(self, run: JobRun) -> str:
        """Stop the job's container; its output is kept beside its progress file."""
        container, run.container = run.container, None
        logs = container.logs()
        (run.progress_file.parent / f"attempt-{run.attempts}.log").write_text(logs)
        container.stop()
        return str(logs)

    def _finished(self, run: JobRun, now: float) -> None:
        status = run.container.wait(5)
        logs = self._stop(run)
        if status == 0 and any(line.startswith("done ") for line in logs.splitlines()):
            run.done_s = now
            self._sample(run, now)
            return
        if status == 2 or any(line.startswith("oom ") for line in logs.splitlines()):
            run.oom_failures += 1
            run.done_work_s = 0.0  # from scratch: the job kept nothing
        elif status == 0 and "checkpoint" in logs:
            run.done_work_s = min(run.done_work_s + last_work_done(logs), run.job.work_s)
            run.notes.append(f"checkpointed at {run.done_work_s:.2f} GPU-s")
            run.gpu = None  # back in the node's queue: placed again, on a GPU with room
        else:
            run.notes.append(f"exit {status}: {logs.strip().splitlines()[-1:] if logs.strip() else ''}")
            run.done_work_s = 0.0
        run.next_start_s = now + self.retry_s

    def _describe(self, run: JobRun) -> str:
        """Process states of an unfinished job (T = stopped at an allocation) and its freezer."""
        states = []
        for pid in run.container.pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            state = next((line.split()[1] for line in status.splitlines() if line.startswith("State:")), "?")
            states.append(f"{pid}:{state}")
        try:
            frozen = (run.container.v2_dir / "cgroup.freeze").read_text().strip() == "1"
        except OSError:
            frozen = False
        return f"pids {' '.join(states)}{' frozen' if frozen else ''}"

    def _top_states(self) -> dict[str, str]:
        """Pod -> the STATE text `gpuwatch top` shows for it now (tui.view_state.state_text of
        the enforcer's view, what the agent serves in /snapshot.json)."""
        from gpuwatch.tui.view_state import state_text

        enforcer = self.pipeline.enforcer
        if enforcer is None:
            return {}
        return {item.identity.pod_name: state_text(item) for item in enforcer.view()
                if item.identity.pod_namespace == NAMESPACE}

    def _look(self, run: JobRun, now: float, view: dict[str, str]) -> None:
        """What the kernel and the cgroup say of the job now, beside top's STATE."""
        stopped = False
        for pid in run.container.pids():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            stopped |= stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
        try:
            frozen = (run.container.v2_dir / "cgroup.freeze").read_text().strip() == "1"
        except OSError:
            frozen = False
        run.seen.append(Seen(now, stopped, frozen, view.get(run.job.name, "-")))

    def _sample(self, run: JobRun, now: float) -> None:
        try:
            text = run.progress_file.read_text()
            value = float(text.split()[0])
        except (OSError, ValueError, IndexError):
            return
        if not run.samples or run.samples[-1][1] != value:
            run.samples.append((now, value))

    def execute(self) -> dict[str, Any]:
        self.pipeline.use_policy(f"{self.mix}-{self.mode}", policy_text(self.mode, [r.job for r in self.jobs],
                                                                         quick=self.retry_s < RETRY_S,
                                                                         requeue_after_s=self.requeue_after_s,
                                                                         order=self.order, headroom=self.headroom,
                                                                         elastic=self.elastic))
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        try:
            while time.monotonic() < deadline:
                now = time.monotonic() - t0
                memory, busy = self._node_ratios()
                self.memory.append((now, memory))
                self.busy.append((now, busy))
                view = self._top_states()
                # the node's queue (pending pods): arrival order, or the smallest declared demand first
                line = sorted(self.jobs, key=lambda r: r.job.footprint_mib) if self.node_queue == "smallest" \
                    else self.jobs
                for run in line:
                    if run.done_s is not None:
                        continue
                    if run.container is None and now >= run.next_start_s:
                        if run.gpu is None:
                            run.gpu = self._place(run)
                            if run.gpu is None:
                                continue  # no GPU holds even its context: it waits at the node
                        run.attempts += 1
                        run.container = self.lab.run(self._spec(run))
                    elif run.container is not None:
                        self._sample(run, now)
                        self._look(run, now, view)
                        if not run.container.running():
                            self._finished(run, now)
                if all(r.done_s is not None for r in self.jobs):
                    break
                time.sleep(POLL_S)
        finally:
            for run in self.jobs:
                if run.container is not None:
                    run.notes.append(f"not done after {self.timeout_s:g} s: {self._describe(run)}")
                    self._stop(run)
        return self.metrics(time.monotonic() - t0)

    def metrics(self, elapsed_s: float) -> dict[str, Any]:
        done = [r for r in self.jobs if r.done_s is not None]
        makespan = max((r.done_s for r in done if r.done_s is not None), default=elapsed_s)
        completions = [r.done_s - r.job.arrival_s for r in done if r.done_s is not None]
        t95s = []
        for r in done:
            final = r.job.loss(r.job.work_s)
            crossed = t95(r.samples, r.job.start, final)
            if crossed is not None:
                t95s.append(crossed - r.job.arrival_s)
        return {
            "avg_completion_s": round(statistics.fmean(completions), 2) if completions else None,
            "makespan_s": round(makespan, 2),
            "mem_util": time_average(self.memory, makespan),
            "gpu_busy": time_average(self.busy, makespan),
            "oom_failures": sum(r.oom_failures for r in self.jobs),
            "t95_progress_s": round(statistics.fmean(t95s), 2) if t95s else None,
            "completed": f"{len(done)}/{len(self.jobs)}",
            "view": view_check(self.jobs),
            "jobs": {r.job.name: {"gpu": r.gpu,
                                  "completion_s": round(r.done_s - r.job.arrival_s, 2) if r.done_s else None,
                                  "attempts": r.attempts, "oom": r.oom_failures, "waited_s": waited_s(r.seen),
                                  "t95_s": round(c - r.job.arrival_s, 2) if (c := t95(
                                      r.samples, r.job.start, r.job.loss(r.job.work_s))) is not None else None,
                                  **({"notes": r.notes} if r.notes else {})}
                     for r in self.jobs},
        }


def waited_s(seen: list[Seen]) -> float:
    """Seconds a job was seen stopped at an allocation (each look counts until the next)."""
    return round(sum(b.t - a.t for a, b in itertools.pairwise(seen) if a.stopped), 2)


def time_average(samples: list[tuple[float, float]], until_s: float) -> float | None:
    """Time-weighted mean of (t, value) samples over [first sample, until_s] (step-wise)."""
    points = [(t, v) for t, v in samples if t <= until_s]
    if not points:
        return None
    total = area = 0.0
    for (t, value), (t_next, _) in zip(points, [*points[1:], (until_s, 0.0)], strict=True):
        area += value * (t_next - t)
        total += t_next - t
    return round(area / total, 3) if total > 0 else round(points[-1][1], 3)


# ---- report -------------------------------------------------------------------------------------


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeats of one mix under one mode: each metric's mean and its spread (max - min)."""
    out: dict[str, Any] = {}
    for key in KEYS:
        values = [r[key] for r in runs if r[key] is not None]
        if key == "oom_failures":
            out[key] = sum(values)
            continue
        out[key] = round(statistics.fmean(values), 3) if values else None
        out[f"{key}_spread"] = round(max(values) - min(values), 3) if len(values) > 1 else 0.0
    done = sum(int(r["completed"].split("/")[0]) for r in runs)
    total = sum(int(r["completed"].split("/")[1]) for r in runs)
    out["completed"] = f"{done}/{total}"
    out["repeats"] = len(runs)
    out["runs"] = [{k: r[k] for k in KEYS} for r in runs]
    out["view"] = combine_views([r["view"] for r in runs])
    return out


def combine_views(views: list[dict[str, Any]]) -> dict[str, Any]:
    """view_check over several runs: counts summed, the agreement its lowest, the frozen shares
    weighted by their looks."""
    counts = ("looks", "jobs_waited", "jobs_shown_waiting", "throttled_looks", "running_looks")
    out: dict[str, Any] = {key: sum(v[key] for v in views) for key in counts}
    agreements = [v["waiting_agreement"] for v in views if v["waiting_agreement"] is not None]
    out["waiting_agreement"] = min(agreements) if agreements else None
    for kind in ("throttled", "running"):
        looks = out[f"{kind}_looks"]
        frozen = sum((v[f"{kind}_frozen"] or 0.0) * v[f"{kind}_looks"] for v in views)
        out[f"{kind}_frozen"] = round(frozen / looks, 3) if looks else None
    return out


def cell(m: dict[str, Any], key: str, spec: str) -> str:
    spread = m.get(f"{key}_spread")
    return fmt(m[key], spec) + (f" ±{format(spread / 2, spec)}" if spread else "")


def ideal_line(jobs: list[Job], results: dict[str, dict[str, Any]]) -> str:
    """What ideal schedulers reach on the same jobs (benchmarks/sharing_bound.py: a fluid model
    with no overhead), and so the most any scheduler could be below static's measured average."""
    from sharing_bound import bounds  # beside this script

    found = bounds(jobs)
    ideal = {label: bound.avg_completion_s for label, bound in found.items() if label != "alone"}
    line = ("ideal schedulers on these jobs, no overhead (sharing_bound.py), average completion: "
            + ", ".join(f"{label} {avg_s:.2f}" for label, avg_s in ideal.items()))
    static_s = results.get("static", {}).get("avg_completion_s")
    if static_s:
        placed = min(avg_s for label, avg_s in ideal.items() if label.endswith("/ arrival"))
        line += (f"; at best {1 - placed / static_s:.1%} below static's measured with this placement, "
                 f"{1 - min(ideal.values()) / static_s:.1%} with an oracle's")
    sliced, learners = found["slicing / arrival"].avg_t95_s, found["learners / arrival"].avg_t95_s
    if sliced and learners:
        line += f"; learners first reach 95 % progress {1 - learners / sliced:+.1%} sooner than time slicing"
    return line


def table(mix: str, results: dict[str, dict[str, Any]], jobs: list[Job] | None = None) -> str:
    lines = [f"{mix} (mean ±half the spread over the repeats):",
             f"{'mode':<10}{'avg completion s':>18}{'makespan s':>16}{'mem util':>16}{'GPU busy':>16}{'OOM':>6}"
             f"{'t95 progress s':>18}{'done':>8}"]
    for mode, m in results.items():
        lines.append(f"{mode:<10}{cell(m, 'avg_completion_s', '.2f'):>18}{cell(m, 'makespan_s', '.2f'):>16}"
                     f"{cell(m, 'mem_util', '.1%'):>16}{cell(m, 'gpu_busy', '.1%'):>16}{m['oom_failures']:>6}"
                     f"{cell(m, 't95_progress_s', '.2f'):>18}"
                     f"{m['completed']:>8}")
    if "static" in results and "adaptive" in results and results["static"]["avg_completion_s"]:
        gain = 1 - results["adaptive"]["avg_completion_s"] / results["static"]["avg_completion_s"]
        lines.append(f"adaptive vs static, average completion: {gain:+.1%}")
    if "adaptive" in results and "elastic" in results and results["adaptive"]["t95_progress_s"]:
        gain = 1 - (results["elastic"]["t95_progress_s"] or 0) / results["adaptive"]["t95_progress_s"]
        lines.append(f"elastic vs adaptive, time to 95% progress: {gain:+.1%}")
    if jobs:
        lines.append(ideal_line(jobs, results))
    view = combine_views([m["view"] for m in results.values()])
    if view["looks"]:
        lines.append(f"top's STATE against the kernel and cgroups ({view['looks']} looks): 'waiting for memory' "
                     f"exactly when stopped at an allocation in {fmt(view['waiting_agreement'], '.1%')} (worst run); "
                     f"{view['jobs_shown_waiting']}/{view['jobs_waited']} jobs held {LAG_S:g} s or longer shown "
                     f"waiting; frozen in {fmt(view['throttled_frozen'], '.0%')} of the looks that said "
                     f"'throttled' ({view['throttled_looks']}), {fmt(view['running_frozen'], '.0%')} of those "
                     f"that said 'running' ({view['running_looks']})")
    return "\n".join(lines)


def combine(per_mix: dict[str, dict[str, dict[str, Any]]], modes: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        rows = [per_mix[mix][mode] for mix in per_mix if mode in per_mix[mix]]

        def mean(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
            values = [r[key] for r in rows if r[key] is not None]
            return round(statistics.fmean(values), 3) if values else None

        out[mode] = {"avg_completion_s": mean("avg_completion_s"), "makespan_s": mean("makespan_s"),
                     "mem_util": mean("mem_util"), "gpu_busy": mean("gpu_busy"),
                     "oom_failures": sum(r["oom_failures"] for r in rows),
                     "t95_progress_s": mean("t95_progress_s")}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI run: one mix, a fraction of the work")
    parser.add_argument("--modes", default=None, help="default: none,static,adaptive,elastic (quick: no none)")
    parser.add_argument("--mixes", default=None, help="heterogeneous,memory-heavy,long-tail (default: all; quick: one)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each mix and mode (default 3)")
    parser.add_argument("--interval", type=float, default=0.25, help="the agent's sample interval (s)")
    parser.add_argument("--timeout-s", type=float, default=None, help="per run (default 300, quick 60)")
    parser.add_argument("--placement", choices=("queue", "late"), default="queue",
                        help="a job that fits on no GPU: queue on the GPU where its context fits, or wait at the "
                             "node until a GPU has room for all of it (late binding)")
    parser.add_argument("--fit", choices=("binpack", "spread"), default="binpack",
                        help="placement among the GPUs where a job's declared demand fits: the fullest (binpack, the "
                             "extender's default) or the emptiest (spread)")
    parser.add_argument("--node-queue", choices=("arrival", "smallest"), default="arrival",
                        help="order of the jobs waiting at the node for a GPU (pending pods): arrival "
                             "(default: kube-scheduler's PrioritySort, one priority) or smallest declared demand first")
    parser.add_argument("--requeue-after", type=float, default=None,
                        help="adaptive/elastic: a job waiting for memory this long (s) is checkpointed and placed "
                             "again (rescheduling.checkpoint_after; default: never)")
    parser.add_argument("--order", choices=("arrival", "smallest"), default="smallest",
                        help="adaptive/elastic admission order on a GPU (rescheduling.order)")
    parser.add_argument("--headroom", type=float, default=1.0,
                        help="adaptive/elastic: admit a job for its current footprint + this fraction of its "
                             "declared demand (rescheduling.headroom; default 1: the whole declared demand)")
    parser.add_argument("--contended", type=float, default=0.0,
                        help="elastic: re-divide GPU time only where the engine is busier than this "
                             "(elastic.contended)")
    parser.add_argument("--elastic-throttle", choices=("all-but-top", "yielding"), default="all-but-top",
                        help="elastic: who is held to its share while a job yields (elastic.throttle)")
    parser.add_argument("--elastic-divide", choices=("plateau", "efficiency"), default="plateau",
                        help="elastic: only plateaued jobs yield GPU time, or all in proportion to growth efficiency "
                             "(elastic.divide)")
    parser.add_argument("--plateau", type=float, default=0.05, metavar="F",
                        help="elastic: a job whose growth efficiency is below F of its early rate has plateaued "
                             "(elastic.plateau; default 0.05)")
    parser.add_argument("--checkpoint-plateaued", choices=("on", "off"), default="on",
                        help="elastic: a plateaued job is checkpointed while others wait for memory on its GPU "
                             "(elastic.checkpoint_plateaued); it is placed again and resumes from its checkpoint")
    parser.add_argument("--kernel-host", choices=("sleep", "spin"), default="sleep",
                        help="what a simulated kernel does to its host thread (gpuwatch sim up --kernel-host): sleep "
                             "(default: the node's GPUs cost no host CPU, as on a real node with 8+ cores per GPU) "
                             "or spin (each busy GPU takes one of this machine's cores)")
    parser.add_argument("--load", type=int, default=2,
                        help="submit each mix's jobs this many times: a queue of about LOAD x the mix's demand")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (audit logs, job output)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_sharing needs root (runc containers, cgroups, BPF probes)", file=sys.stderr)
        return 2
    from gpuwatch.sim import demo
    from gpuwatch.sim import node as simnode
    from gpuwatch.sim.runc import ContainerLab

    modes = [m for m in (args.modes or ",".join(MODES[1:] if args.quick else MODES)).split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}; use {', '.join(MODES)}")
    all_mixes = mixes(args.quick, args.load)
    chosen = args.mixes.split(",") if args.mixes else list(QUICK_MIXES if args.quick else all_mixes)
    unknown = set(chosen) - set(all_mixes)
    if unknown:
        parser.error(f"unknown mix(es) {', '.join(sorted(unknown))}; use {', '.join(all_mixes)}")
    repeats = args.repeats or 3
    timeout_s = args.timeout_s or (60.0 if args.quick else 300.0)
    retry_s = 0.5 if args.quick else RETRY_S
    knobs = ElasticKnobs(args.contended, args.elastic_throttle, args.elastic_divide,
                         args.checkpoint_plateaued == "on", args.plateau)
    work = Path(tempfile.mkdtemp(prefix="bench-sharing-"))
    per_mix: dict[str, dict[str, dict[str, Any]]] = {}
    started = time.monotonic()
    try:
        with ExitStack() as stack:
            sim = simnode.up(name=f"bench{os.getpid()}", root=work / "simroot", devices=GPUS, memory_bytes=8 * GIB,
                             kernel_host=args.kernel_host)
            stack.callback(simnode.down, sim.name)
            dirs = demo.default_lab_dirs(work / "lab")
            lab = stack.enter_context(ContainerLab(**dirs))
            pipeline = Pipeline(sim, dirs, work, args.interval)
            stack.callback(pipeline.close)
            print(f"simulated node: {GPUS} GPUs of 8 GiB; agent interval {args.interval:g} s; {repeats} repeats; "
                  f"set up in {time.monotonic() - started:.1f} s; placement {args.placement} {args.fit}, "
                  f"order {args.order}, "
                  f"node queue {args.node_queue}, "
                  f"headroom {args.headroom:.0%}, requeue after {args.requeue_after or 'never'}, "
                  f"elastic{knobs.text()}", flush=True)
            for mix in chosen:
                runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
                for repeat in range(repeats):  # modes interleaved: a slow spell of the VM hits all of them
                    for mode in modes:
                        t = time.monotonic()
                        run = Run(pipeline, lab, sim, mode, mix, all_mixes[mix], work, timeout_s, retry_s,
                                  repeat=repeat, late_binding=args.placement == "late",
                                  requeue_after_s=args.requeue_after, order=args.order,
                                  headroom=args.headroom, elastic=knobs, fit=args.fit,
                                  node_queue=args.node_queue)
                        result = run.execute()
                        runs[mode].append(result)
                        print(f"  {mix} / {mode} #{repeat + 1}: {time.monotonic() - t:.1f} s, "
                              f"{json.dumps({k: result[k] for k in KEYS})} top {json.dumps(result['view'])} "
                              f"jobs {json.dumps(result['jobs'])}",
                              flush=True)
                per_mix[mix] = {mode: aggregate(results) for mode, results in runs.items()}
            if pipeline.errors:
                print(f"enforcement errors: {pipeline.errors[:5]}", flush=True)
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    for mix, results in per_mix.items():
        print(table(mix, results, all_mixes[mix] if args.placement == "queue" and args.fit == "binpack" else None))
        print()
    print(f"total {time.monotonic() - started:.1f} s")
    summary = {"modes": combine(per_mix, modes), "quick": args.quick, "repeats": repeats,
               "mixes": {mix: {mode: {k: v for k, v in m.items() if k != "runs"} for mode, m in results.items()}
                         for mix, results in per_mix.items()}}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
