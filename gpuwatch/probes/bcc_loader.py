"""The only `import bcc`: compile bpf/ with BCC and load the programs, in a short-lived child.

Why a child: BCC/LLVM cost ~125 MB of RSS for the life of a process. The child compiles the
concatenated bpf/ sources with cflags, creates the maps, loads every program, sends the map
and program file descriptors back over a Unix socket (SCM_RIGHTS) and exits; the agent then
attaches and reads maps with plain bpf() syscalls (bpfsys.py) and never maps LLVM.

Parent side: `load_programs(request)`. Child side: `python -m gpuwatch.probes.bcc_loader FD`.
Two compilation units: "probes" (bpf/ above, the default) and "devicegate" (the cgroup
device program of device isolation, bpf/devicegate.bpf.c; LoadRequest(unit=...)).

Kernel headers (`find_kernel_headers`): BCC compiles against a kernel header tree, but the
programs use no kernel struct layout (tracepoint arguments, uprobe registers and helpers
only), so the headers of any recent kernel serve. Many GPU hosts have BTF and no headers at
all (COS, Bottlerocket, Talos, Flatcar, the H100 host of issue 16): the agent image carries
Debian's headers at BUNDLED_HEADERS (deploy/image/bundle-kernel-headers.sh) for them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuwatch.core.errors import ProbesUnavailable
from gpuwatch.probes.layout import BPF_DIR

# concatenated in this order into BCC's main text (BCC only turns main-text functions into
# programs); the files are used unchanged
BPF_SOURCES = ("gpuwatch.bpf.c", "common.bpf.c", "devices.bpf.c", "ioctl.bpf.c", "inherit.bpf.c",
               "cuda.bpf.c", "lifecycle.bpf.c")
# where kernel headers are looked for, in this order (find_kernel_headers): $BCC_KERNEL_SOURCE;
# LIB_MODULES/<release>/build (the host's own, matching the running kernel); the tree
# deploy/setup.sh merges from Debian's split packages on a host without them; the tree the
# agent image carries (outside /opt/gpuwatch/kernel-headers, so a host mount there cannot hide it)
LIB_MODULES = Path("/lib/modules")
HOST_MERGED_HEADERS = Path("/opt/gpuwatch/kernel-headers/current")
BUNDLED_HEADERS = Path("/opt/gpuwatch/bundled-kernel-headers")
BUNDLED_ORIGIN_FILE = "gpuwatch-headers.txt"  # one line: which Debian packages the tree is from
# the sources, as find_kernel_headers names them (doctor and the agent's log print them)
HEADERS_FROM_ENV = "BCC_KERNEL_SOURCE"
HEADERS_FROM_HOST = "host /lib/modules"
HEADERS_FROM_HOST_MERGED = "host merged tree"
HEADERS_FROM_BUNDLED = "image bundled tree"

log = logging.getLogger(__name__)

TRACEPOINT = "tracepoint"
UPROBE = "uprobe"
UPROBE_MULTI_ATTACH = 48  # BPF_TRACE_UPROBE_MULTI
MULTI_SUFFIX = "@multi"  # progs key of the uprobe_multi variant of a uprobe program

# program name -> BCC program type, per group
PROGRAMS: dict[str, dict[str, str]] = {
    # sched tracepoints only: no cost on syscalls
    "core": {"gw_sched_exit": TRACEPOINT, "gw_sched_exec": TRACEPOINT},
    # syscall tracepoints: while any is attached, every syscall takes the kernel's slower
    # traced path, so device-fd tracking is part of this (switchable) group
    "ioctl": {"gw_enter_openat": TRACEPOINT, "gw_exit_openat": TRACEPOINT,
              "gw_enter_close": TRACEPOINT, "gw_enter_ioctl": TRACEPOINT, "gw_exit_ioctl": TRACEPOINT,
              # device fds from dup/fcntl(F_DUPFD) and fork (inherit.bpf.c)
              "gw_enter_dup": TRACEPOINT, "gw_enter_dup2": TRACEPOINT, "gw_enter_fcntl": TRACEPOINT,
              "gw_exit_dup": TRACEPOINT, "gw_task_newtask": TRACEPOINT},
    "alloc": {"gw_cu_alloc": UPROBE, "gw_cu_alloc_pitch": UPROBE, "gw_cu_create": UPROBE,
              "gw_cu_alloc_ret": UPROBE, "gw_cu_free": UPROBE},
    "launch": {"gw_cu_launch": UPROBE, "gw_cu_graph_launch": UPROBE},
}

MAPS_CORE = ("gw_config", "gw_stats", "gw_tgids", "gw_fds", "gw_ioctls", "gw_uvm_ioctls", "gw_mem", "gw_rm",
             "gw_clients", "gw_gpu_minor", "gw_gpu_instance",
             "gw_cuda", "gw_limits", "gw_events")

# unit "devicegate": the cgroup device program of device isolation, a compilation unit of
# its own (loaded only when the enforcer gates devices; attached per cgroup, not traced)
PROBES_UNIT = "probes"
DEVICE_GATE_UNIT = "devicegate"
DEVICE_GATE_SOURCES = ("devicegate.bpf.c",)
DEVICE_GATE_MAPS = ("gw_gate_nodes", "gw_gate_allow")
DEVICE_GATE_PROGRAM = "gw_device_gate"


@dataclass(frozen=True)
class LoadRequest:
    """What to compile. Groups and bounds become -D cflags, nothing else reaches the source."""

    ioctl: bool = True
    alloc_uprobes: bool = True
    launch_uprobes: bool = False
    verbose_events: bool = False
    max_rm_allocs: int = 65536
    max_cuda_allocs: int = 65536
    max_fds: int = 8192
    extra_cflags: tuple[str, ...] = ()
    unit: str = PROBES_UNIT  # or DEVICE_GATE_UNIT (then the group switches do not apply)

    def groups(self) -> tuple[str, ...]:
        return tuple(g for g, on in (("core", True), ("ioctl", self.ioctl), ("alloc", self.alloc_uprobes),
                                     ("launch", self.launch_uprobes)) if on)

    def cflags(self) -> list[str]:
        return [f"-I{BPF_DIR}",
                f"-DGW_IOCTL={int(self.ioctl)}",
                f"-DGW_ALLOC_UPROBES={int(self.alloc_uprobes)}",
                f"-DGW_LAUNCH_UPROBES={int(self.launch_uprobes)}",
                f"-DGW_VERBOSE_EVENTS={int(self.verbose_events)}",
                f"-DGW_MAX_RM_ALLOCS={int(self.max_rm_allocs)}",
                f"-DGW_MAX_CUDA_ALLOCS={int(self.max_cuda_allocs)}",
                f"-DGW_MAX_FDS={int(self.max_fds)}",
                *self.extra_cflags]


@dataclass
class LoadedObjects:
    """File descriptors owned by the caller (close them to unload)."""

    maps: dict[str, int] = field(default_factory=dict)
    progs: dict[str, int] = field(default_factory=dict)
    compile_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        for fd in [*self.maps.values(), *self.progs.values()]:
            try:
                os.close(fd)
            except OSError:
                continue  # already closed: nothing left to release
        self.maps.clear()
        self.progs.clear()


@dataclass(frozen=True)
class KernelHeaders:
    """The header tree BCC compiles against and where it came from (HEADERS_FROM_*)."""

    path: str
    source: str
    detail: str = ""  # e.g. which Debian packages a bundled tree is from

    def describe(self) -> str:
        """One line for doctor and the agent's log: `<path> (<source>: <detail>)`."""
        return f"{self.path} ({self.source}" + (f": {self.detail})" if self.detail else ")")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for the BCC child: BCC_KERNEL_SOURCE unless BCC finds the tree by itself."""
        env = dict(os.environ if base is None else base)
        if self.source != HEADERS_FROM_HOST:
            env["BCC_KERNEL_SOURCE"] = self.path
        return env


def find_kernel_headers(release: str | None = None, environ: dict[str, str] | None = None,
                        lib_modules: Path = LIB_MODULES, host_merged: Path = HOST_MERGED_HEADERS,
                        bundled: Path = BUNDLED_HEADERS) -> KernelHeaders:
    """The kernel headers BCC should use: $BCC_KERNEL_SOURCE if set, else the host's
    /lib/modules/<release>/build, else the host's merged tree, else the image's bundled tree.

    Raise ProbesUnavailable when BCC_KERNEL_SOURCE names no directory (an explicit setting
    that is wrong is not silently replaced) or when there is no tree at all. Paths are
    parameters so tests can point them at fixture trees.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("BCC_KERNEL_SOURCE")
    if explicit:
        if Path(explicit).is_dir():
            return KernelHeaders(explicit, HEADERS_FROM_ENV)
        raise ProbesUnavailable(
            f"BPF probes off: BCC_KERNEL_SOURCE={explicit} is not a directory",
            fix="point BCC_KERNEL_SOURCE at a kernel header tree, or unset it to use the host's "
                "headers or the ones the agent image carries")
    rel = release or os.uname().release
    build = lib_modules / rel / "build"
    if build.is_dir():  # a dangling symlink (its /usr/src not mounted) does not count
        return KernelHeaders(str(build), HEADERS_FROM_HOST)
    if host_merged.is_dir():
        real = host_merged.resolve()
        return KernelHeaders(str(real), HEADERS_FROM_HOST_MERGED, "made by deploy/setup.sh"
                             + (f", via {host_merged}" if real != host_merged else ""))
    if (bundled / "include").is_dir():
        try:
            origin = (bundled / BUNDLED_ORIGIN_FILE).read_text().strip().splitlines()[0]
        except (OSError, IndexError):
            origin = "origin not recorded"
        return KernelHeaders(str(bundled), HEADERS_FROM_BUNDLED,
                             f"{origin}; the host has none for {rel}")
    raise ProbesUnavailable(
        f"BPF probes off: no kernel headers for BCC (BCC_KERNEL_SOURCE unset, {build}, "
        f"{host_merged} and {bundled} missing); per-container ioctl/allocation counters are "
        "unavailable, NVML attribution continues",
        fix="run the agent image (it carries headers), run `bash deploy/setup.sh install` "
            "(merges Debian's headers), or set BCC_KERNEL_SOURCE to a kernel header tree")


