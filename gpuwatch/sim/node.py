"""Bring a simulated GPU node up and down, read its ledger, inject faults.

A node is three things: a state file in /dev/shm (the "GPU": devices, per-process
memory ledger, busy time, events), a sim root directory (device nodes named like the
real ones, workload progress files, node.json) and a build of the native libraries.
Everything here talks to the state file through the gpuwatchsim_* helpers exported by
the fake libnvidia-ml, so the layout has exactly one definition (csrc/simstate.h).

Kernels on one simulated GPU contend for its execution engine (csrc/simstate.h): one
context runs at a time, time-sliced (`timeslice_ms`), or up to `mps` at once in the
MPS-like mode; `engine(node, gpu)` tells who holds it and how often it changed hands.

The stub libcuda issues the driver traffic a real NVIDIA driver sees (README "Driver
traffic"); how a process allocates -- RM_ALLOC or VID_HEAP_CONTROL, one driver
allocation per cuMemAlloc or chunks, the context's own memory, how a context ends -- is
chosen per process through the environment `driver_env` builds.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.core.errors import SimError
from gpuwatch.sim.build import SimLibraries, build_sim_libraries

DEFAULT_NAME = "default"
DEFAULT_MODEL = "H100 80GB HBM3"
DEFAULT_MEMORY_BYTES = 80 * 1024**3
MAX_DEVICES = 8
FAULT_KINDS = {"xid": 0, "lost": 1, "ecc": 2, "clear": 3, "row-remap-failure": 4}
_LOST_QUIET = 5  # lost without a kernel-log record: the node is being taken down
RM_ALLOC_LAYOUTS = {"nvos64": 0, "nvos21": 1}
TOPOLOGIES = {"pcie": 0, "nvlink-pairs": 1, "nvswitch": 2}
MAX_MPS_LANES = 8  # SIM_MAX_LANES
DEFAULT_TIMESLICE_MS = 2.0  # SIM_DEFAULT_TIMESLICE_US
_NULL_MAJOR_MINOR = (1, 3)  # /dev/null: opens and ioctls succeed harmlessly (ENOTTY)
_ZERO_MAJOR_MINOR = (1, 5)  # /dev/zero for nvidia-uvm: ioctls fail harmlessly, mmap works (managed ranges)
ALLOC_PATHS = ("rm-alloc", "vid-heap")  # how the stub creates memory objects
CTX_TEARDOWNS = ("free-device", "free-client", "close-fd")  # how a process's last cuCtxDestroy ends its client
MAX_DRIVER_MIB = 1 << 20  # the stub's bound on --suballoc-mib / --context-mib
RM_PARAMS_SIZES = ("zero", "class")  # what RM_ALLOC says in paramsSize: 0 (real libcuda 580) or the class's size
# The defaults follow real CUDA (H100, driver 580.159.04, CUDA 13.0; gpuwatch/sim/README.md
# "Driver traffic", tests/system/test_sim_real_shape.py): NVML counts 518 MiB per process after
# cuCtxCreate, and a cuMemAlloc below 2 MiB is carved from a 2 MiB memory object.
DEFAULT_CONTEXT_MIB = 518
DEFAULT_SUBALLOC_MIB = 2
_NOT_UP_FIX = "run `gpuwatch sim up`"
# NVML's process-utilisation sample period: NVML documents "between 1 second and 1/6 second
# depending on the product" (nvmlDeviceGetProcessUtilization); the sim takes 1/6 s (csrc/simstate.h
# SIM_DEFAULT_SAMPLE_PERIOD_NS), a ring of 72 periods per GPU as the real driver keeps.
DEFAULT_SAMPLE_PERIOD_MS = 1000.0 / 6
SAMPLE_RING_PERIODS = 72  # SIM_SAMPLE_RING
# What each fake NVML call costs in CPU of the calling thread (csrc/nvml.c "cost model"):
# "off" (default) or "h100-580" (an H100 with driver 580, ../shared/real-gpu/README.md section 3).
NVML_COST_MODELS = {"off": 0, "h100-580": 1}
# What a running kernel does to the host thread that launched it (csrc/simstate.h
# SIM_KERNEL_HOST_*): "spin" (default) burns one host CPU per busy GPU; "sleep" sleeps in
# 0.5 ms steps -- a node with enough host CPU per GPU, as real nodes have (8-16+ cores per
# GPU), where many busy simulated GPUs on a small machine do not slow each other's jobs.
KERNEL_HOST_MODES = {"spin": 0, "sleep": 1}


@dataclass(frozen=True)
class SimNode:
    """Where one simulated node lives."""

    name: str
    state_path: Path
    root: Path
    libraries: SimLibraries
    device_count: int
    topology: str = "pcie"  # one of TOPOLOGIES
    mps: int = 1  # kernels of up to this many contexts run at once per GPU (1: time-sliced)
    timeslice_ms: float = DEFAULT_TIMESLICE_MS  # run time after which a kernel yields to waiters
    sample_period_ms: float = DEFAULT_SAMPLE_PERIOD_MS  # NVML process-utilisation sample period
    nvml_cost: str = "off"  # one of NVML_COST_MODELS: CPU each fake NVML call burns
    kernel_host: str = "spin"  # one of KERNEL_HOST_MODES: what a kernel does to its host thread

    @property
    def dev_dir(self) -> Path:
        return self.root / "dev"

    @property
    def progress_dir(self) -> Path:
        return self.root / "progress"

    @property
    def kmsg_path(self) -> Path:
        """The node's kernel log: one /dev/kmsg-format record per Xid, appended atomically."""
        return self.root / "kmsg"


