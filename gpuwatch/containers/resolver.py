"""IdentityResolver: host pid or cgroup id -> container identity, cached for a 1 s loop.

Three caches, each validated cheaply:
* per pid, keyed by (pid, inode and ctime of /proc/<pid>): one stat() per known pid per
  call. A reused pid gets a new /proc/<pid> inode, so the key changes; on any change the
  start time in /proc/<pid>/stat decides. The cgroup file alone is re-read every
  `pid_recheck_s` (spread over the period by pid, so no sweep re-reads everything) to
  follow a process moved to another cgroup.
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
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gpuwatch.containers.cgroup_path import (
    KUBEPODS,
    RUNC,
    UNKNOWN,
    normalize_path,
    normalize_pod_uid,
    parse_cgroup_path,
)
from gpuwatch.containers.cgroupfs import CgroupIdIndex, cgroup_dir, discover_mounts
from gpuwatch.containers.metadata import BundleRoots, ContainerMetadata, MetadataLookup
from gpuwatch.containers.pidcgroup import cgroup_choice
from gpuwatch.containers.procfs import (
    parse_stat,
    parse_status,
    read_text,
)
from gpuwatch.model import ContainerIdentity, ProcessIdentity

_parse_path = parse_cgroup_path.__wrapped__  # uncached (module docstring)


@dataclass
class _PathEntry:
    identity: ContainerIdentity
    fs_dir: str | None  # directory whose existence means the cgroup is alive (None: unknown)
    used_gen: int
    meta_pending: bool  # a container id with no metadata found yet


@dataclass
class _PidEntry:
    proc_key: tuple[int, int]  # (st_ino, st_ctime_ns) of /proc/<pid>
    start_ticks: int
    checked_s: float
    path_entry: _PathEntry
    process: ProcessIdentity
    used_gen: int
    cgroup_text: str | None = None  # what /proc/<pid>/cgroup said at the last check


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

    # ---- pids -------------------------------------------------------------------------

    def resolve_pid(self, pid: int) -> ProcessIdentity | None:
        """Identity of a host pid, or None if the process is gone."""
        pdir = f"{self.proc_root}/{pid}"
        try:
            st = os.stat(pdir)
        except OSError:
            self._pids.pop(pid, None)
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
                del self._pids[pid]
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

    def resolve_pids(self, pids: Iterable[int]) -> dict[int, ProcessIdentity]:
        """Identities of the pids still alive (gone ones are left out)."""
        out: dict[int, ProcessIdentity] = {}
        for pid in pids:
            ident = self.resolve_pid(pid)
            if ident is not None:
                out[pid] = ident
        return out

    def _hit(self, entry: _PidEntry) -> ProcessIdentity:
        entry.used_gen = self._gen
        pe = entry.path_entry
        pe.used_gen = self._gen
        if entry.process.identity is not pe.identity:  # metadata arrived since
            entry.process = replace(entry.process, identity=pe.identity)
        return entry.process

    def _load_pid(
        self, pid: int, pdir: str, key: tuple[int, int], now: float, stat_text: str | None
    ) -> ProcessIdentity | None:
        if stat_text is None:
            stat_text = read_text(f"{pdir}/stat")
        parsed = parse_stat(stat_text) if stat_text is not None else None
        cg_text = read_text(f"{pdir}/cgroup")
        if (parsed is None and cg_text is None) or (parsed is not None and parsed.exited):
            self._pids.pop(pid, None)
            return None  # gone between the stat and the reads, or a zombie nobody reaped yet
        comm, start_ticks = (parsed.comm, parsed.start_ticks) if parsed is not None else ("", -1)
        status = read_text(f"{pdir}/status")
        name, nspid = parse_status(status) if status is not None else ("", ())
        if cg_text is not None:
            choice = cgroup_choice(cg_text, self.mounts)  # every line, placed in its hierarchy
            path_entry = self._path_entry(choice.path, choice.hierarchy)
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
        )
        # Spread the periodic rechecks over the recheck period (by pid), so processes that
        # were first seen together are not all re-read in the same sweep.
        checked_s = now - (pid % 64) / 64 * self._pid_recheck_s
        self._pids[pid] = _PidEntry(key, start_ticks, checked_s, path_entry, process, self._gen, cg_text)
        return process

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
        if not cid:
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
        if self._last_sweep_s is not None and now - self._last_sweep_s < self._sweep_min_interval_s:
            return
        self._last_sweep_s = now
        oldest = self._gen - self._idle_sweeps
        self._pids = {pid: e for pid, e in self._pids.items() if e.used_gen >= oldest}
        live_paths = {id(e.path_entry) for e in self._pids.values()}
        keep: dict[str, _PathEntry] = {}
        for path, entry in self._paths.items():
            cgroup_id = entry.identity.cgroup_id
            if entry.fs_dir is not None:
                try:
                    ino = os.stat(entry.fs_dir).st_ino
                except OSError:
                    ino = None
                # gone, or removed and created again under the same name (a new cgroup id)
                alive = ino is not None and (cgroup_id is None or ino == cgroup_id)
            else:
                alive = entry.used_gen >= oldest or id(entry) in live_paths
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
        kept = {id(e) for e in keep.values()}
        tracked = {id(e) for e in self._paths.values()}
        # a pid whose cgroup went away is revalidated from scratch (it is usually a zombie)
        self._pids = {
            pid: e for pid, e in self._pids.items() if id(e.path_entry) in kept or id(e.path_entry) not in tracked
        }
        self._paths = keep
        referenced = {e.identity.container_id for e in keep.values() if e.identity.container_id}
        referenced |= {p.rsplit("/", 1)[-1] for p in keep}
        self._meta = {cid: m for cid, m in self._meta.items() if cid in referenced}

    def cache_sizes(self) -> dict[str, int]:
        """Entries per cache (for tests and the agent's self-metrics)."""
        return {"pids": len(self._pids), "paths": len(self._paths), "metadata": len(self._meta)}


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
