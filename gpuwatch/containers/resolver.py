"""IdentityResolver: host pid or cgroup id -> container identity, cached for a 1 s loop.

Three caches, each validated cheaply:
* per pid, resolved once and then revalidated without a syscall per pid per cycle. On the
  real /proc (pidwatch.py) each cached process keeps a pidfd in one epoll set and an open
  /proc/<pid>/cgroup: `begin_sweep` asks the kernel once which of them exited (a reused
  pid is then loaded afresh, never confused with the old process), and re-reads a share of
  the kept cgroup files (one pread each) so that every process is re-read once per
  `pid_recheck_s` (10 s), at most `max_rechecks_per_sweep` (32) per sweep: a bounded cost
  per cycle (~0.3 ms on a hybrid host); at 800 pids and 1 s sweeps a process is re-read
  every 25 s. Why a periodic re-read for moves: nothing cheaper reports a move of one pid
  (cgroup.events only flips when a cgroup empties), and moves of a GPU process are rare --
  runtimes put a process in its container's cgroup before it execs the workload, i.e.
  before NVML ever lists it -- so a move is seen within that period, at ~6-10 us per
  re-read. exec keeps the cgroup (and so the container); the name shown is the one at
  load, refreshed when the process is loaded again (moved, or dropped after `idle_sweeps`
  sweeps out of the GPU list, which is where exec puts a CUDA process: its driver state
  dies with the old image). `forget_pid` lets a caller that sees exec events (the probes)
  drop one at once.
  Elsewhere (fixture trees, a procfs of another pid namespace, no descriptors left) the
  key is (pid, inode and ctime of /proc/<pid>): one stat() per known pid per call; a
  reused pid gets a new /proc/<pid> inode, so the key changes; on any change the start
  time in /proc/<pid>/stat decides, and the cgroup file is re-read every `pid_recheck_s`.
* per cgroup path: the parsed identity plus metadata and the cgroup id; dropped by
  `begin_sweep` when the cgroup directory is gone.
* per container id: metadata from the runtime's files (metadata.py), dropped when no cached
  cgroup refers to the container any more; a miss is retried every `metadata_retry_s`.
All three hold live containers only (and pids asked about in the last `idle_sweeps`
sweeps), so container churn does not grow them. Paths are parsed with the uncached parser:
the path cache above is the cache (parse_cgroup_path's own would keep up to 8,192 gone
containers' paths and identities, ~7 MB, long after they left).
Zombies (exited, not yet reaped) count as gone. Nothing is ever dropped from the output:
unknown cgroups are runtime "unknown" with the raw path.
"""

from __future__ import annotations

import os
import pwd
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gpuwatch.containers.cgroup_path import (
    KUBEPODS,
    LIBVIRT_LXC,
    RUNC,
    SLURM,
    UNKNOWN,
    normalize_path,
    normalize_pod_uid,
    parse_cgroup_path,
)
from gpuwatch.containers.cgroupfs import CgroupIdIndex, cgroup_dir, discover_mounts
from gpuwatch.containers.metadata import BundleRoots, ContainerMetadata, MetadataLookup
from gpuwatch.containers.pidcgroup import cgroup_choice
from gpuwatch.containers.pidwatch import ProcessHandle, open_pid_watch
from gpuwatch.containers.procfs import (
    parse_stat,
    parse_status,
    parse_uid,
    read_text,
)
from gpuwatch.core.model import ContainerIdentity, ProcessIdentity

_parse_path = parse_cgroup_path.__wrapped__  # uncached (module docstring)


@dataclass
class _PathEntry:
    identity: ContainerIdentity
    fs_dir: str | None  # directory whose existence means the cgroup is alive (None: unknown)
    used_gen: int
    meta_pending: bool  # a container id with no metadata found yet
    pids: int = 0  # cached pid entries in this cgroup
    watched: int = 0  # of which watched (a live member: the cgroup cannot have been removed)


