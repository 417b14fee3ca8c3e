"""What this host supports, and how to fix what it lacks (behind `gpuwatch doctor`).

Each check returns a `Check`: a status, what was found, what the user loses when it is
missing, and the fix. Checks only look (files, PATH, dlopen); they never change the host.
Filesystem roots are injectable so the checks are unit-testable on fixture trees.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gpuwatch.containers.cgroup_path import normalize_path, parse_cgroup_path
from gpuwatch.containers.cgroupfs import discover_mounts
from gpuwatch.containers.pidcgroup import cgroup_choice
from gpuwatch.containers.procfs import read_text
from gpuwatch.core.errors import ProbesUnavailable
from gpuwatch.probes.bcc_loader import BUNDLED_HEADERS, HOST_MERGED_HEADERS, KernelHeaders, find_kernel_headers

KERNEL_HEADERS_FALLBACK = str(HOST_MERGED_HEADERS)


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"  # optional capability missing: something is off, the rest works
    FAIL = "fail"  # the main job cannot run as asked


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    found: str
    loses: str = ""
    fix: str = ""


@dataclass(frozen=True)
class HostRoots:
    """Where to look; tests point these at fixture trees."""

    sys_root: str = "/sys"
    proc_root: str = "/proc"
    lib_modules: str = "/lib/modules"
    kernel_headers_fallback: str = KERNEL_HEADERS_FALLBACK  # the host's merged tree (deploy/setup.sh)
    bundled_kernel_headers: str = str(BUNDLED_HEADERS)  # the agent image's own tree


def check_root(euid: int | None = None) -> Check:
    uid = os.geteuid() if euid is None else euid
    if uid == 0:
        return Check("root", Status.OK, "running as root")
    return Check("root", Status.WARN, f"running as uid {uid}",
                 loses="BPF probes, cgroup enforcement and reading other users' /proc entries",
                 fix="run the agent as root (sudo gpuwatch agent) or in the privileged DaemonSet")


def check_nvml(loader: Callable[[str], object] = ctypes.CDLL) -> Check:
    override = os.environ.get("GPUWATCH_NVML_LIBRARY")
    name = override or "libnvidia-ml.so.1"
    try:
        loader(name)
    except OSError as err:
        return Check("nvml", Status.WARN, f"{name} not loadable ({err})",
                     loses="real GPU data (no NVIDIA driver on this host)",
                     fix="install the NVIDIA driver (its libnvidia-ml.so.1), or try the simulation: "
                         "gpuwatch sim up && gpuwatch quickstart")
    what = f"{name} (GPUWATCH_NVML_LIBRARY)" if override else name
    return Check("nvml", Status.OK, f"{what} loads")


def check_bcc(find_spec: Callable[[str], object] = importlib.util.find_spec) -> Check:
    spec = find_spec("bcc")
    if spec is None:
        return Check("bcc", Status.WARN, "python module `bcc` not importable",
                     loses="kernel probes: per-container ioctl/allocation counts and in-kernel enforcement",
                     fix="apt-get install python3-bpfcc (never `pip install bcc`: an unrelated package); "
                         "use a venv made with --system-site-packages")
    origin = getattr(spec, "origin", "") or ""
    if "dist-packages" not in origin and "bcc" in origin and "site-packages" in origin:
        return Check("bcc", Status.WARN, f"`bcc` at {origin} looks like PyPI's unrelated `bcc` package",
                     loses="kernel probes",
                     fix="pip uninstall bcc; apt-get install python3-bpfcc")
    return Check("bcc", Status.OK, f"bcc at {origin or 'unknown location'}")


def kernel_headers(roots: HostRoots = HostRoots(), release: str | None = None) -> KernelHeaders:
    """The kernel headers BCC will compile against and where they come from (the agent's own
    choice: probes/bcc_loader.find_kernel_headers); ProbesUnavailable when there are none."""
    return find_kernel_headers(release or platform.release(), lib_modules=Path(roots.lib_modules),
                               host_merged=Path(roots.kernel_headers_fallback),
                               bundled=Path(roots.bundled_kernel_headers))


def kernel_headers_dir(roots: HostRoots = HostRoots(), release: str | None = None) -> str | None:
    """The kernel header tree BCC should use, or None when there is none (or BCC_KERNEL_SOURCE
    names no directory)."""
    try:
        return kernel_headers(roots, release).path
    except ProbesUnavailable:
        return None


def check_kernel_headers(roots: HostRoots = HostRoots(), release: str | None = None) -> Check:
    """Which header tree BCC compiles against, and from where: BCC_KERNEL_SOURCE, the host's
    /lib/modules, the host's merged tree (deploy/setup.sh) or the agent image's bundled tree."""
    try:
        found = kernel_headers(roots, release)
    except ProbesUnavailable as err:
        return Check("kernel-headers", Status.WARN, err.message.removeprefix("BPF probes off: "),
                     loses="kernel probes (BCC compiles its programs against kernel headers)",
                     fix="run the agent image (it carries headers); on a host: apt-get install "
                         "linux-headers-amd64, then `bash deploy/setup.sh install` (merges Debian's "
                         "split header tree for BCC); or set BCC_KERNEL_SOURCE to a header tree")
    return Check("kernel-headers", Status.OK, found.describe())


def check_btf(roots: HostRoots = HostRoots()) -> Check:
    if Path(roots.sys_root, "kernel/btf/vmlinux").exists():
        return Check("btf", Status.OK, "/sys/kernel/btf/vmlinux present")
    return Check("btf", Status.WARN, "kernel BTF missing",
                 loses="nothing today (probes use tracepoint args and uprobe registers only)",
                 fix="a kernel built with CONFIG_DEBUG_INFO_BTF=y")


def cgroup_mode(proc_root: str = "/proc") -> tuple[str, str | None]:
    """('v2'|'hybrid'|'v1'|'none', cgroup2 mount point or None), from containers/cgroupfs.py."""
    mounts = discover_mounts(proc_root)
    return mounts.mode, mounts.unified


def check_cgroups(roots: HostRoots = HostRoots()) -> Check:
    mounts = discover_mounts(roots.proc_root)
    mode, mount = mounts.mode, mounts.unified
    if mode not in ("v2", "hybrid"):
        return Check("cgroups", Status.WARN, f"cgroup mode {mode}",
                     loses="cgroup ids for BPF attribution, cgroup.freeze and cgroup.kill",
                     fix="boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1) or hybrid mode")
    found = f"{mode} (cgroup2 at {mount})"
    v2 = mounts.unified_hierarchy
    if v2 is not None and v2.mount_root != "/":
        if not v2.ns_root_known:
            return Check("cgroups", Status.WARN, f"{found}, own cgroup namespace not placed in the host's hierarchy",
                         loses="cgroup ids and directories of containers outside the agent's cgroup namespace: "
                               "per-container probe counters, pause/throttle of other pods",
                         fix="run the agent with the host PID namespace and the host's /sys/fs/cgroup mounted")
        found += f", own cgroup namespace rooted at {v2.ns_root}"
    return Check("cgroups", Status.OK, found)


def containers_without_own_v2_cgroup(proc_root: str = "/proc") -> dict[str, str]:
    """Container display name -> its processes' v2 cgroup, for every running container whose
    identifying cgroup (a v1 controller's, on a hybrid host) is not the v2 cgroup its
    processes are in: the probes count them elsewhere (joined per process) and the enforcer
    refuses in-kernel limits for them."""
    mounts = discover_mounts(proc_root)
    found: dict[str, str] = {}
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        text = read_text(f"{entry.path}/cgroup")
        if text is None:
            continue
        choice = cgroup_choice(text, mounts)
        identity = parse_cgroup_path(normalize_path(choice.path))
        unified = normalize_path(choice.unified) if choice.unified is not None else None
        if identity.is_container and unified != identity.cgroup_path:
            found.setdefault(identity.display_name, unified or "(no v2 line)")
    return found


def check_v2_identity(roots: HostRoots = HostRoots()) -> Check:
    """Hybrid hosts: do the probes' cgroups (v2) and identity name the same containers?"""
    if discover_mounts(roots.proc_root).mode != "hybrid":
        return Check("v2 identity", Status.OK, "not a hybrid host: every container's probes count in its own cgroup")
    odd = containers_without_own_v2_cgroup(roots.proc_root)
    if not odd:
        return Check("v2 identity", Status.OK, "hybrid host; every running container has a v2 cgroup of its own")
    shown = ", ".join(f"{name} (v2 {where})" for name, where in sorted(odd.items())[:5])
    more = f" and {len(odd) - 5} more" if len(odd) > 5 else ""
    return Check("v2 identity", Status.WARN,
                 f"hybrid host; {len(odd)} container(s) named by a v1 cgroup, not a v2 cgroup of their own: "
                 f"{shown}{more}",
                 loses="in-kernel memory limits for them are refused (audit: refuse-inkernel); their probe bytes "
                       "are joined per process, their ioctl counts stay with the shared cgroup",
                 fix="run the runtime with cgroup v2 (or the systemd driver), so each container has its own v2 cgroup")


def check_tracepoints(roots: HostRoots = HostRoots()) -> Check:
    for base in ("kernel/tracing", "kernel/debug/tracing"):
        if Path(roots.sys_root, base, "events/syscalls/sys_enter_ioctl").exists():
            return Check("tracepoints", Status.OK, f"syscall tracepoints under /sys/{base}")
    return Check("tracepoints", Status.WARN, "syscall tracepoints not visible",
                 loses="ioctl accounting (device opens, RM_ALLOC/RM_FREE bytes per container)",
                 fix="mount tracefs (mount -t tracefs nodev /sys/kernel/tracing) and run as root")


def check_binary(name: str, package: str, loses: str,
                 which: Callable[[str], str | None] = shutil.which) -> Check:
    path = which(name) or which(f"/usr/sbin/{name}")
    if path:
        return Check(name, Status.OK, path)
    return Check(name, Status.WARN, f"`{name}` not found", loses=loses, fix=f"apt-get install {package}")


def run_all(roots: HostRoots = HostRoots()) -> list[Check]:
    """Every check, in the order `gpuwatch doctor` prints them."""
    return [
        check_root(),
        check_nvml(),
        check_bcc(),
        check_kernel_headers(roots),
        check_btf(roots),
        check_cgroups(roots),
        check_v2_identity(roots),
        check_tracepoints(roots),
        check_binary("runc", "runc", "simulated workloads in real containers (gpuwatch sim, tests)"),
        check_binary("cc", "gcc libc6-dev", "the simulated GPU node (its C libraries are built on demand)"),
        check_binary("prometheus", "prometheus", "the Prometheus system tests and dashboard checks"),
        check_binary("promtool", "prometheus", "checking alert rules and metric names"),
        check_binary("prometheus-alertmanager", "prometheus-alertmanager",
                     "alert-driven enforcement tests"),
    ]
