"""The ioctl recorder (gpuwatch/sim/csrc/ioctl_recorder.c) and the CUDA exercise program
(cuda_exercise.c), built with the system C compiler and run for real: on the simulated
node (whose libcuda issues nvidia-shaped ioctls on <sim root>/dev/nvidia*), and on
regular files named like device nodes for the edge cases (bad pointers, truncation, XFER,
UVM, dup, mmap, threads, fork).

Each trace must follow the format agreed with the replayer (/work/helpers/trace_format.md,
committed as gpuwatch/sim/TRACE_FORMAT.md), and the recorded program must behave exactly
as it does without the recorder: same output, same exit status, errno preserved.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.sim import sim_env
from gpuwatch.sim.node import driver_env
from tests.conftest import need_binary, need_root
from tests.system.sim_helpers import GIB, MIB, private_node

CSRC = Path(__file__).resolve().parents[2] / "gpuwatch" / "sim" / "csrc"
CALLS_SRC = Path(__file__).resolve().parent / "test_recorder_calls.c"
NVML_FIRST_SRC = Path(__file__).resolve().parent / "test_recorder_nvml.c"
RECORD_SCRIPT = CSRC.parent / "record-on-gpu-host.sh"
CFLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11"]

RM_ALLOC_NR = 0x2B
RM_FREE_NR = 0x29
VID_HEAP_NR = 0x4A
VID_HEAP_ALLOC_SIZE, VID_HEAP_FREE = 2, 3
RM_CONTROL_CMD = 0xC020462A
MEMORY_LOCAL_USER = 0x40
HEADER_KEYS = {
    "format",
    "version",
    "recorded_at",
    "host",
    "pid",
    "argv",
    "driver_version",
    "cuda_driver_version",
    "alloc_params",
    "simulated",
    "gpus",
}
EVENT_KEYS = {
    "open": {"ev", "t_ns", "tid", "path", "flags", "fd"},
    "close": {"ev", "t_ns", "tid", "fd"},
    "dup": {"ev", "t_ns", "fd", "newfd"},
    "ioctl": {"ev", "t_ns", "tid", "fd", "cmd", "ret", "errno", "before", "after", "nested"},
    "mmap": {"ev", "t_ns", "fd", "length", "prot", "flags", "offset", "ret_ok"},
    "checkpoint": {"ev", "t_ns", "name", "nvml"},
    "exit": {"ev", "t_ns", "status"},
}
# keys a line may carry beyond the format's (proposed as additions to the format)
OPTIONAL_KEYS = {
    "open": {"errno", "inherited"},
    "ioctl": {"size_unknown", "unreadable", "params_size_unknown"},
}


@dataclass(frozen=True)
class Programs:
    recorder: Path
    exercise: Path
    calls: Path
    nvml_first: Path  # its stand-in libnvidia-ml.so.1 is next to it


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Programs:
    """The recorder, the exercise program and the edge-case caller, compiled as the
    GPU-host script compiles them."""
    cc = need_binary("cc", "gcc libc6-dev")
    out = tmp_path_factory.mktemp("gwrec-build")
    built = Programs(out / "libgwrec.so", out / "cuda_exercise", out / "recorder_calls", out / "nvml_first")
    builds = [
        [
            cc,
            *CFLAGS,
            "-fPIC",
            "-shared",
            "-o",
            str(built.recorder),
            str(CSRC / "ioctl_recorder.c"),
            "-ldl",
            "-lpthread",
        ],
        [cc, *CFLAGS, "-o", str(built.exercise), str(CSRC / "cuda_exercise.c"), "-ldl"],
        [cc, *CFLAGS, "-o", str(built.calls), str(CALLS_SRC), "-ldl", "-lpthread"],
        [cc, *CFLAGS, "-o", str(built.nvml_first), str(NVML_FIRST_SRC), "-ldl"],
        [
            cc,
            *CFLAGS,
            "-DFAKE_NVML",
            "-fPIC",
            "-shared",
            "-fvisibility=hidden",
            "-o",
            str(out / "libnvidia-ml.so.1"),
            str(NVML_FIRST_SRC),
            "-lpthread",
        ],
    ]
    for cmd in builds:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stderr}"
    return built


def read_trace(path: Path) -> list[dict[str, Any]]:
    """Every line of a trace file, parsed and checked against the format's keys."""
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines, f"{path} is empty"
    events = [json.loads(line) for line in lines]
    header = events[0]
    assert set(header) == HEADER_KEYS, header
    assert header["format"] == "gpuwatch-ioctl-trace" and header["version"] == 1
    assert header["alloc_params"] == "by-class"  # RM_ALLOC parameters sized as the RM sizes them
    assert isinstance(header["pid"], int) and isinstance(header["argv"], list)
    for gpu in header["gpus"]:
        assert set(gpu) == {"minor", "uuid", "name", "memory_total_bytes"}, gpu
    for ev in events[1:]:
        kind = ev["ev"]
        assert kind in EVENT_KEYS, ev
        assert EVENT_KEYS[kind] <= set(ev) <= EVENT_KEYS[kind] | OPTIONAL_KEYS.get(kind, set()), ev
        if kind == "ioctl":
            assert len(ev["before"]) == len(ev["after"])
            check_nested(ev["nested"])
    return events


