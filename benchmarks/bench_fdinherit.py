"""Benchmark: what tracking inherited and duplicated device fds costs (bpf/inherit.bpf.c) and
what seeding the fd map from /proc costs (gpuwatch/probes/fdseed.py).

    sudo .venv/bin/python benchmarks/bench_fdinherit.py [--calls 200000] [--forks 3000] [--json]

Builds a call loop (bench_fdinherit.c) and makes char device nodes (mknod 1:3) under a temp
prefix. In one run, per call in ns, minimum of --runs runs, without probes and with the
ioctl group attached: fork+exit+wait of a process with no device fd (a hash lookup in the
kernel) and of a GPU process holding 1 and 32 device fds (the copy), fcntl(F_GETFL) and
dup+close on an ordinary fd (the enter/exit programs), dup+close of a device fd; and the
kernel's own run-time statistics of each new program (BPF_ENABLE_STATS: ns per run, which
fork's wall time on a small VM is too noisy to show). Then the
time of one seeding pass with --holders processes holding --fds device fds each, and of a
pass over this machine's /proc with nothing to seed. Needs root, BCC and kernel headers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuwatch.probes.manager import ProbeConfig, ProbeManager  # noqa: E402

HERE = Path(__file__).resolve().parent
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_ENABLE_STATS = 32
RUN_TIME_OFFSET = 192  # struct bpf_prog_info: run_time_ns, then run_cnt
INHERIT_PROGS = ("gw_task_newtask", "gw_enter_dup", "gw_enter_dup2", "gw_enter_fcntl", "gw_exit_dup")
_libc = ctypes.CDLL(None, use_errno=True)


def enable_bpf_stats() -> int:
    """BPF_ENABLE_STATS(BPF_STATS_RUN_TIME): the kernel times every program run while the
    returned fd is open."""
    attr = ctypes.c_uint32(0)
    fd = int(_libc.syscall(321, BPF_ENABLE_STATS, ctypes.byref(attr), 4))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "BPF_ENABLE_STATS")
    return fd


def prog_run_stats(prog_fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded program."""
    info = (ctypes.c_uint8 * 256)()
    attr = struct.pack("<IIQ", prog_fd, len(info), ctypes.addressof(info))
    buf = ctypes.create_string_buffer(attr, len(attr))
    if _libc.syscall(321, BPF_OBJ_GET_INFO_BY_FD, buf, len(attr)) < 0:
        raise OSError(ctypes.get_errno(), "prog info")
    run_ns, runs = struct.unpack_from("<QQ", bytes(info), RUN_TIME_OFFSET)
    return run_ns, runs


def call_ns(exe: Path, prefix: str, devfds: int, mode: str, n: int, runs: int) -> float:
    return min(float(subprocess.run([str(exe), prefix, str(devfds), mode, str(n)], check=True,
                                    capture_output=True, text=True).stdout) for _ in range(runs))


CASES = (  # (name, device fds held, mode)
    ("fork, no device fd", 0, "fork"),
    ("fork, GPU process with 1 device fd", 1, "fork"),
    ("fork, GPU process with 32 device fds", 32, "fork"),
    ("fcntl(F_GETFL), ordinary fd", 0, "fcntl"),
    ("dup+close, ordinary fd", 0, "dup"),
    ("dup+close, device fd", 1, "dupdev"),
)