@dataclass
class _PidEntry:
    proc_key: tuple[int, int]  # (st_ino, st_ctime_ns) of /proc/<pid>
    start_ticks: int
    checked_s: float
    path_entry: _PathEntry
    process: ProcessIdentity
    used_gen: int
    cgroup_text: str | None = None  # what /proc/<pid>/cgroup said at the last check
    handle: ProcessHandle | None = None  # kept pidfd + cgroup fd (pidwatch.py); None: stat-revalidated


@dataclass
class _MetaEntry:
    meta: ContainerMetadata | None
    fetched_s: float


class IdentityResolver:
    """pid / cgroup path / cgroup id -> ContainerIdentity, with caches for a sampling loop.

    Roots are injected: `proc_root` (a /proc tree), `cgroup_root` (the cgroup v2 mount;
    default: found in <proc_root>/self/mountinfo), `bundle_roots` (runtime state dirs).
    Call `begin_sweep()` once per sample interval. Not thread-safe: one sampling loop owns it.
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        cgroup_root: str | None = None,
        bundle_roots: BundleRoots | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        pid_recheck_s: float = 10.0,
        metadata_retry_s: float = 5.0,
        rescan_min_interval_s: float = 2.0,
        sweep_min_interval_s: float = 0.5,
        idle_sweeps: int = 3,
        max_watched_pids: int = 8192,
        max_rechecks_per_sweep: int = 32,
    ) -> None:
        self.proc_root = proc_root.rstrip("/") or "/"
        self._clock = clock
        mounts = discover_mounts(self.proc_root)
        if cgroup_root is not None:
            mounts = mounts.with_unified(cgroup_root)
        self.mounts = mounts
        self.bundle_roots = bundle_roots or BundleRoots()
        self._lookup = MetadataLookup(self.bundle_roots)
        self.index = CgroupIdIndex(mounts.unified, clock, rescan_min_interval_s)
        self._pid_recheck_s = pid_recheck_s
        self._metadata_retry_s = metadata_retry_s
        self._sweep_min_interval_s = sweep_min_interval_s
        self._idle_sweeps = idle_sweeps
        self._pids: dict[int, _PidEntry] = {}
        self._paths: dict[str, _PathEntry] = {}
        self._meta: dict[str, _MetaEntry] = {}
        self._gen = 0
        self._last_sweep_s: float | None = None
        # kept process handles (2 fds each) for pids of our own pid namespace; None elsewhere
        self._watch = open_pid_watch(self.proc_root)
        self._max_watched_pids = max_watched_pids
        self._max_rechecks_per_sweep = max_rechecks_per_sweep
        self._recheck_queue: deque[_PidEntry] = deque()  # watched entries, re-read in rotation
        self._recheck_credit = 0.0
        self._last_recheck_s: float | None = None
        self._idle_scan_gen = 0

    # ---- pids -------------------------------------------------------------------------

    def resolve_pid(self, pid: int) -> ProcessIdentity | None:
        """Identity of a host pid, or None if the process is gone."""
        self._drop_exited()
        return self._resolve(pid)

    def resolve_pids(self, pids: Iterable[int]) -> dict[int, ProcessIdentity]:
        """Identities of the pids still alive (gone ones are left out)."""
        self._drop_exited()
        out: dict[int, ProcessIdentity] = {}
        cached, gen = self._pids, self._gen
        for pid in pids:
            entry = cached.get(pid)
            if entry is not None and entry.handle is not None:  # _resolve's first case, inlined:
                entry.used_gen = entry.path_entry.used_gen = gen  # the per-cycle path for 800 pids
                process = entry.process
                out[pid] = process if process.identity is entry.path_entry.identity else self._hit(entry)
                continue
            ident = self._resolve(pid)
            if ident is not None:
                out[pid] = ident
        return out

    def forget_pid(self, pid: int) -> None:
        """Drop what is cached for a pid (e.g. it exec'd): the next call loads it afresh."""
        self._drop_pid(pid)

    def _resolve(self, pid: int) -> ProcessIdentity | None:
        entry = self._pids.get(pid)
        if entry is not None and entry.handle is not None:
            return self._hit(entry)  # its pidfd has not fired: the same process, still alive
        pdir = f"{self.proc_root}/{pid}"
        if entry is None and self._watch is not None and len(self._watch) < self._max_watched_pids:
            handle = self._watch.watch(pid)
            if handle is not None:
                return self._load_watched(pid, pdir, handle)
        try:
            st = os.stat(pdir)
        except OSError:
            self._drop_pid(pid)
            return None
        key = (st.st_ino, st.st_ctime_ns)
        entry = self._pids.get(pid)
        now = self._clock()
        stat_text: str | None = None
        if entry is not None:
            fresh = now - entry.checked_s < self._pid_recheck_s
            if fresh and entry.proc_key == key:
                return self._hit(entry)
            stat_text = read_text(f"{pdir}/stat")
            parsed = parse_stat(stat_text) if stat_text is not None else None
            if parsed is None or parsed.exited:
                self._drop_pid(pid)
                return None
            if parsed.start_ticks == entry.start_ticks:
                if fresh:
                    entry.proc_key = key  # same process, its /proc inode was recycled
                    return self._hit(entry)
                # periodic recheck of the same process: only a cgroup move matters
                cg_text = read_text(f"{pdir}/cgroup")
                if cg_text is not None and cg_text == entry.cgroup_text:
                    entry.proc_key, entry.checked_s = key, now
                    return self._hit(entry)
        return self._load_pid(pid, pdir, key, now, stat_text)

    def _load_watched(self, pid: int, pdir: str, handle: ProcessHandle) -> ProcessIdentity | None:
        """Load a pid whose handles were just opened. The pidfd was opened first: if that
        process is still alive after the reads, every file read belonged to it."""
        assert self._watch is not None
        cg_text = self._watch.read_cgroup(handle)
        process = None
        if cg_text is not None:
            process = self._load_pid(pid, pdir, (0, 0), self._clock(), None, cg_text, handle)
        if process is None or not self._watch.alive(handle):
            self._drop_pid(pid)
            self._watch.close(handle)
            return None
        return process

    def _hit(self, entry: _PidEntry) -> ProcessIdentity:
        entry.used_gen = self._gen
        pe = entry.path_entry
        pe.used_gen = self._gen
        if entry.process.identity is not pe.identity:  # metadata arrived since
            entry.process = replace(entry.process, identity=pe.identity)
        return entry.process

    def _load_pid(
        self, pid: int, pdir: str, key: tuple[int, int], now: float, stat_text: str | None,
        cg_text: str | None = None, handle: ProcessHandle | None = None,
    ) -> ProcessIdentity | None:
        if stat_text is None:
            stat_text = read_text(f"{pdir}/stat")
        parsed = parse_stat(stat_text) if stat_text is not None else None
        if cg_text is None:
            cg_text = read_text(f"{pdir}/cgroup")
        if (parsed is None and cg_text is None) or (parsed is not None and parsed.exited):
            if handle is None:
                self._drop_pid(pid)
            return None  # gone between the stat and the reads, or a zombie nobody reaped yet
        comm, start_ticks = (parsed.comm, parsed.start_ticks) if parsed is not None else ("", -1)
        status = read_text(f"{pdir}/status")
        name, nspid = parse_status(status) if status is not None else ("", ())
        unified: str | None = None
        if cg_text is not None:
            choice = cgroup_choice(cg_text, self.mounts)  # every line, placed in its hierarchy
            path_entry = self._path_entry(choice.path, choice.hierarchy)
            unified = normalize_path(choice.unified) if choice.unified is not None else None
            if path_entry.identity.runtime == SLURM and status is not None:
                _add_slurm_user(path_entry, parse_uid(status))
        else:
            # cgroup unreadable (truncated fixture, permissions): keep the process, say unknown
            unknown = ContainerIdentity(runtime=UNKNOWN, cgroup_path="")
            path_entry = _PathEntry(unknown, None, self._gen, False)
        path_entry.used_gen = self._gen
        process = ProcessIdentity(
            pid=pid,
            container_pid=nspid[-1] if nspid else None,
            comm=comm or name,
            identity=path_entry.identity,
            unified_path=unified,
        )
        # Spread the periodic rechecks over the recheck period (by pid), so processes that
        # were first seen together are not all re-read in the same sweep.
        checked_s = now - (pid % 64) / 64 * self._pid_recheck_s
        old = self._pids.get(pid)
        if old is not None and old.handle is not handle:
            self._drop_pid(pid)
        elif old is not None:
            _count(old, -1)
        entry = _PidEntry(key, start_ticks, checked_s, path_entry, process, self._gen, cg_text, handle)
        self._pids[pid] = entry
        _count(entry, 1)
        if handle is not None:
            self._recheck_queue.append(entry)
        return process

    def _drop_pid(self, pid: int) -> None:
        entry = self._pids.pop(pid, None)
        if entry is None:
            return
        _count(entry, -1)
        if entry.handle is not None and self._watch is not None:
            self._watch.close(entry.handle)

    def _drop_exited(self) -> None:
        """Forget every watched process that exited (one epoll_wait)."""
        if self._watch is None:
            return
        for pid in self._watch.exited():  # their handles are closed already
            entry = self._pids.get(pid)
            if entry is not None and entry.handle is not None and not self._watch.watching(entry.handle):
                self._drop_pid(pid)

    def _recheck_watched(self, now: float) -> None:
        """Re-read the kept cgroup files of a share of the watched pids, so that each is
        re-read once per pid_recheck_s, but at most max_rechecks_per_sweep per sweep (a
        fixed cost per cycle: at 800 pids and 1 s sweeps each is re-read every 25 s); a
        move to another cgroup reloads the pid."""
        if self._watch is None:
            return
        last, self._last_recheck_s = self._last_recheck_s, now
        if last is None or not self._recheck_queue:
            return
        self._recheck_credit += len(self._recheck_queue) * max(0.0, now - last) / self._pid_recheck_s
        count = min(int(self._recheck_credit), len(self._recheck_queue), self._max_rechecks_per_sweep)
        self._recheck_credit = min(self._recheck_credit - count, 1.0)
        queue = self._recheck_queue
        for _ in range(count):
            entry = queue.popleft()
            handle = entry.handle
            pid = entry.process.pid
            if handle is None or self._pids.get(pid) is not entry:
                continue  # dropped or replaced since: falls out of the rotation
            text = self._watch.read_cgroup(handle)
            if text is None:
                self._drop_pid(pid)
                continue
            queue.append(entry)
            if text == entry.cgroup_text:
                continue
            # moved: load it again, keeping its handles (and, as at first load, only if the
            # process the handles belong to outlived the reads)
            reloaded = self._load_pid(pid, f"{self.proc_root}/{pid}", (0, 0), now, None, text, handle)
            if reloaded is None or not self._watch.alive(handle):
                self._drop_pid(pid)

    # ---- cgroups ----------------------------------------------------------------------

    def identity_for_cgroup_path(self, path: str) -> ContainerIdentity:
        """Identity of a cgroup path (v2 path, or a v1 path on hybrid hosts). Never None."""
        entry = self._path_entry(path, "")
        entry.used_gen = self._gen
        return entry.identity

    def identity_for_cgroup_id(self, cgroup_id: int) -> ContainerIdentity | None:
        """Identity of a v2 cgroup id (inode), or None if no such cgroup exists (after a
        rate-limited rescan of the tree)."""
        path = self.index.path_for_id(cgroup_id)
        if path is None:
            return None
        return self.identity_for_cgroup_path(path)

    def _path_entry(self, raw_path: str, hierarchy: str) -> _PathEntry:
        path = normalize_path(raw_path)
        entry = self._paths.get(path)
        if entry is not None:
            return entry
        cgroup_id = self.index.id_for_path(path)
        fs_dir: str | None = None
        if cgroup_id is not None and self.mounts.unified is not None:
            fs_dir = cgroup_dir(self.mounts.unified, path)
        elif hierarchy and hierarchy in self.mounts.v1:
            candidate = cgroup_dir(self.mounts.v1[hierarchy], path)
            fs_dir = candidate if os.path.isdir(candidate) else None
        identity, pending = self._build_identity(path, cgroup_id)
        entry = _PathEntry(identity, fs_dir, self._gen, pending)
        self._paths[path] = entry
        return entry

    def _build_identity(self, path: str, cgroup_id: int | None, parsed: ContainerIdentity | None = None
                        ) -> tuple[ContainerIdentity, bool]:
        """(identity, metadata still missing) for a path: parse (unless `parsed` is the path's
        identity without metadata already), then enrich from bundles."""
        base = parsed if parsed is not None else _parse_path(path)
        if base.cgroup_path != path:  # the host identity is shared; give it this path's id
            base = replace(base, cgroup_path=path)
        if cgroup_id is not None:
            base = replace(base, cgroup_id=cgroup_id)
        cid = base.container_id
        if not cid and base.runtime == UNKNOWN:
            # plain runc with the cgroupfs driver: the leaf is the container id if runc knows it
            leaf = path.rsplit("/", 1)[-1]
            meta = self._metadata(leaf, RUNC, runc_only=True)
            if meta is None:
                return base, False
            base = replace(base, runtime=RUNC, container_id=leaf)
            return _merge(base, meta), False
        if not cid or base.runtime in _NO_BUNDLES:
            return base, False
        meta = self._metadata(cid, base.runtime)
        if meta is None:
            return base, True
        return _merge(base, meta), False

    def _metadata(self, container_id: str, runtime_hint: str, runc_only: bool = False) -> ContainerMetadata | None:
        now = self._clock()
        cached = self._meta.get(container_id)
        fresh = cached is not None and now - cached.fetched_s < self._metadata_retry_s
        if cached is not None and (cached.meta is not None or fresh):
            return cached.meta
        lookup = self._lookup
        meta = lookup.lookup_runc(container_id) if runc_only else lookup.lookup(container_id, runtime_hint)
        self._meta[container_id] = _MetaEntry(meta, now)
        return meta

    # ---- housekeeping -----------------------------------------------------------------

    def begin_sweep(self) -> None:
        """Start a sample interval: drop caches of gone cgroups, idle pids and unreferenced
        metadata; retry missing metadata. Does real work at most every sweep_min_interval_s."""
        self._gen += 1
        now = self._clock()
        self._drop_exited()
        self._recheck_watched(now)
        if self._last_sweep_s is not None and now - self._last_sweep_s < self._sweep_min_interval_s:
            return
        self._last_sweep_s = now
        oldest = self._gen - self._idle_sweeps
        # Exited watched pids are gone already (pidfds); the scan for idle ones (alive, no
        # longer asked about) can wait until one could have become idle.
        if self._watch is None or self._gen - self._idle_scan_gen >= self._idle_sweeps:
            self._idle_scan_gen = self._gen
            for pid in [pid for pid, e in self._pids.items() if e.used_gen < oldest]:
                self._drop_pid(pid)
        keep: dict[str, _PathEntry] = {}
        for path, entry in self._paths.items():
            cgroup_id = entry.identity.cgroup_id
            if entry.watched > 0:
                alive = True  # a cgroup with a live member cannot have been removed: no stat
            elif entry.fs_dir is not None:
                try:
                    ino = os.stat(entry.fs_dir).st_ino
                except OSError:
                    ino = None
                # gone, or removed and created again under the same name (a new cgroup id)
                alive = ino is not None and (cgroup_id is None or ino == cgroup_id)
            else:
                alive = entry.used_gen >= oldest or entry.pids > 0
            if not alive:
                self.index.forget(path)
                continue
            if cgroup_id is None and entry.fs_dir is None and self.mounts.unified is not None:
                cgroup_id = self.index.id_for_path(path)  # the v2 dir may have appeared since
                if cgroup_id is not None:
                    entry.fs_dir = cgroup_dir(self.mounts.unified, path)
                    entry.identity = replace(entry.identity, cgroup_id=cgroup_id)
            if entry.meta_pending:  # its identity is still the parsed path's: no need to parse again
                identity, pending = self._build_identity(path, cgroup_id, entry.identity)
                entry.identity, entry.meta_pending = identity, pending
            keep[path] = entry
        if len(keep) == len(self._paths):
            return  # nothing went: no pid or metadata lost its cgroup
        kept = {id(e) for e in keep.values()}
        tracked = {id(e) for e in self._paths.values()}
        # a pid whose cgroup went away is revalidated from scratch (it is usually a zombie)
        orphans = [pid for pid, e in self._pids.items() if id(e.path_entry) not in kept and id(e.path_entry) in tracked]
        for pid in orphans:
            self._drop_pid(pid)
        self._paths = keep
        referenced = {e.identity.container_id for e in keep.values() if e.identity.container_id}
        referenced |= {p.rsplit("/", 1)[-1] for p in keep}
        self._meta = {cid: m for cid, m in self._meta.items() if cid in referenced}

    def cache_sizes(self) -> dict[str, int]:
        """Entries per cache (for tests and the agent's self-metrics)."""
        return {"pids": len(self._pids), "paths": len(self._paths), "metadata": len(self._meta)}

    def watched_pids(self) -> int:
        """Pids revalidated through kept handles (2 file descriptors each; pidwatch.py)."""
        return len(self._watch) if self._watch is not None else 0

    def close(self) -> None:
        """Release the kept process handles (also done when the resolver is garbage-collected)."""
        if self._watch is not None:
            self._watch.close_all()
            self._watch = None
        self._pids.clear()
        self._recheck_queue.clear()


_NO_BUNDLES = frozenset({SLURM, LIBVIRT_LXC})  # runtimes that leave no OCI bundle / docker config to read


def _add_slurm_user(entry: _PathEntry, uid: int | None) -> None:
    """Give a Slurm step's identity its user (slurm_uid, slurm_user) from one of its processes,
    once: v2 paths do not carry the uid, and every task of a job runs as the job's user."""
    labels = dict(entry.identity.labels)
    if uid is None or "slurm_user" in labels:
        return
    extra = [] if "slurm_uid" in labels else [("slurm_uid", str(uid))]
    extra.append(("slurm_user", _user_name(int(labels.get("slurm_uid", uid)))))
    entry.identity = replace(entry.identity, labels=(*entry.identity.labels, *extra))


def _user_name(uid: int) -> str:
    """The login name of a uid (the node's passwd/NSS), or the number when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def _count(entry: _PidEntry, delta: int) -> None:
    """Keep the per-cgroup counts of cached (and watched) pids in step with the pid cache."""
    entry.path_entry.pids += delta
    if entry.handle is not None:
        entry.path_entry.watched += delta


def _merge(base: ContainerIdentity, meta: ContainerMetadata) -> ContainerIdentity:
    """Path facts win (container id, pod uid from the path); names come from metadata."""
    runtime = base.runtime
    if runtime in (KUBEPODS, UNKNOWN):
        runtime = meta.runtime
    labels = base.labels
    if meta.container_type:
        labels = (*labels, ("container_type", meta.container_type))
    labels = (*labels, *meta.sharing_labels)  # gpuwatch.io/sharing, gpuwatch.io/gpu-share (policy/sharing.py)
    return replace(
        base,
        runtime=runtime,
        container_name=meta.container_name or base.container_name,
        pod_name=meta.pod_name,
        pod_namespace=meta.pod_namespace,
        pod_uid=base.pod_uid or (normalize_pod_uid(meta.pod_uid) if meta.pod_uid else ""),
        labels=labels,
    )