def check_nested(blocks: list[dict[str, Any]]) -> None:
    for block in blocks:
        assert {"at", "size", "before", "after", "nested"} <= set(block), block
        assert len(block["before"]) in (0, 2 * block["size"]), block
        check_nested(block["nested"])


def traces_in(directory: Path) -> dict[int, Path]:
    return {int(p.stem): p for p in directory.glob("*.jsonl")}


def recorder_env(base: dict[str, str], programs: Programs, trace_dir: Path, prefix: str) -> dict[str, str]:
    env = dict(base)
    env["LD_PRELOAD"] = str(programs.recorder)
    env["GPUWATCH_REC_DIR"] = str(trace_dir)
    env["GPUWATCH_REC_PREFIX"] = prefix
    return env


def alloc_size(block: dict[str, Any], image: str) -> int:
    """NV_MEMORY_ALLOCATION_PARAMS.size (u64 at 64) of a captured pAllocParms block."""
    return int(struct.unpack_from("<Q", bytes.fromhex(block[image]), 64)[0])


def memory_allocs(events: list[dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, pAllocParms block) of every RM_ALLOC of video memory (class 0x40)."""
    for i, ev in enumerate(events):
        if ev.get("ev") != "ioctl" or ev["cmd"] & 0xFF != RM_ALLOC_NR or (ev["cmd"] >> 8) & 0xFF != 0x46:
            continue
        if not ev["before"]:  # the parameter struct itself was unreadable
            continue
        params = bytes.fromhex(ev["before"])
        if struct.unpack_from("<I", params, 12)[0] == MEMORY_LOCAL_USER and ev["nested"]:
            yield i, ev["nested"][0]


def test_exercise_on_the_simulated_node(tmp_path: Path, programs: Programs) -> None:
    """One RM_ALLOC per cuMemAlloc and no context memory (pinned: the stub's defaults follow
    real CUDA's shape), so every allocation between checkpoints is one the program asked for;
    the stub's RM_ALLOC paramsSize (0, as real libcuda sends it, or the class size) does not
    matter: the recorder captures the 128 bytes the RM reads for class 0x40."""
    with private_node(tmp_path, devices=2, rm_device_handles=True) as node:
        env = sim_env(node, dict(os.environ))
        env.update(driver_env(suballoc_mib=0, context_mib=0))
        plain = subprocess.run([str(programs.exercise)], env=env, capture_output=True, text=True, timeout=60)
        trace_dir = tmp_path / "traces"
        recorded = subprocess.run(
            [str(programs.exercise), "--device", "0"],
            env=recorder_env(env, programs, trace_dir, f"{node.root}/dev/nvidia"),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert recorded.returncode == plain.returncode
    # the same program output, apart from the line that says whether the recorder is there
    assert "recorder absent" in plain.stdout.splitlines()[0]
    assert "recorder present" in recorded.stdout.splitlines()[0]
    assert recorded.stdout.splitlines()[1:] == plain.stdout.splitlines()[1:]
    assert recorded.stderr == ""

    (trace,) = trace_dir.glob("*.jsonl")
    events = read_trace(trace)
    header = events[0]
    assert trace.name == f"{header['pid']}.jsonl"
    assert header["simulated"] is True
    assert header["argv"][1:] == ["--device", "0"]
    assert header["driver_version"] and isinstance(header["cuda_driver_version"], int)
    assert [g["minor"] for g in header["gpus"]] == [0, 1]
    assert all(g["memory_total_bytes"] > 2 * GIB and g["uuid"].startswith("GPU-") for g in header["gpus"])
    # the program names its device by UUID, as NVML does in the header
    assert f"info device 0: {header['gpus'][0]['uuid']}" in recorded.stdout.splitlines()

    # opens are of the sim's nodes, recorded under /dev/nvidia names
    opened = {ev["path"] for ev in events if ev.get("ev") == "open"}
    assert "/dev/nvidiactl" in opened and "/dev/nvidia0" in opened
    assert all(p.startswith("/dev/nvidia") for p in opened)
    assert all(ev["errno"] == errno.ENOTTY for ev in events if ev.get("ev") == "ioctl" and ev["ret"] < 0)

    # every RM_ALLOC of video memory has its pAllocParms captured (the 128 bytes RM reads),
    # though the stub, as real libcuda, says paramsSize 0 (NVOS64 @32)
    allocs = list(memory_allocs(events))
    assert allocs and all(block["at"] == 16 and block["size"] == 128 for _, block in allocs)
    assert {struct.unpack_from("<I", bytes.fromhex(events[i]["before"]), 32)[0] for i, _ in allocs} == {0}
    # one RM_ALLOC per cuMemAlloc, with the size RM wrote back (pools and VMM, which the
    # stub may implement too, come after these checkpoints)
    asked = {"alloc-1k": 1024, "alloc-1m": MIB, "alloc-2m": 2 * MIB, "alloc-1g": GIB}
    at = {ev["name"]: i for i, ev in enumerate(events) if ev.get("ev") == "checkpoint"}
    names = [ev["name"] for ev in events if ev.get("ev") == "checkpoint"]
    for name, want in asked.items():
        start = at[names[names.index(name) - 1]]
        (got,) = [alloc_size(block, "after") for i, block in allocs if start < i < at[name]]
        assert want <= got <= -(-want // (2 * MIB)) * 2 * MIB, (name, want, got)
    (held,) = [alloc_size(b, "after") for i, b in allocs if at["second-context"] < i < at["held-256m"]]
    assert held == 256 * MIB

    # checkpoints: the program's, in its order, with the fake NVML's numbers; the bytes a
    # checkpoint adds over the one before are the bytes of the RM_ALLOC between them
    checkpoints = [(i, ev) for i, ev in enumerate(events) if ev.get("ev") == "checkpoint"]
    printed = [line.split()[1] for line in plain.stdout.splitlines() if line.startswith("checkpoint ")]
    assert [ev["name"] for _, ev in checkpoints] == printed
    used = {ev["name"]: ev["nvml"][0]["process_used_bytes"] for _, ev in checkpoints}
    assert all(len(ev["nvml"]) == 2 and ev["nvml"][1]["process_used_bytes"] is None for _, ev in checkpoints)
    assert all(g["device_used_bytes"] >= (g["process_used_bytes"] or 0) for _, ev in checkpoints for g in ev["nvml"])
    assert used["init"] is None  # no context yet: NVML does not list the process
    previous = None
    for index, ev in checkpoints:
        if ev["name"].startswith("alloc-") and previous is not None:
            between = [alloc_size(b, "after") for i, b in allocs if previous[0] < i < index]
            assert used[ev["name"]] - used[previous[1]["name"]] == sum(between), ev["name"]
        previous = (index, ev)
    assert used["free-1g"] == used["context"]
    assert used["held-256m"] >= 256 * MIB

    assert events[-1] == {"ev": "exit", "t_ns": events[-1]["t_ns"], "status": 0}


def driver_objects(events: list[dict[str, Any]]) -> Iterator[tuple[int, int]]:
    """(index, bytes) of every video-memory object the trace shows the driver creating:
    RM_ALLOC of class 0x40 (size written back in pAllocParms) and VID_HEAP_CONTROL
    ALLOC_SIZE in video memory (NVOS32 size at 88, attr LOCATION bits 26:25 = 0)."""
    for i, block in memory_allocs(events):
        yield i, alloc_size(block, "after")
    for i, ev in enumerate(events):
        if ev.get("ev") == "ioctl" and ev["cmd"] & 0xFF == VID_HEAP_NR and (ev["cmd"] >> 8) & 0xFF == 0x46:
            after = bytes.fromhex(ev["after"])
            function, attr = struct.unpack_from("<I", after, 8)[0], struct.unpack_from("<I", after, 56)[0]
            if function == VID_HEAP_ALLOC_SIZE and (attr >> 25) & 3 == 0:
                yield i, int(struct.unpack_from("<Q", after, 88)[0])


def is_free(ev: dict[str, Any]) -> bool:
    if ev.get("ev") != "ioctl" or (ev["cmd"] >> 8) & 0xFF != 0x46:
        return False
    if ev["cmd"] & 0xFF == RM_FREE_NR:
        return True
    return (
        ev["cmd"] & 0xFF == VID_HEAP_NR and struct.unpack_from("<I", bytes.fromhex(ev["before"]), 8)[0] == VID_HEAP_FREE
    )


@pytest.mark.parametrize(
    ("alloc_path", "suballoc_mib", "context_mib"), [("vid-heap", 0, 2), ("rm-alloc", 8, 4), ("vid-heap", 8, 4)]
)
def test_recorded_driver_objects_add_up_to_nvml(
    tmp_path: Path, programs: Programs, alloc_path: str, suballoc_mib: int, context_mib: int
) -> None:
    """In every allocation mode of the simulated driver, the memory objects the trace
    shows between two checkpoints add up to what NVML's per-process number grew by: the
    recording holds what a decoder needs (no free in between; managed memory, which the
    sim counts without any RM call, left out)."""
    with private_node(tmp_path, devices=1, rm_device_handles=True) as node:
        env = sim_env(node, dict(os.environ))
        env.update(driver_env(alloc_path=alloc_path, suballoc_mib=suballoc_mib, context_mib=context_mib))
        trace_dir = tmp_path / "traces"
        env = recorder_env(env, programs, trace_dir, f"{node.root}/dev/nvidia")
        proc = subprocess.run([str(programs.exercise)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (trace,) = trace_dir.glob("*.jsonl")
    events = read_trace(trace)
    objects = list(driver_objects(events))
    path_nr = VID_HEAP_NR if alloc_path == "vid-heap" else RM_ALLOC_NR
    assert any(events[i]["cmd"] & 0xFF == path_nr for i, _ in objects)
    checkpoints = [
        (i, ev["name"], ev["nvml"][0]["process_used_bytes"] or 0)
        for i, ev in enumerate(events)
        if ev.get("ev") == "checkpoint"
    ]
    compared = []
    for (start, _, before), (end, name, after) in itertools.pairwise(checkpoints):
        if name.startswith("managed-") or any(is_free(ev) for ev in events[start:end]):
            continue
        grown = sum(size for i, size in objects if start < i < end)
        assert after - before == grown, (name, after - before, grown)
        compared.append(name)
    assert {"context", "alloc-1k", "alloc-1g", "second-context", "held-256m"} <= set(compared)
    used = {name: used for _, name, used in checkpoints}
    assert used["context"] == context_mib * MIB


def test_calls_keep_their_behaviour_and_are_recorded_whole(tmp_path: Path, programs: Programs) -> None:
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ("nvidiactl", "nvidia-uvm", "unrelated"):
        (devices / name).write_bytes(b"x" * 4096)
    argv = [str(programs.calls), str(devices)]
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "GPUWATCH_SIM_STATE")}
    plain = subprocess.run(argv, env=base, capture_output=True, text=True, timeout=60)
    trace_dir = tmp_path / "traces"
    env = recorder_env(base, programs, trace_dir, f"{devices}/nvidia")
    recorded = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 3, plain.stdout + plain.stderr
    assert (recorded.returncode, recorded.stdout) == (plain.returncode, plain.stdout)
    assert "errno after success=4242" in recorded.stdout
    assert "rm_alloc bad struct pointer ret=-1 errno=25" in recorded.stdout

    traces = traces_in(trace_dir)
    assert len(traces) == 3, traces  # the program, its forked child, the child it exec'd
    by_status = {events[-1]["status"]: events for events in map(read_trace, traces.values())}
    assert sorted(by_status) == [3, 7, 9]
    parent_pid = by_status[3][0]["pid"]
    events = by_status[3]
    assert events[0]["simulated"] is False and events[0]["gpus"] == []
    ioctls = [ev for ev in events if ev.get("ev") == "ioctl"]

    opens = [ev for ev in events if ev.get("ev") == "open"]
    assert [(ev["path"], ev["fd"] >= 0) for ev in opens] == [
        ("/dev/nvidiactl", True),
        ("/dev/nvidia9", False),
        ("/dev/nvidia-uvm", True),
        ("/dev/nvidiactl", True),  # kept open across the child's exec
    ]
    assert opens[1]["errno"] == errno.ENOENT
    ctl_fd, uvm_fd = opens[0]["fd"], opens[2]["fd"]

    fionread = ioctls[0]
    assert (fionread["cmd"], fionread["ret"], fionread["errno"], fionread["before"]) == (0x541B, 0, 0, "")
    nvos64 = ioctls[1]
    assert nvos64["errno"] == errno.ENOTTY and len(nvos64["before"]) == 2 * 48
    (params,) = nvos64["nested"]
    assert (params["at"], params["size"], alloc_size(params, "before")) == (16, 128, 3 * MIB)
    (bad_params,) = ioctls[2]["nested"]
    assert (bad_params["at"], bad_params["size"], bad_params["before"], bad_params.get("unreadable")) == (
        16,
        0,
        "",
        True,
    )
    assert ioctls[3]["before"] == "" and ioctls[3]["unreadable"] is True and ioctls[3]["nested"] == []
    (big,) = ioctls[4]["nested"]
    assert (big["at"], big["size"], big["truncated"], big["declared_size"]) == (16, 65536, True, MIB)
    (inner,) = ioctls[5]["nested"]
    assert (ioctls[5]["cmd"], inner["at"], inner["size"]) == (0xC01046D3, 8, 48)
    (inner_params,) = inner["nested"]
    assert (inner_params["at"], alloc_size(inner_params, "before")) == (16, 5 * MIB)
    check_rm_alloc_by_class(ioctls[6:15])

    dups = [(ev["fd"], ev["newfd"]) for ev in events if ev.get("ev") == "dup"]
    assert [d[0] for d in dups] == [ctl_fd] * 4 and [d[1] for d in dups][1:] == [100, 101, 200]
    closed = [ev["fd"] for ev in events if ev.get("ev") == "close"]
    kept = opens[3]["fd"]
    assert closed == [dups[0][1], 100, 101, 200, kept, uvm_fd, ctl_fd]  # 9999 and "unrelated" are not tracked
    (mapping,) = [ev for ev in events if ev.get("ev") == "mmap"]
    assert (mapping["fd"], mapping["length"], mapping["ret_ok"]) == (ctl_fd, 4096, True)

    uvm = [ev for ev in ioctls if ev["fd"] == uvm_fd]
    assert uvm[0]["cmd"] == 0x30000001 and uvm[0]["before"] == "02" + "00" * 15
    # MAP_EXTERNAL_ALLOCATION: its 24-byte head (base, length, offset), the same on every branch
    assert uvm[1]["cmd"] == 33 and "size_unknown" not in uvm[1]
    assert struct.unpack("<QQQ", bytes.fromhex(uvm[1]["before"])) == (0x7F0000200000, 2 * MIB, 4096)
    assert uvm[2]["cmd"] == 68 and uvm[2]["size_unknown"] is True and uvm[2]["before"] == ""

    # 4 threads x 200 RM_CONTROLs (NVOS54.cmd at 8 = 0x100 + thread number), none lost
    storm = [ev for ev in ioctls if ev["tid"] != parent_pid]
    assert len(storm) == 800 and len({ev["tid"] for ev in storm}) == 4
    per_thread = {ev["tid"]: struct.unpack_from("<I", bytes.fromhex(ev["before"]), 8)[0] for ev in storm}
    assert sorted(per_thread.values()) == [0x100, 0x101, 0x102, 0x103]

    # a signal handler's ioctls (NVOS54.cmd 0x5151) never deadlock the recorder: recorded,
    # or passed through unrecorded when the handler interrupted the recorder itself
    assert "signals: 0 unexpected results in the loop, 0 in handlers" in recorded.stdout
    handled = [
        ev for ev in ioctls if struct.unpack_from("<I", bytes.fromhex(ev["before"] or "00" * 12), 8)[0] == 0x5151
    ]
    assert all(ev["tid"] == parent_pid for ev in handled)

    (checkpoint,) = [ev for ev in events if ev.get("ev") == "checkpoint"]
    assert checkpoint["name"] == "synthetic" and checkpoint["nvml"] == []
    assert events[-1]["ev"] == "exit" and events[-1]["status"] == 3

    child = by_status[7]
    assert child[0]["pid"] != parent_pid
    inherited = [(ev["path"], ev["fd"]) for ev in child if ev.get("ev") == "open"]
    assert inherited == [("/dev/nvidiactl", ctl_fd), ("/dev/nvidia-uvm", uvm_fd)]
    assert all(ev.get("inherited") is True for ev in child if ev.get("ev") == "open")
    assert [ev["cmd"] for ev in child if ev.get("ev") == "ioctl"] == [RM_CONTROL_CMD] * 3
    assert child[-1]["ev"] == "exit" and child[-1]["status"] == 7

    # the fd kept across exec is known to the new image: an inherited open, then its ioctl
    execd = by_status[9]
    assert [(ev["ev"], ev.get("fd"), ev.get("inherited")) for ev in execd[1:]] == [
        ("open", kept, True),
        ("ioctl", kept, None),
        ("exit", None, None),
    ]


def check_rm_alloc_by_class(ioctls: list[dict[str, Any]]) -> None:
    """The RM_ALLOCs of test_recorder_calls.c's rm_alloc_by_class: pAllocParms is captured
    with the class's size (RM_ALLOC_PARAMS_BYTES) whatever paramsSize says, a NULL pointer
    never, and an unknown class by a non-zero paramsSize or not at all (marked)."""
    def classes(ev: dict[str, Any]) -> int:
        return int(struct.unpack_from("<I", bytes.fromhex(ev["before"]), 12)[0])

    mem, device, null_client, client, unknown0, unknown16, mem_size8, nvos21, xfer = ioctls
    assert [classes(ev) for ev in ioctls[:8]] == [0x40, 0x80, 0x41, 0x41, 0x1234, 0x1234, 0x40, 0x40]
    (block,) = mem["nested"]
    assert (block["at"], block["size"], alloc_size(block, "before")) == (16, 128, 7 * MIB)
    (block,) = device["nested"]
    assert (block["at"], block["size"], block["before"][:2]) == (16, 56, "01")
    assert null_client["nested"] == [] and "params_size_unknown" not in null_client
    (block,) = client["nested"]
    assert (block["size"], block["before"]) == (4, "0100d0c1")
    assert unknown0["nested"] == [] and unknown0["params_size_unknown"] is True
    (block,) = unknown16["nested"]
    assert (block["size"], block["before"]) == (16, "ab" * 16) and "params_size_unknown" not in unknown16
    (block,) = mem_size8["nested"]
    assert (block["size"], alloc_size(block, "before")) == (128, 9 * MIB)
    (block,) = nvos21["nested"]
    assert (len(nvos21["before"]), block["at"], block["size"], alloc_size(block, "before")) == (64, 16, 128, 11 * MIB)
    (inner,) = xfer["nested"]
    (block,) = inner["nested"]
    assert (xfer["cmd"], block["at"], block["size"], alloc_size(block, "before")) == (0xC01046D3, 16, 128, 13 * MIB)
    assert all("params_size_unknown" not in ev for ev in ioctls if ev is not unknown0)


def test_memory_params_are_120_bytes_on_driver_535(tmp_path: Path, programs: Programs) -> None:
    """NV_MEMORY_ALLOCATION_PARAMS is 120 bytes on driver 535 (128 from 550 on): the recorder
    reads no more than that RM does, by the version in /proc/driver/nvidia/version (a tmpfs
    over /proc/driver in a mount namespace of the test's own says 535.288.01)."""
    need_root()
    need_binary("unshare", "util-linux")
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ("nvidiactl", "nvidia-uvm"):
        (devices / name).write_bytes(b"x" * 4096)
    trace_dir = tmp_path / "traces"
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "GPUWATCH_SIM_STATE")}
    env = recorder_env(base, programs, trace_dir, f"{devices}/nvidia")
    script = (
        "mount --make-rprivate / && mount -t tmpfs none /proc/driver && mkdir /proc/driver/nvidia && "
        "echo 'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.288.01  Release Build' "
        '> /proc/driver/nvidia/version && exec "$0" "$1"'
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, str(programs.calls), str(devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    events = next(e for e in map(read_trace, traces_in(trace_dir).values()) if e[-1]["status"] == 3)
    assert events[0]["driver_version"] == "535.288.01"
    sizes = [block["size"] for _, block in memory_allocs(events) if not block.get("unreadable")]
    assert len(sizes) == 4 and set(sizes) == {120}, sizes  # top-level class-0x40 RM_ALLOCs


def test_without_a_trace_directory_nothing_is_recorded(tmp_path: Path, programs: Programs) -> None:
    devices = tmp_path / "dev"
    devices.mkdir()
    (devices / "nvidiactl").write_bytes(b"x" * 4096)
    (devices / "nvidia-uvm").write_bytes(b"x" * 4096)
    argv = [str(programs.calls), str(devices)]
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GPUWATCH_REC_DIR")}
    plain = subprocess.run(argv, env=base, capture_output=True, text=True, timeout=60)
    preloaded = subprocess.run(
        argv,
        env=dict(base, LD_PRELOAD=str(programs.recorder)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (preloaded.returncode, preloaded.stdout) == (plain.returncode, plain.stdout)
    assert "GPUWATCH_REC_DIR is not set" in preloaded.stderr
    assert not list(tmp_path.rglob("*.jsonl"))


def test_the_gpu_host_script_records_every_gpu(tmp_path: Path) -> None:
    """The script a GPU host runs (C compiler only), pointed at the simulated node."""
    need_binary("cc", "gcc libc6-dev")
    out = tmp_path / "out"
    with private_node(tmp_path, devices=2, rm_device_handles=True) as node:
        env = sim_env(node, dict(os.environ))
        env["GPUWATCH_REC_PREFIX"] = f"{node.root}/dev/nvidia"
        proc = subprocess.run(
            ["sh", str(RECORD_SCRIPT), "-o", str(out), "-d", "all"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for gpu in (0, 1):
        (trace,) = (out / "traces" / f"exercise-gpu{gpu}").glob("*.jsonl")
        events = read_trace(trace)
        assert f"/dev/nvidia{gpu}" in {ev["path"] for ev in events if ev.get("ev") == "open"}
        assert events[-1]["ev"] == "exit" and events[-1]["status"] == 0
        assert (out / f"exercise-gpu{gpu}.out").read_text().endswith("exit_status: 0\n")
    assert (out / "host.txt").read_text().startswith("recorded_at: ")
    assert f"traces (2 files) are in {out}/traces" in proc.stdout
    assert "tests/fixtures/traces/real/" in proc.stdout
    assert "SIMULATED node" in proc.stdout


@pytest.mark.parametrize("mode", ["then-the-program", "nvml-only"])
def test_a_program_whose_first_gpu_access_is_nvml(tmp_path: Path, programs: Programs, mode: str) -> None:
    """NVML's own opens and ioctls are recorded without asking NVML for the header from
    inside NVML (the stand-in aborts if re-entered): their lines wait for the header."""
    devices = tmp_path / "dev"
    devices.mkdir()
    for name in ("nvidiactl", "nvidia0"):
        (devices / name).write_bytes(b"")
    trace_dir = tmp_path / "traces"
    env = recorder_env(dict(os.environ), programs, trace_dir, f"{devices}/nvidia")
    env.update(LD_LIBRARY_PATH=str(programs.nvml_first.parent), FAKE_NVML_DEV=str(devices))
    env.pop("GPUWATCH_SIM_STATE", None)
    proc = subprocess.run([str(programs.nvml_first), mode], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (trace,) = trace_dir.glob("*.jsonl")
    events = read_trace(trace)
    kinds = [(ev["ev"], ev.get("path")) for ev in events[1:]]
    if mode == "nvml-only":
        # the header is written at exit, when NVML may no longer be asked
        assert events[0]["gpus"] == [] and events[0]["cuda_driver_version"] is None
        assert kinds == [("open", "/dev/nvidiactl"), ("ioctl", None), ("ioctl", None), ("exit", None)]
    else:
        assert events[0]["gpus"] == [
            {"minor": 0, "uuid": "GPU-fake-nvml", "name": "fake NVML GPU", "memory_total_bytes": GIB}
        ]
        # the last ioctl is NVML's destructor's: library destructors run before the exit line
        assert kinds == [
            ("open", "/dev/nvidiactl"),
            ("ioctl", None),
            ("open", "/dev/nvidia0"),
            ("ioctl", None),
            ("exit", None),
        ]
