"""Slurm jobs on the simulated node: per-job memory and kernel seconds against the sim's ledger.

The test builds Slurm-shaped cgroup trees itself (root, real cgroups) and runs the sim's
`simworker` in them, as slurmstepd would run tasks:
* job 101 in the cgroup v2 shape -- ``<test>_slurmstepd.scope/job_101/step_0/user/task_0``
  and ``.../step_batch/user/task_0`` (two steps of one job);
* job 102 in the v1 shape on this hybrid host -- ``/slurm_<test>/uid_0/job_102/step_0/task_0``
  in the v1 controllers, its v2 cgroup the root (what slurm-wlm's cgroup/v1 plugin does here).
A running `gpuwatch agent` (no probes) must export each job as namespace "slurm", pod
"job-<N>", each step as container "step-<M>"; the job's memory is exactly what the ledger
holds for its processes, its kernel seconds within 10 % of the ledger's busy time (the jobs
are frozen before comparing, so both sides stand still).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwatch.sim import SimNode, status
from gpuwatch.sim.node import SimStatus
from tests.system.sim_helpers import Workers, cgroup2_root, in_cgroups, private_node, remove_dirs, workers
from tests.system.test_pipeline_containers import Scrape, scrape, sim_agent, wait_for

pytestmark = [pytest.mark.root]


def _mounted_v1(*names: str) -> tuple[str, ...]:
    """The v1 hierarchies among `names` this host really mounts (cpu and cpuacct are one
    `cpu,cpuacct` hierarchy on some hosts, two on others, such as this one): a name that is no
    mount point would be a plain directory on the /sys/fs/cgroup tmpfs, left behind."""
    root = Path("/sys/fs/cgroup")
    return tuple(n for n in names if os.path.ismount(root / n) and not (root / n).is_symlink())


V1_CONTROLLERS = _mounted_v1("freezer", "memory", "pids", "cpu,cpuacct", "cpu", "cpuacct")
NODE = "slurm-node"
INTERVAL_S = 0.5
SETTLE_S = 7.0  # frozen: the ledger stands still; the agent reads NVML samples at most 6 s apart


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups)")
    with private_node(tmp_path, devices=2, memory_bytes=16 << 30) as sim:
        yield sim


class SlurmTree:
    """Slurm-shaped cgroup directories for one test (v2 scope and v1 slurm_<name> tops),
    removed deepest first at the end."""

    def __init__(self, name: str) -> None:
        self.v2_top = cgroup2_root() / f"{name}_slurmstepd.scope"
        self.v1_top = f"slurm_{name}"
        self.made: list[Path] = []

    def v2_task(self, job: int, step: str) -> Path:
        path = self.v2_top / f"job_{job}" / f"step_{step}" / "user" / "task_0"
        self._make(path)
        return path

    def v1_task(self, job: int, step: str) -> list[Path]:
        rel = Path(self.v1_top, "uid_0", f"job_{job}", f"step_{step}", "task_0")
        dirs = [Path("/sys/fs/cgroup", ctrl, rel) for ctrl in V1_CONTROLLERS]
        for d in dirs:
            self._make(d)
        return dirs

    def _make(self, path: Path) -> None:
        for parent in reversed((path, *path.parents)):
            if not parent.exists():
                parent.mkdir()
                self.made.append(parent)

    def remove(self) -> None:
        remove_dirs(self.made)


def start_in(w: Workers, procs_files: list[Path], *args: str) -> tuple[int, int]:
    """A simworker that moves itself into the given cgroups before it execs; (pid, bytes)."""
    proc = w.start(argv=in_cgroups(procs_files, [str(w.node.libraries.worker_path), *args]))
    line = Workers.wait_line(proc, "ready")
    return proc.pid, int(line[2])


def freeze(tree: SlurmTree, state: str) -> None:
    for job in tree.v2_top.glob("job_*"):
        (job / "cgroup.freeze").write_text("1" if state == "FROZEN" else "0")
    for job in Path("/sys/fs/cgroup/freezer", tree.v1_top, "uid_0").glob("job_*"):
        (job / "freezer.state").write_text(state)


def test_slurm_jobs_are_exported_per_job_like_the_ledger(node: SimNode, tmp_path: Path) -> None:
    tree = SlurmTree(f"gwtest{os.getpid()}")
    try:
        with sim_agent(node, tmp_path, NODE, INTERVAL_S) as (agent, port):

            def alive_and(predicate: Callable[[Scrape], bool]) -> Callable[[], bool]:
                def check() -> bool:
                    assert agent.poll() is None, (tmp_path / "agent.log").read_text()
                    try:
                        return predicate(scrape(port))
                    except OSError:
                        return False
                return check

            with workers(node) as w:
                try:
                    jobs = start_jobs(w, tree)
                    wait_for(alive_and(lambda m: all(m.value("gpuwatch_pod_memory_bytes", namespace="slurm",
                                                             pod=f"job-{j}") for j in jobs)),
                             30, "both jobs in the agent's metrics")
                    # compare what both sides add over one stretch of work between two standstills
                    # (the seconds a process ran before the agent first listed it are not the question)
                    freeze(tree, "FROZEN")
                    time.sleep(SETTLE_S)
                    before = (scrape(port), status(node))
                    freeze(tree, "THAWED")
                    time.sleep(3.0)  # run kernels for a while
                    freeze(tree, "FROZEN")
                    time.sleep(SETTLE_S)
                    compare(before, (scrape(port), status(node)), jobs)
                finally:
                    freeze(tree, "THAWED")  # a frozen v1 task would not die before the workers' kill
    finally:
        tree.remove()


def start_jobs(w: Workers, tree: SlurmTree) -> dict[int, list[int]]:
    """Job 101: two steps (0 and batch) on GPU 0, v2 shape; job 102: one step on GPU 1, v1 shape
    with its v2 cgroup the root. Job id -> pids."""
    jobs: dict[int, list[int]] = {101: [], 102: []}
    for step, mib in (("0", 96), ("batch", 64)):
        task = tree.v2_task(101, step)
        pid, _ = start_in(w, [task / "cgroup.procs"], "--gpu", "0", "--mib-per-step", str(mib),
                          "--steps", "2", "--duty", "0.3", "--kernel-ms", "5")
        jobs[101].append(pid)
    v1_dirs = tree.v1_task(102, "0")
    pid, _ = start_in(w, [cgroup2_root() / "cgroup.procs", *(d / "cgroup.procs" for d in v1_dirs)], "--gpu", "1",
                      "--mib-per-step", "128", "--steps", "1", "--duty", "0.5", "--kernel-ms", "5")
    jobs[102].append(pid)
    return jobs


def compare(before: tuple[Scrape, SimStatus], after: tuple[Scrape, SimStatus], jobs: dict[int, list[int]]) -> None:
    """Per job: memory exactly the ledger's; the kernel seconds it gained within 10 % of the
    busy time the ledger gained; steps as containers."""
    m, ledger = after
    for job, pids in jobs.items():
        mem = sum(p.memory_bytes for p in ledger.processes if p.host_pid in pids)

        def busy(state: SimStatus, pids: list[int] = pids) -> float:
            return sum(p.busy_seconds_total for p in state.processes if p.host_pid in pids)

        def kernel(scraped: Scrape, job: int = job) -> float:
            return scraped.value("gpuwatch_pod_kernel_seconds_total", namespace="slurm", pod=f"job-{job}") or 0.0

        busy_s = busy(ledger) - busy(before[1])
        got_s = kernel(m) - kernel(before[0])
        got_mem = m.value("gpuwatch_pod_memory_bytes", namespace="slurm", pod=f"job-{job}")
        print(f"job {job}: memory {got_mem} vs ledger {mem}; kernel +{got_s:.3f} s vs ledger +{busy_s:.3f} s")
        assert got_mem == mem
        assert busy_s > 0.3 and got_s == pytest.approx(busy_s, rel=0.10)
    batch = m.labels_of("gpuwatch_container_memory_bytes", namespace="slurm", pod="job-101", container="step-batch")
    assert batch["container_id"] == "101.batch"
    v1_step = m.labels_of("gpuwatch_container_memory_bytes", namespace="slurm", pod="job-102")
    assert (v1_step["container"], v1_step["container_id"]) == ("step-0", "102.0")
    assert m.value("gpuwatch_pod_containers", namespace="slurm", pod="job-101") == 2
