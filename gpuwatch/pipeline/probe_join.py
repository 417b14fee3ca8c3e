"""Probe counters joined to containers one process at a time, where cgroups cannot be (pure).

The kernel probes count per cgroup v2 id (bpf_get_current_cgroup_id). Identity names a
process from every line of /proc/<pid>/cgroup, and on a hybrid host (v1 controllers plus a
v2 hierarchy) the line that names the container may be a v1 controller's: a runtime that
manages v1 only leaves its containers' processes in the v2 root, in its own service's
cgroup, or in a parent shared by several containers (docker with the cgroupfs driver puts
every container in one v2 cgroup). Joined by cgroup, their probe bytes would go to "/" or to
the service while NVML's go to the container, and the probe-vs-NVML cross-check would never
meet them.

`needs_process_join` says when that can happen (a GPU process whose v2 cgroup is not the
path that names it); `join_process_probes` then re-joins every counter with the per-process
live bytes the probes keep (gw_tgids), through the same resolver identities NVML's
processes get:

* a cgroup whose GPU processes all belong to one container that is not the cgroup's own
  identity (the v1-named workload alone in the v2 root): the whole counter -- bytes, ioctl
  and allocation counts -- is that container's;
* a cgroup shared by several (or by a container and others): each container's bytes (per
  GPU, decoded RM and libcuda) are the sum over its processes, in a counter of its own; the
  shared cgroup keeps the rest of the bytes and every count (the kernel counts calls per
  cgroup, not per process: a shared cgroup's counts cannot be split honestly).

A joined counter no single cgroup holds gets a negative `cgroup_id` (-1, -2, ... in container
key order; real cgroup ids are inode numbers, never negative), so every consumer that pairs
`Snapshot.probe_counters` with `probe_identities` by id works unchanged. Counters of one
container from several cgroups are summed into one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from gpuwatch.core.model import ContainerIdentity, ProbeCounters, ProcessIdentity, ProcessProbe

ProbeIdentities = tuple[tuple[int, ContainerIdentity], ...]


def needs_process_join(processes: Iterable[ProcessIdentity]) -> bool:
    """True when some process's v2 cgroup (where the probes count it) is not the cgroup path
    that names it: only then can a cgroup's counters belong to another container."""
    return any(p.unified_path != p.identity.cgroup_path for p in processes)


def join_process_probes(counters: Sequence[ProbeCounters], probe_identities: ProbeIdentities,
                        processes: Sequence[ProcessProbe], identities: Mapping[int, ProcessIdentity]
                        ) -> tuple[tuple[ProbeCounters, ...], ProbeIdentities]:
    """(counters, identities by cgroup id) with every process's bytes on its own container
    (module docstring). Processes without an identity (exited) stay with their cgroup."""
    own = dict(probe_identities)
    by_cgroup: dict[int, list[ProcessProbe]] = {}
    for proc in processes:
        by_cgroup.setdefault(proc.cgroup_id, []).append(proc)
    kept: list[ProbeCounters] = []
    kept_ids: dict[int, ContainerIdentity] = {}
    moved: dict[str, list[ProbeCounters]] = {}  # container key -> counters (whole or split) now its
    moved_identity: dict[str, ContainerIdentity] = {}
    for counter in counters:
        cg_identity = own.get(counter.cgroup_id)
        groups: dict[str, list[ProcessProbe]] = {}
        unresolved = False
        for proc in by_cgroup.get(counter.cgroup_id, ()):
            pident = identities.get(proc.tgid)
            if pident is None:
                unresolved = True
                continue
            groups.setdefault(pident.identity.key, []).append(proc)
            moved_identity.setdefault(pident.identity.key, pident.identity)
        own_key = cg_identity.key if cg_identity is not None else None
        foreign = {key: procs for key, procs in groups.items() if key != own_key}
        if not foreign:
            kept.append(counter)
            if cg_identity is not None:
                kept_ids[counter.cgroup_id] = cg_identity
            continue
        if len(groups) == 1 and not unresolved:  # one container, alone in another's cgroup: all of it
            (key,) = foreign
            moved.setdefault(key, []).append(counter)
            continue
        rest = counter
        for key, procs in foreign.items():
            share = _bytes_of(procs, counter)
            moved.setdefault(key, []).append(share)
            rest = _minus_bytes(rest, share)
        kept.append(rest)
        if cg_identity is not None:
            kept_ids[counter.cgroup_id] = cg_identity
    for counter in list(kept):  # a container's own cgroup and what was joined to it: one counter
        identity = kept_ids.get(counter.cgroup_id)
        if identity is not None and identity.key in moved:
            moved[identity.key].insert(0, counter)
            kept.remove(counter)
    out = list(kept)
    out_ids = [(cg, kept_ids[cg]) for cg in (c.cgroup_id for c in kept) if cg in kept_ids]
    for n, key in enumerate(sorted(moved), start=1):
        joined = dataclasses.replace(_sum(moved[key]), cgroup_id=-n)
        out.append(joined)
        out_ids.append((-n, moved_identity[key]))
    return tuple(out), tuple(out_ids)


