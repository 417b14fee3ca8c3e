"""GPU backends: the GpuBackend protocol and its NVML implementation (the one pynvml user)."""
