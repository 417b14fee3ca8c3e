"""Helpers for the simulated-node system tests: a private node per test, native
workers that are always killed, and nvidia-ml-py run in a fresh subprocess (NVML
state is process-global, and the subprocess loads the fake by soname through
LD_LIBRARY_PATH exactly as on a real node)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.containers.cgroupfs import discover_mounts
from gpuwatch.sim import SimNode, down, sim_env, up
from gpuwatch.sim.node import DEFAULT_CONTEXT_MIB, driver_env
from gpuwatch.sim.runc import ContainerLab, ContainerSpec

GIB = 1024**3
MIB = 1024**2
CONTEXT_BYTES = DEFAULT_CONTEXT_MIB * MIB  # what NVML counts per process after cuCtxCreate (the H100's)
# The stub's defaults follow real CUDA (a 518 MiB context, allocations below 2 MiB carved
# from 2 MiB objects). A test about something else whose arithmetic is in the bytes a
# workload asks for pins this instead -- no context memory, one object per allocation --
# and says why where it does.
EXACT_DRIVER = driver_env(suballoc_mib=0, context_mib=0)
KIB = 1024
RECORDED_CONTEXT_MIB = [6, *[2] * 14, 70]  # the H100 context's memory objects, then the rest in one


def rm_size(nbytes: int) -> int:
    """The size RM gives a memory object of `nbytes` (sim README "Sizes": 2 MiB pages from
    2 MiB up, 64 KiB pages below)."""
    page = 2 * MIB if nbytes >= 2 * MIB else 64 * KIB
    return -(-nbytes // page) * page


def context_objects(context_mib: int = DEFAULT_CONTEXT_MIB) -> list[int]:
    """The sizes of a context's own class-0x40 memory objects, in the order it allocates
    them (sim README "Driver traffic", GPUWATCH_SIM_CONTEXT_MIB): the recorded H100
    context's pieces, the rest in one, each capped at what is left and kept a multiple of
    2 MiB, an odd last MiB on its own. The default context's are 17 objects, 518 MiB."""
    pieces, left = [], context_mib * MIB
    while left:
        cap = RECORDED_CONTEXT_MIB[len(pieces)] * MIB if len(pieces) < len(RECORDED_CONTEXT_MIB) else left
        piece = min(left, cap)
        piece -= piece % (2 * MIB) if piece >= 2 * MIB else 0
        pieces.append(piece)
        left -= piece
    return [rm_size(p) for p in pieces]


CONTEXT_MEMORY_OBJECTS = len(context_objects())  # class-0x40 RM_ALLOCs of a default context (17)


@contextmanager
def private_node(tmp_path: Path, **kwargs: Any) -> Iterator[SimNode]:
    """A simulated node with a unique name/state file, always taken down."""
    name = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}"
    node = up(name=name, root=tmp_path / "simroot", **kwargs)
    try:
        yield node
    finally:
        down(name)


def cgroup2_root() -> Path:
    """Where the cgroup v2 hierarchy is mounted (hybrid or pure v2), through the project's layer."""
    unified = discover_mounts().unified
    if unified is None:
        pytest.fail("no cgroup v2 mount found")
    return Path(unified)