def kernel_headers_env() -> dict[str, str]:
    """Environment for BCC (BCC_KERNEL_SOURCE set as find_kernel_headers decides)."""
    return find_kernel_headers().env()


def load_programs(request: LoadRequest, timeout_s: float = 120.0) -> LoadedObjects:
    """Compile and load in a child process; return the map/program fds it passed back."""
    headers = find_kernel_headers()
    env = headers.env()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuwatch.probes.bcc_loader", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        child.close()
        parent.sendall(json.dumps(asdict(request)).encode() + b"\n")
        parent.settimeout(timeout_s)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(parent, 1 << 20, 256)
        except TimeoutError as err:
            proc.kill()
            raise ProbesUnavailable(f"BPF compile did not finish in {timeout_s:.0f} s",
                                    fix="check CPU load; rerun `gpuwatch doctor`") from err
        _out, err_text = proc.communicate(timeout=timeout_s)
    finally:
        parent.close()
        child.close()  # idempotent
    tail = " | ".join(err_text.decode(errors="replace").strip().splitlines()[-12:])
    if not msg:
        raise ProbesUnavailable(f"BPF probes off: the kernel or BCC refused the programs "
                                f"(kernel headers: {headers.describe()}): {tail}",
                                fix="run `gpuwatch doctor`; check kernel headers and BPF support")
    reply = json.loads(msg.decode())
    if reply.get("error"):
        for fd in fds:
            os.close(fd)
        detail = f" ({tail})" if tail else ""
        raise ProbesUnavailable(f"BPF probes off: {reply['error']}{detail} "
                                f"[kernel headers: {headers.describe()}]", fix=reply.get("fix", ""))
    objs = LoadedObjects(compile_s=time.monotonic() - started, notes=list(reply.get("notes", [])))
    log.info("BPF unit %s compiled and loaded in %.2f s against kernel headers %s",
             request.unit, objs.compile_s, headers.describe())
    for name, idx in reply["maps"].items():
        objs.maps[name] = fds[idx]
    for name, idx in reply["progs"].items():
        objs.progs[name] = fds[idx]
    return objs


