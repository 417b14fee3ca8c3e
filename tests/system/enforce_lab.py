"""Real cgroups with real processes for the enforcement system tests.

`CgroupLab` creates cgroups under a unique parent in the v2 tree (or the v1 freezer tree)
and starts CPU-burning workers inside them (moved in by the child itself before exec, so
no instruction runs outside the cgroup). Each worker counts its loop iterations into a
file and, on the checkpoint signal, writes a marker file. `cleanup()` thaws, kills and
removes everything it created, on every path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.core.model import ContainerIdentity, ContainerUsage, DeviceInfo, Snapshot
from gpuwatch.enforce.audit import read_audit
from gpuwatch.enforce.cgroup_ops import detect_roots, process_cpu_seconds
from gpuwatch.enforce.enforcer import Enforcer
from gpuwatch.probes.manager import ProbeConfig, ProbeManager
from gpuwatch.sim import node as simnode
from gpuwatch.sim.runc import ContainerLab, RunningContainer
from tests.enforcer_setup import enforcer_for
from tests.system.sim_helpers import sim_container, sim_run_argv

WORKER = r"""
import os, signal, sys, time
counter, marker, exit_on_signal = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
state = {"n": 0}
def on_checkpoint(signum, frame):
    with open(marker, "w") as f:
        f.write(f"{time.time()} {state['n']}\n")
        f.flush(); os.fsync(f.fileno())
    if exit_on_signal:
        sys.exit(0)
signal.signal(int(sys.argv[4]), on_checkpoint)
last = time.monotonic()
while True:
    state["n"] += 1
    if state["n"] % 20000 == 0:
        now = time.monotonic()
        if now - last > 0.02:
            with open(counter + ".tmp", "w") as f:
                f.write(str(state["n"]))
            os.replace(counter + ".tmp", counter)
            last = now
"""

GIB = 2**30


@dataclass
class Worker:
    popen: subprocess.Popen[bytes]
    counter: Path
    marker: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def progress(self) -> int:
        try:
            return int(self.counter.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_started(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.progress() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.progress() > 0, "worker did not start counting"


class CgroupLab:
    def __init__(self, tmp: Path) -> None:
        v2, v1 = detect_roots()
        self.v2_root, self.v1_root = v2, v1
        self.tmp = tmp
        self.parent = f"/gpuwatch-test-{uuid.uuid4().hex[:8]}"
        self.dirs: list[Path] = []
        self.workers: list[Worker] = []

    def make(self, name: str, tree: str = "v2") -> str:
        root = self.v2_root if tree == "v2" else self.v1_root
        assert root is not None, f"no {tree} cgroup tree on this host"
        for rel in (self.parent, f"{self.parent}/{name}"):
            directory = root / rel.lstrip("/")
            if not directory.exists():
                directory.mkdir()
                self.dirs.append(directory)
        return f"{self.parent}/{name}"

    def spawn(
        self, cgroup_path: str, tree: str = "v2", exit_on_signal: bool = False, checkpoint_signal: int = signal.SIGUSR1
    ) -> Worker:
        root = self.v2_root if tree == "v2" else self.v1_root
        assert root is not None
        procs = root / cgroup_path.lstrip("/") / "cgroup.procs"
        counter = self.tmp / f"count-{uuid.uuid4().hex[:6]}"
        marker = self.tmp / f"marker-{uuid.uuid4().hex[:6]}"

        def enter() -> None:
            procs.write_text("0")
            # A steady CPU share on a busy shared host: with autogroup scheduling, nice only
            # counts inside a session, so the worker gets its own session and a niced autogroup.
            os.setsid()
            try:
                Path("/proc/self/autogroup").write_text("-15")
            except OSError:
                os.nice(-15)

        popen = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                str(counter),
                str(marker),
                "1" if exit_on_signal else "0",
                str(int(checkpoint_signal)),
            ],
            preexec_fn=enter,
        )
        worker = Worker(popen, counter, marker)
        self.workers.append(worker)
        worker.wait_started()
        return worker

    def cleanup(self) -> None:
        for directory in reversed(self.dirs):
            for name, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
                with contextlib.suppress(OSError):  # each dir has only one of the two files
                    (directory / name).write_text(value)
        for worker in self.workers:
            if worker.alive():
                worker.popen.kill()
            worker.popen.wait(5)
        for directory in reversed(self.dirs):
            for _ in range(50):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def v2_cgroup_id(cgroup_path: str) -> int | None:
    """The cgroup id the resolver gives a path that is a cgroup v2 directory (its inode), else
    None (a v1-only cgroup: the enforcer then refuses in-kernel limits for it, and audits that)."""
    v2, _ = detect_roots()
    directory = v2 / cgroup_path.lstrip("/") if v2 is not None else None
    return directory.stat().st_ino if directory is not None and directory.is_dir() else None


def identity(cgroup_path: str, name: str, namespace: str = "lab") -> ContainerIdentity:
    return ContainerIdentity(
        runtime="k8s",
        cgroup_path=cgroup_path,
        container_id=f"id-{name}",
        container_name=name,
        pod_name=f"pod-{name}",
        pod_namespace=namespace,
        cgroup_id=v2_cgroup_id(cgroup_path),
    )


def snapshot(*rows: tuple[ContainerIdentity, int], t: float | None = None) -> Snapshot:
    device = DeviceInfo(0, "GPU-0", "sim", None, 16 * GIB, None, None, simulated=True)
    usages = tuple(ContainerUsage(i, 0, "GPU-0", memory, 0.0, 0.0) for i, memory in rows)
    return Snapshot(
        timestamp_s=time.time() if t is None else t,
        node="lab",
        devices=(device,),
        containers=usages,
        interval_s=1.0,
        simulated=True,
    )


def identity_of(container: RunningContainer) -> ContainerIdentity:
    """The identity the resolver gives a k8s-style ContainerLab container (for hand-built snapshots)."""
    return ContainerIdentity(
        runtime="k8s",
        cgroup_path=container.cgroup_path,
        container_id=container.id,
        container_name=container.name,
        pod_name=container.pod or "",
        pod_namespace=container.namespace,
        cgroup_id=v2_cgroup_id(container.cgroup_path),
    )


def ledger_snapshot(sim: simnode.SimNode, containers: list[RunningContainer],
                    timestamp_s: float | None = None) -> Snapshot:
    """The sim ledger as the sampler would see it on GPU 0: each container that still has
    processes with the ledger's memory of its pids (taken at `timestamp_s`, default now)."""
    state = simnode.status(sim)
    device = state.devices[0]
    rows = []
    for c in containers:
        pids = set(c.pids())
        memory = sum(p.memory_bytes for p in state.processes if p.host_pid in pids)
        if pids:
            rows.append(ContainerUsage(identity_of(c), 0, "GPU-0", memory, 0.0, 0.0))
    info = DeviceInfo(
        0,
        "GPU-0",
        "sim",
        None,
        device.memory_total_bytes,
        device.memory_used_bytes,
        device.memory_total_bytes - device.memory_used_bytes,
        simulated=True,
    )
    return Snapshot(timestamp_s=time.time() if timestamp_s is None else timestamp_s, node="sim", devices=(info,),
                    containers=tuple(rows), simulated=True)


