"""Which cgroups this agent has frozen (pause or throttle): a marker on each cgroup, a journal on disk.

The truth lives with the cgroup: before a freeze, `mark()` sets gpuwatch's freeze marker
(an xattr naming this agent, enforce/freeze/markers.py) on the directory it freezes and appends the
cgroup to the journal (default /run/gpuwatch/frozen.json, mode 0600, written atomically
through an O_EXCL|O_NOFOLLOW temporary file); after the thaw `unmark()` removes both.
`thaw_all()` runs on close/exit (SIGTERM included).

`recover()` runs once at start, under the node lock, and reconciles: every cgroup in the
v2 or v1 freezer tree whose marker belongs to an agent that is gone, and every cgroup the
journal lists, is thawed -- both the v2 `cgroup.freeze` and the v1 `freezer.state` when the
mechanism is unknown -- unless a live agent's marker is on it. A journal of any wrong shape
(garbage, empty, `[]`, `{"frozen": 5}`, a missing key, a non-numeric time, a symlink, a
FIFO, too large) is logged, moved aside to `<name>.bad` and ignored; the markers still
find what it lost. Every recovery step is reported (`RecoveryAction`) for the audit log
and the metrics.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.core.errors import EnforcementError
from gpuwatch.core.safeio import RefusedFile, read_regular_file
from gpuwatch.enforce.cgroup_ops import V1_FREEZER, V2, CgroupHandle, CgroupTree, normalise_cgroup_path
from gpuwatch.enforce.freeze.markers import (
    LIVE_OTHER,
    STALE,
    UNKNOWN_OTHER,
    Marker,
    MarkerOwner,
    MarkerStore,
    XattrMarkers,
    classify,
    scan,
)

DEFAULT_STATE_PATH = Path("/run/gpuwatch/frozen.json")
MAX_STATE_BYTES = 4 << 20
MECHANISMS = (V2, V1_FREEZER)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrozenEntry:
    cgroup_path: str
    mechanism: str
    reason: str
    since_s: float


@dataclass(frozen=True)
class RecoveryAction:
    """One step of start-up reconciliation (audited and counted by the caller)."""

    action: str
    """"thaw", "leave" (a live agent holds it) or "move-aside" (a broken journal)."""
    result: str
    """"ok", "failed", "gone" (the cgroup no longer exists) or "skipped"."""
    cgroup_path: str
    reason: str
    detail: str
    source: str = ""
    """"marker", "journal" or "marker+journal"."""


class JournalError(ValueError):
    """The journal exists but has the wrong shape (message: what is wrong)."""


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_journal(raw: bytes) -> list[FrozenEntry]:
    """The entries of a journal file; JournalError for anything but the shape `_save` writes."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise JournalError(f"not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("frozen"), list):
        raise JournalError('expected {"frozen": [...]}, got ' + type(data).__name__
                           + (f" with frozen={type(data.get('frozen')).__name__}" if isinstance(data, dict) else ""))
    entries = []
    for index, item in enumerate(data["frozen"]):
        what = f"entry {index}"
        if not isinstance(item, dict):
            raise JournalError(f"{what} is a {type(item).__name__}, not an object")
        for key in ("cgroup_path", "mechanism"):
            if not isinstance(item.get(key), str):
                raise JournalError(f"{what}: {key!r} missing or not a string")
        if not _number(item.get("since_s", 0.0)):
            raise JournalError(f"{what}: since_s {item.get('since_s')!r} is not a number")
        if not isinstance(item.get("reason", ""), str):
            raise JournalError(f"{what}: reason is not a string")
        try:
            path = normalise_cgroup_path(item["cgroup_path"])
        except EnforcementError:
            raise JournalError(f"{what}: cgroup_path {item['cgroup_path']!r} is not a container's cgroup") from None
        entries.append(FrozenEntry(path, item["mechanism"], item.get("reason", ""), float(item.get("since_s", 0.0))))
    return entries


def _marker_dirs(handle: CgroupHandle, mechanism: str) -> list[Path]:
    """The directories a freeze by `mechanism` writes to (both trees when unknown)."""
    dirs = []
    if mechanism != V1_FREEZER and handle.v2_dir is not None:
        dirs.append(handle.v2_dir)
    if mechanism != V2 and handle.v1_freezer_dir is not None:
        dirs.append(handle.v1_freezer_dir)
    return dirs