@dataclass(frozen=True)
class SimDevice:
    """One simulated device as the state file records it."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    minor: int
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int  # busy share of the last second, as NVML reports it
    lost: bool
    ecc_corrected_volatile: int
    ecc_uncorrected_volatile: int
    row_remap_failure: bool = False
    row_remap_pending: bool = False
    remapped_rows_uncorrectable: int = 0
    device_instance: int = 0  # RM's device instance (NV0080 deviceId): reversed order, not the minor
    gpu_id: int = 0  # CARD_INFO / GET_ID_INFO_V2 gpu_id (PCI bus << 8)


@dataclass(frozen=True)
class SimProcess:
    """One (live process, device) pair in the ledger."""

    host_pid: int  # pid in the caller's PID namespace (0: alive but not visible from here)
    ns_pid: int  # pid inside the process's own PID namespace
    pidns_inode: int
    device: int
    memory_bytes: int
    allocations: int
    busy_seconds_total: float
    kernel_launches: int
    engine_wait_seconds_total: float = 0.0  # time its launches waited for the GPU's engine
    # what memory_bytes is made of (RM's rule: memory_bytes == rm_memory_bytes), and more
    rm_memory_bytes: int = 0  # live class-0x40 memory objects at their rounded sizes
    rm_objects: int = 0  # how many
    context_bytes: int = 0  # of rm_memory_bytes: the contexts' own memory
    managed_bytes: int = 0  # mapped managed memory (nvidia-uvm, no RM object; NVML leaves it out)
    requested_bytes: int = 0  # what the live cuMemAlloc* calls asked for


@dataclass(frozen=True)
class SimEngine:
    """The execution engine of one simulated GPU (kernels contend for it)."""

    gpu: int
    lanes: int  # contexts that run at once: 1 time-sliced, N MPS-like
    timeslice_ms: float
    holder_pids: tuple[int, ...]  # pids (in the caller's namespace; 0: not visible) running a kernel now
    waiters: int  # launches waiting for the engine now
    acquisitions_total: int  # times a lane was taken
    steals_total: int  # ... from a holder that had stopped running (frozen, stopped, dead)
    yields_total: int  # time slices that ended with a hand-over to a waiter


@dataclass(frozen=True)
class SimStatus:
    node: SimNode
    devices: tuple[SimDevice, ...]
    processes: tuple[SimProcess, ...]


class _ProcInfo(ctypes.Structure):
    _fields_ = [
        ("host_pid", ctypes.c_int32),
        ("ns_pid", ctypes.c_int32),
        ("pidns_ino", ctypes.c_uint64),
        ("start_ticks", ctypes.c_uint64),
        ("device", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("memory_bytes", ctypes.c_uint64),
        ("allocations", ctypes.c_uint64),
        ("busy_ns_total", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("engine_wait_ns_total", ctypes.c_uint64),
        ("rm_memory_bytes", ctypes.c_uint64),
        ("rm_objects", ctypes.c_uint64),
        ("context_bytes", ctypes.c_uint64),
        ("managed_bytes", ctypes.c_uint64),
        ("requested_bytes", ctypes.c_uint64),
    ]


class _EngineInfo(ctypes.Structure):
    _fields_ = [
        ("lanes", ctypes.c_uint32),
        ("timeslice_us", ctypes.c_uint32),
        ("acquisitions", ctypes.c_uint64),
        ("steals", ctypes.c_uint64),
        ("yields", ctypes.c_uint64),
        ("holders", ctypes.c_uint32),
        ("waiters", ctypes.c_uint32),
        ("holder_pids", ctypes.c_int32 * MAX_MPS_LANES),
    ]


class _DeviceInfo(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 96),
        ("uuid", ctypes.c_char * 48),
        ("pci_bus_id", ctypes.c_char * 32),
        ("memory_total_bytes", ctypes.c_uint64),
        ("ecc_corrected_volatile", ctypes.c_uint64),
        ("ecc_uncorrected_volatile", ctypes.c_uint64),
        ("minor", ctypes.c_uint32),
        ("lost", ctypes.c_uint32),
        ("utilization_percent", ctypes.c_uint32),
        ("remap_failure", ctypes.c_uint32),
        ("remapped_rows_unc", ctypes.c_uint32),
        ("remap_pending", ctypes.c_uint32),
        ("device_instance", ctypes.c_uint32),
        ("gpu_id", ctypes.c_uint32),
    ]


def state_path_for(name: str) -> Path:
    """The state file of node `name` (GPUWATCH_SIM_STATE overrides for the default node)."""
    env = os.environ.get("GPUWATCH_SIM_STATE")
    if env and name == DEFAULT_NAME:
        return Path(env)
    return Path("/dev/shm") / f"gpuwatch-sim-{name}"


def root_for(name: str) -> Path:
    """The sim root of node `name`: GPUWATCH_SIM_ROOT, else /run/gpuwatch-sim/<name>."""
    env = os.environ.get("GPUWATCH_SIM_ROOT")
    if env and name == DEFAULT_NAME:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/run/gpuwatch-sim") / name
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "gpuwatch-sim" / name
    return Path(f"/tmp/gpuwatch-sim-{os.getuid()}") / name


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise SimError(f"invalid sim node name {name!r}", fix="use letters, digits, '-', '_' or '.'")


_helper_libs: dict[Path, ctypes.CDLL] = {}


def _helper(libs: SimLibraries) -> ctypes.CDLL:
    """The fake NVML loaded for its gpuwatchsim_* helpers (loaded once per path)."""
    lib = _helper_libs.get(libs.nvml_path)
    if lib is None:
        lib = ctypes.CDLL(str(libs.nvml_path))
        lib.gpuwatchsim_create.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.c_char_p,
            ctypes.c_ulonglong,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint,
        ]
        lib.gpuwatchsim_configure.argtypes = [ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_uint]
        lib.gpuwatchsim_settings.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.POINTER(ctypes.c_uint),
        ]
        lib.gpuwatchsim_kernel_host.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.gpuwatchsim_replay.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong]
        lib.gpuwatchsim_engine.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(_EngineInfo)]
        lib.gpuwatchsim_inject.argtypes = [
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_ulonglong,
            ctypes.c_uint,
            ctypes.c_int,
        ]
        lib.gpuwatchsim_list.argtypes = [ctypes.c_char_p, ctypes.POINTER(_ProcInfo), ctypes.c_uint]
        lib.gpuwatchsim_device.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(_DeviceInfo)]
        lib.gpuwatchsim_node.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_uint,
            ctypes.POINTER(ctypes.c_uint),
        ]
        _helper_libs[libs.nvml_path] = lib
    return lib


def _make_device_node(path: Path, numbers: tuple[int, int] = _NULL_MAJOR_MINOR) -> bool:
    """A char device with /dev/null's numbers (or `numbers`); a regular file when mknod is
    not allowed.

    Returns True for a real char device."""
    if path.exists() or path.is_symlink():
        path.unlink()
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(*numbers))
        os.chmod(path, 0o666)
        return True
    except PermissionError:
        path.touch(mode=0o666)
        return False


def up(
    devices: int = 2,
    model: str = DEFAULT_MODEL,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    name: str = DEFAULT_NAME,
    *,
    state_path: Path | None = None,
    root: Path | None = None,
    rm_alloc_params: str = "nvos64",
    rm_device_handles: bool = False,
    topology: str = "pcie",
    mps: int = 1,
    timeslice_ms: float = DEFAULT_TIMESLICE_MS,
    sample_period_ms: float = DEFAULT_SAMPLE_PERIOD_MS,
    nvml_cost: str = "off",
    kernel_host: str = "spin",
) -> SimNode:
    """Create (or re-create) a simulated node and return it.

    `rm_alloc_params` picks the RM_ALLOC parameter layout the stub issues (NVOS64, 48 B,
    or NVOS21, 32 B). Contexts always allocate the RM client (0x41), NV01_DEVICE_0 (0x80,
    deviceId = the device instance, numbered in reverse of the minors), NV20_SUBDEVICE_0
    (0x2080) and a VA space (0x90F1), as the real driver sequence does (README "Driver
    traffic"); `rm_device_handles` is accepted for compatibility and changes nothing.
    `topology` is the GPU interconnect NVML reports: "pcie" (no NVLink),
    "nvlink-pairs" (GPUs 2k and 2k+1 bridged by 4 NVLinks) or "nvswitch" (18 NVLinks per
    GPU, all to NVSwitches); the PCIe common ancestors are the same in all three (see the
    README). `mps` is how many contexts' kernels run at once on one GPU: 1 (default) is a
    time-sliced GPU -- one kernel at a time, tenants take turns every `timeslice_ms` of
    run time; N > 1 is MPS-like (up to N at once, each at full speed). `sample_period_ms`
    is the NVML process-utilisation sample period (default 1/6 s, see
    DEFAULT_SAMPLE_PERIOD_MS; 10..1000 ms); `nvml_cost` ("off" or "h100-580") makes every
    fake NVML call on the node burn the CPU the real call took (README "NVML cost model"); `kernel_host`
    ("spin" or "sleep", KERNEL_HOST_MODES) is what a running kernel does to its host thread. Re-creating a node
    that is up resets its ledger and empties its kernel log (`kmsg_path`): processes of
    the old node keep their mapping of the old (unlinked) file and are no longer seen."""
    _check_name(name)
    if not 1 <= devices <= MAX_DEVICES:
        raise SimError(
            f"a simulated node has 1..{MAX_DEVICES} devices, not {devices}",
            fix=f"pass --devices between 1 and {MAX_DEVICES}",
        )
    if memory_bytes < 1024**2:
        raise SimError(f"device memory of {memory_bytes} bytes is too small", fix="pass at least 1 MiB")
    if rm_alloc_params not in RM_ALLOC_LAYOUTS:
        raise SimError(f"unknown RM_ALLOC layout {rm_alloc_params!r}", fix="use nvos64 or nvos21")
    if topology not in TOPOLOGIES:
        raise SimError(f"unknown GPU topology {topology!r}", fix=f"use one of {', '.join(TOPOLOGIES)}")
    if not 1 <= mps <= MAX_MPS_LANES:
        raise SimError(f"--mps {mps} is out of range", fix=f"pass 1 (time-sliced) to {MAX_MPS_LANES}")
    timeslice_us = round(timeslice_ms * 1000)
    if not 100 <= timeslice_us <= 1_000_000:
        raise SimError(f"time slice of {timeslice_ms} ms is out of range", fix="pass 0.1 to 1000 ms")
    sample_period_ns = round(sample_period_ms * 1e6)
    if not 10_000_000 <= sample_period_ns <= 1_000_000_000:
        raise SimError(f"sample period of {sample_period_ms} ms is out of range", fix="pass 10 to 1000 ms")
    if nvml_cost not in NVML_COST_MODELS:
        raise SimError(f"unknown NVML cost model {nvml_cost!r}", fix=f"use one of {', '.join(NVML_COST_MODELS)}")
    if kernel_host not in KERNEL_HOST_MODES:
        raise SimError(f"unknown kernel host mode {kernel_host!r}", fix=f"use one of {', '.join(KERNEL_HOST_MODES)}")
    libs = build_sim_libraries()
    state = state_path or state_path_for(name)
    sim_root = root or root_for(name)
    try:
        (sim_root / "dev").mkdir(parents=True, exist_ok=True)
        (sim_root / "progress").mkdir(parents=True, exist_ok=True)
        os.chmod(sim_root / "progress", 0o1777)
        real = [
            _make_device_node(sim_root / "dev" / "nvidiactl"),
            _make_device_node(sim_root / "dev" / "nvidia-uvm", _ZERO_MAJOR_MINOR),
        ]
        real += [_make_device_node(sim_root / "dev" / f"nvidia{i}") for i in range(devices)]
        kmsg = sim_root / "kmsg"
        kmsg.write_bytes(b"")  # a new node is a new boot: its kernel log starts empty
        os.chmod(kmsg, 0o644)
    except OSError as err:
        raise SimError(
            f"cannot create the sim root {sim_root}: {err}",
            fix="run as root or set GPUWATCH_SIM_ROOT to a writable directory",
        ) from err
    rc = _helper(libs).gpuwatchsim_create(
        str(state).encode(),
        name.encode(),
        str(sim_root).encode(),
        devices,
        model.encode(),
        memory_bytes,
        RM_ALLOC_LAYOUTS[rm_alloc_params],
        int(rm_device_handles),
        TOPOLOGIES[topology],
        mps,
        timeslice_us,
    )
    if rc < 0:
        raise SimError(
            f"cannot create the sim state file {state}: {os.strerror(-rc)}",
            fix="check that /dev/shm is writable",
        )
    rc = _helper(libs).gpuwatchsim_configure(str(state).encode(), sample_period_ns, NVML_COST_MODELS[nvml_cost])
    if rc >= 0:
        rc = min(_helper(libs).gpuwatchsim_kernel_host(str(state).encode(), KERNEL_HOST_MODES[kernel_host]), 0)
    if rc < 0:
        raise SimError(f"cannot configure the sim state file {state}: {os.strerror(-rc)}", fix=_NOT_UP_FIX)
    node = SimNode(
        name=name,
        state_path=state,
        root=sim_root,
        libraries=libs,
        device_count=devices,
        topology=topology,
        mps=mps,
        timeslice_ms=timeslice_us / 1000,
        sample_period_ms=sample_period_ns / 1e6,
        nvml_cost=nvml_cost,
        kernel_host=kernel_host,
    )
    info = {
        "name": name,
        "state_path": str(state),
        "root": str(sim_root),
        "lib_dir": str(libs.lib_dir),
        "devices": devices,
        "model": model,
        "memory_bytes": memory_bytes,
        "char_device_nodes": all(real),
        "rm_alloc_params": rm_alloc_params,
        "rm_device_handles": rm_device_handles,
        "topology": topology,
        "mps": mps,
        "timeslice_ms": timeslice_us / 1000,
        "sample_period_ms": sample_period_ns / 1e6,
        "nvml_cost": nvml_cost,
        "kernel_host": kernel_host,
        "kmsg": str(node.kmsg_path),
    }
    (sim_root / "node.json").write_text(json.dumps(info, indent=2) + "\n")
    return node


def get_node(name: str = DEFAULT_NAME, *, state_path: Path | None = None) -> SimNode:
    """The node `name` if it is up, else SimError telling how to start it."""
    _check_name(name)
    state = state_path or state_path_for(name)
    if not state.exists():
        raise SimError(f"sim is not up: no state file {state}", fix=_NOT_UP_FIX)
    libs = build_sim_libraries()
    root_buf = ctypes.create_string_buffer(256)
    topo = ctypes.c_uint(0)
    count = _helper(libs).gpuwatchsim_node(str(state).encode(), root_buf, len(root_buf), ctypes.byref(topo))
    if count < 0:
        raise SimError(
            f"sim state file {state} is unreadable: {os.strerror(-count)}",
            fix=f"run `gpuwatch sim down --name {name}` then `gpuwatch sim up --name {name}`",
        )
    root = Path(root_buf.value.decode())
    topology = next((k for k, v in TOPOLOGIES.items() if v == topo.value), "pcie")
    info = _EngineInfo()
    rc = _helper(libs).gpuwatchsim_engine(str(state).encode(), 0, ctypes.byref(info))
    mps, timeslice_ms = (info.lanes, info.timeslice_us / 1000) if rc == 0 else (1, DEFAULT_TIMESLICE_MS)
    period_ns, cost = ctypes.c_ulonglong(0), ctypes.c_uint(0)
    rc = _helper(libs).gpuwatchsim_settings(str(state).encode(), ctypes.byref(period_ns), ctypes.byref(cost))
    host = _helper(libs).gpuwatchsim_kernel_host(str(state).encode(), -1)
    sample_period_ms = period_ns.value / 1e6 if rc == 0 else DEFAULT_SAMPLE_PERIOD_MS
    nvml_cost = next((k for k, v in NVML_COST_MODELS.items() if v == cost.value), "off")
    kernel_host = next((k for k, v in KERNEL_HOST_MODES.items() if v == host), "spin")
    return SimNode(
        name=name,
        state_path=state,
        root=root,
        libraries=libs,
        device_count=count,
        topology=topology,
        mps=mps,
        timeslice_ms=timeslice_ms,
        sample_period_ms=sample_period_ms,
        nvml_cost=nvml_cost,
        kernel_host=kernel_host,
    )


def set_nvml_replay(node: SimNode, compiled: Path | None, origin_s: float = 0.0) -> None:
    """Make the node's fake NVML answer the per-process calls from a compiled recording
    (gpuwatch/sim/nvml_replay.py `compile_recording`), its start shifted to `origin_s`
    (time.time()); `compiled=None` stops a replay. Every process's fake NVML follows at its
    next call (csrc/nvml.c "replay")."""
    path = str(compiled.resolve()) if compiled is not None else ""
    if len(path.encode()) >= 256:
        raise SimError(f"replay path {path} is too long", fix="use a path of at most 255 bytes")
    rc = _helper(node.libraries).gpuwatchsim_replay(
        str(node.state_path).encode(), path.encode(), round(origin_s * 1e6) if compiled is not None else 0
    )
    if rc < 0:
        raise SimError(f"cannot set the NVML replay on {node.state_path}: {os.strerror(-rc)}", fix=_NOT_UP_FIX)


def down(name: str = DEFAULT_NAME, *, state_path: Path | None = None) -> bool:
    """Remove a node's state file and sim root. Returns False when it was not up.

    Like a driver unload: every device is marked lost first, so processes that still map
    the removed state (an agent's NVML, running workloads) see their GPUs gone instead of
    a node that silently froze in time; nothing new can attach to the node."""
    _check_name(name)
    state = state_path or state_path_for(name)
    root: Path | None = None
    if state.exists():
        try:
            node = get_node(name, state_path=state)
            root = node.root
            for gpu in range(node.device_count):
                _inject(node, _LOST_QUIET, "lost", gpu, 0, False, None)
        except SimError:
            root = None
        state.unlink(missing_ok=True)
        existed = True
    else:
        existed = False
    root = root or root_for(name)
    if root.is_dir() and (root / "node.json").exists():
        shutil.rmtree(root, ignore_errors=False)
    return existed


def status(node: SimNode) -> SimStatus:
    """Devices and per-process ledger entries of a node, read from its state file."""
    lib = _helper(node.libraries)
    path = str(node.state_path).encode()
    cap = 8192
    buf = (_ProcInfo * cap)()
    n = lib.gpuwatchsim_list(path, buf, cap)
    if n < 0:
        raise SimError(f"cannot read sim state {node.state_path}: {os.strerror(-n)}", fix=_NOT_UP_FIX)
    procs = tuple(
        SimProcess(
            host_pid=e.host_pid,
            ns_pid=e.ns_pid,
            pidns_inode=e.pidns_ino,
            device=e.device,
            memory_bytes=e.memory_bytes,
            allocations=e.allocations,
            busy_seconds_total=e.busy_ns_total / 1e9,
            kernel_launches=e.launches,
            engine_wait_seconds_total=e.engine_wait_ns_total / 1e9,
            rm_memory_bytes=e.rm_memory_bytes,
            rm_objects=e.rm_objects,
            context_bytes=e.context_bytes,
            managed_bytes=e.managed_bytes,
            requested_bytes=e.requested_bytes,
        )
        for e in buf[:n]
    )
    devices = []
    for i in range(node.device_count):
        d = _DeviceInfo()
        rc = lib.gpuwatchsim_device(path, i, ctypes.byref(d))
        if rc < 0:
            raise SimError(f"cannot read device {i} of {node.state_path}: {os.strerror(-rc)}", fix=_NOT_UP_FIX)
        devices.append(
            SimDevice(
                index=i,
                name=d.name.decode(),
                uuid=d.uuid.decode(),
                pci_bus_id=d.pci_bus_id.decode(),
                minor=d.minor,
                memory_total_bytes=d.memory_total_bytes,
                memory_used_bytes=sum(p.memory_bytes for p in procs if p.device == i),
                utilization_percent=d.utilization_percent,
                lost=bool(d.lost),
                ecc_corrected_volatile=d.ecc_corrected_volatile,
                ecc_uncorrected_volatile=d.ecc_uncorrected_volatile,
                row_remap_failure=bool(d.remap_failure),
                row_remap_pending=bool(d.remap_pending),
                remapped_rows_uncorrectable=d.remapped_rows_unc,
                device_instance=d.device_instance,
                gpu_id=d.gpu_id,
            )
        )
    return SimStatus(node=node, devices=tuple(devices), processes=procs)


def engine(node: SimNode, gpu: int) -> SimEngine:
    """The execution engine of GPU `gpu`: mode, who runs a kernel now, hand-over counters.

    A holder that stopped renewing its lane (frozen, stopped, dead) is not listed: the
    next waiter may take the lane from it."""
    if not 0 <= gpu < node.device_count:
        raise SimError(
            f"no GPU {gpu} on sim node {node.name!r} ({node.device_count} devices)",
            fix=f"pass a GPU between 0 and {node.device_count - 1}",
        )
    info = _EngineInfo()
    rc = _helper(node.libraries).gpuwatchsim_engine(str(node.state_path).encode(), gpu, ctypes.byref(info))
    if rc < 0:
        raise SimError(f"cannot read the engine of GPU {gpu} of {node.state_path}: {os.strerror(-rc)}",
                       fix=_NOT_UP_FIX)
    return SimEngine(
        gpu=gpu,
        lanes=info.lanes,
        timeslice_ms=info.timeslice_us / 1000,
        holder_pids=tuple(pid for pid in info.holder_pids[: info.lanes] if pid >= 0),
        waiters=info.waiters,
        acquisitions_total=info.acquisitions,
        steals_total=info.steals,
        yields_total=info.yields,
    )


def inject_fault(
    node: SimNode,
    kind: str,
    gpu: int,
    *,
    xid: int = 79,
    count: int = 1,
    uncorrected: bool = False,
    pid: int | None = None,
) -> None:
    """Inject a fault on GPU `gpu`:

    * `xid`: an Xid error with code `xid`: an NVML XID event, and one record in the
      node's kernel log (`node.kmsg_path`) naming `pid` and its comm (`pid` None: the
      driver's `pid='<unknown>', name=<unknown>` form);
    * `lost`: the GPU falls off the bus: NVML returns GPU_IS_LOST, CUDA calls fail, Xid
      79 is delivered and logged;
    * `ecc`: `count` ECC errors (+ event); `uncorrected` ones also mark `count` rows
      remapped, pending until the next reset;
    * `row-remap-failure`: nvmlDeviceGetRemappedRows reports failureOccurred (no event:
      inject `xid` 64 for the driver's Xid);
    * `clear`: a GPU reset: undo lost, volatile ECC counts, pending remaps and the remap
      failure.
    """
    if kind not in FAULT_KINDS:
        raise SimError(f"unknown fault kind {kind!r}", fix=f"use one of {', '.join(FAULT_KINDS)}")
    if not 0 <= gpu < node.device_count:
        raise SimError(
            f"no GPU {gpu} on sim node {node.name!r} ({node.device_count} devices)",
            fix=f"pass --gpu between 0 and {node.device_count - 1}",
        )
    if kind == "xid" and not 0 <= xid < 2**31:
        raise SimError(f"Xid {xid} is out of range", fix="pass a code such as 13, 48, 79 or 94")
    if pid is not None and pid <= 0:
        raise SimError(f"pid {pid} is not a process id", fix="pass the pid of a process, or no --pid")
    data = xid if kind == "xid" else count
    _inject(node, FAULT_KINDS[kind], kind, gpu, data, uncorrected, pid)


def _inject(node: SimNode, code: int, kind: str, gpu: int, data: int, uncorrected: bool, pid: int | None) -> None:
    rc = _helper(node.libraries).gpuwatchsim_inject(
        str(node.state_path).encode(), gpu, code, data, int(uncorrected), pid or 0
    )
    if rc < 0:
        raise SimError(f"cannot inject {kind} on GPU {gpu}: {os.strerror(-rc)}", fix=_NOT_UP_FIX)
    if rc > 0:
        raise SimError(
            f"injected {kind} on GPU {gpu}, but its kernel-log record could not be written to "
            f"{node.kmsg_path}: {os.strerror(rc)}",
            fix="check that the sim root exists and is writable (`gpuwatch sim up` re-creates it)",
        )


def sim_env(node: SimNode, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment a workload needs to run on `node` (merged over `base` when given).

    GPUWATCH_SIM_STATE / GPUWATCH_SIM_ROOT locate the node, LD_LIBRARY_PATH makes
    `libcuda.so.1` and `libnvidia-ml.so.1` resolve to the sim's, GPUWATCH_SIM_LIBCUDA
    names the stub by absolute path for ctypes users."""
    env = dict(base) if base is not None else {}
    lib_dir = str(node.libraries.lib_dir)
    old = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = f"{lib_dir}:{old}" if old else lib_dir
    env["GPUWATCH_SIM_STATE"] = str(node.state_path)
    env["GPUWATCH_SIM_ROOT"] = str(node.root)
    env["GPUWATCH_SIM_LIBCUDA"] = str(node.libraries.cuda_path)
    return env


def driver_env(
    alloc_path: str = "rm-alloc",
    suballoc_mib: int = DEFAULT_SUBALLOC_MIB,
    context_mib: int = DEFAULT_CONTEXT_MIB,
    ctx_teardown: str | None = None,
    rm_params_size: str = "zero",
) -> dict[str, str]:
    """Environment that tells the stub libcuda how a process talks to the driver.

    The defaults are what real CUDA does (README "Driver traffic"). `alloc_path`: memory
    objects through RM_ALLOC (class 0x40) or VID_HEAP_CONTROL (ALLOC_SIZE / FREE).
    `suballoc_mib`: N (default 2) = cuMemAllocs below N MiB are carved from N-MiB chunks
    (freed when empty); 0 = one driver allocation per cuMemAlloc. `context_mib`: memory
    each context allocates for itself (default 518, the H100's; 0 = none), as the recorded
    context's objects (6 MiB, fourteen of 2 MiB, 70 MiB, the rest in one).
    `ctx_teardown`: what the process's last cuCtxDestroy does to its RM client: free the
    device (the client stays), RM_FREE the client, or close nvidiactl; None leaves the
    stub's default (free-device) or the caller's setting. `rm_params_size`: what RM_ALLOC
    says in paramsSize: "zero" (real libcuda 580: RM sizes the parameters by class) or
    "class" (the size of the class's parameters)."""
    if alloc_path not in ALLOC_PATHS:
        raise SimError(f"unknown allocation path {alloc_path!r}", fix=f"use one of {', '.join(ALLOC_PATHS)}")
    if rm_params_size not in RM_PARAMS_SIZES:
        raise SimError(
            f"unknown RM_ALLOC paramsSize rule {rm_params_size!r}", fix=f"use one of {', '.join(RM_PARAMS_SIZES)}"
        )
    if ctx_teardown is not None and ctx_teardown not in CTX_TEARDOWNS:
        raise SimError(f"unknown context teardown {ctx_teardown!r}", fix=f"use one of {', '.join(CTX_TEARDOWNS)}")
    for what, mib in (("--suballoc-mib", suballoc_mib), ("--context-mib", context_mib)):
        if not 0 <= mib <= MAX_DRIVER_MIB:
            raise SimError(f"{what} {mib} is out of range", fix=f"pass 0 to {MAX_DRIVER_MIB} MiB")
    env = {
        "GPUWATCH_SIM_ALLOC_PATH": alloc_path,
        "GPUWATCH_SIM_SUBALLOC_MIB": str(suballoc_mib),
        "GPUWATCH_SIM_CONTEXT_MIB": str(context_mib),
        "GPUWATCH_SIM_RM_PARAMS_SIZE": rm_params_size,
    }
    if ctx_teardown is not None:
        env["GPUWATCH_SIM_CTX_TEARDOWN"] = ctx_teardown
    return env


def preload_fake_nvml(path: Path | str, state_path: Path | str | None = None) -> ctypes.CDLL:
    """Make `CDLL("libnvidia-ml.so.1")` (what nvidia-ml-py does) resolve to the fake.

    Call before nvmlInit. The library is loaded by absolute path with RTLD_GLOBAL, so
    the later load by soname returns it. `state_path` sets GPUWATCH_SIM_STATE, which
    the fake reads at nvmlInit."""
    if state_path is not None:
        os.environ["GPUWATCH_SIM_STATE"] = str(state_path)
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