# ---- child side ---------------------------------------------------------------------------

def _child_main(sock_fd: int) -> int:
    sock = socket.socket(fileno=sock_fd)
    fields = json.loads(sock.makefile("rb").readline())
    fields["extra_cflags"] = tuple(fields.get("extra_cflags", ()))
    request = LoadRequest(**fields)
    try:
        import bcc  # the one place BCC is imported
    except ImportError as err:
        sock.sendall(json.dumps({"error": f"BCC is not importable ({err})",
                                 "fix": "apt-get install python3-bpfcc; use a venv with "
                                        "--system-site-packages"}).encode())
        return 1
    if request.unit == DEVICE_GATE_UNIT:
        return _load_device_gate(bcc, sock, request)
    text = b"\n".join((BPF_DIR / name).read_bytes() for name in BPF_SOURCES)
    try:
        prog = bcc.BPF(text=text, cflags=request.cflags())
        fds: list[int] = []
        maps: dict[str, int] = {}
        progs: dict[str, int] = {}
        notes: list[str] = []
        names = list(MAPS_CORE)
        if request.launch_uprobes:
            names.append("gw_launches")
        for name in names:
            maps[name] = len(fds)
            fds.append(prog.get_table(name).map_fd)
        for group in request.groups():
            for fn, kind in PROGRAMS[group].items():
                if kind == UPROBE:  # also as a uprobe_multi program, where the kernel has them
                    try:
                        multi = prog.load_func(fn.encode(), bcc.BPF.KPROBE, attach_type=UPROBE_MULTI_ATTACH)
                        progs[fn + MULTI_SUFFIX] = len(fds)
                        fds.append(multi.fd)
                        del prog.funcs[fn.encode()]  # BCC caches by name; load the perf variant too
                    except Exception as err:  # BCC raises bare Exception; perf uprobes still work
                        notes.append(f"{fn}: no uprobe_multi variant ({err}); perf uprobes only")
                ptype = bcc.BPF.TRACEPOINT if kind == TRACEPOINT else bcc.BPF.KPROBE
                progs[fn] = len(fds)
                fds.append(prog.load_func(fn.encode(), ptype).fd)
    except Exception as err:  # BCC raises bare Exception for compile/verifier errors
        sock.sendall(json.dumps({"error": f"BCC could not build/load bpf/: {err}",
                                 "fix": "see the verifier/compiler output above; run `gpuwatch doctor`"}
                                ).encode())
        return 1
    socket.send_fds(sock, [json.dumps({"maps": maps, "progs": progs, "notes": notes}).encode()], fds)
    sock.close()
    return 0


