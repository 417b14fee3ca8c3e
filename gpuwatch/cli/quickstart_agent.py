"""The agent `gpuwatch quickstart` runs: the real node agent (gpuwatch/agent/daemon.py) in a thread.

The quick start shows what gpuwatch does beyond NVML monitoring, so it runs the same agent
a node runs -- kernel probes where the host supports them, the enforcer with a policy on the
simulated node -- and the view reads the agent's /snapshot.json like `gpuwatch top --agent`
(which is what adds the enforcer's STATE column). Its node lock, audit log and frozen-state
journal live in the quick start's temporary directory, so it never touches an agent that
already runs on this host, and everything it froze is thawed when it stops.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatch.core.errors import GpuwatchError
from gpuwatch.core.model import Snapshot

NO_SAMPLE_YET = "no sample taken yet"  # the sampler's placeholder before its first sweep
START_TIMEOUT_S = 60.0
"""Probes compile (BCC) while the agent starts: a few seconds here, more on a loaded host."""


class _StartupLog(logging.Handler):
    """Keeps the agent's log lines (what is on, what is off and why) for the quick start to
    report from (probes_summary, probes_note); nothing reaches the terminal while the screen
    runs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass
class QuickstartAgent:
    """A running in-process agent; `stop()` ends it (probes detached, frozen cgroups thawed)."""

    url: str
    thread: threading.Thread
    stop_event: threading.Event
    log: _StartupLog
    errors: list[BaseException] = field(default_factory=list)
    saved_logging: tuple[int, bool] = (logging.NOTSET, True)  # the gpuwatch logger's level, propagate

    def snapshot(self) -> Snapshot:
        from gpuwatch.tui.sources import AgentSource

        return AgentSource(self.url).next_snapshot()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        logger = logging.getLogger("gpuwatch")
        logger.removeHandler(self.log)
        logger.setLevel(self.saved_logging[0])
        logger.propagate = self.saved_logging[1]


class AgentViewSource:
    """The screen's snapshot source: the agent's /snapshot.json (with the enforcer's view),
    with the quick start's own lines (what is on, where to look) first among its notes, so
    the live screen keeps saying them."""

    def __init__(self, agent: QuickstartAgent, notes: tuple[str, ...] = ()) -> None:
        self.agent = agent
        self.notes = notes

    def next_snapshot(self) -> Snapshot:
        snapshot = self.agent.snapshot()
        return dataclasses.replace(snapshot, notes=self.notes + snapshot.notes) if self.notes else snapshot

    def close(self) -> None:
        return None


def free_port(host: str, wanted: int) -> int:
    """`wanted` when it can be bound on `host`, else a free port (said by the caller)."""
    for port in (wanted, 0):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
            try:
                s.bind((host, port))
            except OSError:
                continue
            bound: int = s.getsockname()[1]
            return bound
    raise GpuwatchError(f"no free port on {host}", fix="pass --listen HOST:PORT")


def start_agent(work: Path, host: str, port: int, interval_s: float, nvml_library: str | None,
                bundle_roots: Any, policy_path: Path | None, device_prefix: str = "/dev/nvidia",
                kmsg_path: str | None = None) -> QuickstartAgent:
    """Start the agent in a thread and wait until it serves its first snapshot.

    Raises GpuwatchError (with the agent's own message) when it cannot start."""
    from gpuwatch.agent.daemon import AgentConfig, run_agent

    config = AgentConfig(
        listen_host=host, listen_port=port, interval_s=interval_s, nvml_library=nvml_library,
        probes=None, device_prefix=device_prefix,
        policy_path=str(policy_path) if policy_path is not None else None,
        audit_log=str(work / "audit.jsonl"), frozen_state_path=str(work / "frozen.json"),
        lock_path=str(work / "agent.lock"), bundle_roots=bundle_roots, kmsg_path=kmsg_path,
        network=False,  # the demo pods' network bytes add nothing to the quick start
        idle_without_gpus=False)  # an interactive start must show NVML's own error, not idle
    handler = _StartupLog()
    logger = logging.getLogger("gpuwatch")
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.propagate = False  # the screen owns the terminal; the caller reports from the kept lines
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_agent(config, stop, threading.Event())
        except BaseException as err:  # reported by start_agent / the caller, never lost
            errors.append(err)

    thread = threading.Thread(target=run, name="quickstart-agent", daemon=True)
    agent = QuickstartAgent(f"http://{host if ':' not in host else f'[{host}]'}:{port}", thread, stop,
                            handler, errors, saved)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if errors or not thread.is_alive():
            agent.stop()
            err = errors[0] if errors else None
            if isinstance(err, GpuwatchError):
                raise err
            raise GpuwatchError(f"the agent stopped while starting: {err!r}",
                                fix="run `gpuwatch doctor`, or `gpuwatch agent` to see its log")
        try:
            snapshot = agent.snapshot()
        except GpuwatchError:
            snapshot = None
        if snapshot is not None and (snapshot.gpu_up or snapshot.gpu_error != NO_SAMPLE_YET):
            return agent
        if time.monotonic() > deadline:
            agent.stop()
            raise GpuwatchError(f"the agent did not serve {agent.url} within {START_TIMEOUT_S:.0f} s",
                                fix="the host may be overloaded; try again")
        time.sleep(0.2)


def probes_note(snapshot: Snapshot, log_lines: list[str]) -> str:
    """The live view's short form of probes_summary (the screen hides the lines above it)."""
    if snapshot.probes_up:
        return "kernel probes ON (PROBES column); live driver events: sudo gpuwatch trace"
    for line in log_lines:
        found = re.search(r"BPF probes off: (.+?)(?:; | \(fix:|\)$|$)", line)
        if found:
            return f"kernel probes OFF: {found.group(1)} (gpuwatch doctor says how to fix it)"
    return "kernel probes OFF (gpuwatch doctor says why)"


def probes_summary(snapshot: Snapshot, log_lines: list[str]) -> str:
    """One line saying whether the kernel probes run and, when not, why (the agent's words)."""
    if snapshot.probes_up:
        return ("kernel probes: ON -- driver ioctls and CUDA allocations are counted per container in "
                "the kernel (PROBES column); watch the events live: `sudo gpuwatch trace` in another terminal")
    why = next((line for line in log_lines if "BPF unavailable" in line or "BPF probes off" in line), None)
    why = why or next((line for line in log_lines if "probes disabled" in line), "see `gpuwatch doctor`")
    return f"kernel probes: OFF -- {why}"
