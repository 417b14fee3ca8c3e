"""Checkpoint then kill: thaw, send the checkpoint signal (default SIGUSR1) to every
process (then SIGCONT, for processes stopped at an allocation), wait the grace period (or
until they all exit), then kill what is left.

Runs in a background thread so the enforcer keeps evaluating; `apply` returns STARTED
and the final result goes to the completion callback (audit + metrics).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from gpuwatch.core.errors import EnforcementError
from gpuwatch.enforce.actions.base import ActionResult, Completion, Status
from gpuwatch.enforce.control import FreezeControl
from gpuwatch.policy.decisions import Decision, Verb

log = logging.getLogger(__name__)


class CheckpointKillAction:
    verb = Verb.CHECKPOINT_KILL

    def __init__(self, control: FreezeControl, on_complete: Completion | None = None) -> None:
        self.control = control
        self.on_complete = on_complete
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}
        self._cancel = threading.Event()

    def apply(self, decision: Decision) -> ActionResult:
        path = decision.target.cgroup_path
        handle = self.control.cgroups.handle(path)
        if not handle.exists():
            return ActionResult(Status.GONE, f"{path} no longer exists")
        with self._lock:
            if path in self._running and self._running[path].is_alive():
                return ActionResult(Status.STARTED, "checkpoint already in progress")
            thread = threading.Thread(target=self._run, args=(decision,), name=f"checkpoint:{path}", daemon=True)
            self._running[path] = thread
        thread.start()
        return ActionResult(
            Status.STARTED,
            f"{signal.Signals(decision.signal).name} sent; kill after {decision.grace_s:g}s grace",
        )

    def _run(self, decision: Decision) -> None:
        started = time.monotonic()
        handle = self.control.cgroups.handle(decision.target.cgroup_path)
        try:
            self.control.forget(handle.cgroup_path)  # frozen processes cannot checkpoint
            reached = handle.signal_all(decision.signal)
            # A process stopped at an allocation (SIGSTOP from the kernel probe) handles the
            # checkpoint signal only once continued; the pending signal runs first.
            handle.signal_all(signal.SIGCONT)
            deadline = started + decision.grace_s
            while time.monotonic() < deadline and handle.pids() and not self._cancel.is_set():
                time.sleep(0.02)
            leftover = handle.pids()
            if not leftover:
                result = ActionResult(
                    Status.OK,
                    f"all {len(reached)} process(es) exited within the grace period",
                    time.monotonic() - started,
                )
            else:
                how = handle.kill()
                empty = handle.wait_empty(2.0)
                result = ActionResult(
                    Status.OK if empty else Status.FAILED,
                    f"signalled {len(reached)}, killed {len(leftover)} after grace via {how}",
                    time.monotonic() - started,
                )
        except EnforcementError as err:
            result = ActionResult(Status.FAILED, str(err), time.monotonic() - started)
        if self.on_complete is not None:
            self.on_complete(decision, result)
        else:
            log.info("checkpoint-then-kill %s: %s", decision.target.display_name, result.detail)

    def in_progress(self) -> set[str]:
        """Cgroup paths whose checkpoint (grace period, then kill) is under way."""
        with self._lock:
            return {path for path, thread in self._running.items() if thread.is_alive()}

    def wait(self, timeout_s: float) -> bool:
        """Wait for every checkpoint in progress (tests, shutdown); True if all finished."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self._running.values()):
            thread.join(max(deadline - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in self._running.values())

    def close(self) -> None:
        """Shutdown: stop waiting out grace periods (the kills then happen at once)."""
        self._cancel.set()
        self.wait(5.0)
