"""Progress input: each container's evaluation function, read once per sample interval.

FlowCon re-divides a GPU by how fast each job progresses -- its evaluation function, such
as its loss. A container declares that function with two pod annotations, which the
runtime copies into the OCI bundle; containers/metadata.py reads them there (like the
sharing annotations) and the resolver puts the valid ones into the identity's labels under
the same keys, so `progress_request_of(identity)` reads them back:

    gpuwatch.io/progress-file: /path/inside/the/container   (absolute; rewritten by the job)
    gpuwatch.io/progress-goal: minimize | maximize          (default minimize: a loss)

The file holds one number: the first word of its first line, in Python float syntax,
finite; the rest of the line is ignored; at most MAX_PROGRESS_BYTES (256) bytes. Write it
to a temporary file and rename it over the old one (atomic). A writer that truncates and
rewrites in place can be caught in between: an empty file ("empty"), or -- if its values
end with a newline -- a value without one ("partial"); either way the last good value is
kept. (A writer without newlines cannot be told from a half-written number; use rename.)

How a file is read (`read_progress_file`), for each container that declared one:
* through /proc/<pid>/root of one of its GPU processes (the next one if that pid is gone),
  so the path means what it means inside the container: its mount namespace, its volumes;
* by gpuwatch/core/containerfile.py, the one reader of files inside containers: resolved with
  openat2(2) RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS (symlinks resolve as the job sees
  them, "/" and ".." stop at the container's root, /proc magic links are refused; without
  openat2 every symlink is refused), opened O_PATH and checked to be a regular file of an
  ordinary filesystem before it is opened for reading (no device, FIFO, socket, procfs or
  sysfs file), and read on a helper thread holding the process's fsuid, fsgid, groups and
  effective capabilities: the job's own file, or one it could read itself, nothing more;
* O_NONBLOCK, MAX_PROGRESS_BYTES + 1 bytes read at most. Errors name the path and the
  problem, never the content.
A failed read never stops anything: the last good value is kept and the error is counted
by reason (`ERROR_REASONS`).

Rates (`ProgressTracker`): each good read adds a sample (time, value, the container's
kernel seconds on all its GPUs, from attribution). Over the samples of the last `window_s`:
`rate_per_gpu_second` = evaluation gained in the goal's direction / GPU-seconds the
container ran (FlowCon's growth efficiency: independent of the share it gets; a plateau
reads ~0), and `rate_per_second` = the same per wall second (proportional to its share).
"""

from __future__ import annotations

import math
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import NamedTuple

from gpuwatch.core.annotations import (
    MAXIMIZE,
    MINIMIZE,
    PROGRESS_FILE_ANNOTATION,
    PROGRESS_GOAL_ANNOTATION,
    parse_progress_goal,
    parse_progress_path,
)
from gpuwatch.core.containerfile import ContainerFileError, read_container_file
from gpuwatch.core.errors import ReasonError
from gpuwatch.core.model import ContainerIdentity, ContainerProgress, ContainerUsage

MAX_PROGRESS_BYTES = 256
ERROR_REASONS = (
    "pid_gone",  # no process of the container could be opened (/proc/<pid>/root)
    "missing",  # no such file (or a directory on the way is not one)
    "unreadable",  # permission denied or another I/O error
    "symlink",  # a link that may not be followed (magic link; any symlink without openat2)
    "not_regular",  # a FIFO, device, socket or directory
    "too_large",  # more than MAX_PROGRESS_BYTES
    "empty",  # caught between a truncate and a write
    "partial",  # a value without the newline this writer's values end with
    "garbage",  # not a finite number
    "rights",  # the process's file rights could not be taken (refused, not read as root)
)


@dataclass(frozen=True)
class ProgressRequest:
    """What a container declared: where its evaluation value is, and which way is better."""

    path: str
    goal: str = MINIMIZE


def progress_request_of(identity: ContainerIdentity) -> ProgressRequest | None:
    """The progress declaration in an identity's labels; None without a (valid) progress-file."""
    labels = dict(identity.labels)
    path = parse_progress_path(labels.get(PROGRESS_FILE_ANNOTATION))
    if path is None:
        return None
    return ProgressRequest(path, parse_progress_goal(labels.get(PROGRESS_GOAL_ANNOTATION)) or MINIMIZE)


# ---- reading one file (I/O) -----------------------------------------------------------------


class ProgressReadError(ReasonError):
    """A progress file could not be used this time; `reason` is one of ERROR_REASONS."""


@dataclass(frozen=True)
class ProgressReading:
    value: float
    newline: bool  # the content ended with a newline


