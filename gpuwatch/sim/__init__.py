"""Simulated GPU node: fake libnvidia-ml + stub libcuda (C) + workload driver.

Public entry points: `build_sim_libraries`, `up`, `down`, `get_node`, `status`, `engine`,
`inject_fault`, `sim_env`, `preload_fake_nvml` (see node.py and build.py); `TOPOLOGIES`
and `FAULT_KINDS` name what `up(topology=...)` and `inject_fault(kind=...)` accept.
The workload behind `gpuwatch sim run` (with its progress model) is in workload.py.
"""

from gpuwatch.sim.build import SimLibraries, build_sim_libraries
from gpuwatch.sim.node import (
    FAULT_KINDS,
    TOPOLOGIES,
    SimDevice,
    SimEngine,
    SimNode,
    SimProcess,
    SimStatus,
    down,
    engine,
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
    "SimEngine",
    "SimLibraries",
    "SimNode",
    "SimProcess",
    "SimStatus",
    "build_sim_libraries",
    "down",
    "engine",
    "get_node",
    "inject_fault",
    "preload_fake_nvml",
    "sim_env",
    "status",
    "up",
]
