"""Slurm job / step / task cgroups -> where in a path a Slurm job sits (pure, no I/O).

slurmd's cgroup plugins (proctrack/cgroup, task/cgroup) put every job step in its own cgroup:

* cgroup v2 (cgroup/v2): ``/system.slice/slurmstepd.scope/job_<N>/step_<M>/user/task_<K>``;
  the step's own slurmstepd sits in ``.../step_<M>/slurm``, the daemons in
  ``slurmstepd.scope/system``. Some versions and test clusters leave out the ``user`` level;
  a node running several slurmd (multiple-slurmd) names the scope ``<node>_slurmstepd.scope``,
  and a node without systemd has ``slurmstepd.scope`` at the top.
* cgroup v1 (cgroup/v1): ``/slurm/uid_<U>/job_<N>/step_<M>/task_<K>`` in every controller
  (``/slurm_<node>/...`` with multiple-slurmd).

Steps are numbered (``step_0``) or named: ``step_batch`` (the batch script), ``step_extern``
(processes adopted by pam_slurm_adopt; task ``task_special`` on v2) and ``step_interactive``.
A step is what a container is elsewhere (the unit that runs work; Slurm writes it
``<job>.<step>``, e.g. ``42.batch``), its job what a pod is (cgroup_path.py maps them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_V2_SCOPE = re.compile(r"^(?:.+_)?slurmstepd\.scope$")
_V1_TOP = re.compile(r"^slurm(?:_.+)?$")
_UID = re.compile(r"^uid_(?P<uid>[0-9]+)$")
_JOB = re.compile(r"^job_(?P<job>[0-9]+)$")
_STEP = re.compile(r"^step_(?P<step>[0-9]+|batch|extern|interactive)$")
_TASK = re.compile(r"^task_(?P<task>[0-9]+|special)$")


@dataclass(frozen=True)
class SlurmPlace:
    """A Slurm job (and maybe step) found in a cgroup path.

    `step` is "" for a job-level cgroup; `stepd` marks the step's own slurmstepd cgroup
    (``step_<M>/slurm`` on v2): the runtime's helper, not the step's work. `uid` is known
    on v1 only (v2 paths do not carry it: the resolver reads it from the process).
    `job_at` / `end_at` are the indices of the job component and of the last Slurm
    component in the split path."""

    job: str
    step: str = ""
    task: str = ""
    uid: str = ""
    stepd: bool = False
    job_at: int = -1
    end_at: int = -1


def find_slurm(comps: list[str]) -> SlurmPlace | None:
    """The Slurm job/step of a split cgroup path, or None when the path is not Slurm's.

    The job component must follow a slurmstepd scope (v2) or ``slurm[/uid_<U>]`` (v1):
    a ``job_<N>`` directory anywhere else is somebody else's cgroup."""
    for i, comp in enumerate(comps):
        uid = ""
        j = -1
        if _V2_SCOPE.match(comp):
            j = i + 1
        elif _V1_TOP.match(comp) and i + 1 < len(comps):
            m = _UID.match(comps[i + 1])
            if m:
                uid, j = m.group("uid"), i + 2
            elif _JOB.match(comps[i + 1]):
                j = i + 1
        if j < 0 or j >= len(comps):
            continue
        job = _JOB.match(comps[j])
        if job is None:
            continue
        return _below_job(comps, j, job.group("job"), uid)
    return None


def _below_job(comps: list[str], j: int, job: str, uid: str) -> SlurmPlace:
    """The step and task below the job component at index j."""
    k = j + 1
    step = _STEP.match(comps[k]) if k < len(comps) else None
    if step is None:
        return SlurmPlace(job=job, uid=uid, job_at=j, end_at=j)
    end = k
    rest = comps[k + 1:k + 3]
    task = ""
    if rest and rest[0] == "slurm":
        return SlurmPlace(job=job, step=step.group("step"), uid=uid, stepd=True, job_at=j, end_at=k + 1)
    if rest and rest[0] == "user":
        end += 1
        rest = rest[1:]
    if rest:
        t = _TASK.match(rest[0])
        if t is not None:
            task = t.group("task")
            end += 1
    return SlurmPlace(job=job, step=step.group("step"), task=task, uid=uid, job_at=j, end_at=end)
