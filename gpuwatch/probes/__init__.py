"""Kernel probes: per-cgroup GPU driver ioctl and libcuda accounting with BPF.

`ProbeManager(ProbeConfig(...))` is the entry point (gpuwatch.probes.manager). BCC is
imported only by bcc_loader, in a short-lived child process; the agent itself keeps file
descriptors and reads maps with bpf() syscalls (bpfsys).
"""