def remove_dirs(paths: Iterable[Path]) -> None:
    """rmdir each directory, deepest first, each retried for up to 5 s (a cgroup is busy
    until its last processes have exited)."""
    for path in sorted(paths, key=lambda p: len(p.parts), reverse=True):
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@contextmanager
def scratch_cgroup(name: str) -> Iterator[Path]:
    """A v2 cgroup for one test, removed afterwards (retried while its last processes exit)."""
    path = cgroup2_root() / f"{name}-{os.getpid()}"
    path.mkdir()
    try:
        yield path
    finally:
        remove_dirs([path])


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 20) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout_s`; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def gpuwatch_trace(*args: str, cwd: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """`python -m gpuwatch trace` with `args`, once its banner says the probes are attached;
    killed if it still runs at the end (end_trace stops it the orderly way)."""
    trace = subprocess.Popen([sys.executable, "-m", "gpuwatch", "trace", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        assert trace.stderr is not None
        banner = trace.stderr.readline()
        assert "probes attached" in banner, banner
        yield trace
    finally:
        if trace.poll() is None:
            trace.kill()
            trace.wait()


def end_trace(trace: subprocess.Popen[str]) -> str:
    """SIGTERM to a gpuwatch_trace: it must exit 0; what it printed."""
    trace.send_signal(signal.SIGTERM)
    out, err = trace.communicate(timeout=30)
    assert trace.returncode == 0, err
    return out


def sim_run_argv(*args: str, name: str | None = None, **options: object) -> list[str]:
    """`python -m gpuwatch sim run` (on the node called `name`, else the one GPUWATCH_SIM_STATE
    names): each keyword is its option with "_" as "-" (True: a bare flag; False/None: left out;
    anything else: the option's value, as str), then `args` as given."""
    argv = [sys.executable, "-m", "gpuwatch", "sim", "run", *(("--name", name) if name is not None else ())]
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return [*argv, *args]


def sim_container(node: SimNode, name: str, argv: list[str], *, binds: Iterable[Path | str] = (),
                  env: dict[str, str] | None = None, **spec: Any) -> ContainerSpec:
    """A ContainerSpec that runs `argv` on `node`: the sim's environment (`env` over it), its state
    and root bound read-write (plus `binds`), its libraries read-only; `spec` is the rest
    (namespace, pod...)."""
    return ContainerSpec(name=name, argv=argv, env={**sim_env(node), **(env or {})},
                         extra_binds=[str(node.state_path.parent), str(node.root), *map(str, binds)],
                         ro_binds=[str(node.libraries.lib_dir)], **spec)


@contextmanager
def tmp_container_lab(tmp_path: Path) -> Iterator[ContainerLab]:
    """A ContainerLab whose containerd bundles, Docker containers and runc state are all under `tmp_path`."""
    with ContainerLab(tmp_path / "work", bundle_root=tmp_path / "bundles", docker_root=tmp_path / "docker",
                      runc_root=tmp_path / "runc") as lab:
        yield lab


def sim_agent_env(node: SimNode) -> dict[str, str]:
    """The environment of a `gpuwatch agent` on `node`: it reaches the fake NVML by
    --nvml-library alone (no LD_LIBRARY_PATH), the ledger by GPUWATCH_SIM_STATE."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUWATCH_SIM_STATE": str(node.state_path)}
    env.pop("LD_LIBRARY_PATH", None)
    return env


def sim_agent_argv(node: SimNode, tmp_path: Path, port: int, node_name: str, interval_s: float,
                   *extra: str) -> list[str]:
    """`python -m gpuwatch agent` on `node` without probes, its state, audit log and lock in `tmp_path`."""
    return [sys.executable, "-m", "gpuwatch", "agent", f"--listen=127.0.0.1:{port}", f"--node={node_name}",
            f"--interval={interval_s}", f"--nvml-library={node.libraries.nvml_path}", "--no-probes", *extra,
            f"--state-file={tmp_path / 'frozen.json'}", f"--audit-log={tmp_path / 'audit.jsonl'}",
            f"--lock-file={tmp_path / 'agent.lock'}"]


class Workers:
    """Starts simworkers (or any command) on a node; kills them all on close."""

    def __init__(self, node: SimNode, driver: dict[str, str] | None = None) -> None:
        self.node = node
        self.driver = driver or {}  # driver_env() settings for every worker (default: the stub's)
        self.procs: list[subprocess.Popen[str]] = []

    def env(self) -> dict[str, str]:
        return {**sim_env(self.node, dict(os.environ)), **self.driver}

    def start(self, *args: str, argv: list[str] | None = None) -> subprocess.Popen[str]:
        cmd = argv or [str(self.node.libraries.worker_path), *args]
        proc = subprocess.Popen(cmd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def start_ready(self, *args: str) -> tuple[subprocess.Popen[str], int]:
        """Start a simworker and wait for its "ready <pid> <bytes>" line."""
        proc = self.start(*args)
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", (
            f"worker did not get ready: {line} {proc.stderr.read() if proc.stderr else ''}"
        )
        return proc, int(line[2])

    @staticmethod
    def wait_line(proc: subprocess.Popen[str], prefix: str) -> list[str]:
        """Read the process's stdout until a line starting with `prefix`; its words."""
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                return line.split()
        err = proc.stderr.read() if proc.stderr else ""
        pytest.fail(f"process {proc.args!r} ended without printing {prefix!r}: {err[-2000:]}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def in_cgroups(procs_files: Iterable[Path], argv: list[str]) -> list[str]:
    """`argv` run by a shell that first writes its pid into each cgroup.procs file (and stops if
    one write fails): the process joins its cgroups before exec, as runtimes do."""
    moves = " && ".join(f"echo $$ > {f}" for f in procs_files)
    return ["/bin/sh", "-c", f'{moves} && exec "$@"', "sh", *argv]


@contextmanager
def workers(node: SimNode, driver: dict[str, str] | None = None) -> Iterator[Workers]:
    w = Workers(node, driver)
    try:
        yield w
    finally:
        w.close()


def run_nvml(node: SimNode, code: str, timeout_s: float = 30, **extra_env: str) -> Any:
    """Run `code` (with pynvml imported and initialised) in a fresh interpreter whose
    environment points at `node`; the code prints one JSON document, returned here."""
    prologue = "import json, os, sys, time, ctypes\nimport pynvml\npynvml.nvmlInit()\n"
    env = sim_env(node, dict(os.environ))
    env.update(extra_env)
    proc = subprocess.run(
        [sys.executable, "-c", prologue + code], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"NVML script failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
