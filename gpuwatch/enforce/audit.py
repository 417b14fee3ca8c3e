"""Append-only JSON-lines audit log: one record per decision and per final result.

Each record is written with O_APPEND and fsynced before `record()` returns, so a crash
never loses a decision that was carried out. Fields: time, target identity, rule, scope,
reason, measured values, action, result, detail, dry_run, suppressed. Start-up recovery
steps are recorded too (`record_recovery`), and changes no decision carries (`record_event`).
The file is created 0640 with O_NOFOLLOW and must be a regular file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpuwatch.core.errors import EnforcementError
from gpuwatch.core.model import ContainerIdentity
from gpuwatch.enforce.actions.base import ActionResult
from gpuwatch.enforce.freeze.frozen_state import RecoveryAction
from gpuwatch.policy.decisions import Decision

DEFAULT_AUDIT_PATH = Path("/var/log/gpuwatch/audit.jsonl")


def _open_log(path: Path) -> int:
    """O_APPEND descriptor of the log: created 0640 without following a symlink, regular
    files only (a FIFO would block the writer), group/other write and other read removed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o640)
    except OSError as err:
        why = "is a symbolic link" if err.errno == errno.ELOOP else err.strerror
        raise EnforcementError(
            f"cannot open audit log {path}: {why}", fix="choose a writable --audit-log path (a regular file)"
        ) from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EnforcementError(f"audit log {path} is not a regular file", fix="choose another --audit-log path")
        if stat.S_IMODE(st.st_mode) & ~0o640:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o640)
    except BaseException:
        os.close(fd)
        raise
    return fd


class AuditLog:
    def __init__(self, path: Path | str = DEFAULT_AUDIT_PATH, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.clock = clock
        self._lock = threading.Lock()
        self._fd = _open_log(self.path)

    def record(
        self, decision: Decision, result: ActionResult, *, dry_run: bool, event: str = "decision"
    ) -> dict[str, object]:
        target = decision.target
        entry: dict[str, object] = {
            "time": round(self.clock(), 6),
            "event": event,
            "target": {
                "runtime": target.runtime,
                "cgroup_path": target.cgroup_path,
                "container_id": target.container_id,
                "container": target.container_name,
                "pod": target.pod_name,
                "namespace": target.pod_namespace,
            },
            "rule": decision.rule,
            "scope": decision.scope,
            "reason": decision.reason,
            "measured": dict(decision.measured),
            "action": decision.verb.value,
            "result": result.status.value,
            "detail": result.detail,
            "dry_run": dry_run,
            "suppressed": decision.suppressed,
        }
        self._write(entry)
        return entry

    def record_recovery(self, step: RecoveryAction, *, dry_run: bool = False) -> dict[str, object]:
        """One start-up reconciliation step (enforce/freeze/frozen_state.py), same fields as a decision:
        event "recovery", rule "recovery", scope "node", action thaw/leave/move-aside."""
        entry: dict[str, object] = {
            "time": round(self.clock(), 6),
            "event": "recovery",
            "target": {"runtime": "", "cgroup_path": step.cgroup_path, "container_id": "", "container": "",
                       "pod": "", "namespace": ""},
            "rule": "recovery",
            "scope": "node",
            "reason": step.reason,
            "measured": {},
            "action": step.action,
            "result": step.result,
            "detail": step.detail + (f" (found by {step.source})" if step.source else ""),
            "dry_run": dry_run,
            "suppressed": "",
        }
        self._write(entry)
        return entry

    def record_event(self, target: ContainerIdentity, *, event: str, rule: str, scope: str, reason: str,
                     action: str, result: str, detail: str = "", measured: dict[str, float] | None = None,
                     dry_run: bool = False) -> dict[str, object]:
        """A change the enforcer makes that no policy decision carries (e.g. the probe vs
        NVML cross-check suspending in-kernel enforcement), same fields as a decision."""
        entry: dict[str, object] = {
            "time": round(self.clock(), 6),
            "event": event,
            "target": {"runtime": target.runtime, "cgroup_path": target.cgroup_path,
                       "container_id": target.container_id, "container": target.container_name,
                       "pod": target.pod_name, "namespace": target.pod_namespace},
            "rule": rule,
            "scope": scope,
            "reason": reason,
            "measured": dict(measured or {}),
            "action": action,
            "result": result,
            "detail": detail,
            "dry_run": dry_run,
            "suppressed": "",
        }
        self._write(entry)
        return entry

    def _write(self, entry: dict[str, object]) -> None:
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
            os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_audit(path: Path | str) -> list[dict[str, object]]:
    """All records of an audit log (tests and `gpuwatch` tooling)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
