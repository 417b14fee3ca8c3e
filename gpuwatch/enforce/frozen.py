"""Which cgroups this agent has frozen (pause or throttle), kept on disk.

Every freeze is recorded in a JSON file (default /run/gpuwatch/frozen.json) *before* the
freeze is written, and removed after the thaw, so an agent that crashed mid-pause can thaw
what it froze on its next start (`recover()`). `thaw_all()` runs on close/exit.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.enforce.cgroupfs import CgroupTree
from gpuwatch.errors import EnforcementError

DEFAULT_STATE_PATH = Path("/run/gpuwatch/frozen.json")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrozenEntry:
    cgroup_path: str
    mechanism: str
    reason: str
    since_s: float


class FrozenRegistry:
    """Thread-safe record of frozen cgroups, persisted atomically on every change."""

    def __init__(self, cgroups: CgroupTree, state_path: Path | str = DEFAULT_STATE_PATH) -> None:
        self.cgroups = cgroups
        self.state_path = Path(state_path)
        self._lock = threading.Lock()
        self._entries: dict[str, FrozenEntry] = {}

    def entries(self) -> dict[str, FrozenEntry]:
        with self._lock:
            return dict(self._entries)

    def mark(self, cgroup_path: str, mechanism: str, reason: str) -> None:
        with self._lock:
            if cgroup_path not in self._entries:
                self._entries[cgroup_path] = FrozenEntry(cgroup_path, mechanism, reason, time.time())
                self._save()

    def unmark(self, cgroup_path: str) -> None:
        with self._lock:
            if self._entries.pop(cgroup_path, None) is not None:
                self._save()

    def _save(self) -> None:
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        data = {"frozen": [e.__dict__ for e in self._entries.values()]}
        with open(tmp, "w") as handle:
            json.dump(data, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.state_path)

    def _thaw(self, entry: FrozenEntry) -> bool:
        handle = self.cgroups.handle(entry.cgroup_path)
        if not handle.exists():
            return True
        try:
            handle.set_frozen(False, entry.mechanism)
        except EnforcementError as err:
            log.error("could not thaw %s: %s", entry.cgroup_path, err)
            return False
        return True

    def thaw_all(self) -> list[str]:
        """Thaw everything recorded (close/exit path); returns the paths thawed."""
        thawed = []
        for entry in list(self.entries().values()):
            if self._thaw(entry):
                thawed.append(entry.cgroup_path)
                self.unmark(entry.cgroup_path)
        return thawed

    def recover(self) -> list[str]:
        """On start: thaw whatever a previous (crashed) agent left frozen."""
        try:
            data = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            log.error("frozen-state file %s unreadable (%s); nothing to recover", self.state_path, err)
            return []
        with self._lock:
            for item in data.get("frozen", []):
                entry = FrozenEntry(
                    str(item["cgroup_path"]),
                    str(item["mechanism"]),
                    str(item.get("reason", "")),
                    float(item.get("since_s", 0.0)),
                )
                self._entries.setdefault(entry.cgroup_path, entry)
        thawed = self.thaw_all()
        if thawed:
            log.warning("recovered from a previous run: thawed %s", ", ".join(thawed))
        return thawed
