"""Real Slurm on one machine: slurmctld + slurmd (Debian's slurm-wlm, proctrack/cgroup) run a
sim worker through `srun`; the resolver names the task's process as its job and step.

The daemons run from a private configuration (own ports, state and spool under tmp, the
node named after this host) and are stopped at the end. On this hybrid CI machine
slurm-wlm 22.05's cgroup/v1 plugin puts the task in ``freezer:/slurm_<node>/uid_0/job_<N>/
step_0`` with the v2 line ``/``: identity must come from that v1 line.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.containers.resolver import IdentityResolver
from gpuwatch.sim import SimNode, sim_env, status
from tests.conftest import need_binary, need_root
from tests.system.sim_helpers import private_node

pytestmark = [pytest.mark.root]
MIB = 1 << 20

SLURM_CONF = """ClusterName=gwtest
SlurmctldHost={host}
AuthType=auth/munge
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
NodeName={host} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=gw Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
CGROUP_CONF = "CgroupPlugin=autodetect\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """slurmctld + slurmd of a one-node cluster; the environment that reaches it."""
    need_root()
    for name in ("slurmctld", "slurmd", "srun", "munged"):
        need_binary(name, "slurm-wlm")
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    host = socket.gethostname().split(".")[0]
    (d / "slurm.conf").write_text(SLURM_CONF.format(host=host, d=d, ctld_port=_free_port(), d_port=_free_port(),
                                                    cpus=os.cpu_count() or 1))
    (d / "cgroup.conf").write_text(CGROUP_CONF)
    env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
    munge_socket = Path("/run/munge/munge.socket.2")
    if not munge_socket.exists():
        Path("/run/munge").mkdir(exist_ok=True)
        subprocess.run(["chown", "munge:munge", "/run/munge"], check=True)
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    subprocess.run(["slurmctld", "-f", str(d / "slurm.conf")], env=env, check=True)
    try:
        subprocess.run(["slurmd", "-f", str(d / "slurm.conf")], env=env, check=True)
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                           text=True).stdout:
            assert time.monotonic() < deadline, (d / "slurmd.log").read_text()[-2000:]
            time.sleep(0.2)
        yield env
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            with contextlib.suppress(OSError, ValueError):  # not started, or gone already
                os.kill(int((d / pid_file).read_text()), 15)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    with private_node(tmp_path, devices=1, memory_bytes=8192 * MIB) as sim:
        yield sim


def test_srun_task_is_named_by_its_job_and_step(slurm: dict[str, str], node: SimNode) -> None:
    env = sim_env(node, dict(slurm))
    worker = [str(node.libraries.worker_path), "--gpu", "0", "--mib-per-step", "64", "--steps", "1",
              "--lifetime-s", "30"]
    srun = subprocess.Popen(["srun", "-N1", "-n1", "--job-name=gw", *worker], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert srun.stdout is not None
        line = srun.stdout.readline().split()
        assert line and line[0] == "ready", srun.stderr.read() if srun.stderr else ""
        pid = int(line[1])  # the task's pid (same pid namespace as ours)
        found = IdentityResolver().resolve_pid(pid)
        assert found is not None
        ident = found.identity
        labels = dict(ident.labels)
        print(f"slurm task {pid}: {ident.cgroup_path} -> {ident.pod_namespace}/{ident.pod_name}/"
              f"{ident.container_name} ({ident.container_id}) {labels}")
        job = labels["slurm_job"]
        assert (ident.runtime, ident.pod_namespace, ident.pod_name) == ("slurm", "slurm", f"job-{job}")
        assert (ident.container_name, ident.container_id) == ("step-0", f"{job}.0")
        assert labels["slurm_user"] == "root" and labels["slurm_uid"] == "0"
        held = sum(p.memory_bytes for p in status(node).processes if p.host_pid == pid)
        assert held > 64 * MIB  # the task is the sim's GPU process (context + its allocation)
    finally:
        srun.terminate()
        srun.wait(timeout=20)
