"""The one cgroup filesystem layer: where the hierarchies are mounted, which directory a cgroup
path names, cgroup id <-> path, and paths read in another cgroup namespace.

Everyone (identity, probes, enforcement, the simulated node, `gpuwatch doctor`) asks this
module; nothing else parses mountinfo.

* Mounts come from /proc/<self>/mountinfo: pure v2 (/sys/fs/cgroup), hybrid (v1 controllers
  plus v2 at /sys/fs/cgroup/unified) and v1-only hosts.
* A cgroup id (what bpf_get_current_cgroup_id() returns) is the inode number of the cgroup's
  directory in the v2 hierarchy.
* Cgroup namespaces (the DaemonSet case: host /sys/fs/cgroup bind-mounted into a container
  that has its own cgroup namespace). The kernel prints every cgroup path -- mountinfo's root
  field and other processes' /proc/<pid>/cgroup lines -- relative to the reader's namespace
  root: the host's hierarchy root reads `/../../..`, a pod beside ours
  `/../../kubepods-besteffort.slice/...`. We find the namespace root's real place in the
  hierarchy once (the directory, that many levels below the mount, whose cgroup.procs holds
  this process) and from then on speak absolute hierarchy paths, exactly as on the host.
  When it cannot be found, paths stay namespace-relative and those that climb out of the
  namespace ('..') have no directory here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuwatch.containers.procfs import parse_cgroup_file, read_text
from gpuwatch.core.errors import GpuwatchError

log = logging.getLogger(__name__)


class CgroupUnavailable(GpuwatchError):
    """A cgroup hierarchy the caller needs is not mounted (or not visible) here."""


@dataclass(frozen=True)
class CgroupHierarchy:
    """One mounted cgroup hierarchy.

    `controllers` is () for the v2 (unified) hierarchy, else the v1 controllers and
    "name=..." of the mount (e.g. ("cpu", "cpuacct")). `mount_root` is mountinfo's root field
    (relative to our cgroup namespace: "/" or "/../.."). `ns_root` is where our cgroup
    namespace's root sits in this hierarchy (absolute; "/" on the host). `ns_root_known` is
    False when a namespace root could not be placed: paths then stay namespace-relative.
    """

    mount_point: str
    controllers: tuple[str, ...] = ()
    mount_root: str = "/"
    ns_root: str = "/"
    ns_root_known: bool = True

    @property
    def is_v2(self) -> bool:
        return not self.controllers

    @property
    def ups(self) -> int:
        """How many levels above our namespace root the mount's root is."""
        return sum(1 for c in self.mount_root.split("/") if c == "..")

    def absolute(self, ns_path: str) -> str | None:
        """Hierarchy path of a path as printed in /proc/<pid>/cgroup (namespace-relative);
        None when it climbs above what we can place (outside a namespace we could not place)."""
        base = self.ns_root if self.ns_root_known else "/"
        return join_cgroup_path(base, ns_path)

    def directory(self, path: str) -> str | None:
        """Directory of an absolute hierarchy path under this mount (None if it has '..')."""
        if ".." in path.split("/"):
            return None
        return cgroup_dir(self.mount_point, normalize(path))


def normalize(path: str) -> str:
    """'/'-rooted path without empty or '.' components (".." kept); empty becomes '/'."""
    return "/" + "/".join(c for c in path.strip().split("/") if c and c != ".")


def join_cgroup_path(base: str, rel: str) -> str | None:
    """`rel` (a cgroup path, possibly with '..', with or without its leading '/') resolved
    against `base`; None when it climbs above the root."""
    parts = [c for c in base.split("/") if c and c != "."]
    for comp in rel.strip().split("/"):
        if not comp or comp == ".":
            continue
        if comp == "..":
            if not parts:
                return None
            parts.pop()
        else:
            parts.append(comp)
    return "/" + "/".join(parts)


def cgroup_dir(mount: str, path: str) -> str:
    """Filesystem directory of a cgroup path under a hierarchy's mount point."""
    return mount.rstrip("/") + path if path != "/" else mount