def _thaw(handle: CgroupHandle, mechanisms: set[str]) -> tuple[str, str]:
    """Thaw the cgroup in each tree named; (result, detail), checked after the write."""
    done: list[str] = []
    failed: list[str] = []
    for mech in sorted(mechanisms):
        directory = handle.v2_dir if mech == V2 else handle.v1_freezer_dir
        if directory is None or not directory.is_dir():
            continue
        one = CgroupHandle(handle.cgroup_path, directory if mech == V2 else None,
                           directory if mech == V1_FREEZER else None)
        try:
            one.set_frozen(False, mech)
            if one.is_frozen():
                failed.append(f"{mech}: still frozen after the thaw (a parent cgroup may be frozen)")
            else:
                done.append(mech)
        except (EnforcementError, OSError) as err:
            failed.append(f"{mech}: {err}")
    if failed:
        return "failed", "; ".join(failed)
    if not done:
        return "gone", "the cgroup no longer exists"
    return "ok", "thawed via " + " and ".join(done)


class FrozenRegistry:
    """Thread-safe record of frozen cgroups: markers on the cgroups, a journal on disk."""

    def __init__(self, cgroups: CgroupTree, state_path: Path | str = DEFAULT_STATE_PATH, *,
                 owner: MarkerOwner | None = None, markers: MarkerStore | None = None,
                 proc_root: str = "/proc") -> None:
        self.cgroups = cgroups
        self.state_path = Path(state_path)
        self.owner = owner or MarkerOwner.current(proc_root=proc_root)
        self.markers: MarkerStore = markers if markers is not None else XattrMarkers()
        self.proc_root = proc_root
        self._lock = threading.Lock()
        self._entries: dict[str, FrozenEntry] = {}
        self._marker_warned = False

    def entries(self) -> dict[str, FrozenEntry]:
        with self._lock:
            return dict(self._entries)

    # -- markers --------------------------------------------------------------------------
    def holder(self, cgroup_path: str) -> str | None:
        """Who else holds this cgroup frozen (a live agent's marker), or None."""
        handle = self.cgroups.handle(cgroup_path)
        for directory in _marker_dirs(handle, ""):
            raw = self._get_marker(directory)
            if raw is None:
                continue
            marker = Marker.decode(raw)
            if marker is not None and classify(marker, self.owner, self.proc_root) == LIVE_OTHER:
                return f"another gpuwatch agent ({marker.owner.describe()})"
        return None

    def _get_marker(self, directory: Path) -> bytes | None:
        try:
            return self.markers.get(directory)
        except OSError:
            return None

    def _set_markers(self, entry: FrozenEntry) -> None:
        value = Marker(self.owner, entry.mechanism, entry.reason, entry.since_s).encode()
        for directory in _marker_dirs(self.cgroups.handle(entry.cgroup_path), entry.mechanism):
            try:
                self.markers.set(directory, value)
            except OSError as err:
                if not self._marker_warned:
                    self._marker_warned = True
                    log.warning("cannot set the freeze marker on %s (%s): a crash while it is frozen is "
                                "recovered from the state file %s only", directory, err.strerror or err,
                                self.state_path)

    def _remove_markers(self, cgroup_path: str) -> None:
        for directory in _marker_dirs(self.cgroups.handle(cgroup_path), ""):
            try:
                self.markers.remove(directory)
            except OSError as err:
                log.warning("cannot remove the freeze marker of %s: %s", directory, err)

    # -- the record -----------------------------------------------------------------------
    def mark(self, cgroup_path: str, mechanism: str, reason: str) -> None:
        """Record a freeze before it is written (marker + journal). EnforcementError if a
        live agent already holds this cgroup (its thaw would be ours to undo, or ours its)."""
        other = self.holder(cgroup_path)
        if other is not None:
            raise EnforcementError(f"{cgroup_path} is held frozen by {other}; not taking it over",
                                   fix="run one gpuwatch agent per node (see --lock-file)")
        with self._lock:
            if cgroup_path in self._entries:
                return
            entry = FrozenEntry(cgroup_path, mechanism, reason, time.time())
            self._entries[cgroup_path] = entry
            self._save()
        self._set_markers(entry)

    def unmark(self, cgroup_path: str) -> None:
        """After the thaw: remove the marker, then the journal entry."""
        with self._lock:
            known = cgroup_path in self._entries
        if not known:
            return
        self._remove_markers(cgroup_path)
        with self._lock:
            if self._entries.pop(cgroup_path, None) is not None:
                self._save()

    def _save(self) -> None:
        """Write the journal atomically: a new 0600 file (O_EXCL|O_NOFOLLOW), fsync, rename."""
        directory = self.state_path.parent
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        data = json.dumps({"frozen": [e.__dict__ for e in self._entries.values()]}, indent=1).encode()
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.state_path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.state_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def thaw_all(self) -> list[str]:
        """Thaw everything recorded (close/exit path); returns the paths thawed."""
        thawed = []
        for entry in list(self.entries().values()):
            handle = self.cgroups.handle(entry.cgroup_path)
            if handle.exists():
                try:
                    handle.set_frozen(False, entry.mechanism if entry.mechanism in MECHANISMS else None)
                except EnforcementError as err:
                    log.error("could not thaw %s: %s", entry.cgroup_path, err)
                    continue
            thawed.append(entry.cgroup_path)
            self.unmark(entry.cgroup_path)
        return thawed

    # -- start-up reconciliation ----------------------------------------------------------
    def _read_journal(self) -> tuple[list[FrozenEntry], str | None, bool]:
        """(entries, what is wrong with the file or None, whether a file is there)."""
        try:
            raw = read_regular_file(self.state_path, MAX_STATE_BYTES, follow_symlinks=False)
        except FileNotFoundError:
            return [], None, False
        except RefusedFile as err:
            return [], err.why, True
        except OSError as err:
            return [], f"unreadable ({err.strerror or err})", True
        try:
            return parse_journal(raw), None, True
        except JournalError as err:
            return [], str(err), True

    def _move_aside(self, problem: str) -> RecoveryAction:
        aside = self.state_path.with_name(self.state_path.name + ".bad")
        try:
            os.replace(self.state_path, aside)
        except OSError as err:
            log.error("frozen-state file %s is broken (%s) and cannot be moved aside: %s; ignoring it",
                      self.state_path, problem, err)
            return RecoveryAction("move-aside", "failed", str(self.state_path), problem, str(err))
        log.error("frozen-state file %s is broken (%s): moved aside to %s and ignored; the cgroups' "
                  "freeze markers say what to thaw", self.state_path, problem, aside)
        return RecoveryAction("move-aside", "ok", str(self.state_path), problem, f"moved to {aside}")

    def recover(self, report: Callable[[RecoveryAction], None] | None = None) -> list[str]:
        """On start: thaw whatever an agent that is gone left frozen; returns the paths no
        longer held (thawed, or gone with their cgroup).

        Call it once, before this registry freezes anything (the agent does so under the
        node lock). `report` gets every step (thaw, leave, move-aside)."""
        steps: list[RecoveryAction] = []
        entries, problem, present = self._read_journal()
        if problem is not None:
            steps.append(self._move_aside(problem))
        targets: dict[str, set[str]] = {}
        sources: dict[str, set[str]] = {}
        left: dict[str, str] = {}
        for tree, root in ((V2, self.cgroups.v2_root), (V1_FREEZER, self.cgroups.v1_freezer_root)):
            if root is None:
                continue
            for path, raw in scan(root, self.markers):
                marker = Marker.decode(raw)
                verdict = classify(marker, self.owner, self.proc_root)
                if verdict != STALE:
                    assert marker is not None
                    why = ("a live gpuwatch agent holds it" if verdict == LIVE_OTHER else
                           "its agent ran in another pid namespace: cannot tell whether it is alive"
                           if verdict == UNKNOWN_OTHER else "this process holds it")
                    left[path] = f"{why} ({marker.owner.describe()})"
                    continue
                targets.setdefault(path, set()).add(tree)
                sources.setdefault(path, set()).add("marker")
        for entry in entries:
            if entry.cgroup_path in left:
                continue
            mechs = {entry.mechanism} if entry.mechanism in MECHANISMS else set(MECHANISMS)
            if entry.mechanism not in MECHANISMS:
                log.warning("frozen-state entry %s has unknown mechanism %r: thawing both the v2 and the v1 freezer",
                            entry.cgroup_path, entry.mechanism)
            targets.setdefault(entry.cgroup_path, set()).update(mechs)
            sources.setdefault(entry.cgroup_path, set()).add("journal")
        thawed = []
        for path in sorted(targets):
            source = "+".join(sorted(sources[path], key=("marker", "journal").index))
            handle = self.cgroups.handle(path)
            result, detail = _thaw(handle, targets[path])
            if result != "failed":
                self._remove_markers(path)
            if result != "failed":
                thawed.append(path)
            if result == "ok":
                log.warning("recovered from a previous run: thawed %s (%s; found by %s)", path, detail, source)
            elif result == "failed":
                log.error("recovery: could not thaw %s: %s", path, detail)
            steps.append(RecoveryAction("thaw", result, path, "left frozen by a gpuwatch agent that is gone",
                                        detail, source))
        for path, why in sorted(left.items()):
            log.info("recovery: leaving %s frozen: %s", path, why)
            steps.append(RecoveryAction("leave", "skipped", path, why, "not thawed", "marker"))
        if present or targets:
            with self._lock:
                try:
                    self._save()  # the journal now says what is true: nothing held by this agent
                except OSError as err:
                    log.error("cannot rewrite the frozen-state file %s: %s", self.state_path, err)
        if report is not None:
            for step in steps:
                report(step)
        return thawed