def _load_device_gate(bcc: Any, sock: socket.socket, request: LoadRequest) -> int:
    """Child side of unit "devicegate": its two maps and one BPF_PROG_TYPE_CGROUP_DEVICE program."""
    text = b"\n".join((BPF_DIR / name).read_bytes() for name in DEVICE_GATE_SOURCES)
    try:
        prog = bcc.BPF(text=text, cflags=request.cflags())
        fds = [prog.get_table(name).map_fd for name in DEVICE_GATE_MAPS]
        fds.append(prog.load_func(DEVICE_GATE_PROGRAM.encode(), bcc.BPF.CGROUP_DEVICE).fd)
    except Exception as err:  # BCC raises bare Exception for compile/verifier errors
        sock.sendall(json.dumps({"error": f"BCC could not build/load the device gate: {err}",
                                 "fix": "see the verifier/compiler output above; the kernel needs "
                                        "CONFIG_CGROUP_BPF (cgroup device programs)"}).encode())
        return 1
    reply = {"maps": {name: i for i, name in enumerate(DEVICE_GATE_MAPS)},
             "progs": {DEVICE_GATE_PROGRAM: len(DEVICE_GATE_MAPS)}, "notes": []}
    socket.send_fds(sock, [json.dumps(reply).encode()], fds)
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(int(sys.argv[1])))
