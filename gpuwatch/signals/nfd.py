"""Node labels for Node Feature Discovery (NFD), written as a local-source feature file.

gpuwatch feeds NFD in NFD's own format: nfd-worker's ``local`` source reads every file in
``/etc/kubernetes/node-feature-discovery/features.d/`` and turns ``name=value`` lines into
node labels (and into the ``local.feature`` / ``local.label`` features NodeFeatureRules
match on). The rules below were checked against NFD's source
(github.com/kubernetes-sigs/node-feature-discovery, 2026-07):

* ``source/local/local.go``: files over ``MaxFeatureFileSize`` (65536 bytes) are skipped
  whole; names starting with ``.`` are ignored (so a dot-file can be written and renamed
  into place); the text is split on ``\\n`` and each line trimmed; ``#`` lines are comments,
  ``# +expiry-time=<RFC3339>`` is a directive that applies to the lines after it (lines
  after an expiry in the past are dropped); ``name=value`` splits at the first ``=`` and a
  bare ``name`` means ``true``. The expiry is only evaluated when the worker re-reads the
  files: every ``core.sleepInterval`` (60 s by default, ``pkg/nfd-worker/nfd-worker.go``)
  and, since NFD v0.19, on fsnotify events in the directory -- rate-limited to one
  re-discovery per second, with the events in between *dropped*, not deferred
  (``runNotifier`` in local.go).
* ``pkg/nfd-worker/nfd-worker.go`` (``GetFeatureLabels``): names from the local source are
  not prefixed; a label whose name is not a Kubernetes qualified name or whose value is not
  a valid label value is ignored.
* ``pkg/apis/nfd/validate/validate.go`` (``Label``) and ``pkg/nfd-master/nfd-master.go``
  (``filterFeatureLabel``): nfd-master accepts any prefix except ``kubernetes.io`` and
  ``*.kubernetes.io`` (other than ``feature.node.kubernetes.io``/``profile.node.kubernetes.io``)
  and the namespaces listed in ``-deny-label-ns`` (``-extra-label-ns`` re-allows a denied
  one). So ``gpuwatch.io/`` labels need no nfd-master flag unless an operator denies that
  namespace; ``nvidia.com/`` is never written here (GPU Feature Discovery owns it).
* Kubernetes validity (k8s.io/apimachinery ``pkg/api/validate/content/kube.go`` and
  ``dns.go``): a label name is ``[prefix/]name``, the prefix a DNS-1123 subdomain of at most
  253 characters, the name at most 63 characters matching
  ``([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]``; a value at most 63 characters matching
  ``(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?``.

Why the temporary file lives in a dot-*directory* (``features.d/.<name>.tmp.d/``) rather than
being a dot-file beside the target: NFD's fsnotify watcher is not recursive and reacts to
any event in ``features.d``, dot-files included. Creating ``features.d/.x.tmp`` fires a
re-discovery at once (which reads the *old* file), and the rename a few milliseconds later
falls in the same one-second window and is dropped, so the new labels would wait for the
next ``sleepInterval`` (up to 60 s). Inside the dot-directory only the final rename is an
event in ``features.d``: NFD re-reads exactly when the new file is complete. The rename
stays atomic (same filesystem), and NFD skips the dot-directory like any dot-name.
The dot-directory is opened O_DIRECTORY|O_NOFOLLOW and used only when it is a real directory
owned by the agent's euid without group/other write bits (issue 20, 6 d); everything in it is
done relative to that fd, so a symlink planted there is refused and never followed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

from gpuwatch.core.model import DeviceInfo, GpuLink, GpuTopology, NodeSignals, Snapshot, TopologyLevel

log = logging.getLogger(__name__)

LABEL_PREFIX = "gpuwatch.io/"
DEFAULT_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d"
MAX_FEATURE_FILE_SIZE = 65536  # bytes; NFD skips a file whose size is > this (local.go)
LABEL_VALUE_MAX_LENGTH = 63
LABEL_NAME_MAX_LENGTH = 63
LABEL_PREFIX_MAX_LENGTH = 253
# The writer never uses an interval shorter than this for its expiry and refresh arithmetic.
# NFD evaluates the expiry only when it re-reads the files (every sleepInterval, 60 s by
# default, or on a change event), so an expiry of a few seconds gains nothing, while every
# rewrite is an fsnotify event that makes nfd-worker re-discover and re-publish its
# NodeFeature object. With 10 s and the default 5 intervals the file says "valid for 50 s"
# and is refreshed about every 30 s (twice per NFD period); labels of an agent that died
# without cleaning up vanish at most expiry + sleepInterval (~110 s) later.
MIN_REFRESH_INTERVAL_S = 10.0
REFRESH_MARGIN_INTERVALS = 2

_ALNUM = "A-Za-z0-9"
_LABEL_NAME_RE = re.compile(rf"([{_ALNUM}][-{_ALNUM}_.]*)?[{_ALNUM}]")
_LABEL_VALUE_RE = re.compile(rf"(([{_ALNUM}][-{_ALNUM}_.]*)?[{_ALNUM}])?")
_DNS1123_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_VALUE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
_EDGE_RE = re.compile(rf"^[^{_ALNUM}]+|[^{_ALNUM}]+$")

# CUDA compute capability -> architecture family. (major, None) covers every minor.
_FAMILIES: dict[tuple[int, int | None], str] = {
    (3, None): "kepler",
    (5, None): "maxwell",
    (6, None): "pascal",
    (7, 0): "volta",
    (7, 2): "volta",
    (7, 5): "turing",
    (8, 0): "ampere",
    (8, 6): "ampere",
    (8, 7): "ampere",
    (8, 9): "ada-lovelace",
    (9, None): "hopper",
    (10, None): "blackwell",
    (11, None): "blackwell",  # CUDA 13 renumbered sm_101 (Jetson Thor) to sm_110
    (12, None): "blackwell",
}

# gpu.topology values, best connection first. INTERNAL (two GPUs on one board, e.g. K80,
# M60) gets its own name: NVML says the GPUs share a board, which is at least as close as a
# shared PCIe switch, and a scheduler should not have to guess which one we folded it into.
TOPOLOGY_ORDER = ("nvswitch", "nvlink", "same-board", "single-switch", "multi-switch", "host-bridge",
                  "numa", "system")
_LEVEL_NAMES = {
    TopologyLevel.INTERNAL: "same-board",
    TopologyLevel.SINGLE: "single-switch",
    TopologyLevel.MULTIPLE: "multi-switch",
    TopologyLevel.HOSTBRIDGE: "host-bridge",
    TopologyLevel.NODE: "numa",
    TopologyLevel.SYSTEM: "system",
}


# ---------------------------------------------------------------------------------------------
# label syntax


def sanitize_label_value(text: str) -> str:
    """A valid Kubernetes label value made from `text` ("" when nothing usable is left).

    Spaces become '-', every other character outside ``[A-Za-z0-9-_.]`` (unicode included)
    is dropped, non-alphanumerics are stripped from both ends, and the result is cut to 63
    characters and stripped again.
    """
    kept = "".join("-" if ch == " " else ch for ch in text if ch == " " or ch in _VALUE_CHARS)
    kept = _EDGE_RE.sub("", kept)
    return _EDGE_RE.sub("", kept[:LABEL_VALUE_MAX_LENGTH])


def is_valid_label_value(value: str) -> bool:
    return len(value) <= LABEL_VALUE_MAX_LENGTH and _LABEL_VALUE_RE.fullmatch(value) is not None


def is_valid_label_key(key: str) -> bool:
    """A Kubernetes qualified name with a prefix (NFD would auto-prefix an unprefixed one)."""
    prefix, sep, name = key.partition("/")
    if not sep or "/" in name:
        return False
    return (0 < len(prefix) <= LABEL_PREFIX_MAX_LENGTH and _DNS1123_SUBDOMAIN_RE.fullmatch(prefix) is not None
            and len(name) <= LABEL_NAME_MAX_LENGTH and _LABEL_NAME_RE.fullmatch(name) is not None)


# ---------------------------------------------------------------------------------------------
# labels from a snapshot (pure)


def node_labels(snapshot: Snapshot) -> dict[str, str]:
    """The ``gpuwatch.io/*`` node labels for one snapshot. Pure; unknown facts give no label.

    GPU facts count physical GPUs only (MIG instances are parts of them). When the snapshot
    has no devices but the health tracker still knows GPUs (NVML down), only the counts are
    given, from the verdicts, so the unhealthy count -- and the taint rule on it -- holds.
    """
    labels: dict[str, str] = {}
    signals = snapshot.signals
    physical = sorted((d for d in snapshot.devices if not d.is_mig), key=lambda d: d.index)
    health = {h.index: h.healthy for h in signals.health} if signals is not None else {}

    if physical:
        count = len(physical)
        healthy = sum(1 for d in physical if health.get(d.index, d.healthy))
        indices = [d.index for d in physical]
    elif health:
        count = len(health)
        healthy = sum(1 for ok in health.values() if ok)
        indices = sorted(health)
    elif snapshot.gpu_up:
        count, healthy, indices = 0, 0, []
    else:
        count, healthy, indices = -1, -1, []  # nothing known about the GPUs
    if count >= 0:
        labels["gpu.count"] = str(count)
        labels["gpu.healthy-count"] = str(healthy)
        labels["gpu.unhealthy-count"] = str(count - healthy)

    if physical:
        labels.update(_device_labels(physical))
    if indices:
        topology = signals.topology if signals is not None else None
        labels.update(_topology_labels(indices, topology))

    if snapshot.driver_version:
        labels["driver.version"] = snapshot.driver_version
    cuda = snapshot.cuda_driver_version
    if cuda is not None and cuda > 0:
        labels["cuda.driver.major"] = str(cuda // 1000)
        labels["cuda.driver.minor"] = str(cuda % 1000 // 10)

    if signals is not None:
        labels.update(_network_labels(signals))
    if snapshot.simulated:
        labels["gpu.simulated"] = "true"

    out: dict[str, str] = {}
    for name, raw in labels.items():
        value = sanitize_label_value(raw)
        key = LABEL_PREFIX + name
        if value and is_valid_label_key(key):
            out[key] = value
    return out


def _device_labels(physical: Sequence[DeviceInfo]) -> dict[str, str]:
    labels: dict[str, str] = {}
    names = Counter(d.name for d in physical)
    top = max(names.values())
    product = next(d.name for d in physical if names[d.name] == top)  # ties: lowest index
    labels["gpu.product"] = product
    memories = [d.memory_total_bytes for d in physical if d.memory_total_bytes is not None]
    if memories:
        labels["gpu.memory-mib"] = str(min(memories) // (1024 * 1024))
        labels["gpu.memory-mib.max"] = str(max(memories) // (1024 * 1024))
    capability = next((d.compute_capability for d in physical
                       if d.name == product and d.compute_capability is not None), None)
    if capability is not None:
        major, minor = capability
        labels["gpu.compute.major"] = str(major)
        labels["gpu.compute.minor"] = str(minor)
        family = _FAMILIES.get((major, minor)) or _FAMILIES.get((major, None))
        if family:
            labels["gpu.family"] = family
    return labels


def _topology_labels(indices: Sequence[int], topology: GpuTopology | None) -> dict[str, str]:
    if len(indices) == 1:
        return {"gpu.nvlink-island": "1"}  # one GPU is its own island; no pair, no gpu.topology
    if topology is None:
        return {}
    labels = {"gpu.nvlink-island": str(nvlink_island_size(indices, topology))}
    worst = worst_connection(indices, topology)
    if worst is not None:
        labels["gpu.topology"] = worst
    return labels


def worst_connection(indices: Sequence[int], topology: GpuTopology) -> str | None:
    """The worst connection over all pairs of `indices` (a TOPOLOGY_ORDER name).

    None for fewer than two GPUs or when any pair is unknown (not listed, or no NVLink and
    no PCIe level): a partial answer could claim a better connection than the node has.
    """
    links = {(link.gpu_index, link.peer_index): link for link in topology.links}
    ranks = []
    for pos, a in enumerate(indices):
        for b in indices[pos + 1:]:
            rank = _pair_rank([link for link in (links.get((a, b)), links.get((b, a))) if link is not None],
                              topology.nvswitch)
            if rank is None:
                return None
            ranks.append(rank)
    return TOPOLOGY_ORDER[max(ranks)] if ranks else None


def _pair_rank(seen: Sequence[GpuLink], nvswitch: bool) -> int | None:
    """Index into TOPOLOGY_ORDER for one GPU pair (both directions), None when unknown."""
    if not seen:
        return None
    if any(link.nvlinks > 0 for link in seen):
        return TOPOLOGY_ORDER.index("nvswitch" if nvswitch else "nvlink")
    levels = [link.level for link in seen if link.level is not None]
    if not levels:
        return None
    name = _LEVEL_NAMES.get(max(levels))
    return TOPOLOGY_ORDER.index(name) if name is not None else None


def nvlink_island_size(indices: Iterable[int], topology: GpuTopology) -> int:
    """Size of the largest set of GPUs that are all pairwise linked by NVLink (>= 1).

    An exact maximum clique (Bron-Kerbosch with pivoting and a size bound): trivial for the
    <= 16 GPUs of a node. A link counts when either direction reports active NVLinks. An
    NVSwitch node whose NVML gave no per-pair links at all counts as one island.
    """
    nodes = set(indices)
    if not nodes:
        return 0
    if topology.nvswitch and not topology.links:
        return len(nodes)
    adjacent: dict[int, set[int]] = {n: set() for n in nodes}
    for link in topology.links:
        a, b = link.gpu_index, link.peer_index
        if link.nvlinks > 0 and a != b and a in nodes and b in nodes:
            adjacent[a].add(b)
            adjacent[b].add(a)
    best = 1

    def expand(size: int, candidates: set[int], excluded: set[int]) -> None:
        nonlocal best
        if not candidates:
            if not excluded:
                best = max(best, size)
            return
        if size + len(candidates) <= best:
            return
        pivot = max(candidates | excluded, key=lambda n: len(adjacent[n] & candidates))
        for node in sorted(candidates - adjacent[pivot]):
            expand(size + 1, candidates & adjacent[node], excluded & adjacent[node])
            candidates = candidates - {node}
            excluded = excluded | {node}

    expand(0, set(nodes), set())
    return best


def _network_labels(signals: NodeSignals) -> dict[str, str]:
    labels: dict[str, str] = {}
    if any(nic.rdma for nic in signals.nics) or signals.rdma_ports:
        labels["network.rdma"] = "true"
    elif signals.nics:
        labels["network.rdma"] = "false"
    speeds = [nic.speed_bytes_per_second for nic in signals.nics
              if nic.operstate == "up" and nic.speed_bytes_per_second is not None
              and nic.speed_bytes_per_second > 0]
    if speeds:
        labels["network.max-speed-mbps"] = str(round(max(speeds) * 8 / 1_000_000))
    return labels


# ---------------------------------------------------------------------------------------------
# the feature file


def format_expiry(expiry: datetime | float) -> str:
    """RFC3339 in UTC with whole seconds: 2026-11-26T10:00:00Z."""
    if not isinstance(expiry, datetime):
        expiry = datetime.fromtimestamp(math.floor(expiry), tz=UTC)
    elif expiry.tzinfo is None:
        expiry = expiry.replace(tzinfo=UTC)
    return expiry.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_HEADER = (
    "# Written by gpuwatch (the GPU node agent) for Node Feature Discovery's local source.\n"
    "# Do not edit: the agent replaces this file atomically; its lines expire when the agent stops.\n"
)


def render_features(labels: Mapping[str, str], expiry: datetime | float) -> str:
    """The feature-file text: header comment, the expiry directive, sorted ``name=value`` lines.

    `expiry` is an aware datetime (a naive one is taken as UTC) or epoch seconds. Labels
    whose name or value NFD would reject are left out (and logged); if the text would
    exceed NFD's 64 KiB limit, labels are dropped from the end of the sorted list (and
    logged) so that NFD never skips the whole file.
    """
    lines = []
    for key in sorted(labels):
        value = labels[key]
        if not (is_valid_label_key(key) and is_valid_label_value(value)):
            log.warning("NFD feature file: label %r=%r is not a valid Kubernetes label; left out", key, value)
            continue
        lines.append(f"{key}={value}\n")
    head = f"{_HEADER}# +expiry-time={format_expiry(expiry)}\n"
    size = len(head) + sum(len(line) for line in lines)  # all ASCII: characters == bytes
    dropped = 0
    while size > MAX_FEATURE_FILE_SIZE and lines:
        size -= len(lines.pop())
        dropped += 1
    if dropped:
        log.warning("NFD feature file would exceed NFD's %d-byte limit: %d labels left out",
                    MAX_FEATURE_FILE_SIZE, dropped)
    return head + "".join(lines)


class FeatureFileWriter:
    """Keeps one NFD feature file up to date; never raises from `update` or `remove`.

    `update(labels)` rewrites the file only when the labels changed, the file is missing,
    or its expiry is within `REFRESH_MARGIN_INTERVALS` intervals of now. The expiry is
    ``now + expiry_intervals * max(interval_s, MIN_REFRESH_INTERVAL_S)`` (see that constant).
    Writes are atomic: a dot-file inside a dot-directory of the same directory (see the
    module docstring for why not beside the target), written, fsynced, renamed over the
    target, then the directory fsynced; mode 0644. A missing directory is created when its
    parent exists. Failures are counted (`errors_total`), kept (`last_error`) and logged once
    per distinct error, with one line when writing works again. The agent does not call
    `remove()` when it stops: a restart or rolling update must not flap the node's labels
    and taint; the expiry directive retires the labels of an agent that is gone.
    """

    def __init__(self, path: str | os.PathLike[str], interval_s: float, expiry_intervals: int = 5,
                 clock: Callable[[], float] = time.time) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        if expiry_intervals <= REFRESH_MARGIN_INTERVALS:
            raise ValueError(f"expiry_intervals must be more than {REFRESH_MARGIN_INTERVALS}, got {expiry_intervals}")
        self.path = Path(path)
        self.interval_s = interval_s
        self.expiry_intervals = expiry_intervals
        self._clock = clock
        effective = max(interval_s, MIN_REFRESH_INTERVAL_S)
        self.expiry_s = expiry_intervals * effective
        self.refresh_margin_s = REFRESH_MARGIN_INTERVALS * effective
        self.staging_dir = self.path.parent / f".{self.path.name}.tmp.d"
        self.writes_total = 0
        self.errors_total = 0
        self.last_error: str | None = None
        self.expires_at: float | None = None  # epoch seconds written in the current file
        self._labels: dict[str, str] | None = None
        self._logged_error: str | None = None
        self._stale_checked = False
        self._lock = threading.Lock()

    @property
    def temp_path(self) -> Path:
        return self.staging_dir / f".{self.path.name}.{os.getpid()}.tmp"

    def update(self, labels: Mapping[str, str]) -> bool:
        """Write the file if needed; True when it was written."""
        with self._lock:
            now = self._clock()
            wanted = dict(labels)
            if not self._due(wanted, now):
                return False
            expires_at = float(math.floor(now + self.expiry_s))
            text = render_features(wanted, expires_at)
            try:
                self._write(text.encode("utf-8"))
            except OSError as err:
                self._failed("write", err)
                return False
            self._labels = wanted
            self.expires_at = expires_at
            self.writes_total += 1
            if self._logged_error is not None:
                log.info("NFD feature file %s written again", self.path)
                self._logged_error = None
            return True

    def remove(self) -> bool:
        """Delete the file (and the writer's temp directory); True when a file was removed."""
        with self._lock:
            self._labels = None
            self.expires_at = None
            removed = False
            try:
                if os.path.lexists(self.path):  # (a read-only fs answers EROFS even for a missing file)
                    os.unlink(self.path)
                    removed = True
            except FileNotFoundError:
                pass
            except OSError as err:
                self._failed("remove", err)
            self._remove_staging()
            if removed:
                self._fsync_dir(self.path.parent, quiet=True)
            return removed

    # -- internals -----------------------------------------------------------------------------

    def _due(self, labels: dict[str, str], now: float) -> bool:
        if self._labels != labels or self.expires_at is None:
            return True
        remaining = self.expires_at - now
        if remaining <= self.refresh_margin_s or remaining > self.expiry_s + 1.0:  # near expiry / clock stepped back
            return True
        return not os.path.lexists(self.path)  # deleted behind our back

    def _write(self, data: bytes) -> None:
        directory = self.path.parent
        if not directory.is_dir():
            if not directory.parent.is_dir():
                raise FileNotFoundError(errno.ENOENT, "neither the directory nor its parent exists", str(directory))
            os.mkdir(directory, 0o755)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.staging_dir, 0o700)
        staging_fd = self._open_staging()
        try:
            if not self._stale_checked:
                self._clean_staging(staging_fd)
                self._stale_checked = True
            name = self.temp_path.name
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=staging_fd)
                try:
                    os.fchmod(fd, 0o644)  # whatever the umask
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(name, self.path, src_dir_fd=staging_fd)
            except OSError:
                self._unlink_quietly(name, staging_fd)
                raise
        finally:
            os.close(staging_fd)
        self._fsync_dir(directory, quiet=False)

    def _open_staging(self) -> int:
        """An fd on the staging directory, opened without following a symlink, when it is a real
        directory owned by this euid that neither group nor others may write; else an OSError
        whose text says what is wrong and how to fix it (nothing is created or removed in it)."""
        where = str(self.staging_dir)
        fix = f"remove {where}; the agent recreates it (0700, its own)"
        try:
            fd = os.open(self.staging_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            # O_DIRECTORY|O_NOFOLLOW on a symlink answers ENOTDIR (or ELOOP): lstat says which it is
            if err.errno == errno.ELOOP or (err.errno == errno.ENOTDIR and os.path.islink(self.staging_dir)):
                raise OSError(errno.ELOOP, f"is a symbolic link (not followed); {fix}", where) from err
            if err.errno == errno.ENOTDIR:
                raise OSError(errno.ENOTDIR, f"is not a directory; {fix}", where) from err
            raise
        st = os.fstat(fd)
        problem = None
        if st.st_uid != os.geteuid():
            problem = f"is owned by uid {st.st_uid}, not the agent's {os.geteuid()}"
        elif st.st_mode & 0o022:
            problem = f"is writable by group or others (mode {st.st_mode & 0o7777:04o})"
        if problem is not None:
            os.close(fd)
            raise OSError(errno.EPERM, f"{problem} (not used); {fix}", where)
        return fd

    def _failed(self, what: str, err: OSError) -> None:
        self.errors_total += 1
        reason = err.strerror or str(err)
        where = err.filename or self.path
        message = f"cannot {what} the NFD feature file {self.path} ({where}: {reason})"
        self.last_error = message
        if message != self._logged_error:
            self._logged_error = message
            if what == "write":
                log.warning("%s: the gpuwatch.io/* node labels (and the gpu-unhealthy taint rule that reads "
                            "them) are not updated until it works; NFD drops them when the last written file "
                            "expires. Retrying every interval; logged once.", message)
            else:
                log.warning("%s: its gpuwatch.io/* labels stay on the node until NFD sees the file's "
                            "expiry-time pass", message)

    def _clean_staging(self, staging_fd: int) -> None:
        """Remove temp files a crashed agent left behind (only names this writer makes), in the
        directory `staging_fd` holds (checked by _open_staging)."""
        try:
            entries = list(os.scandir(staging_fd))
        except OSError:
            return
        prefix = f".{self.path.name}."
        for entry in entries:
            if entry.name.startswith(prefix) and entry.name.endswith(".tmp"):
                self._unlink_quietly(entry.name, staging_fd)

    def _remove_staging(self) -> None:
        """Empty (of this writer's temp files) and remove the staging directory, only when it is
        one _open_staging accepts: a planted symlink or foreign directory is left alone."""
        try:
            staging_fd = self._open_staging()
        except OSError:
            return
        try:
            self._clean_staging(staging_fd)
        finally:
            os.close(staging_fd)
        try:
            os.rmdir(self.staging_dir)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.debug("NFD feature file: cannot remove %s: %s", self.staging_dir, err)

    @staticmethod
    def _unlink_quietly(name: str, dir_fd: int) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.debug("NFD feature file: cannot remove %s: %s", name, err)

    @staticmethod
    def _fsync_dir(directory: Path, quiet: bool) -> None:
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            if quiet:
                return
            raise
        try:
            os.fsync(fd)
        except OSError:
            if not quiet:
                raise
        finally:
            os.close(fd)
