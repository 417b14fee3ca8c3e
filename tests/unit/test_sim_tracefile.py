"""Trace files are checked whole before a replay (line numbers in every error), and the
replayer rebuilds nested parameter blocks with their pointers patched (no root needed)."""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path

import pytest

from gpuwatch.sim.replay import _materialize
from gpuwatch.sim.tracefile import Block, Checkpoint, Ioctl, TraceError, read_trace

HEADER = {"format": "gpuwatch-ioctl-trace", "version": 1, "recorded_at": "2026-11-26T00:00:00Z", "host": "h",
          "pid": 1, "argv": ["x"], "driver_version": None, "cuda_driver_version": None, "simulated": True,
          "gpus": [{"minor": 0, "uuid": "GPU-0", "name": "n", "memory_total_bytes": 1}]}
OPEN = {"ev": "open", "t_ns": 1, "tid": 1, "path": "/dev/nvidiactl", "flags": 2, "fd": 3}
FREE_CMD = 0xC0104629  # RM_FREE, _IOC_SIZE 16


def _ioctl(**over: object) -> dict[str, object]:
    ev: dict[str, object] = {"ev": "ioctl", "t_ns": 2, "tid": 1, "fd": 3, "cmd": FREE_CMD, "ret": 0, "errno": 0,
                             "before": "00" * 16, "after": "00" * 16, "nested": []}
    ev.update(over)
    return ev


def _write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_a_good_trace_keeps_events_in_order(tmp_path: Path) -> None:
    cp = {"ev": "checkpoint", "t_ns": 3, "name": "a", "nvml": [{"minor": 0, "process_used_bytes": 5}]}
    trace = read_trace(_write(tmp_path, HEADER, OPEN, _ioctl(), cp, {"ev": "exit", "t_ns": 4, "status": 0}))
    assert [type(e).__name__ for e in trace.events] == ["Open", "Ioctl", "Checkpoint", "Exit"]
    assert isinstance(trace.events[1], Ioctl) and trace.events[1].cmd == FREE_CMD
    assert trace.checkpoints() == (Checkpoint(4, "a", ({"minor": 0, "process_used_bytes": 5},)),)
    assert trace.device_paths == ("/dev/nvidiactl",)


@pytest.mark.parametrize(("lines", "line_no", "what"), [
    (["{not json"], 1, "not JSON"),
    ([{**HEADER, "version": 2}], 1, "version 2 is not supported"),
    ([HEADER, OPEN, _ioctl(after="00" * 15)], 3, "before is 16 bytes but after is 15"),
    ([HEADER, OPEN, _ioctl(before="00" * 8, after="00" * 8)], 3, "_IOC_SIZE is 16"),
    ([HEADER, OPEN, _ioctl(after="zz" * 16)], 3, "not a hex string"),
    ([HEADER, _ioctl()], 2, "fd 3 is used but the trace never opened it"),
    ([HEADER, OPEN, _ioctl(nested=[{"at": 12, "size": 1, "before": "00", "after": "00"}])], 3, "outside"),
    ([HEADER, OPEN, _ioctl(nested=[{"at": 0, "size": 2, "before": "00", "after": "00"}])], 3, "size 2"),
    ([HEADER, {**OPEN, "path": "/etc/passwd"}], 2, "must start with /dev/nvidia"),
    ([HEADER, {"ev": "exit", "t_ns": 1, "status": 0}, OPEN], 3, "after the exit event"),
    ([HEADER, {"ev": "fork", "t_ns": 1}], 2, "unknown event 'fork'"),
    ([HEADER, OPEN, {"ev": "close", "t_ns": 1, "tid": 1, "fd": "3"}], 3, "fd must be an integer"),
])
def test_bad_traces_name_the_line_and_the_problem(tmp_path: Path, lines: list[object], line_no: int,
                                                  what: str) -> None:
    path = _write(tmp_path, *lines)
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}:{line_no}:" in str(err.value) and what in str(err.value)


def test_nested_blocks_are_rebuilt_with_patched_pointers() -> None:
    inner = Block(after=b"INNER-AFTER" + bytes(5), nested=((8, Block(after=b"deepest!")),))
    outer = Block(after=struct.pack("<IIQ", 0x2B, 16, 0xDEADBEEF), nested=((8, inner),))
    keep: list[ctypes.Array[ctypes.c_char]] = []
    address = _materialize(outer, keep)
    head = ctypes.string_at(address, 16)
    assert head[:8] == struct.pack("<II", 0x2B, 16)
    inner_address = struct.unpack_from("<Q", head, 8)[0]
    assert inner_address != 0xDEADBEEF
    rebuilt = ctypes.string_at(inner_address, 16)
    assert rebuilt[:8] == b"INNER-AF"  # its own bytes, with the pointer at 8 patched
    assert ctypes.string_at(struct.unpack_from("<Q", rebuilt, 8)[0], 8) == b"deepest!"