def parse_progress_value(data: bytes, expect_newline: bool = False) -> ProgressReading:
    """The value in a progress file's bytes; ProgressReadError("empty" / "partial" /
    "garbage") otherwise. `expect_newline`: this writer's values end with a newline, so
    one without is a write caught half way."""
    if not data.strip():
        raise ProgressReadError("empty", "the file is empty (caught between a truncate and a write?)")
    newline = data.endswith(b"\n")
    if expect_newline and not newline:
        raise ProgressReadError("partial", "no newline at the end, unlike this writer's earlier values")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as err:
        raise ProgressReadError("garbage", "not ASCII text") from err
    words = text.split("\n", 1)[0].split()
    if not words:
        raise ProgressReadError("garbage", "the first line holds no number")
    try:
        value = float(words[0])
    except ValueError as err:
        raise ProgressReadError("garbage", "the first word of the first line is not a number") from err
    if not math.isfinite(value):
        raise ProgressReadError("garbage", "the first word of the first line is not a finite number")
    return ProgressReading(value, newline)


def read_progress_file(proc_root: str, pid: int, path: str, max_bytes: int = MAX_PROGRESS_BYTES,
                       resolver: str = "auto") -> bytes:
    """The bytes of `path` as process `pid` sees it and may read it, through the one safe
    container-file reader (gpuwatch/core/containerfile.py: resolved in its root, typed on an O_PATH
    fd before any open, read with its fsuid/fsgid/groups). Raises ProgressReadError.
    `resolver`: "auto" (openat2 where the kernel has it, else the O_NOFOLLOW walk),
    "openat2" or "walk" (tests)."""
    try:
        return read_container_file(proc_root, pid, path, max_bytes, resolver)
    except ContainerFileError as err:
        raise ProgressReadError(err.reason, err.detail) from err


# ---- the tracker: the source the sampler calls ----------------------------------------------


@dataclass(slots=True)
class _Track:
    identity: ContainerIdentity
    request: ProgressRequest
    samples: deque[tuple[float, float, float]] = field(default_factory=deque)  # (t, value, kernel s)
    value: float | None = None
    updated_s: float | None = None
    first: tuple[float, float] | None = None  # (value, kernel s) at the first good read
    newline: bool = False  # this writer's values have ended with a newline
    reads: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    last_error: str = ""
    seen_s: float = 0.0

    def away(self) -> _Away:
        """The compact record kept while the container is not in the snapshot."""
        return _Away(self.request, array("d", chain.from_iterable(self.samples)), self.value, self.updated_s,
                     self.first, self.newline, self.reads, tuple(self.errors.items()), self.last_error,
                     self.seen_s)


class _Away(NamedTuple):
    """A track whose container is not in the snapshot: one tuple, samples as packed doubles
    (t, value, kernel s, t, ...) -- no identity (the returning container brings its own)."""

    request: ProgressRequest
    samples: array[float]
    value: float | None
    updated_s: float | None
    first: tuple[float, float] | None
    newline: bool
    reads: int
    errors: tuple[tuple[str, int], ...]
    last_error: str
    seen_s: float

    def back(self, identity: ContainerIdentity) -> _Track:
        flat = iter(self.samples)
        samples = deque(zip(flat, flat, flat, strict=False))  # the same iterator thrice: triples
        return _Track(identity, self.request, samples, self.value, self.updated_s,
                      self.first, self.newline, self.reads, Counter(dict(self.errors)), self.last_error,
                      self.seen_s)