def lab_enforcer(tmp_path: Path, policy: Path | None = None, **kwargs: Any) -> Enforcer:
    """An Enforcer on `policy` (default tmp_path/policy.yaml), its audit log and frozen state in
    `tmp_path`, no own cgroups (the test's cgroups are all fair game); `kwargs` (EnforcerConfig
    and EnforcerHooks fields) add to or replace those."""
    return enforcer_for(tmp_path / "policy.yaml" if policy is None else policy, tmp_path, **kwargs)


@contextlib.contextmanager
def kernel_limit_lab(tmp_path: Path, sim: simnode.SimNode, action: str | None = None,
                     **probe_options: Any) -> Iterator[tuple[ProbeManager, ContainerLab, Enforcer]]:
    """The real probes on `sim` (its device nodes and stub libcuda; `probe_options` add to the
    ProbeConfig), a ContainerLab in `tmp_path`, and a lab_enforcer whose limits go to the
    probes' kernel map (`action`, when given, is the kernel action for every container). The
    test closes the enforcer; the lab and the probes are stopped here."""
    config = ProbeConfig(device_prefix=str(sim.dev_dir / "nvidia"), libcuda_paths=(str(sim.libraries.cuda_path),),
                         **probe_options)
    with (
        ProbeManager(config) as pm,
        ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", runc_root=tmp_path / "runc") as lab,
    ):
        yield pm, lab, lab_enforcer(tmp_path, kernel_limits=pm, kernel_limit_action=action)


def run_pod(lab: ContainerLab, sim: simnode.SimNode, markers: Path, real_driver: bool = False) -> RunningContainer:
    """Pod ml/grow-0: `gpuwatch sim run` growing by 128 MiB every 0.7 s, 6 times, then holding
    (checkpoint marker markers/grow-0)."""
    argv = sim_run_argv(
        mib_per_step=128, steps=6, interval_s=0.7, hold=True, checkpoint_marker=markers / "grow-0",
        # exact driver (no context, no carving): the ledger's bytes are the API's, so the kill
        # and stop cases of the kernel-limit tests measure the limit in the bytes the workload asked for
        context_mib=None if real_driver else 0, suballoc_mib=None if real_driver else 0,
    )
    return lab.run(sim_container(sim, "grower", argv, binds=[markers], namespace="ml", pod="grow-0"))


class LedgerWatch:
    """Polls the sim ledger every 2 ms and keeps the peak used memory."""

    def __init__(self, sim: simnode.SimNode) -> None:
        self.sim, self.peak, self._stop = sim, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, simnode.status(self.sim).devices[0].memory_used_bytes)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        return self.peak



def wait_ready(container: RunningContainer, timeout_s: float = 15.0) -> RunningContainer:
    """Wait until a `gpuwatch sim run` workload printed "ready" (its memory is allocated)."""
    deadline = time.monotonic() + timeout_s
    while "ready" not in container.logs() and container.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert container.running() and "ready" in container.logs(), container.logs()
    return container



def audit_decisions(path: Path) -> list[dict[str, object]]:
    """The audit log's decision records; start-up recovery records (which name whatever other
    frozen cgroups are on this node at the time) are tested in test_agent_hardening.py."""
    return [r for r in read_audit(path) if r.get("event") != "recovery"]
