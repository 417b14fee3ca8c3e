"""GPU pair scores for topology-aware placement (pure).

The table is the one NVIDIA's device plugin allocator scores GPU pairs with, so a
scheduler that reads `gpuwatch_gpu_pair_score` ranks GPU sets the way the allocator that
finally hands out the devices does: by PCIe common ancestor -- cross-CPU 10, same CPU
(NUMA node) 20, same host bridge 30, several PCIe switches 40, one PCIe switch 50, same
board 60 -- plus 100 per NVLink between the two GPUs (direct or through NVSwitches).
"""

from __future__ import annotations

from gpuwatch.core.model import GpuLink, TopologyLevel

_LEVEL_SCORES = {
    TopologyLevel.INTERNAL: 60,
    TopologyLevel.SINGLE: 50,
    TopologyLevel.MULTIPLE: 40,
    TopologyLevel.HOSTBRIDGE: 30,
    TopologyLevel.NODE: 20,
    TopologyLevel.SYSTEM: 10,
}
NVLINK_SCORE = 100


def pair_score(link: GpuLink) -> int:
    """The allocator's score of one GPU pair (0 when the PCIe level is unknown and no NVLink)."""
    base = _LEVEL_SCORES.get(link.level, 0) if link.level is not None else 0
    return base + NVLINK_SCORE * max(link.nvlinks, 0)
