"""Append-only JSON-lines audit log: one record per decision and per final result.

Each record is written with O_APPEND and fsynced before `record()` returns, so a crash
never loses a decision that was carried out. Fields: time, target identity, rule, scope,
reason, measured values, action, result, detail, dry_run, suppressed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpuwatch.enforce.actions.base import ActionResult
from gpuwatch.errors import EnforcementError
from gpuwatch.policy.evaluate import Decision

DEFAULT_AUDIT_PATH = Path("/var/log/gpuwatch/audit.jsonl")


class AuditLog:
    def __init__(self, path: Path | str = DEFAULT_AUDIT_PATH, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.clock = clock
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        except OSError as err:
            raise EnforcementError(
                f"cannot open audit log {self.path}: {err.strerror}", fix="choose a writable --audit-log path"
            ) from err

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
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
            os.fsync(self._fd)
        return entry

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_audit(path: Path | str) -> list[dict[str, object]]:
    """All records of an audit log (tests and `gpuwatch` tooling)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