def _bytes_of(procs: Iterable[ProcessProbe], template: ProbeCounters) -> ProbeCounters:
    """A counter with the processes' live bytes only (no counts: those are per cgroup)."""
    rm: dict[int, int] = {}
    cuda = 0
    for proc in procs:
        for gpu, size in proc.allocated_bytes_by_gpu:
            rm[gpu] = rm.get(gpu, 0) + size
        cuda += proc.cuda_allocated_bytes
    return ProbeCounters(cgroup_id=template.cgroup_id, allocated_bytes_by_gpu=tuple(sorted(rm.items())),
                         launches_total=None if template.launches_total is None else 0,
                         graph_launches_total=None if template.graph_launches_total is None else 0,
                         cuda_allocated_bytes=None if template.cuda_allocated_bytes is None else cuda)


def _minus_bytes(counter: ProbeCounters, share: ProbeCounters) -> ProbeCounters:
    """The counter with a share's live bytes taken out (never below zero)."""
    taken = dict(share.allocated_bytes_by_gpu)
    rm = tuple((gpu, max(size - taken.get(gpu, 0), 0)) for gpu, size in counter.allocated_bytes_by_gpu)
    cuda = counter.cuda_allocated_bytes
    if cuda is not None:
        cuda = max(cuda - (share.cuda_allocated_bytes or 0), 0)
    return dataclasses.replace(counter, allocated_bytes_by_gpu=rm, cuda_allocated_bytes=cuda)


def _sum(counters: Sequence[ProbeCounters]) -> ProbeCounters:
    """One counter adding up several (bytes per GPU, counts per op, totals)."""
    if len(counters) == 1:
        return counters[0]

    def by_name(field: str) -> tuple[tuple[str, int], ...]:
        acc: dict[str, int] = {}
        for c in counters:
            for name, n in getattr(c, field):
                acc[name] = acc.get(name, 0) + n
        return tuple(sorted(acc.items()))

    def optional(field: str) -> int | None:
        values = [getattr(c, field) for c in counters if getattr(c, field) is not None]
        return sum(values) if values else None

    rm: dict[int, int] = {}
    for c in counters:
        for gpu, size in c.allocated_bytes_by_gpu:
            rm[gpu] = rm.get(gpu, 0) + size
    return ProbeCounters(
        cgroup_id=counters[0].cgroup_id,
        ioctl_calls_by_op=by_name("ioctl_calls_by_op"),
        ioctl_failures_total=sum(c.ioctl_failures_total for c in counters),
        allocated_bytes_by_gpu=tuple(sorted(rm.items())),
        allocations_total=sum(c.allocations_total for c in counters),
        frees_total=sum(c.frees_total for c in counters),
        allocation_failures_total=sum(c.allocation_failures_total for c in counters),
        launches_total=optional("launches_total"),
        cuda_allocated_bytes=optional("cuda_allocated_bytes"),
        cuda_allocations_total=sum(c.cuda_allocations_total for c in counters),
        cuda_frees_total=sum(c.cuda_frees_total for c in counters),
        cuda_oom_total=sum(c.cuda_oom_total for c in counters),
        ioctl_failures_by_op=by_name("ioctl_failures_by_op"),
        graph_launches_total=optional("graph_launches_total"),
        uvm_ioctl_calls_by_cmd=by_name("uvm_ioctl_calls_by_cmd"),
    )
