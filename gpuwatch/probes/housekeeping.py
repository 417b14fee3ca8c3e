"""Map housekeeping done from user space, off the hot path.

* sweep_stale: fd/allocation entries of exited processes (or closed fds) are recognised by
  their generation numbers and deleted; their bytes were already released in the kernel.
  RM objects whose parent chain no longer leads to a live client or root (a parent or the
  client was freed, or the client's fd closed) are deleted too.
* drop_removed_cgroups: counters of cgroups that no longer exist are deleted, so the
  bounded per-cgroup maps never fill with removed containers.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gpuwatch.containers.cgroupfs import live_cgroup_ids
from gpuwatch.probes import layout
from gpuwatch.probes.bpfsys import BpfMap


def drop_removed_cgroups(maps: Mapping[str, BpfMap], root: Path) -> int:
    """Delete per-cgroup entries whose cgroup (v2 directory under `root`) is gone and holds
    no process state. Returns the number of entries removed."""
    counter_maps = [maps[name] for name in ("gw_ioctls", "gw_uvm_ioctls", "gw_mem", "gw_limits", "gw_launches")
                    if name in maps]
    # keys first, then the tree: a cgroup created in between has no key in our list (every
    # key of these maps starts with the u64 cgroup id)
    keyed = [(m, key, struct.unpack_from("<Q", key, 0)[0]) for m in counter_maps for key in list(m.keys())]
    held = {layout.GwTgidState.from_buffer_copy(v).cgroup_id for _, v in maps["gw_tgids"].items()}
    alive = live_cgroup_ids(root) | held
    return sum(m.delete(key) for m, key, cg in keyed if cg not in alive)


def sweep_stale(maps: Mapping[str, BpfMap]) -> int:
    """Delete fd/allocation/device-handle entries that no longer match a live process (or
    fd) generation. Returns the number of entries removed."""
    gens: dict[int, int] = {}
    for key, value in maps["gw_tgids"].items():
        gens[struct.unpack("<I", key)[0]] = layout.GwTgidState.from_buffer_copy(value).gen
    removed = 0
    fd_gens: dict[tuple[int, int], int] = {}
    fds = maps["gw_fds"]
    for key, value in fds.items():
        fk = layout.GwFdKey.from_buffer_copy(key)
        fv = layout.GwFdVal.from_buffer_copy(value)
        if gens.get(fk.tgid) != fv.tgid_gen:
            removed += fds.delete(key)
        else:
            fd_gens[(fk.tgid, fk.fd)] = fv.fd_gen
    clients: dict[tuple[int, int], int] = {}
    for key, value in maps["gw_clients"].items():
        ck = layout.GwClientKey.from_buffer_copy(key)
        cv = layout.GwClientVal.from_buffer_copy(value)
        if gens.get(ck.tgid) != cv.tgid_gen or fd_gens.get((ck.tgid, cv.fd)) != cv.fd_gen:
            removed += maps["gw_clients"].delete(key)
        else:
            clients[(ck.tgid, ck.h_client)] = cv.gen
    removed += _sweep_objects(maps["gw_rm"], gens, fd_gens, clients)
    removed += _sweep(maps["gw_cuda"], layout.GwCudaKey, layout.GwCudaVal,
                      lambda k, v: gens.get(k.tgid) == v.tgid_gen)
    return removed


def _sweep_objects(objects: BpfMap, gens: dict[int, int], fd_gens: dict[tuple[int, int], int],
                   clients: dict[tuple[int, int], int]) -> int:
    """Delete RM objects that are no longer live: their process or accounting fd is gone, or a
    link of their parent chain (parent generation) no longer matches up to a live client or
    root object. Their bytes were already released in the kernel."""
    entries: dict[tuple[int, int, int], tuple[bytes, layout.GwRmVal]] = {}
    for key, value in objects.items():
        k = layout.GwRmKey.from_buffer_copy(key)
        entries[(k.tgid, k.h_root, k.h_object)] = (key, layout.GwRmVal.from_buffer_copy(value))
    live: dict[tuple[int, int, int], bool] = {}

    def is_live(ident: tuple[int, int, int], depth: int = 0) -> bool:
        if ident in live:
            return live[ident]
        tgid, h_root, _ = ident
        v = entries[ident][1]
        ok = gens.get(tgid) == v.tgid_gen and fd_gens.get((tgid, v.fd)) == v.fd_gen
        if ok and v.parent_gen != 0:
            parent = (tgid, h_root, v.h_parent)
            if v.h_parent == h_root:
                ok = clients.get((tgid, h_root)) == v.parent_gen
            else:
                ok = (parent in entries and entries[parent][1].gen == v.parent_gen
                      and depth < layout.GW_RM_DEPTH and is_live(parent, depth + 1))
        live[ident] = ok
        return ok

    return sum(objects.delete(key) for ident, (key, _) in entries.items() if not is_live(ident))


def _sweep(m: BpfMap, key_t: type[ctypes.Structure], val_t: type[ctypes.Structure],
           keep: Callable[[Any, Any], bool]) -> int:
    removed = 0
    for key, value in m.items():
        if not keep(key_t.from_buffer_copy(key), val_t.from_buffer_copy(value)):
            removed += m.delete(key)
    return removed
