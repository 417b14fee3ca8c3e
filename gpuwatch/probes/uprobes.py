"""Which libcuda entry points get which program, and attaching them to one library file.

Allocation group: entry probes store the arguments, one return program records the result.
Launch group (opt-in): one counter increment per call. Where the kernel has uprobe_multi
links (>= 6.6) one link per (program, entry/return) covers every offset of a file: attach
and detach take milliseconds, where each perf uprobe costs a synchronisation (~90 ms here)
to detach. Perf uprobes remain the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatch.probes import bpfsys
from gpuwatch.probes.bcc_loader import MULTI_SUFFIX

# libcuda symbol -> (program, also attach the return probe)
ALLOC_SYMBOLS: dict[str, tuple[str, bool]] = {
    "cuMemAlloc_v2": ("gw_cu_alloc", True),
    "cuMemAllocManaged": ("gw_cu_alloc", True),
    "cuMemAllocAsync": ("gw_cu_alloc", True),
    "cuMemAllocPitch_v2": ("gw_cu_alloc_pitch", True),
    "cuMemCreate": ("gw_cu_create", True),
    "cuMemFree_v2": ("gw_cu_free", False),
    "cuMemFreeAsync": ("gw_cu_free", False),
    "cuMemRelease": ("gw_cu_free", False),
}
LAUNCH_SYMBOLS: dict[str, tuple[str, bool]] = {
    "cuLaunchKernel": ("gw_cu_launch", False),
    "cuLaunchKernelEx": ("gw_cu_launch", False),
    "cuGraphLaunch": ("gw_cu_graph_launch", False),
}
ALLOC_RET_PROG = "gw_cu_alloc_ret"


def symbol_table(alloc: bool, launch: bool) -> dict[str, tuple[str, bool]]:
    """symbol -> (program, with return probe) for the enabled groups."""
    table: dict[str, tuple[str, bool]] = {}
    if alloc:
        table.update(ALLOC_SYMBOLS)
    if launch:
        table.update(LAUNCH_SYMBOLS)
    return table


def attach_library(progs: Mapping[str, int], path: str, table: Mapping[str, tuple[str, bool]],
                   offsets: Mapping[str, int], use_multi: bool, notes: list[str]) -> list[int]:
    """Attach every symbol of `offsets` in `path`; returns the link/perf fds (close = detach).
    On an error, whatever was attached is detached again before the error propagates."""
    wanted: dict[tuple[str, bool], list[int]] = {}
    for sym, offset in offsets.items():
        prog, with_ret = table[sym]
        wanted.setdefault((prog, False), []).append(offset)
        if with_ret:
            wanted.setdefault((ALLOC_RET_PROG, True), []).append(offset)
    fds: list[int] = []
    try:
        for (prog, ret), offs in wanted.items():
            multi = progs.get(prog + MULTI_SUFFIX) if use_multi else None
            if multi is not None:
                try:
                    fds.append(bpfsys.attach_uprobe_multi(multi, path, offs, retprobe=ret))
                    continue
                except OSError as err:
                    notes.append(f"uprobe_multi refused for {path} ({err}); using perf uprobes")
            for off in offs:
                fds.append(bpfsys.attach_uprobe(progs[prog], path, off, retprobe=ret))
    except OSError:
        bpfsys.close_all(fds)
        raise
    return fds
