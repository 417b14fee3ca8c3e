"""GPU index -> device numbers, from the device nodes themselves (never hard-coded).

The device gate judges accesses by (major, minor), so it needs the numbers of every GPU
node: `<prefix>N` (default /dev/nvidia0, /dev/nvidia1...; real NVIDIA is major 195) stat()ed
each time the gate is updated (a node that appears later is picked up then). A number the
gate cannot tell apart from a non-GPU node is left ungated (allowed) and reported, rather
than risk denying it: numbers shared by two GPU indices, by a non-GPU node in the same
directory (nvidiactl), or by a char device directly under /dev (the simulated node makes all
its nodes with /dev/null's numbers 1:3 — gating those would deny /dev/null).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field

from gpuwatch.probes.layout import GW_GATE_MAX_GPUS, GW_GATE_MAX_NODES

DevNum = tuple[int, int]


@dataclass(frozen=True)
class GpuNodes:
    """GPU index -> (major, minor) of the nodes the gate can judge, plus what it cannot."""

    numbers: dict[int, DevNum] = field(default_factory=dict)
    ungated: dict[int, str] = field(default_factory=dict)  # index -> why it is not judged


def _char_numbers(path: str) -> DevNum | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def _numbers_in(directory: str, skip: set[str]) -> dict[DevNum, str]:
    """Char device numbers of the entries of `directory` (not following subdirectories)."""
    out: dict[DevNum, str] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return out
    for name in names:
        path = os.path.join(directory, name)
        if path in skip:
            continue
        nums = _char_numbers(path)
        if nums is not None:
            out.setdefault(nums, path)
    return out


def resolve_gpu_nodes(prefix: str, dev_dir: str = "/dev") -> GpuNodes:
    """stat() every `<prefix>N`; keep the numbers that identify exactly one GPU node."""
    directory, base = os.path.split(prefix)
    directory = directory or "."
    pattern = re.compile(re.escape(base) + r"(\d+)")
    found: dict[int, DevNum] = {}
    gpu_paths: set[str] = set()
    ungated: dict[int, str] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        index, path = int(match.group(1)), os.path.join(directory, name)
        gpu_paths.add(path)
        nums = _char_numbers(path)
        if nums is None:
            ungated[index] = f"{path} is not a char device"
        elif index >= GW_GATE_MAX_GPUS:
            ungated[index] = f"{path}: index above {GW_GATE_MAX_GPUS - 1}"
        else:
            found[index] = nums
    others = _numbers_in(directory, gpu_paths)
    if os.path.realpath(directory) != os.path.realpath(dev_dir):
        for nums, path in _numbers_in(dev_dir, gpu_paths).items():
            others.setdefault(nums, path)
    owners: dict[DevNum, list[int]] = {}
    for index, nums in found.items():
        owners.setdefault(nums, []).append(index)
    numbers: dict[int, DevNum] = {}
    for index, nums in sorted(found.items()):
        label = f"{prefix}{index} ({nums[0]}:{nums[1]})"
        if len(owners[nums]) > 1:
            ungated[index] = f"{label} shares its numbers with GPUs {owners[nums]}"
        elif nums in others:
            ungated[index] = f"{label} shares its numbers with {others[nums]}"
        elif len(numbers) >= GW_GATE_MAX_NODES:
            ungated[index] = f"{label}: more than {GW_GATE_MAX_NODES} GPU nodes"
        else:
            numbers[index] = nums
    return GpuNodes(numbers=numbers, ungated=ungated)