class ProgressTracker:
    """Reads every declared progress file once per interval and keeps the recent history.

    `collect(containers, now_s)` is called by the sampler with the interval's usage rows:
    containers without a gpuwatch.io/progress-file label are skipped at no cost; the others
    are read through one of their GPU processes. History is kept per container key while
    the container is seen and `retention_s` after (a container that is briefly without GPU
    processes keeps its samples). A container that leaves the snapshot is packed into one
    tuple; at most `max_gone` of those are kept (oldest dropped first), and they are expired
    in batches every `retention_s` / 8, so a cycle costs what the containers in the snapshot
    cost, however many came and went."""

    def __init__(self, proc_root: str = "/proc", *, window_s: float = 30.0, retention_s: float = 600.0,
                 max_bytes: int = MAX_PROGRESS_BYTES, min_kernel_seconds: float = 0.05,
                 max_gone: int = 1024, resolver: str = "auto",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.proc_root = proc_root
        self.window_s = window_s
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.min_kernel_seconds = min_kernel_seconds
        self.max_gone = max_gone
        self.resolver = resolver
        self._clock = clock
        self._tracks: dict[str, _Track] = {}  # containers in the last snapshot
        self._gone: dict[str, _Away] = {}  # the others, in the order they left
        self._expire_at_s: float | None = None

    def collect(self, containers: Sequence[ContainerUsage], now_s: float | None = None
                ) -> tuple[ContainerProgress, ...]:
        now = self._clock() if now_s is None else now_s
        out: list[ContainerProgress] = []
        tracks: dict[str, _Track] = {}
        for identity, pids, kernel_s in _group(containers):
            request = progress_request_of(identity)
            if request is None:
                continue
            key = identity.key
            track = self._tracks.get(key)
            if track is None:
                away = self._gone.pop(key, None)
                if away is not None and now - away.seen_s <= self.retention_s:
                    track = away.back(identity)
            if track is None or track.request != request:
                track = _Track(identity, request)
            track.identity = identity
            track.seen_s = now
            tracks[key] = track
            self._read(track, pids, kernel_s, now)
            out.append(self._report(track, kernel_s))
        for key, track in self._tracks.items():  # the last snapshot's containers: O(live)
            if key not in tracks:
                self._gone[key] = track.away()
        self._tracks = tracks
        if len(self._gone) > self.max_gone:
            self._drop_oldest(len(self._gone) - self.max_gone + self.max_gone // 8)
        if self._expire_at_s is None or now >= self._expire_at_s or now < self._expire_at_s - self.retention_s:
            self._expire(now)
        return tuple(out)

    def sizes(self) -> dict[str, int]:
        """Containers with a history: in the snapshot, and away (for tests and benchmarks)."""
        return {"live": len(self._tracks), "gone": len(self._gone)}

    # ---- internals ----------------------------------------------------------------------

    def _read(self, track: _Track, pids: Sequence[int], kernel_s: float, now: float) -> None:
        error: ProgressReadError | None = None
        reading: ProgressReading | None = None
        for pid in pids or (0,):
            try:
                data = read_progress_file(self.proc_root, pid, track.request.path, self.max_bytes, self.resolver)
                reading = parse_progress_value(data, expect_newline=track.newline)
                break
            except ProgressReadError as err:
                error = err
                if err.reason != "pid_gone":
                    break  # the file itself is the problem: another pid of the container sees the same
        track.reads += 1
        if reading is None:
            assert error is not None
            track.errors[error.reason] += 1
            track.last_error = str(error)
            return
        track.last_error = ""
        track.newline = track.newline or reading.newline
        track.value = reading.value
        track.updated_s = now
        if track.first is None:
            track.first = (reading.value, kernel_s)
        samples = track.samples
        if samples and (kernel_s < samples[-1][2] or now <= samples[-1][0]):
            samples.clear()  # kernel seconds went back (attribution restarted) or time did: start over
        samples.append((now, reading.value, kernel_s))
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()

    def _report(self, track: _Track, kernel_s: float) -> ContainerProgress:
        sign = 1.0 if track.request.goal == MAXIMIZE else -1.0
        rate_gpu = rate_wall = None
        span_s = span_k = 0.0
        samples = track.samples
        if len(samples) >= 2:
            (t0, v0, k0), (t1, v1, k1) = samples[0], samples[-1]
            span_s, span_k = t1 - t0, k1 - k0
            gained = sign * (v1 - v0)
            rate_wall = gained / span_s if span_s > 0 else None
            rate_gpu = gained / span_k if span_k >= self.min_kernel_seconds else None
        first_value, first_kernel = track.first if track.first is not None else (None, None)
        return ContainerProgress(
            identity=track.identity,
            path=track.request.path,
            goal=track.request.goal,
            value=track.value,
            updated_s=track.updated_s,
            rate_per_gpu_second=rate_gpu,
            rate_per_second=rate_wall,
            window_s=span_s,
            window_kernel_seconds=span_k,
            kernel_seconds_total=kernel_s,
            first_value=first_value,
            first_kernel_seconds=first_kernel,
            reads_total=track.reads,
            errors_total=sum(track.errors.values()),
            errors_by_reason=tuple(sorted(track.errors.items())),
            last_error=track.last_error,
        )

    def _expire(self, now: float) -> None:
        """Forget what left more than retention_s ago: one pass every retention_s / 8."""
        self._expire_at_s = now + max(self.retention_s / 8, 1.0)
        limit = now - self.retention_s
        if any(away.seen_s < limit for away in islice(self._gone.values(), 1)):
            self._gone = {key: away for key, away in self._gone.items() if away.seen_s >= limit}

    def _drop_oldest(self, count: int) -> None:
        self._gone = dict(islice(self._gone.items(), count, None))


def _group(containers: Iterable[ContainerUsage]) -> list[tuple[ContainerIdentity, list[int], float]]:
    """Per container (key, first-seen order): its identity, its GPU processes' host pids and
    its kernel seconds summed over its GPUs."""
    grouped: dict[str, tuple[ContainerIdentity, list[int], list[float]]] = {}
    for usage in containers:
        _, pids, kernel = grouped.setdefault(usage.identity.key, (usage.identity, [], []))
        for proc in usage.processes:
            if proc.pid not in pids:
                pids.append(proc.pid)
        if math.isfinite(usage.kernel_seconds_total):
            kernel.append(usage.kernel_seconds_total)
    return [(identity, pids, sum(kernel)) for identity, pids, kernel in grouped.values()]


__all__ = [
    "ERROR_REASONS",
    "MAX_PROGRESS_BYTES",
    "ProgressReadError",
    "ProgressReading",
    "ProgressRequest",
    "ProgressTracker",
    "parse_progress_value",
    "progress_request_of",
    "read_progress_file",
]
