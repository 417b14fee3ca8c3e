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
import shutil
import socket
import subprocess
import tempfile
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
AuthInfo=socket={munge_socket}
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


@contextlib.contextmanager
def private_munged() -> Iterator[Path]:
    """A munged of our own (own key, socket, pid, seed and log in a private directory), stopped
    at the end; its socket path. The host's /run/munge may hold a socket whose daemon is gone
    (CI ran into 'Connection refused' there), and a test must not start or stop a host daemon."""
    d = Path(tempfile.mkdtemp(prefix="gwmunge-"))  # short: a unix socket path has 108 bytes
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    sock = d / "munge.sock"
    subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                    f"--seed-file={d / 'munged.seed'}", f"--log-file={d / 'munged.log'}", "--num-threads=4"],
                   check=True, capture_output=True, text=True)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline, (d / "munged.log").read_text()
            time.sleep(0.05)
        yield sock
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((d / "munged.pid").read_text()), 15)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """slurmctld + slurmd of a one-node cluster with its own munged; the environment that reaches it."""
    need_root()
    for name in ("slurmctld", "slurmd", "srun", "munged"):
        need_binary(name, "slurm-wlm")
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    host = socket.gethostname().split(".")[0]
    with private_munged() as munge_socket:
        (d / "slurm.conf").write_text(SLURM_CONF.format(host=host, d=d, ctld_port=_free_port(), d_port=_free_port(),
                                                        cpus=os.cpu_count() or 1, munge_socket=munge_socket))
        (d / "cgroup.conf").write_text(CGROUP_CONF)
        env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}
        yield from _slurm_daemons(d, env)


def _slurm_daemons(d: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    subprocess.run(["slurmctld", "-f", str(d / "slurm.conf")], env=env, check=True)
    try:
        subprocess.run(["slurmd", "-f", str(d / "slurm.conf")], env=env, check=True)
        deadline = time.monotonic() + 60  # slurmd registers within seconds; CI hosts are slow
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                           text=True).stdout:
            assert time.monotonic() < deadline, ((d / "slurmd.log").read_text()[-2000:] + "\n--- slurmctld:\n"
                                                 + (d / "slurmctld.log").read_text()[-2000:])
            time.sleep(0.2)
        yield env
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid"):
            with contextlib.suppress(OSError, ValueError):  # not started, or gone already
                os.kill(int((d / pid_file).read_text()), 15)
        _remove_empty_slurm_cgroups()


def _remove_empty_slurm_cgroups() -> None:
    """slurmd leaves its (then empty) ``slurm_<node>`` directory in each v1 hierarchy; remove
    what is empty, deepest first, so that a later run starts from the host as it was."""
    host = socket.gethostname().split(".")[0]
    for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{host}"):
        for sub in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


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