def measure(exe: Path, prefix: str, calls: int, forks: int, runs: int,
            progs: dict[str, int] | None = None) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Wall ns per call for each case; with `progs` (stats enabled) also the kernel's ns per
    run of each new program during that case."""
    wall: dict[str, float] = {}
    prog_ns: dict[str, dict[str, float]] = {}
    for name, devfds, mode in CASES:
        before = {p: prog_run_stats(fd) for p, fd in (progs or {}).items()}
        wall[name] = call_ns(exe, prefix, devfds, mode, forks if mode == "fork" else calls, runs)
        after = {p: prog_run_stats(fd) for p, fd in (progs or {}).items()}
        prog_ns[name] = {p: (after[p][0] - before[p][0]) / (after[p][1] - before[p][1])
                         for p in before if after[p][1] - before[p][1] >= 100}
    return wall, prog_ns


def seed_cost(exe: Path, prefix: str, holders: int, fds: int) -> dict[str, float]:
    procs = [subprocess.Popen([str(exe), prefix, str(fds), "hold", "0"], stdout=subprocess.PIPE, text=True)
             for _ in range(holders)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        pm = ProbeManager(ProbeConfig(device_prefix=prefix, alloc_uprobes=False, fd_seed_interval_s=0.0))
        t0 = time.monotonic()
        pm.start()  # seeds once
        start_s = time.monotonic() - t0
        try:
            c0, t1 = time.process_time(), time.monotonic()
            again = pm.seed_fds()  # everything known: the steady-state periodic pass
            cpu, wall = time.process_time() - c0, time.monotonic() - t1
            seeded = pm.seed_totals.seeded
        finally:
            pm.stop()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    nproc = sum(1 for e in os.listdir("/proc") if e.isdigit())
    nfds = sum(len(os.listdir(f"/proc/{e}/fd")) for e in os.listdir("/proc") if e.isdigit()
               and os.access(f"/proc/{e}/fd", os.R_OK))
    return {"holders": holders, "device_fds_each": fds, "seeded_at_start": seeded,
            "known_on_rescan": again.known, "rescan_wall_ms": wall * 1e3, "rescan_cpu_ms": cpu * 1e3,
            "start_incl_compile_s": start_s, "processes_on_machine": nproc, "fds_on_machine": nfds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200000)
    ap.add_argument("--forks", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--holders", type=int, default=100)
    ap.add_argument("--fds", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (BPF)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("needs a C compiler (apt-get install gcc)")
    with tempfile.TemporaryDirectory(prefix="gw-bench-fdinherit-") as tmp:
        work = Path(tmp)
        exe = work / "calls"
        subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "bench_fdinherit.c")], check=True)
        (work / "dev").mkdir()
        os.mknod(work / "dev" / "nvidiactl", 0o666 | 0o020000, os.makedev(1, 3))
        prefix = str(work / "dev" / "nvidia")
        base, _ = measure(exe, prefix, args.calls, args.forks, args.runs)
        pm = ProbeManager(ProbeConfig(device_prefix=prefix, alloc_uprobes=False, fd_seed_interval_s=0.0))
        pm.start()
        try:
            probed, _ = measure(exe, prefix, args.calls, args.forks, args.runs)
            loaded = pm._objs.progs if pm._objs else {}  # a benchmark reads its own loaded programs
            stats_fd = enable_bpf_stats()  # separately: timing each run inflates the wall numbers
            try:
                _, per_run = measure(exe, prefix, args.calls, args.forks, 1,
                                     {name: loaded[name] for name in INHERIT_PROGS})
            finally:
                os.close(stats_fd)
            stats = pm.stats()
        finally:
            pm.stop()
        seeding = seed_cost(exe, prefix, args.holders, args.fds)
    rows = {k: {"no_probe_ns": base[k], "probed_ns": probed[k], "added_ns": probed[k] - base[k]} for k in base}
    report = {"per_call": rows, "program_run_time": per_run, "seeding": seeding, "fd_overflow": stats["fd_overflow"]}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'per call (min of runs)':44} {'no probe':>10} {'probed':>10} {'added':>10}")
    for k, r in rows.items():
        print(f"{k:44} {r['no_probe_ns']:>8.0f}ns {r['probed_ns']:>8.0f}ns {r['added_ns']:>+8.0f}ns")
    print("kernel run time of the new programs per run, during each case (BPF_ENABLE_STATS):")
    for case, progs in per_run.items():
        print(f"  {case:42} " + ", ".join(f"{p} {ns:.0f}ns" for p, ns in progs.items()))
    print("seeding:", json.dumps(seeding))
    return 0


if __name__ == "__main__":
    sys.exit(main())
