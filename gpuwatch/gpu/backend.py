"""The GPU backend protocol: one read of everything the sampler needs per interval.

The sampler depends on this protocol only; `NvmlBackend` (gpu/nvml.py) implements it
over the NVIDIA Management Library and tests implement it with fakes. A sweep is one
consistent pass over all devices: device state, per-process memory (compute and
graphics) and per-process SM utilisation.

Failure contract:
* a field NVML cannot read is ``None`` in the returned model (N/A), and the sweep's
  ``errors`` names it -- a sweep never fails because one field did;
* a sweep that cannot be taken at all (driver gone, simulated node down) raises a
  `gpuwatch.core.errors.GpuwatchError` (`NvmlCallFailed`); the sampler then reports the GPU
  backend as down and recreates the backend through its factory.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpuwatch.core.model import GpuSweep


@runtime_checkable
class GpuBackend(Protocol):
    """Something that can read the node's GPUs, once per sample interval."""

    def sweep(self) -> GpuSweep:
        """Read devices, per-process memory and per-process SM utilisation.

        Raises `GpuwatchError` when no sweep is possible at all.
        """
        ...

    def close(self) -> None:
        """Release the backend (e.g. nvmlShutdown). Never raises."""
        ...