@dataclass(frozen=True)
class CgroupMounts:
    """Every usable cgroup hierarchy of this host, as this process sees them."""

    hierarchies: tuple[CgroupHierarchy, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    # ---- lookups --------------------------------------------------------------------------
    @property
    def unified_hierarchy(self) -> CgroupHierarchy | None:
        return next((h for h in self.hierarchies if h.is_v2), None)

    def v1_hierarchy(self, controller: str) -> CgroupHierarchy | None:
        """The v1 hierarchy carrying `controller` ("cpu", "freezer", "name=systemd")."""
        return next((h for h in self.hierarchies if controller in h.controllers), None)

    def hierarchy(self, controller: str) -> CgroupHierarchy | None:
        """v2 for "" (the `0::` line), else the v1 hierarchy of the controller."""
        return self.unified_hierarchy if controller == "" else self.v1_hierarchy(controller)

    @property
    def unified(self) -> str | None:
        """Mount point of the v2 hierarchy, or None."""
        h = self.unified_hierarchy
        return h.mount_point if h is not None else None

    @property
    def v1(self) -> dict[str, str]:
        """v1 mount point by controller (co-mounted controllers each get an entry)."""
        out: dict[str, str] = {}
        for h in self.hierarchies:
            for c in h.controllers:
                out.setdefault(c, h.mount_point)
        return out

    @property
    def v2(self) -> Path | None:
        return Path(self.unified) if self.unified is not None else None

    @property
    def pure_v2(self) -> bool:
        return self.unified is not None and len(self.hierarchies) == 1

    @property
    def mode(self) -> str:
        """'v2', 'hybrid', 'v1' or 'none'."""
        has_v1 = any(not h.is_v2 for h in self.hierarchies)
        if self.unified is not None:
            return "hybrid" if has_v1 else "v2"
        return "v1" if has_v1 else "none"

    def v1_controller(self, controller: str) -> Path | None:
        h = self.v1_hierarchy(controller)
        return Path(h.mount_point) if h is not None else None

    @property
    def roots(self) -> list[Path]:
        """Mount points of every hierarchy (v2 first)."""
        ordered = sorted(self.hierarchies, key=lambda h: not h.is_v2)
        return [Path(h.mount_point) for h in ordered]

    # ---- paths ----------------------------------------------------------------------------
    def absolute(self, ns_path: str, controller: str = "") -> str:
        """A /proc/<pid>/cgroup path turned into its hierarchy path; unchanged (normalised,
        '..' kept) when the hierarchy is not mounted or the path cannot be placed."""
        h = self.hierarchy(controller)
        if h is not None:
            placed = h.absolute(ns_path)
            if placed is not None:
                return placed
        return normalize(ns_path)

    def v2_dir(self, cgroup_path: str) -> Path:
        """Directory of a cgroup path in the v2 tree; CgroupUnavailable without one."""
        h = self.unified_hierarchy
        directory = h.directory(cgroup_path) if h is not None else None
        if directory is None:
            raise CgroupUnavailable(
                "no cgroup2 hierarchy is mounted" if h is None else f"cgroup path {cgroup_path!r} is not visible here",
                fix="mount cgroup2 (e.g. at /sys/fs/cgroup/unified) or boot with a v2 systemd",
            )
        return Path(directory)

    def all_dirs(self, cgroup_path: str) -> list[Path]:
        """Directories of a cgroup path in every hierarchy (v2 first, then v1)."""
        out = []
        for h in sorted(self.hierarchies, key=lambda h: not h.is_v2):
            directory = h.directory(cgroup_path)
            if directory is not None:
                out.append(Path(directory))
        return out

    @classmethod
    def v2_only(cls, mount_point: str | Path) -> CgroupMounts:
        """A v2 hierarchy mounted at `mount_point` (a fixture tree, or an injected root)."""
        return cls((CgroupHierarchy(str(mount_point)),))

    def with_unified(self, mount_point: str) -> CgroupMounts:
        """These mounts with the v2 hierarchy replaced (an injected cgroup_root)."""
        rest = tuple(h for h in self.hierarchies if not h.is_v2)
        return replace(self, hierarchies=(CgroupHierarchy(mount_point), *rest))


# ---- mountinfo -------------------------------------------------------------------------------
_IGNORED_OPTIONS = {"rw", "ro", "noprefix", "cpuset_v2_mode", "xattr", "favordynmods", "clone_children"}


def _unescape(s: str) -> str:
    r"""mountinfo escapes space, tab, newline and backslash as \ooo octal."""
    if "\\" not in s:
        return s
    out = []
    i = 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _root_rank(root: str) -> int | None:
    """0 for a hierarchy's root seen from its namespace ("/"), 1 for a root above our
    namespace ("/../.."), None for a bind of a sub-cgroup (it would map paths wrongly)."""
    comps = [c for c in root.split("/") if c]
    if not comps:
        return 0
    if all(c == ".." for c in comps):
        return 1
    return None


def parse_mountinfo(text: str) -> CgroupMounts:
    """Cgroup hierarchies from /proc/<pid>/mountinfo text; malformed lines are skipped.

    Format: id parent major:minor root mountpoint options [optional...] - fstype source super.
    Per hierarchy, a mount of its root ("/") wins over one of a root above our cgroup
    namespace ("/../.."); binds of sub-cgroups are not used. Namespace roots are placed by
    `discover_mounts` (this function does no I/O).
    """
    best: dict[tuple[str, ...], tuple[int, CgroupHierarchy]] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        root, mount_point = _unescape(lf[3]), _unescape(lf[4])
        fstype, super_opts = rf[0], rf[2]
        if fstype == "cgroup2":
            controllers: tuple[str, ...] = ()
        elif fstype == "cgroup":
            names = [o for o in super_opts.split(",")
                     if o not in _IGNORED_OPTIONS and not o.startswith("release_agent")]
            if not names:
                continue
            controllers = tuple(names)
        else:
            continue
        rank = _root_rank(root)
        if rank is None:
            continue
        held = best.get(controllers)
        if held is None or rank < held[0]:
            best[controllers] = (rank, CgroupHierarchy(mount_point, controllers, normalize(root),
                                                       ns_root_known=rank == 0))
    ordered = sorted(best.values(), key=lambda rh: not rh[1].is_v2)
    return CgroupMounts(tuple(h for _, h in ordered))


# ---- cgroup namespaces -----------------------------------------------------------------------
def _holds_pid(directory: str, pid: int) -> bool:
    text = read_text(os.path.join(directory, "cgroup.procs"))
    return text is not None and str(pid) in text.split()


def find_namespace_root(mount_point: str, ups: int, own_ns_path: str, pid: int,
                        max_dirs: int = 100_000) -> str | None:
    """Absolute path of our cgroup namespace root in a hierarchy mounted `ups` levels above
    it: the directory `ups` levels below the mount from which our own cgroup (`own_ns_path`,
    as /proc/self/cgroup prints it, '..' included) holds `pid`. None if not found or not
    unique."""
    level = [""]
    seen = 0
    for _ in range(ups):
        nxt = []
        for rel in level:
            try:
                with os.scandir(mount_point.rstrip("/") + rel or "/") as it:
                    nxt += [f"{rel}/{e.name}" for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
        seen += len(nxt)
        if seen > max_dirs:
            return None
        level = nxt
    found = set()
    for rel in level:
        own = join_cgroup_path(rel or "/", own_ns_path)  # our cgroup may lie below or beside the root
        if own is not None and _holds_pid(cgroup_dir(mount_point, own), pid):
            found.add(rel or "/")
    # several roots fit only when we were moved out of the namespace root ('..' in our own
    # path) and it has siblings: which one it is cannot be told, so none is guessed
    return found.pop() if len(found) == 1 else None


def place_namespace(mounts: CgroupMounts, own_cgroup_text: str, pid: int) -> CgroupMounts:
    """Place our cgroup namespace root in every hierarchy mounted above it (root "/../..")."""
    own = parse_cgroup_file(own_cgroup_text)
    own_paths = {"": own.unified or "/", **{c: p for c, p in own.v1}}
    placed: list[CgroupHierarchy] = []
    notes: list[str] = list(mounts.notes)
    for h in mounts.hierarchies:
        if h.ns_root_known:
            placed.append(h)
            continue
        own_path = own_paths.get("") if h.is_v2 else next((own_paths[c] for c in h.controllers if c in own_paths), None)
        root = find_namespace_root(h.mount_point, h.ups, own_path or "/", pid) if own_path is not None else None
        name = "v2" if h.is_v2 else ",".join(h.controllers)
        if root is None:
            note = (f"cgroup {name} at {h.mount_point}: our cgroup namespace root could not be placed; "
                    "cgroups outside the namespace have no directory or id here (no cgroup ids for the probes' "
                    "counters, no pause/throttle of other pods)")
            log.warning("%s", note)
            notes.append(note)
            placed.append(h)
        else:
            log.debug("cgroup %s: our cgroup namespace root is %s", name, root)
            placed.append(replace(h, ns_root=root, ns_root_known=True))
    return CgroupMounts(tuple(placed), tuple(notes))


def discover_mounts(proc_root: str = "/proc", pid: int | None = None) -> CgroupMounts:
    """Cgroup hierarchies as this process sees them (empty when mountinfo is unreadable),
    with our cgroup namespace's root placed where the mount shows more than the namespace."""
    text = read_text(os.path.join(proc_root, "self", "mountinfo"))
    if text is None:
        return CgroupMounts()
    mounts = parse_mountinfo(text)
    if all(h.ns_root_known for h in mounts.hierarchies):
        return mounts
    own = read_text(os.path.join(proc_root, "self", "cgroup")) or ""
    return place_namespace(mounts, own, os.getpid() if pid is None else pid)


def own_cgroup_paths(mounts: CgroupMounts, proc_root: str = "/proc") -> frozenset[str]:
    """Every cgroup path of this process (all hierarchies), as hierarchy paths."""
    text = read_text(os.path.join(proc_root, "self", "cgroup"))
    if text is None:
        return frozenset()
    cg = parse_cgroup_file(text)
    paths = [(p, "") for p in [cg.unified] if p is not None] + [(p, c) for c, p in cg.v1]
    return frozenset(q for q in (mounts.absolute(p, c) for p, c in paths) if q != "/")


# ---- cgroup ids ------------------------------------------------------------------------------
def live_cgroup_ids(root: str | Path) -> set[int]:
    """Inode numbers (cgroup ids) of `root` and every directory below it."""
    ids: set[int] = set()
    try:
        ids.add(os.stat(root).st_ino)
    except OSError:
        return ids
    stack = [str(root)]
    while stack:
        path = stack.pop()
        try:
            with os.scandir(path) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        try:
                            ids.add(entry.inode())
                        except OSError:
                            continue
                        stack.append(entry.path)
        except OSError:
            continue  # removed while we walked: its id is gone too
    return ids


class CgroupIdIndex:
    """cgroup id <-> path for the v2 hierarchy, filled lazily and by tree walks.

    `id_for_path` stats one directory. `path_for_id` answers from the index and, on a miss,
    walks the whole tree again, at most once per `rescan_min_interval_s` so a stream of
    unknown ids (short-lived cgroups) cannot turn into a stream of tree walks.
    """

    def __init__(
        self,
        unified_root: str | None,
        clock: Callable[[], float],
        rescan_min_interval_s: float = 2.0,
    ) -> None:
        self.unified_root = unified_root
        self._clock = clock
        self._rescan_min_interval_s = rescan_min_interval_s
        self._by_id: dict[int, str] = {}
        self._by_path: dict[str, int] = {}
        self._last_scan_s: float | None = None
        self.scans = 0

    def id_for_path(self, path: str) -> int | None:
        """Inode of <v2 mount><path>, or None without a v2 mount or if the dir is absent."""
        if self.unified_root is None or "/.." in path:
            # ".." means a cgroup outside a namespace we could not place: no dir of ours names it
            return None
        try:
            ino = os.stat(cgroup_dir(self.unified_root, path)).st_ino
        except OSError:
            self.forget(path)
            return None
        old = self._by_path.get(path)
        if old is not None and old != ino:
            self._by_id.pop(old, None)  # recreated under the same name: a new cgroup
        self._by_path[path] = ino
        self._by_id[ino] = path
        return ino

    def path_for_id(self, cgroup_id: int) -> str | None:
        """Path of a cgroup id, rescanning the tree on a miss (rate-limited)."""
        path = self._by_id.get(cgroup_id)
        if path is not None:
            return path
        now = self._clock()
        if self._last_scan_s is not None and now - self._last_scan_s < self._rescan_min_interval_s:
            return None
        self.rescan()
        return self._by_id.get(cgroup_id)

    def rescan(self) -> None:
        """Walk the v2 tree and rebuild the index (gone cgroups drop out)."""
        self._last_scan_s = self._clock()
        self.scans += 1
        if self.unified_root is None:
            return
        by_id: dict[int, str] = {}
        root = self.unified_root.rstrip("/") or "/"
        try:
            by_id[os.stat(root).st_ino] = "/"
        except OSError:
            self._by_id, self._by_path = {}, {}
            return
        stack = [(root, "")]
        while stack:
            fs_dir, rel = stack.pop()
            try:
                with os.scandir(fs_dir) as it:
                    for entry in it:
                        if not entry.is_dir(follow_symlinks=False):
                            continue
                        sub = f"{rel}/{entry.name}"
                        try:
                            by_id[entry.inode()] = sub
                        except OSError:
                            continue
                        stack.append((entry.path, sub))
            except OSError:
                continue  # removed while walking, or unreadable: skip that subtree
        self._by_id = by_id
        self._by_path = {p: i for i, p in by_id.items()}

    def forget(self, path: str) -> None:
        ino = self._by_path.pop(path, None)
        if ino is not None and self._by_id.get(ino) == path:
            del self._by_id[ino]

    def __len__(self) -> int:
        return len(self._by_id)
