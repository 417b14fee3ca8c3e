"""Simulated GPU node: fake libnvidia-ml + stub libcuda (C) + workload driver.

Public entry points: `build_sim_libraries`, `up`, `down`, `get_node`, `status`,
`inject_fault`, `sim_env`, `preload_fake_nvml` (see node.py and build.py); `TOPOLOGIES`
and `FAULT_KINDS` name what `up(topology=...)` and `inject_fault(kind=...)` accept.
"""

from gpuwatch.sim.build import SimLibraries, build_sim_libraries
from gpuwatch.sim.node import (
    FAULT_KINDS,
    TOPOLOGIES,
    SimDevice,
    SimNode,
    SimProcess,
    SimStatus,
    down,
    get_node,
    inject_fault,
    preload_fake_nvml,
    sim_env,
    status,
    up,
)

__all__ = [
    "FAULT_KINDS",
    "TOPOLOGIES",
    "SimDevice",
    "SimLibraries",
    "SimNode",
    "SimProcess",
    "SimStatus",
    "build_sim_libraries",
    "down",
    "get_node",
    "inject_fault",
    "preload_fake_nvml",
    "sim_env",
    "status",
    "up",
]
